"""Every registered format: same pixels as the reference decode, same labels as ImageFolder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.datasets import ImageFolder

from dlstore import convert, open_cache
from dlstore.formats import FORMATS
from dlstore.formats.codecs import is_image_codec
from dlstore.spec import ImagePolicy
from dlstore.write.imageops import decode_file
from dlstore.write.options import ConvertOptions
from dlstore.write.sources import ArraySource

FORMAT_CASES = [
    ("ram", {}),
    ("npz", {}),
    ("npz", {"codec": "deflate"}),
    ("zarr", {}),
    ("zarr", {"codec": "lz4"}),
    ("zarr", {"codec": "none"}),
]


@pytest.fixture(scope="module")
def caches(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    base = tmp_path_factory.mktemp("caches")
    for i, (fmt, opts) in enumerate(FORMAT_CASES):
        dest = base / f"{fmt}{i}"
        convert(image_tree, dest, format=fmt, size=24, workers=2, **opts)
        out[f"{fmt}{i}"] = dest
    return out


def test_every_registered_format_and_codec_is_covered() -> None:
    from dlstore.cli.convert_cmd import convert_cmd

    choices = {p.name: getattr(p.type, "choices", None) for p in convert_cmd.params}
    assert set(FORMATS) == {f for f, _ in FORMAT_CASES} == set(choices["format"])
    for name, fmt in FORMATS.items():
        codecs = fmt.writer.codecs.names() if fmt.writer.codecs else ()
        # lossy image codecs (jpeg) cannot match pixels exactly: test_payload.py covers them
        codecs = tuple(c for c in codecs if not is_image_codec(fmt.writer.codecs[c].impl))  # type: ignore[index]
        covered = {
            opts.get("codec", fmt.writer.codecs and fmt.writer.codecs.default)
            for f, opts in FORMAT_CASES
            if f == name
        }
        assert set(codecs) <= covered, name


def test_pixels_and_labels_match_references(image_tree: Path, caches: dict[str, Path]) -> None:
    folder = ImageFolder(str(image_tree))
    expected = np.stack([decode_file(p, ImagePolicy(size=24)) for p, _ in folder.samples])
    for name, dest in caches.items():
        cache = open_cache(dest)
        assert list(cache.spec.classes) == folder.classes, name
        assert cache.labels.tolist() == folder.targets, name
        np.testing.assert_array_equal(cache.read(np.arange(len(cache))), expected, err_msg=name)


def test_random_order_reads_match_sequential(caches: dict[str, Path]) -> None:
    rng = np.random.default_rng(0)
    for name, dest in caches.items():
        cache = open_cache(dest)
        full = cache.read(np.arange(len(cache)))
        idx = rng.integers(0, len(cache), 40)  # unsorted, with duplicates
        np.testing.assert_array_equal(cache.read(idx), full[idx], err_msg=name)
        np.testing.assert_array_equal(cache.read([-1]), full[-1:], err_msg=name)
        with pytest.raises(IndexError):
            cache.read([len(cache)])


def test_manifest_records_the_policy_and_fingerprint(image_tree: Path, caches: dict[str, Path]) -> None:
    for dest in caches.values():
        spec = open_cache(dest).spec
        assert spec.image.resize == "crop" and spec.image.size == 24 and spec.image.exif_transpose
        assert spec.source["count"] == spec.n and len(spec.source["fingerprint"]) == 64
        assert spec.checksums and all(len(v) == 64 for v in spec.checksums.values())


def test_no_staging_left_behind(caches: dict[str, Path]) -> None:
    parent = next(iter(caches.values())).parent
    assert sorted(p.name for p in parent.iterdir()) == sorted(p.name for p in caches.values())


@pytest.mark.parametrize("fmt,opts", FORMAT_CASES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_roundtrip_property(tmp_path: Path, fmt: str, opts: dict, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40), label="n")
    side = data.draw(st.integers(1, 9), label="side")
    channels = data.draw(st.sampled_from([1, 3]), label="channels")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    arrays = rng.integers(0, 256, (n, side, side, channels), dtype=np.uint8)
    labels = rng.integers(0, 3, n)
    src = ArraySource(
        description="arrays",
        classes=("a", "b", "c"),
        names=[str(i) for i in range(n)],
        labels=labels,
        kind="test",
        data=arrays,
    )
    dest = Path(tempfile.mkdtemp(dir=tmp_path)) / "cache"
    convert(src, dest, format=fmt, size=side, resize="stretch", channels=channels, workers=1, **opts)
    cache = open_cache(dest)
    np.testing.assert_array_equal(cache.read(np.arange(n)), arrays)
    np.testing.assert_array_equal(cache.labels, labels)


def test_storage_order_is_shuffled_but_indices_follow_the_source(image_tree: Path, tmp_path: Path) -> None:
    shuffled = open_cache(next(iter(caches_for_order(image_tree, tmp_path, "shuffled"))))
    source = open_cache(next(iter(caches_for_order(image_tree, tmp_path, "source"))))
    assert not np.array_equal(shuffled.positions, np.arange(len(shuffled)))
    np.testing.assert_array_equal(source.positions, np.arange(len(source)))
    np.testing.assert_array_equal(shuffled.labels, source.labels)
    np.testing.assert_array_equal(
        shuffled.read(np.arange(len(shuffled))), source.read(np.arange(len(source)))
    )


def caches_for_order(image_tree: Path, tmp_path: Path, order: str) -> list[Path]:
    dest = tmp_path / order
    convert(image_tree, dest, ConvertOptions(format="zarr", size=8, workers=1, storage_order=order))
    return [dest]
