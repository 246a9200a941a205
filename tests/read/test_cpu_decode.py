"""The CPU share's read path: payloads located with ``PayloadExtents`` (no per-image bytes in the loading
process), read by the decode workers from the units' files or copied into the slot, CRC-checked there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from decode_helpers import corrupt_payload, cpu_split_loader

from dlstore import Loader, convert, open_cache
from dlstore.errors import CacheCorruptError, SampleReadError
from dlstore.formats import FORMATS
from dlstore.write.options import ConvertOptions

PAYLOAD_FORMATS = [f.name for f in FORMATS.values() if f.ragged_ok]


@pytest.fixture(scope="module", params=PAYLOAD_FORMATS)
def jpeg_cache(
    request: pytest.FixtureRequest, image_tree: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    dest = tmp_path_factory.mktemp("cpu-read") / request.param
    convert(
        image_tree,
        dest,
        ConvertOptions(format=request.param, size=24, resize="shorter", codec="jpeg", workers=2),
    )
    return dest


def _epoch_equals_cpu_decode(loader: Loader, path: Path) -> int:
    """The epoch's (label, image) pairs equal the reader's own CPU decode of every index, each once;
    returns the count."""
    from collections import Counter

    cache = open_cache(path)
    want = Counter(
        (int(label), img.shape, img.tobytes())
        for label, img in zip(cache.labels.tolist(), cache.read_images(np.arange(len(cache))))
    )
    got: Counter[Any] = Counter()
    for images, labels in loader:
        for img, label in zip(images, labels.tolist()):
            hwc = img.permute(1, 2, 0).contiguous().numpy()
            got[(int(label), hwc.shape, hwc.tobytes())] += 1
    assert got == want
    return sum(got.values())


def test_extents_locate_the_same_bytes_as_read_payloads(jpeg_cache: Path) -> None:
    cache = open_cache(jpeg_cache)
    index = np.random.default_rng(0).permutation(len(cache))[:17]
    payloads, shapes = cache.read_payloads(index)
    extents = cache.payload_extents(index)
    assert len(extents) == 17 and extents.shapes.tolist() == shapes.tolist()
    out = bytearray(int(extents.sizes.sum()))
    at = extents.copy_into(memoryview(out), np.arange(17))
    for i, p in enumerate(payloads):
        assert bytes(out[at[i] : at[i] + len(p)]) == bytes(p)
    # local units are files the workers can read themselves, at the same bytes
    assert all(s is not None for s in extents.sources)
    for i, p in enumerate(payloads):
        path, offset = extents.sources[int(extents.buffer[i])]  # type: ignore[misc]
        with open(path, "rb") as f:
            f.seek(offset + int(extents.starts[i]))
            assert f.read(len(p)) == bytes(p)


@pytest.mark.parametrize("from_files", [True, False])
def test_split_epoch_equals_cpu_decode_from_files_or_copied(
    jpeg_cache: Path, from_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers read the payloads from the unit files, or (units that are not files: a remote cache's)
    find them copied into the slot; either way the same pixels, every image once."""
    from dlstore.read import cache as cache_module

    sent: list[int] = []
    real = cache_module.Cache.payload_extents

    def extents(self: Any, indices: Any) -> Any:
        out = real(self, indices)
        if not from_files:
            out.sources = [None] * len(out.sources)
        sent.append(sum(s is not None for s in out.sources))
        return out

    monkeypatch.setattr(cache_module.Cache, "payload_extents", extents)
    loader = cpu_split_loader(jpeg_cache, 1.0, batch=8, order="random")
    try:
        assert _epoch_equals_cpu_decode(loader, jpeg_cache) == len(open_cache(jpeg_cache))
        assert loader.stats.cpu_images == len(open_cache(jpeg_cache)) and loader.stats.cpu_redecoded == 0
    finally:
        loader.close()
    assert sent and (all(sent) if from_files else not any(sent))


@pytest.mark.parametrize("from_files", [True, False])
def test_a_corrupt_payload_read_by_a_worker_is_the_named_error(
    jpeg_cache: Path, tmp_path: Path, from_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers check each payload's CRC (the loading process no longer does for the CPU share): a
    flipped byte fails the run, the loader reads it again itself and raises the reader's error naming
    the dataset index and the chunk. (The changed payload still decodes: without the check the epoch
    would return wrong pixels.)"""
    import shutil

    from dlstore.read import cache as cache_module

    if not from_files:
        real = cache_module.Cache.payload_extents

        def copied(self: Any, indices: Any) -> Any:
            out = real(self, indices)
            out.sources = [None] * len(out.sources)
            return out

        monkeypatch.setattr(cache_module.Cache, "payload_extents", copied)
    bad = tmp_path / "bad"
    shutil.copytree(jpeg_cache, bad)
    index = 9
    k, unit_file = corrupt_payload(bad, index)
    loader = cpu_split_loader(bad, 1.0, batch=8, order="random")
    try:
        with pytest.raises(SampleReadError) as err:
            for _ in loader:
                pass
    finally:
        loader.close()
    message = str(err.value)
    assert f"index {index} " in message and f"chunk {k}" in message and unit_file.name in message
    assert isinstance(err.value.__cause__, CacheCorruptError)
    assert loader.stats.cpu_redecoded > 0  # the workers refused the run; the loader named the image


def test_a_worker_checks_crcs_and_reads_files(tmp_path: Path) -> None:
    """decode_table on its own: a row from a file, a row from the block, a wrong CRC refused."""
    import zlib

    from dlstore.formats.codecs import get_codec
    from dlstore.read.decode.cpu_lane import MappedFiles, decode_table

    codec = get_codec("jpeg", 90)
    img = np.random.default_rng(1).integers(0, 255, (8, 6, 3), dtype=np.uint8)
    payload = codec.encode(img)
    (tmp_path / "f").write_bytes(b"xyz" + payload)
    n, out_bytes = len(payload), img.size
    block = np.zeros(n + 2 * out_bytes, np.uint8)
    block[:n] = np.frombuffer(payload, np.uint8)
    crc = zlib.crc32(payload)
    table = np.array([[0, n, n, 8, 6, 3, crc, -1], [3, 3 + n, n + out_bytes, 8, 6, 3, crc, 0]], np.int64)
    files = MappedFiles(2)
    decode_table(codec, block, table, np.empty(0, np.uint8), lambda i: files.get(str(tmp_path / "f")))
    want = codec.decode(payload, (8, 6, 3)).transpose(2, 0, 1).reshape(-1)
    assert np.array_equal(block[n : n + out_bytes], want)
    assert np.array_equal(block[n + out_bytes :], want)
    table[1, 6] = crc ^ 1
    with pytest.raises(ValueError, match="row 1: the payload fails its CRC check"):
        decode_table(codec, block, table, np.empty(0, np.uint8), lambda i: files.get(str(tmp_path / "f")))
    table[1, 1] = 10**9
    with pytest.raises(ValueError, match="beyond"):
        decode_table(codec, block, table, np.empty(0, np.uint8), lambda i: files.get(str(tmp_path / "f")))


def test_fewer_runs_than_processes_decode_the_same_epoch(jpeg_cache: Path) -> None:
    """``CpuDecoders.runs`` < processes: each share goes to fewer workers in turn; same pixels, each once."""
    loader = cpu_split_loader(jpeg_cache, 1.0, batch=8, order="random")
    try:
        it = iter(loader)
        next(it)  # the decoders start with the first epoch
        it.close()  # type: ignore[attr-defined]  # and its read-ahead stops before _send is counted
        assert loader._path.cpu is not None
        loader._path.cpu.runs = 1
        sent: list[int] = []
        real = loader._path.cpu._send

        def counting(table: Any, names: bytes = b"") -> Any:
            sent.append(len(table))
            return real(table, names)

        loader._path.cpu._send = counting  # type: ignore[method-assign]
        assert _epoch_equals_cpu_decode(loader, jpeg_cache) == len(open_cache(jpeg_cache))
        assert sent and len(sent) == len(loader) and loader.stats.cpu_redecoded == 0
    finally:
        loader.close()


def test_the_worker_module_imports_no_torch() -> None:
    """Decode workers are fresh interpreters that import this module: no torch (seconds and GBs each)."""
    import subprocess
    import sys

    probe = "import sys; from dlstore.read.decode.cpu_lane import main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_only_a_whole_memory_map_names_its_file(tmp_path: Path) -> None:
    """A unit whose data is a slice of a map would give the map's offset, not the slice's: no file then."""
    from dlstore.formats.payload import PayloadUnit

    np.arange(100, dtype=np.uint8).tofile(tmp_path / "m")
    whole = np.memmap(tmp_path / "m", np.uint8, "r", offset=10, shape=(50,))

    def unit(data: Any) -> PayloadUnit:
        return PayloadUnit(
            data, np.array([0, 1]), np.ones((1, 3), np.int32), np.zeros(1, np.uint32), np.zeros(2)
        )

    assert unit(whole).file_source() == (str(tmp_path / "m"), 10)
    assert unit(whole[5:]).file_source() is None
    assert unit(np.zeros(5, np.uint8)).file_source() is None
