"""F1: a conversion to an object store never deletes an object that is not dlstore's. Against a real
S3-compatible server (moto's server mode on a free port), with foreign objects at the prefix, below it
and beside it (``mydata-other/``, ``mydatax.txt``), and at a bucket's root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree

from dlstore import Remote, convert, open_cache
from dlstore.cli import main
from dlstore.errors import CacheExistsError
from dlstore.storage.stores import RemoteStore

pytestmark = pytest.mark.s3
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

FOREIGN = {
    "mydata/important.txt": b"my notes",
    "mydata/sub/notes.csv": b"a,b\n1,2\n",
    "mydata-other/model.pt": b"weights",
    "mydatax.txt": b"beside the prefix",
    "README": b"the bucket's own readme",
    "other-project/model.pt": b"more weights",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=6)


_count = iter(range(1000))


@pytest.fixture
def bucket(server: Any) -> str:
    """A fresh bucket holding the foreign objects."""
    name = f"own-{next(_count)}"
    store = RemoteStore(f"s3://{name}")
    store.fs.mkdir(name)
    for rel, data in FOREIGN.items():
        store.put_bytes(data, rel)
    return name


def everything(bucket: str) -> dict[str, bytes]:
    store = RemoteStore(f"s3://{bucket}")
    return {rel: store.get_bytes(rel) for rel in store.sizes()}


def assert_foreign_intact(bucket: str) -> None:
    now = everything(bucket)
    assert {rel: now.get(rel) for rel in FOREIGN} == FOREIGN


def conv(tree: Path, url: str, fmt: str = "npz", **kw: Any) -> Any:
    return convert(tree, url, format=fmt, size=8, workers=1, **kw)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_prefix_holding_other_objects_is_refused_whatever_the_flags(
    bucket: str, tree: Path, overwrite: bool
) -> None:
    before = everything(bucket)
    with pytest.raises(CacheExistsError, match=r"mydata: exists and is not a dlstore cache.*important.txt"):
        conv(tree, f"s3://{bucket}/mydata", overwrite=overwrite)
    assert everything(bucket) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_bucket_root_is_refused_unless_empty(bucket: str, tree: Path, overwrite: bool) -> None:
    before = everything(bucket)
    with pytest.raises(CacheExistsError, match=r"bucket's root .*README.*choose a prefix"):
        conv(tree, f"s3://{bucket}", overwrite=overwrite)
    assert everything(bucket) == before


def test_an_empty_bucket_root_takes_a_cache_and_its_rebuild(server: Any, tree: Path, tmp_path: Path) -> None:
    RemoteStore("s3://own-empty").fs.mkdir("own-empty")
    conv(tree, "s3://own-empty")
    conv(tree, "s3://own-empty", fmt="zarr", overwrite=True)
    cache = open_cache("s3://own-empty", remote=Remote(cache_dir=tmp_path))
    assert cache.spec.format == "zarr"
    assert not [k for k in everything("own-empty") if k.startswith("shards/")]  # the npz generation went


def test_overwrite_deletes_only_what_the_old_manifest_lists(bucket: str, tree: Path, tmp_path: Path) -> None:
    url = f"s3://{bucket}/cache"
    conv(tree, url)
    store = RemoteStore(url)
    for rel, data in {"notes.txt": b"mine", "sub/also.txt": b"mine too"}.items():
        store.put_bytes(data, rel)  # the user's objects inside the cache's prefix
    old = set(store.sizes())
    conv(tree, url, fmt="zarr", overwrite=True)
    now = set(store.sizes())
    assert {"notes.txt", "sub/also.txt"} <= now
    assert not [k for k in now if k.startswith("shards/")]  # the old npz shards went
    assert not [k for k in now if k.startswith(".dlstore-staging")]
    assert {k for k in old if k.startswith("shards/")}  # there were npz shards to delete
    assert store.get_bytes("notes.txt") == b"mine"
    assert open_cache(url, remote=Remote(cache_dir=tmp_path)).spec.format == "zarr"
    assert_foreign_intact(bucket)


def test_a_publish_killed_mid_replace_resumes_and_still_keeps_foreign_objects(
    bucket: str, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/killed"
    conv(tree, url)
    store = RemoteStore(url)
    store.put_bytes(b"mine", "notes.txt")
    copy = RemoteStore.copy
    calls: list[str] = []

    def dying_copy(self: RemoteStore, src: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after the old manifest went, while copying the new files
        copy(self, src, dst)

    monkeypatch.setattr(RemoteStore, "copy", dying_copy)
    with pytest.raises(KeyboardInterrupt):
        conv(tree, url, fmt="zarr", overwrite=True)
    monkeypatch.setattr(RemoteStore, "copy", copy)
    assert "dlstore.json" not in store.sizes()  # mid-replace: no cache opens
    # The re-run sees objects without a manifest, but knows them as its own from the staged records.
    conv(tree, url, fmt="zarr", overwrite=True)
    cache = open_cache(url, remote=Remote(cache_dir=tmp_path))
    images = cache.read(np.arange(len(cache)))
    assert images.shape[0] == 12 and cache.spec.format == "zarr"
    now = store.sizes()
    assert not [k for k in now if k.startswith(("shards/", ".dlstore-staging"))]
    assert store.get_bytes("notes.txt") == b"mine"
    assert_foreign_intact(bucket)


def test_cli_refusal_is_one_line_and_exits_1(bucket: str, tree: Path) -> None:
    before = everything(bucket)
    for extra in ([], ["--overwrite"]):
        result = CliRunner().invoke(
            main, ["convert", str(tree), f"s3://{bucket}/mydata", "--size", "8", "--format", "npz", *extra]
        )
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert "not a dlstore cache" in result.output and "choose another prefix" in result.output
    assert everything(bucket) == before
