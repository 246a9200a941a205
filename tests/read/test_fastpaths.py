"""Fast paths return exactly the plain path's pixels and labels; the sampler's contract; buffers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import small_units

from dlstore import Loader, convert, open_cache
from dlstore.formats import FORMATS
from dlstore.read.pinned import BufferRing
from dlstore.read.sampler import ChunkSampler
from dlstore.write.sources import ArraySource

UNIT = 8  # images per unit (shard, chunk, slab): 97 images make 13 units


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """97 distinct 6x6 images (first pixel encodes the index) in every format, units of 8 images
    (left to itself a format would put all 97 tiny images in one unit)."""
    rng = np.random.default_rng(1)
    n = 97
    data = rng.integers(0, 256, (n, 6, 6, 3), dtype=np.uint8)
    data[:, 0, 0, 0], data[:, 0, 0, 1] = np.arange(n) % 256, np.arange(n) // 256
    src = ArraySource(
        description="t",
        classes=("a", "b", "c"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 3, n),
        kind="test",
        data=data,
    )
    base = tmp_path_factory.mktemp("fast")
    with pytest.MonkeyPatch.context() as m:
        small_units(m, UNIT)
        for fmt in FORMATS:
            convert(src, base / fmt, format=fmt, size=6, resize="stretch", workers=1)
    for fmt in FORMATS:
        assert open_cache(base / fmt).spec.format_options["unit_size"] == UNIT
    return {fmt: base / fmt for fmt in FORMATS}


def index_of(images: torch.Tensor) -> list[int]:
    return (images[:, 0, 0, 0].long() + 256 * images[:, 1, 0, 0].long()).tolist()


def check_epoch(batches: list[tuple[torch.Tensor, torch.Tensor]], path: Path, expect_all: bool) -> None:
    cache = open_cache(path)
    reference = torch.from_numpy(cache.read(np.arange(len(cache)))).permute(0, 3, 1, 2)
    seen = []
    for x, y in batches:
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 6, 6)
        idx = index_of(x)
        assert torch.equal(x, reference[idx]) and y.tolist() == cache.labels[idx].tolist()
        seen += idx
    assert len(seen) == len(set(seen))
    if expect_all:
        assert sorted(seen) == list(range(len(cache)))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("order", ["auto", "random", "sequential"])
def test_pinned_loader_matches_plain_reads(caches: dict[str, Path], fmt: str, order: str) -> None:
    loader = Loader(caches[fmt], batch_size=10, device="cpu", order=order, drop_last=False, via="pinned")
    for _ in range(2):
        check_epoch(list(loader), caches[fmt], expect_all=True)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pinned_loader_decoding_ahead_in_processes_matches_plain_reads(
    caches: dict[str, Path], fmt: str
) -> None:
    loader = Loader(caches[fmt], batch_size=10, device="cpu", drop_last=False, cpu_decoders=2, via="pinned")
    for _ in range(2):
        check_epoch(list(loader), caches[fmt], expect_all=True)
    procs = loader.cache.engines.batch_processes
    # the formats whose units decode into pixel arrays used them (zarr, npz); ram reads directly
    assert (procs is not None) == loader.cache.reader.traits.unit_arrays
    loader.cache.close()
    assert procs is None or all(p.poll() is not None for p in procs.procs)


def test_pinned_loader_with_slow_consumer(caches: dict[str, Path]) -> None:
    loader = Loader(caches["zarr"], batch_size=8, device="cpu", via="pinned")
    batches = []
    for x, y in loader:
        time.sleep(0.01)  # the producer runs ahead and must wait for a free buffer
        batches.append((x, y))
    check_epoch(batches, caches["zarr"], expect_all=False)
    assert len(batches) == 97 // 8


def test_pinned_loader_yields_the_batches_before_a_read_error_then_raises(caches: dict[str, Path]) -> None:
    """The next batch is fetched ahead of the one returned: an error reading it must still come after
    every batch read before it, and end the epoch."""
    loader = Loader(caches["ram"], batch_size=8, device="cpu", order="sequential", via="pinned")
    real, calls = loader.cache.read, []

    def failing(indices, out=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise OSError("chunk 2 unreadable")
        return real(indices, out=out)

    loader.cache.read = failing  # type: ignore[method-assign]
    it = iter(loader)
    got = [next(it), next(it)]
    with pytest.raises(OSError, match="chunk 2 unreadable"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    check_epoch(got, caches["ram"], expect_all=False)


def test_pinned_loader_returns_a_ready_batch_without_waiting_for_the_next(caches: dict[str, Path]) -> None:
    """The copy ahead takes the next batch only when it is already gathered: the batch in hand must
    come back while the gather of the next one is still held up (a blocking fetch would wait here)."""
    loader = Loader(caches["ram"], batch_size=8, device="cpu", order="sequential", via="pinned")
    real, calls, gate = loader.cache.read, [], threading.Event()

    def held(indices, out=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) >= 2:  # every read after the first waits for the gate
            assert gate.wait(30)
        return real(indices, out=out)

    loader.cache.read = held  # type: ignore[method-assign]
    it = iter(loader)
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
    first.start()
    first.join(10)
    returned = not first.is_alive()
    gate.set()
    first.join(30)
    assert returned, "the first batch waited for the second batch's gather"
    got += list(it)
    check_epoch(got, caches["ram"], expect_all=False)
    assert len(got) == 97 // 8


def test_buffer_is_not_refilled_before_its_copy_finished() -> None:
    ring = BufferRing(1, (2, 1), pin=False)

    class SlowCopy:
        done = threading.Event()

        def synchronize(self) -> None:
            self.done.wait(5)

    slot = ring.acquire()
    copy = SlowCopy()
    ring.release(slot, copy)
    got: list[float] = []
    t = threading.Thread(target=lambda: got.append(ring.acquire()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # still waiting on the copy
    copy.done.set()
    t.join(5)
    assert got == [slot]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_resident_loader(caches: dict[str, Path], fmt: str) -> None:
    loader = Loader(caches[fmt], batch_size=16, device="cpu", drop_last=False, via="resident")
    check_epoch(list(loader), caches[fmt], expect_all=True)
    assert len(list(loader)) == len(loader) == 7


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_loaders_refuse_a_batch_size_torch_refuses(caches: dict[str, Path], batch_size: object) -> None:
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        torch.utils.data.BatchSampler(range(4), batch_size, False)  # type: ignore[arg-type]
    for via in ("pinned", "resident"):
        with pytest.raises(ValueError, match=f"batch_size should be a positive integer.*={batch_size}"):
            Loader(caches["ram"], batch_size=batch_size, device="cpu", via=via)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", [n for n, f in FORMATS.items() if f.traits.unit_grouped])
def test_chunk_sampler_decodes_each_unit_once(caches: dict[str, Path], fmt: str) -> None:
    from dlstore.formats.base import UnitCache

    cache = open_cache(caches[fmt])
    reader = cache.reader
    # Keep only two windows of 2 units (what a batch straddling two windows touches; the loaders'
    # default_window also assumes 2 windows fit): a sampler that came back to a unit after leaving its
    # window would have to decode it again.
    reader._units = UnitCache(4)
    loads: list[int] = []
    original = reader.load_unit
    reader.load_unit = lambda k: loads.append(k) or original(k)  # type: ignore[method-assign]
    sampler = ChunkSampler(cache.positions, reader.unit, window=2, seed=3)
    order = list(sampler)
    assert order != sorted(order)  # shuffled
    for i in range(0, len(order), 8):
        cache.read(order[i : i + 8])
    assert sorted(loads) == list(range(-(-97 // UNIT)))  # every unit decoded, none twice


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_chunk_sampler_epoch_contract(replicas: int) -> None:
    positions = np.random.default_rng(0).permutation(100)
    per_rank = [
        list(ChunkSampler(positions, 7, window=3, seed=5, num_replicas=replicas, rank=r))
        for r in range(replicas)
    ]
    assert len({len(p) for p in per_rank}) == 1
    union = sum(per_rank, [])
    assert set(union) == set(range(100)) and len(union) - 100 < replicas  # only DistributedSampler padding
    if replicas == 1:
        assert sorted(union) == list(range(100))
    again = list(ChunkSampler(positions, 7, window=3, seed=5, num_replicas=replicas, rank=0))
    assert again == per_rank[0]
    s = ChunkSampler(positions, 7, window=3, seed=5, num_replicas=replicas, rank=0)
    s.set_epoch(1)
    assert list(s) != per_rank[0]  # a new epoch, a new order


def test_chunk_sampler_drop_last() -> None:
    s = [list(ChunkSampler(np.arange(10), 3, num_replicas=3, rank=r, drop_last=True)) for r in range(3)]
    assert [len(x) for x in s] == [3, 3, 3] and len(set(sum(s, []))) == 9


def test_abandoned_epoch_does_not_block_the_next(caches: dict[str, Path]) -> None:
    loader = Loader(caches["ram"], batch_size=4, device="cpu", drop_last=False, via="pinned")
    for _ in range(3):
        next(iter(loader))  # start an epoch and walk away, buffers still filled
    check_epoch(list(loader), caches["ram"], expect_all=True)


def test_zarr_buffer_reuse_under_eviction(caches: dict[str, Path]) -> None:
    from dlstore.formats.base import UnitCache

    reference = open_cache(caches["zarr"]).read(np.arange(97))
    cache = open_cache(caches["zarr"])
    reader = cache.reader
    reader._units = UnitCache(2)  # evict constantly so decode buffers are recycled
    evicted: list[int] = []
    recycle = reader.recycle
    reader.recycle = lambda bufs: (evicted.append(len(bufs)), recycle(bufs))  # type: ignore[method-assign]
    fresh: list[int] = []
    take = reader._buffers.take
    reader._buffers.take = lambda: (fresh.append(len(reader._buffers._free)), take())[1]  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    unit_of = cache.positions // UNIT
    for _ in range(60):  # 2 random units per read: some are still cached, others evict and reuse
        idx = np.flatnonzero(np.isin(unit_of, rng.choice(unit_of.max() + 1, 2, replace=False)))
        np.testing.assert_array_equal(cache.read(idx), reference[idx])
    assert sum(evicted) > 50 and sum(n > 0 for n in fresh) > 50  # buffers were evicted and reused
