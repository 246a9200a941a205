"""Caches on object storage, against a real S3-compatible server (moto's server mode on a free port):
convert to s3://, open/read/verify/info from it, atomic publish and resume, the read-through chunk
cache, checksums on truncated or tampered objects, retries and a clear error when the server dies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from reliability_helpers import FORMAT_NAMES, make_tree, read_all
from s3server import aws_env, start_server

import dlstore.storage.stores as stores
from dlstore import CachedDataset, Loader, Remote, convert, open_cache, verify
from dlstore.cli import main
from dlstore.errors import CacheExistsError, CacheNotFoundError, CacheReplacedError, SampleReadError
from dlstore.formats import FORMATS
from dlstore.storage.stores import RemoteStore
from dlstore.write.options import ConvertOptions

pytestmark = pytest.mark.s3
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

BUCKET = "dlstore-test"
SECRET = "not-a-real-secret-4f1c"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A moto S3 server; credentials and endpoint through the standard AWS environment."""
    server = start_server()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in aws_env(server, SECRET).items():
            mp.setenv(name, value)
        mp.setenv("DLSTORE_SPOOL", str(tmp_path_factory.mktemp("spool")))
        RemoteStore(f"s3://{BUCKET}").fs.mkdir(BUCKET)
        yield {"server": server}
    server.stop()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=12)


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "RETRIES", 3)
    monkeypatch.setattr(stores, "BACKOFF_S", 0.01)


def url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def conv(tree: Path, dest: str | Path, fmt: str, **kw: Any) -> Any:
    return convert(tree, dest, format=fmt, size=8, workers=1, **kw)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_convert_to_s3_and_read_back_the_same_pixels(
    s3: dict, tree: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 5))
    local = conv(tree, tmp_path / "local", fmt)
    remote = conv(tree, url(f"roundtrip-{fmt}"), fmt)
    assert remote.dest == url(f"roundtrip-{fmt}") and remote.n == local.n == 24
    images, labels = read_all(tmp_path / "local")
    cache = open_cache(url(f"roundtrip-{fmt}"), remote=Remote(cache_dir=tmp_path / "mirror"))
    assert np.array_equal(cache.read(np.arange(len(cache))), images)
    assert np.array_equal(cache.labels, labels)
    assert verify(url(f"roundtrip-{fmt}")).ok
    manifest = RemoteStore(url(f"roundtrip-{fmt}")).get_bytes("dlstore.json").decode()
    assert SECRET not in manifest and "testing" not in manifest  # credentials never in the manifest


def test_dataset_and_loaders_read_a_url(
    s3: dict, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLSTORE_REMOTE_CACHE", str(tmp_path / "mirror"))
    conv(tree, url("ds"), "npz")
    ds = CachedDataset(url("ds"))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn")
    seen = torch.cat([y for _, y in loader])
    assert sorted(seen.tolist()) == sorted(ds.targets)
    pinned = Loader(url("ds"), batch_size=8, device="cpu", order="chunk", via="pinned")
    assert sum(len(y) for _, y in pinned) == 24


def test_decode_loader_reads_a_url_and_shards_it_across_ranks(s3: dict, tree: Path, tmp_path: Path) -> None:
    fmt = next(f.name for f in FORMATS.values() if f.ragged_ok)  # a payload layout: --codec jpeg
    conv(tree, tmp_path / "local", fmt, codec="jpeg")
    conv(tree, url("jpeg"), fmt, codec="jpeg")
    kw: dict[str, Any] = {"device": "cpu", "order": "sequential", "drop_last": False}
    local = [(x, y) for x, y in Loader(tmp_path / "local", 4, via="decode", **kw)]
    remote = Loader(
        url("jpeg"), 4, remote=Remote(cache_dir=tmp_path / "mirror", cache_bytes=64 << 20), via="decode", **kw
    )
    got = list(remote)
    assert remote.cache.mirror is not None and (tmp_path / "mirror") in remote.cache.mirror.path.parents
    assert len(got) == len(local) == 6
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, local))
    shares = [
        torch.cat(
            [
                y
                for _, y in Loader(
                    url("jpeg"),
                    4,
                    num_replicas=2,
                    rank=r,
                    remote=Remote(cache_dir=tmp_path / "m2"),
                    via="decode",
                    **kw,
                )
            ]
        )
        for r in range(2)
    ]
    assert len(shares[0]) == len(shares[1]) == 12
    assert sorted(torch.cat(shares).tolist()) == sorted(torch.cat([y for _, y in local]).tolist())


def test_second_epoch_reads_local_disk_and_the_mirror_stays_bounded(
    s3: dict, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 4))
    conv(tree, url("lru"), "npz")
    cache = open_cache(url("lru"), remote=Remote(cache_dir=tmp_path / "big"))
    for start in range(0, 24, 4):
        cache.read(np.arange(start, min(24, start + 4)))
    store = cache.mirror.store
    before = store.requests
    cache.read(np.arange(24))  # the whole second epoch
    assert store.requests == before  # nothing fetched again
    unit_bytes = max(p.stat().st_size for p in (cache.mirror.path / "shards").iterdir())
    small = open_cache(url("lru"), remote=Remote(cache_dir=tmp_path / "small", cache_bytes=2 * unit_bytes))
    for start in range(0, 24, 4):
        small.read(np.arange(start, min(24, start + 4)))
        shards = list((small.mirror.path / "shards").iterdir())
        assert sum(p.stat().st_size for p in shards) <= 2 * unit_bytes
    assert np.array_equal(small.read(np.arange(24)), cache.read(np.arange(24)))


def test_pinned_loader_prefetches_the_next_batch_units(
    s3: dict, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 4))
    conv(tree, url("prefetch"), "npz")
    cache = open_cache(url("prefetch"), remote=Remote(cache_dir=tmp_path))
    cache.prefetch(np.arange(8))
    cache.mirror._prefetcher.shutdown(wait=True)
    assert sorted(p.name for p in (cache.mirror.path / "shards").iterdir()) == [
        Path(f).name for f in cache.reader.files_for(cache.positions[:8])
    ]
    asked: list[list[int]] = []
    real = type(cache).prefetch
    monkeypatch.setattr(type(cache), "prefetch", lambda self, idx: (asked.append(list(idx)), real(self, idx)))
    loader = Loader(cache, batch_size=8, device="cpu", order="chunk", via="pinned")
    batches = [sorted(y.tolist()) for _, y in loader]
    assert (
        len(asked) == len(batches) - 1
    )  # every batch but the first was prefetched while the previous one was read


def test_publish_is_atomic_and_resumes_from_staging(
    s3: dict, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 5))
    conv(tree, url("atomic"), "npz")
    old = read_all_url(url("atomic"), tmp_path / "m0")
    put = RemoteStore.put_file
    calls: list[str] = []

    def dying_put(self: RemoteStore, src: Path, rel: str) -> None:
        calls.append(rel)
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed mid-upload
        put(self, src, rel)

    monkeypatch.setattr(RemoteStore, "put_file", dying_put)
    with pytest.raises(KeyboardInterrupt):
        convert(tree, url("atomic"), ConvertOptions(format="npz", size=12, workers=1, overwrite=True))
    # The previous cache is untouched while the new one is only staged.
    assert np.array_equal(read_all_url(url("atomic"), tmp_path / "m1")[0], old[0])
    calls.clear()
    monkeypatch.setattr(
        RemoteStore, "put_file", lambda self, src, rel: (calls.append(rel), put(self, src, rel))
    )
    convert(tree, url("atomic"), ConvertOptions(format="npz", size=12, workers=1, overwrite=True))
    assert 0 < len(calls) < 9  # only what was not staged yet
    assert open_cache(url("atomic"), remote=Remote(cache_dir=tmp_path / "m2")).spec.shape == (12, 12, 3)
    leftovers = [k for k in RemoteStore(url("atomic")).sizes() if k.startswith(".dlstore-staging")]
    assert leftovers == []


def read_all_url(u: str, mirror: Path) -> tuple[np.ndarray, np.ndarray]:
    cache = open_cache(u, remote=Remote(cache_dir=mirror))
    return cache.read(np.arange(len(cache))), cache.labels


def test_a_reader_of_a_rebuilt_remote_cache_is_told_never_mixed(
    s3: dict, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 5))
    conv(tree, url("rebuilt"), "npz")
    cache = open_cache(url("rebuilt"), remote=Remote(cache_dir=tmp_path))
    first = cache.read(np.arange(5))
    convert(
        tree,
        url("rebuilt"),
        ConvertOptions(format="npz", size=8, workers=1, overwrite=True, storage_order="source"),
    )
    # F5: the CacheReplacedError itself, not a SampleReadError wrapping it (issue 20 item 2)
    with pytest.raises(CacheReplacedError, match="rebuilt or removed while open"):
        cache.read(np.arange(len(cache)))
    assert np.array_equal(cache.read(np.arange(5)), first)  # units already here: the old generation


def test_no_manifest_means_no_cache_and_existing_needs_overwrite(
    s3: dict, tree: Path, tmp_path: Path
) -> None:
    store = RemoteStore(url("half"))
    store.put_bytes(b"x" * 10, "labels.npy")  # objects without a manifest: a half-written cache
    with pytest.raises(CacheNotFoundError, match="no dlstore.json"):
        open_cache(url("half"), remote=Remote(cache_dir=tmp_path))
    conv(tree, url("exists"), "npz")
    assert conv(tree, url("exists"), "npz").up_to_date  # the same command: make-like, as locally
    with pytest.raises(CacheExistsError, match="--overwrite"):
        conv(tree, url("exists"), "zarr")


def test_a_missing_bucket_is_refused_before_any_work(s3: dict, tree: Path) -> None:
    import os

    from dlstore.storage.stores import RemoteStoreError

    spool = Path(os.environ["DLSTORE_SPOOL"])
    before = sorted(spool.rglob("*"))
    # The store's own one-line message for a missing bucket (issue 20 item 3), at the write probe.
    with pytest.raises(RemoteStoreError, match="the bucket 'no-such-bucket-x' does not exist.*create it"):
        conv(tree, "s3://no-such-bucket-x/c", "npz")
    assert sorted(spool.rglob("*")) == before  # nothing converted


@pytest.mark.parametrize("damage", ["truncate", "tamper"])
def test_damaged_objects_are_caught_by_their_checksum(
    s3: dict, tree: Path, tmp_path: Path, damage: str
) -> None:
    u = url(f"damaged-{damage}")
    conv(tree, u, "npz")
    store = RemoteStore(u)
    shard = next(k for k in store.sizes() if k.startswith("shards/"))
    data = store.get_bytes(shard)
    store.put_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-8] + b"XXXXXXXX", shard)
    cache = open_cache(u, remote=Remote(cache_dir=tmp_path))
    with pytest.raises(SampleReadError, match=rf"{shard}.*(checksum mismatch|truncated)"):
        cache.read(np.arange(len(cache)))
    assert not (cache.mirror.path / shard).exists()  # never kept, never read
    result = verify(u)
    assert not result.ok and shard in result.first_problem


def test_server_dying_mid_epoch_gives_a_clear_error_naming_the_object(tree: Path, tmp_path: Path) -> None:
    server = start_server()
    host, port = server.get_host_and_port()
    opts = {
        "endpoint_url": f"http://{host}:{port}",
        "key": "testing",
        "secret": SECRET,
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
    }
    try:
        RemoteStore("s3://dying", opts).fs.mkdir("dying")
        monkey = pytest.MonkeyPatch()
        monkey.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 5))
        monkey.setenv("DLSTORE_SPOOL", str(tmp_path / "spool"))
        convert(tree, "s3://dying/c", ConvertOptions(format="npz", size=8, workers=1, storage_options=opts))
        cache = open_cache("s3://dying/c", remote=Remote(cache_dir=tmp_path / "m", storage_options=opts))
        cache.read(np.arange(5))  # the first unit arrives
    finally:
        server.stop()
        monkey.undo()
    with pytest.raises(SampleReadError) as info:
        cache.read(np.arange(5, 24))
    message = str(info.value)
    assert "s3://dying/c/shards/" in message and "failed 3 times" in message
    assert SECRET not in message


def test_cli_convert_info_verify_bench_with_a_url(s3: dict, tree: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["convert", str(tree), url("cli"), "--format", "npz", "--size", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["dest"] == url("cli")
    res = runner.invoke(main, ["info", url("cli"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n"] == 24
    res = runner.invoke(main, ["verify", url("cli")])
    assert res.exit_code == 0 and "ok" in res.output
    opts = json.dumps({"key": "testing", "secret": SECRET})
    res = runner.invoke(main, ["info", url("cli"), "--storage-options", opts])
    assert res.exit_code == 0 and SECRET not in res.output
    bench = [
        "bench",
        str(tree),
        "--loaders",
        "npz",
        "--cache",
        url("cli"),
        "--size",
        "8",
        "--workers",
        "0",
        "--batch-size",
        "8",
    ]
    res = runner.invoke(
        main, [*bench, "--steps", "2", "--warmup", "1", "--repeats", "1", "--out", str(tmp_path / "b")]
    )
    assert res.exit_code == 0, res.output
    run = json.loads((tmp_path / "b" / "result.json").read_text())
    assert run["loaders"]["npz"]["cache"] == url("cli") and run["loaders"]["npz"]["remote"]


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS.values() if f.ragged_ok])
def test_jpeg_ragged_cache_on_s3_reads_the_same_images(
    s3: dict, tree: Path, tmp_path: Path, fmt: str
) -> None:
    kw: dict[str, Any] = {"codec": "jpeg", "resize": "shorter"}
    conv(tree, tmp_path / "local", fmt, **kw)
    conv(tree, url(f"jpeg-{fmt}"), fmt, **kw)
    local = open_cache(tmp_path / "local").read_images(np.arange(24))
    remote_cache = open_cache(url(f"jpeg-{fmt}"), remote=Remote(cache_dir=tmp_path / "mirror"))
    remote = remote_cache.read_images(np.arange(24))
    assert all(np.array_equal(a, b) for a, b in zip(local, remote))
    # the mirror's unit files may be evicted once read: CPU decode workers get the bytes copied, never
    # a path to re-read later
    extents = remote_cache.payload_extents(np.arange(24))
    assert extents.sources and all(s is None for s in extents.sources)
    assert all(s is not None for s in open_cache(tmp_path / "local").payload_extents(np.arange(24)).sources)
    assert verify(url(f"jpeg-{fmt}")).ok
