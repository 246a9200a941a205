"""zarr v3's sharding codec (``--shard-mb``): many chunks inside one shard file, read by byte range
through the shard index. The cache stays plain zarr, reads the same pixels as an unsharded one,
writes one file per shard, refuses a damaged index, and on S3 costs one GET per shard."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlstore.errors import SampleReadError, SpecError
from dlstore.read.cache import Remote, open_cache
from dlstore.write.conversion import convert

CHUNK = 2  # images per chunk: small, so the 27-image tree spans 5 shards, the last one partial
SHARD_MB = 3 * CHUNK * 12 * 12 * 3 / 2**20  # three chunks per shard at 12 px


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "dlstore.formats.zarr_cache.ZarrWriter.choose_unit_size", staticmethod(lambda b: CHUNK)
    )


def make(tree: Path, dest: Path | str, codec: str, shard_mb: float = 0.0, **kw: Any) -> Any:
    shards = {"shard_mb": shard_mb} if shard_mb else {}
    return convert(tree, dest, format="zarr", size=12, workers=2, codec=codec, writer_options=shards, **kw)


@pytest.fixture(scope="module")
def pairs(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per codec: (unsharded cache, sharded cache) of the same images."""
    base = tmp_path_factory.mktemp("shards")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dlstore.formats.zarr_cache.ZarrWriter.choose_unit_size", staticmethod(lambda b: CHUNK))
        for codec in ("zstd", "lz4", "none"):
            make(image_tree, base / f"plain-{codec}", codec)
            make(image_tree, base / f"sharded-{codec}", codec, SHARD_MB)
            out[codec] = (base / f"plain-{codec}", base / f"sharded-{codec}")
    return out


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
def test_sharded_cache_reads_the_same_pixels_as_an_unsharded_one(
    pairs: dict[str, tuple[Path, Path]], codec: str
) -> None:
    plain, sharded = (open_cache(p) for p in pairs[codec])
    assert sharded.reader.sharding is not None and sharded.reader.sharding.per_shard == 3
    assert sharded.reader.unit == CHUNK and len(plain) == len(sharded) == 27
    everything = np.arange(len(plain))
    np.testing.assert_array_equal(sharded.read(everything), plain.read(everything))
    shuffled = np.random.default_rng(0).permutation(len(plain))[:20]
    np.testing.assert_array_equal(sharded.read(shuffled), plain.read(shuffled))
    np.testing.assert_array_equal(sharded.labels, plain.labels)


def test_one_file_per_shard_and_plain_zarr_reads_it(pairs: dict[str, tuple[Path, Path]]) -> None:
    zarr = pytest.importorskip("zarr")
    plain, sharded = pairs["zstd"]
    ours = open_cache(sharded)
    shard_len = 3 * CHUNK
    files = sorted(p for p in (sharded / "images" / "c").rglob("*") if p.is_file())
    assert len(files) == -(-len(ours) // shard_len)
    assert len(list((plain / "images" / "c").rglob("*/*/*/*"))) == -(-len(ours) // CHUNK)
    meta = json.loads((sharded / "images" / "zarr.json").read_text())
    assert meta["codecs"][0]["name"] == "sharding_indexed"
    assert meta["chunk_grid"]["configuration"]["chunk_shape"][0] == shard_len
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(sharded, mode="r")
        images = group["images"][:]
        positions = group["positions"][:]
    assert group["images"].shards == (shard_len, 12, 12, 3)
    idx = np.arange(len(ours))
    np.testing.assert_array_equal(images[positions[idx]], ours.read(idx))


def test_a_damaged_shard_index_names_the_file(pairs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    import shutil

    dest = tmp_path / "c"
    shutil.copytree(pairs["zstd"][1], dest)
    shard = dest / "images" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # inside the index (offset/nbytes of the last chunk), before its crc32c
    shard.write_bytes(bytes(data))
    cache = open_cache(dest)
    shard_of = np.asarray(cache.positions) // (3 * CHUNK)
    cache.read(np.flatnonzero(shard_of == 0))  # shard 0 is intact
    with pytest.raises(SampleReadError, match=r"images/c/1/0/0/0: shard index checksum mismatch"):
        cache.read(np.flatnonzero(shard_of == 1))


def test_shards_are_for_pixel_caches_only(image_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="--shard-mb"):
        make(image_tree, tmp_path / "j", "jpeg", 1.0)


def test_unsharded_manifest_has_no_shard_option(pairs: dict[str, tuple[Path, Path]]) -> None:
    plain, sharded = pairs["zstd"]
    assert not open_cache(plain).spec.writer_options["shard_mb"]
    assert open_cache(sharded).spec.writer_options["shard_mb"] == pytest.approx(SHARD_MB)


# --- on S3 (moto's server) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from s3server import aws_env, start_server

    from dlstore.storage.stores import RemoteStore

    server = start_server()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in aws_env(server).items():
            mp.setenv(name, value)
        mp.setenv("DLSTORE_SPOOL", str(tmp_path_factory.mktemp("spool")))
        RemoteStore("s3://shards").fs.mkdir("shards")
        yield
    server.stop()


@pytest.mark.s3
def test_sharded_cache_on_s3_costs_one_get_per_shard(
    s3: None, image_tree: Path, pairs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    make(image_tree, "s3://shards/c", "zstd", SHARD_MB)
    cache = open_cache("s3://shards/c", remote=Remote(cache_dir=tmp_path / "mirror"))
    store = cache.mirror.store
    before = store.requests
    everything = np.arange(len(cache))
    for a in range(0, len(cache), 4):  # batches smaller than a shard: each shard still fetched once
        np.testing.assert_array_equal(
            cache.read(everything[a : a + 4]), open_cache(pairs["zstd"][0]).read(everything[a : a + 4])
        )
    assert store.requests - before == -(-len(cache) // (3 * CHUNK))


def test_sharded_chunks_decoded_in_processes_match(pairs: dict[str, tuple[Path, Path]]) -> None:
    plain, sharded = pairs["zstd"]
    ref = open_cache(plain)
    cache = open_cache(sharded)
    batches = [np.sort(b) for b in np.array_split(np.random.default_rng(1).permutation(len(cache)), 5)]
    for idx, got in zip(batches, cache.read_batches(batches, processes=2), strict=True):
        np.testing.assert_array_equal(got, ref.read(idx))
    cache.close()
