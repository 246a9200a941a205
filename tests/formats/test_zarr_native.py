"""A dlstore zarr cache is first-class zarr (issue 9): plain zarr-python opens it without a single
warning, finds the spec in the group's attributes, and reads the pixels dlstore serves."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from dlstore.read.cache import open_cache
from dlstore.write.conversion import convert
from dlstore.write.options import ConvertOptions


@pytest.fixture(scope="module")
def cache(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("zarr") / "c"
    convert(image_tree, dest, ConvertOptions(format="zarr", size=12, workers=1))
    return dest


def test_plain_zarr_opens_the_cache_without_warnings(cache: Path) -> None:
    zarr = pytest.importorskip("zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(cache, mode="r")
        members = dict(group.members(max_depth=None))
        tree = str(group.tree())
        attrs = dict(group.attrs)["dlstore"]
    assert set(members) == {"images", "labels", "positions"} and "positions" in tree
    assert attrs["classes"] == ["cat", "dog", "zebra"]
    assert attrs["policy"]["resize"] == "crop" and attrs["policy"]["size"] == 12
    assert attrs["shape"] == [12, 12, 3] and attrs["source"]["kind"] == "folder"


def test_zarr_arrays_hold_what_dlstore_reads(cache: Path) -> None:
    zarr = pytest.importorskip("zarr")
    group = zarr.open_group(cache, mode="r")
    ours = open_cache(cache)
    positions = group["positions"][:]
    np.testing.assert_array_equal(positions, ours.positions)
    np.testing.assert_array_equal(group["labels"][:][positions], ours.labels)
    idx = np.arange(len(ours))
    np.testing.assert_array_equal(group["images"][:][positions[idx]], ours.read(idx))


ZARR_KINDS = {"pixels": {}, "jpeg": {"codec": "jpeg"}, "ragged": {"resize": "shorter"}}


@pytest.fixture(scope="module", params=list(ZARR_KINDS))
def any_zarr(
    request: pytest.FixtureRequest, image_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    dest = tmp_path_factory.mktemp("zarr-kinds") / request.param
    convert(image_tree, dest, format="zarr", size=12, workers=1, **ZARR_KINDS[request.param])
    return dest


def test_every_zarr_cache_opens_warning_free_with_its_spec(any_zarr: Path) -> None:
    """Issue 22 item 5: the JPEG and ragged layouts too (they gave 5 ZarrUserWarnings and no attributes)."""
    zarr = pytest.importorskip("zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(any_zarr, mode="r")
        members = set(dict(group.members(max_depth=None)))
        attrs = dict(group.attrs)["dlstore"]
    assert {"images", "labels", "positions"} <= members
    assert attrs["classes"] == ["cat", "dog", "zebra"]
    ours = open_cache(any_zarr)
    positions = group["positions"][:]  # dataset index → storage row
    assert np.array_equal(positions, ours.positions)
    assert np.array_equal(group["labels"][:][positions], ours.labels)


def test_xarray_opens_every_zarr_cache(any_zarr: Path) -> None:
    xr = pytest.importorskip("xarray")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = xr.open_zarr(any_zarr)
    ours = open_cache(any_zarr)
    positions = ds["positions"].values
    assert ds.sizes["sample"] == len(ours) and np.array_equal(ds["labels"].values[positions], ours.labels)
    if "y" in ds["images"].dims:  # fixed-size pixels: the same array dlstore reads
        assert ds["images"].dims == ("sample", "y", "x", "channel")
        assert np.array_equal(ds["images"].values[positions], ours.read(np.arange(len(ours))))
