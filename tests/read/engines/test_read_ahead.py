"""Chunked readers decoding ahead (``prefetch``): order, each unit once, errors, bounds, shutdown."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest

from dlstore import convert, open_cache
from dlstore.errors import CacheCorruptError, SampleReadError
from dlstore.formats.base import ChunkedReader
from dlstore.formats.describe import Traits
from dlstore.formats.zarr_cache import ZarrWriter
from dlstore.read.loader import make_sampler, storage_sorted
from dlstore.write.sources import ArraySource

UNIT, SHAPE = 4, (2, 2, 1)


class FakeReader(ChunkedReader):
    """Unit k holds UNIT images filled with k; decodes are recorded and can be held at a gate."""

    traits: ClassVar[Traits] = ChunkedReader.traits

    def __init__(self, units: int, max_units: int = 8, threads: int = 1, fail: tuple[int, ...] = ()) -> None:
        spec: Any = SimpleNamespace(format="fake", shape=SHAPE, image_bytes=4, n_stored=units * UNIT)
        super().__init__(Path("."), spec, unit=UNIT, cache_bytes=max_units * UNIT * 4, threads=threads)
        self.calls: list[int] = []
        self.fail = set(fail)
        self.gate = threading.Event()
        self.gate.set()
        self._calls_lock = threading.Lock()

    def load_unit(self, k: int) -> np.ndarray:
        with self._calls_lock:
            self.calls.append(k)
        assert self.gate.wait(10), "test gate never opened"
        if k in self.fail:
            raise CacheCorruptError(f"chunk {k} does not decode")
        return np.full((UNIT, *SHAPE), k, np.uint8)

    @classmethod
    def unit_file(cls, k: int) -> str:
        return f"u/{k}"


def positions(*units: int) -> np.ndarray:
    return np.concatenate([np.arange(k * UNIT, (k + 1) * UNIT) for k in units])


def read(reader: FakeReader, pos: np.ndarray) -> np.ndarray:
    out = np.empty((len(pos), *SHAPE), np.uint8)
    reader.read_into(pos, out)
    return out


def drain(reader: FakeReader) -> None:
    """Wait for every decode started ahead (the test's view of 'the pool is idle')."""
    for f, _ in list(reader._ahead.values()):
        f.exception(timeout=10)


def test_decodes_in_the_order_given_and_each_unit_once() -> None:
    r = FakeReader(units=12, threads=1)
    r.prefetch(positions(5, 3, 9))
    r.prefetch(positions(3, 7))  # 3 is decoding ahead already: not queued twice
    drain(r)
    assert r.calls == [5, 3, 9, 7]
    got = read(r, positions(3, 5, 7, 9, 1))  # 1 was not prefetched: the read decodes it
    assert got[:, 0, 0, 0].tolist() == [k for k in (3, 5, 7, 9, 1) for _ in range(UNIT)]
    assert sorted(r.calls) == [1, 3, 5, 7, 9]
    r.close()


def test_a_read_waits_for_a_unit_being_decoded_ahead_instead_of_decoding_it_again() -> None:
    r = FakeReader(units=4, threads=1)
    r.gate.clear()
    r.prefetch(positions(2))
    result: list[np.ndarray] = []
    reader_thread = threading.Thread(target=lambda: result.append(read(r, positions(2))))
    reader_thread.start()
    reader_thread.join(0.2)
    assert reader_thread.is_alive()  # held at the gate inside the decode ahead
    r.gate.set()
    reader_thread.join(10)
    assert r.calls == [2] and result[0][:, 0, 0, 0].tolist() == [2] * UNIT
    r.close()


def test_an_error_decoding_ahead_is_raised_by_the_read_that_needs_the_unit() -> None:
    r = FakeReader(units=6, threads=2, fail=(4,))
    r.prefetch(positions(3, 4, 5))  # no error here: nobody asked for unit 4 yet
    drain(r)
    assert read(r, positions(3))[:, 0, 0, 0].tolist() == [3] * UNIT
    with pytest.raises(CacheCorruptError, match="chunk 4"):
        read(r, positions(4, 5))
    with pytest.raises(CacheCorruptError, match="chunk 4"):  # not remembered as good: decoded again
        read(r, positions(4))
    assert r.calls.count(4) == 3  # ahead, then by each read (the error is the read's own)
    r.close()


def test_decodes_ahead_at_most_half_the_unit_cache_and_drops_what_no_read_takes() -> None:
    r = FakeReader(units=40, max_units=8, threads=2)
    r.prefetch(positions(*range(10, 30)))
    drain(r)
    assert r.max_ahead == 4 and r.calls == list(range(10, 14))
    for _ in range(r.STALE_READS + 1):  # reads of other units: the ones decoded ahead go stale
        read(r, positions(0))
    r.prefetch(positions(30, 31))
    drain(r)
    assert r.calls[4:] == [0, 30, 31] and set(r._ahead) == {30, 31}
    r.close()


def test_close_cancels_queued_decodes_and_stops_its_threads() -> None:
    r = FakeReader(units=10, max_units=20, threads=1)
    r.gate.clear()
    r.prefetch(positions(1, 2, 3, 4))
    closer = threading.Thread(target=r.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waits for the decode that is running
    r.gate.set()
    closer.join(10)
    assert not closer.is_alive() and r.calls == [1]
    assert not [t for t in threading.enumerate() if t.name.startswith("dlstore-ahead")]


@pytest.fixture(scope="module")
def zarr_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 images in chunks of 7 (left to itself zarr puts them all in one ≥ 1 MB chunk)."""
    rng = np.random.default_rng(3)
    n = 300
    src = ArraySource(
        description="t",
        classes=("a", "b", "c"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 3, n),
        kind="test",
        data=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
    )
    dest = tmp_path_factory.mktemp("ahead") / "zarr"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ZarrWriter, "choose_unit_size", staticmethod(lambda image_bytes: 7))
        convert(src, dest, format="zarr", size=16, resize="stretch", workers=1)
    return dest


def epoch(root: Path, depth: int) -> tuple[list[np.ndarray], list[int]]:
    """Batches of 32 in ChunkSampler order, prefetching `depth` batches ahead; the units decoded."""
    cache = open_cache(root)
    cache.reader.threads = 3
    calls: list[int] = []
    load = cache.reader.load_unit
    cache.reader.load_unit = lambda k: (calls.append(k), load(k))[1]  # type: ignore[method-assign]
    order = list(make_sampler(cache, "chunk", seed=1))
    batches = [storage_sorted(cache, order[i : i + 32]) for i in range(0, len(order), 32)]
    got = []
    for i, idx in enumerate(batches):
        if depth and i + 1 < len(batches):
            cache.prefetch(np.concatenate(batches[i + 1 : i + 1 + depth]))
        got.append(cache.read(idx))
    cache.close()
    return got, calls


def test_zarr_reads_with_prefetch_match_plain_reads_and_decode_each_chunk_once(zarr_cache: Path) -> None:
    plain, plain_calls = epoch(zarr_cache, 0)
    ahead, ahead_calls = epoch(zarr_cache, 2)
    assert all(np.array_equal(a, b) for a, b in zip(plain, ahead))
    assert len(set(plain_calls)) == 43  # every chunk of 7 (the last one short)
    assert sorted(ahead_calls) == sorted(set(ahead_calls)) == sorted(set(plain_calls))


def test_a_damaged_zarr_chunk_decoded_ahead_names_the_chunk_in_the_read(
    zarr_cache: Path, tmp_path: Path
) -> None:
    import shutil

    root = tmp_path / "z"
    shutil.copytree(zarr_cache, root)
    chunk = root / "images" / "c" / "1" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    cache = open_cache(root)
    cache.reader.threads = 2
    unit = cache.reader.unit
    index = np.flatnonzero(cache.positions // unit == 1)[:2]
    cache.prefetch(index)
    with pytest.raises(SampleReadError, match=r"images/c/1/0/0/0: chunk 1"):
        cache.read(index)
    cache.close()
