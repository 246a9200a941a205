"""Reused shared-memory batch slots (dlstore.read.slots) under torch's DataLoader: the pixels are right,
slots are reused and never overwritten while the main process holds them, DataLoader semantics hold
(fork/spawn, persistent workers, epochs, worker errors), and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlstore import CachedDataset, convert
from dlstore.read import slots
from dlstore.read.engines import workers
from dlstore.write.options import ConvertOptions

pytestmark = pytest.mark.skipif(not slots.supported(), reason="needs os.memfd_create (Linux)")


@pytest.fixture(scope="module")
def ram(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("slots") / "ram"
    convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=1))
    return dest


@pytest.fixture(scope="module")
def reference(ram: Path) -> torch.Tensor:
    ds = CachedDataset(ram)
    return torch.stack([ds[i][0] for i in range(len(ds))])


def _worker_pids(loader: DataLoader) -> set[int]:
    return {w.pid for w in loader._iterator._workers}  # type: ignore[union-attr]


def _epoch(loader: DataLoader, ref: torch.Tensor, batch: int) -> int:
    seen = 0
    for k, (x, _) in enumerate(loader):
        assert torch.equal(x.as_subclass(torch.Tensor), ref[k * batch : k * batch + len(x)])
        seen += len(x)
    return seen


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_persistent_workers_reuse_their_slots_across_epochs(
    ram: Path, reference: torch.Tensor, ctx: str
) -> None:
    ds = CachedDataset(ram)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context=ctx)
    for _ in range(3):
        assert _epoch(loader, reference, 4) == len(ds)
    batches = 3 * len(loader)
    new = slots.mapped_slots(_worker_pids(loader))
    # each worker maps a slot per batch it has in flight (prefetch 2 + the one being consumed), not
    # one per batch: without reuse this would be `batches`
    assert 2 <= new <= 2 * 4 < batches


def test_batches_kept_alive_are_never_overwritten(ram: Path, reference: torch.Tensor) -> None:
    ds = CachedDataset(ram)
    loader = DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True)
    kept = [x for _ in range(3) for x, _ in loader]  # more batches than a worker has slots
    assert len(kept) > slots.MAX_SLOTS
    flat = torch.cat([x.as_subclass(torch.Tensor) for x in kept])
    assert torch.equal(flat, torch.cat([reference] * 3))


def test_a_view_of_a_batch_keeps_its_slot(ram: Path, reference: torch.Tensor) -> None:
    loader = DataLoader(CachedDataset(ram), batch_size=4, num_workers=1, persistent_workers=True)
    first = None
    for x, _ in loader:
        if first is None:
            first = x[1:3]  # a view: the batch tensor itself is dropped
    for _ in loader:  # a second epoch would overwrite a slot freed too early
        pass
    assert first is not None and torch.equal(first, reference[1:3])


def test_new_workers_each_epoch_do_not_pile_up_mappings(ram: Path, reference: torch.Tensor) -> None:
    ds = CachedDataset(ram)
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=False)
    counts = []
    for _ in range(4):
        assert _epoch(loader, reference, 4) == len(ds)
        counts.append(slots.mapped_slots())
    # the slots of the previous epoch's (exited) workers are unmapped when the next workers' arrive
    assert max(counts[1:]) <= counts[0] + 2 * slots.MAX_SLOTS


def test_worker_errors_still_reach_the_main_process(ram: Path) -> None:
    class Failing(CachedDataset):
        def __getitems__(self, indices):  # type: ignore[no-untyped-def]
            if 5 in indices:
                raise OSError(f"bad image at index 5 in {self.path}")
            return super().__getitems__(indices)

    loader = DataLoader(Failing(ram), batch_size=4, num_workers=2)
    with pytest.raises(OSError, match="bad image at index 5"):
        for _ in loader:
            pass


def test_a_batch_resent_from_the_main_process_is_a_copy(ram: Path, reference: torch.Tensor) -> None:
    """A slot batch put on another multiprocessing queue (torch's own reduction) arrives intact."""
    import multiprocessing as mp

    x, _ = next(iter(DataLoader(CachedDataset(ram), batch_size=4, num_workers=1)))
    q = mp.get_context("fork").SimpleQueue()
    q.put(x)
    back = q.get()
    assert torch.equal(back.as_subclass(torch.Tensor), reference[:4])


def test_unsent_slot_is_freed_when_the_worker_drops_it() -> None:
    """A worker whose read raised after taking a slot must get the slot back, not leak it."""
    pool_before = len(slots._worker_pool().slots)
    for _ in range(3 * slots.MAX_SLOTS):
        t = slots.acquire(4096)
        assert t is not None
        del t
    # an empty pool is made whole (WARM_SLOTS) on its first acquire; after that no slot is added
    assert len(slots._worker_pool().slots) <= max(pool_before + 1, slots.WARM_SLOTS)


def _resident_bytes(t: torch.Tensor) -> int:
    """Rss of the mapping holding ``t`` (from /proc/self/smaps): its pages that are mapped now."""
    address, rss, inside = t.data_ptr(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            rss = int(line.split()[1]) * 1024
    return rss


def _fresh_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty pool in this process, as a newly started worker has."""
    monkeypatch.setattr(slots, "_pool", slots._Pool(os.getpid()))


def test_a_pool_is_made_whole_and_populated_on_its_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _populate_supported():
        pytest.skip("kernel without MADV_POPULATE_WRITE (< 5.14): slots fault in as used")
    _fresh_pool(monkeypatch)
    size = 64 * 4096
    t = slots.acquire(size)
    assert t is not None and len(slots._pool.slots) == slots.WARM_SLOTS  # type: ignore[union-attr]
    # every page allocated in one madvise, before the batch is written (made on demand: Rss 0 here)
    assert _resident_bytes(t) >= size
    others = [s for s in slots._pool.slots if s.flag[0] == 0]  # type: ignore[union-attr]
    assert len(others) == slots.WARM_SLOTS - 1


def _populate_supported() -> bool:
    import mmap

    probe = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.uint8)
    return slots.populate(probe, write=True)


def test_slots_still_work_where_populate_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An old kernel refuses MADV_POPULATE_*: the slot is still made, its pages fault in as used."""
    _fresh_pool(monkeypatch)
    monkeypatch.setattr(workers, "_libc", False)
    t = slots.acquire(8 * 4096)
    assert t is not None and _resident_bytes(t) <= 4096  # the flag's page only, written by acquire
    t.fill_(7)
    assert int(t.sum()) == 7 * 8 * 4096


def test_the_main_process_maps_a_workers_whole_pool_with_its_first_batch(ram: Path) -> None:
    loader = DataLoader(CachedDataset(ram), batch_size=4, num_workers=1, persistent_workers=True)
    it = iter(loader)
    next(it)
    # made on demand, the main process would map one slot here and the others at random later
    assert slots.mapped_slots(_worker_pids(loader)) == slots.WARM_SLOTS
    seen = 0
    for _ in range(2):
        for images, _ in loader:  # holds the previous batch while the next is fetched
            seen += len(images)
    assert seen == 2 * len(loader.dataset)  # type: ignore[arg-type]
    assert slots.mapped_slots(_worker_pids(loader)) == slots.WARM_SLOTS  # none made on demand


_CHILD = """
import os, sys, time, torch
from torch.utils.data import DataLoader
from dlstore import CachedDataset
if __name__ == "__main__":
    loader = DataLoader(CachedDataset(sys.argv[1]), batch_size=4, num_workers=2, persistent_workers=True)
    for epoch in range(1000):
        for x, _ in loader:
            maps = open("/proc/self/maps").read()
            if epoch == 1:
                # named shared memory still linked (mp's semaphores are unlinked at once: "deleted")
                shm = [l for l in maps.splitlines() if "/dev/shm/" in l and "(deleted)" not in l]
                memfd = [l for l in maps.splitlines() if "memfd:dlstore-batch" in l]
                print(len(shm), len(memfd), flush=True)
                time.sleep(60)
"""


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_kill_leaves_no_shared_memory_behind(ram: Path, tmp_path: Path) -> None:
    """Slots are memfd mappings (no name): a killed loader cannot leave files in /dev/shm."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    before = _shm_names()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ram)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        shm_maps, memfd_maps = (int(v) for v in line.split())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert memfd_maps >= 1 and shm_maps == 0  # batches live in anonymous memfd slots, nothing named
    time.sleep(0.5)
    # names torch's file_system strategy or a named dlstore segment would leave (others' concurrent
    # runs create their own psm_/sem. entries, so only these prefixes are ours to check)
    leaked = {n for n in _shm_names() - before if n.startswith(("torch_", "dlstore"))}
    assert not leaked


class _FakeCudart:
    """cudaHostRegister/Unregister as calls recorded (the CPU machine has no CUDA)."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append(address)
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.unregistered.append(address)
        return 0


class _FakeEvent:
    """A CUDA event whose completion the test decides."""

    done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return _FakeEvent.done


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    rt = _FakeCudart()
    monkeypatch.setattr(slots, "_cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "done", False)
    return rt


def test_pinning_a_worker_batch_locks_its_slot_once_and_copies_nothing(
    ram: Path, reference: torch.Tensor, fake_cuda: _FakeCudart
) -> None:
    loader = DataLoader(CachedDataset(ram), batch_size=4, num_workers=1, persistent_workers=True)
    for _ in range(3):
        for k, (x, _) in enumerate(loader):
            pinned = x.pin_memory()
            assert pinned.data_ptr() == x.data_ptr()  # in place: no copy
            assert torch.equal(pinned, reference[k * 4 : k * 4 + len(x)])
            _FakeEvent.done = True  # the device read it at once
    # each slot the worker used was registered once, not once per batch
    assert 1 <= len(fake_cuda.registered) == len(set(fake_cuda.registered)) <= slots.MAX_SLOTS
    assert len(fake_cuda.registered) < 3 * len(loader)


def test_a_pinned_slot_goes_back_only_after_the_device_read_it(ram: Path, fake_cuda: _FakeCudart) -> None:
    loader = DataLoader(CachedDataset(ram), batch_size=4, num_workers=1, persistent_workers=True)
    it = iter(loader)
    x, _ = next(it)
    pinned = x.pin_memory()
    mapped = slots._by_address[pinned.untyped_storage().data_ptr()]
    assert mapped.registered
    # no worker left to take the slot again as soon as it is free: its flag says who holds it
    it._shutdown_workers()  # type: ignore[attr-defined]
    del x, pinned  # released while the device copy (the fake event) is still pending
    slots.reclaim()
    assert mapped.flag[0] != 0 and mapped.fenced  # the worker may not refill it yet
    _FakeEvent.done = True
    slots.reclaim()
    assert mapped.flag[0] == 0 and not mapped.fenced
    del it, loader


def test_slots_of_exited_workers_are_unlocked_before_unmapping(ram: Path, fake_cuda: _FakeCudart) -> None:
    _FakeEvent.done = True
    ds = CachedDataset(ram)
    loader = DataLoader(ds, batch_size=4, num_workers=1)  # new workers each epoch
    first_epoch: set[int] = set()
    for epoch in range(2):
        for x, _ in loader:
            x.pin_memory()
        if epoch == 0:
            first_epoch = set(fake_cuda.registered)
    third = next(iter(loader))  # the third epoch's first new slot forgets the exited workers' slots
    assert first_epoch
    # every slot of the first epoch's (exited) worker was unlocked before its mapping went
    assert first_epoch <= set(fake_cuda.unregistered)
    del x, third
