"""Shared-memory batch slots that DataLoader workers reuse, so a batch crosses processes for free.

torch hands each worker batch to the main process in a new shared-memory file: the worker creates and
zero-fills it, sends its descriptor over a socket (a connection and an HMAC handshake per batch), the
main process maps it, takes one page fault per 4 KiB when the batch is first read (about 12,800 for a
50 MB batch) and unmaps it when the batch is freed. On the H200 that per-batch cost in the main
process capped 16 workers at about 35k img/s of 256 px images, under a fifth of memcpy bandwidth.

Here each worker keeps a small pool of slots: anonymous shared memory (``memfd_create``: no name, so
nothing can leak in /dev/shm even after ``kill -9``) mapped once in the worker and once in the main
process. A slot's descriptor travels only with its first batch; later batches send the slot's key and
the tensor's geometry, a few dozen bytes. The first byte of each slot says who holds it (0 free,
1 filling or in the main process): the worker takes a free slot, the main process frees it when the
last tensor viewing the batch is released (a finalizer on the numpy view under the tensor's storage).
When every slot is held (a user keeping batches alive) the worker falls back to torch's own path,
so nothing ever waits on the main process.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

_HEADER = mmap.PAGESIZE  # the flag byte, then the batch page-aligned
_FREE, _HELD = 0, 1
MAX_SLOTS = 8  # per worker; steady state needs prefetch_factor + the batches the main process holds
MAX_LOCAL_SLOTS = 3  # in a process reading for itself (0 workers): this batch, the last, one spare
# DLSTORE_SHM_SLOTS=0 hands batches over as torch does (benchmarks' A/B; forked workers inherit
# a change of ``enabled`` made before they start).
enabled = os.environ.get("DLSTORE_SHM_SLOTS", "1") != "0"


@dataclass
class _Slot:
    """One slot as the worker sees it."""

    key: tuple[int, str, int]
    fd: int
    capacity: int
    buf: mmap.mmap
    flag: np.ndarray
    data: np.ndarray
    use: int = 0  # incremented on each acquire: a finalizer of an earlier use must not free a later one
    sent_use: int = -1  # the use whose batch went to the main process (ownership passed there)

    def release_unsent(self, use: int) -> None:
        """The worker's view of this use died: free the slot unless its batch was sent."""
        if self.use == use and self.sent_use != use:
            self.flag[0] = _FREE


@dataclass
class _Pool:
    pid: int
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))
    slots: list[_Slot] = field(default_factory=list)
    created: int = 0  # slot keys are never reused within a pool
    by_address: dict[int, _Slot] = field(default_factory=dict)


_pool: _Pool | None = None
_lock = threading.Lock()


def supported() -> bool:
    return enabled and hasattr(os, "memfd_create")


def _worker_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child starts with a pool of its own
        _pool = _Pool(os.getpid())
    return _pool


def _new_slot(pool: _Pool, nbytes: int) -> _Slot:
    fd = os.memfd_create("dlstore-batch", os.MFD_CLOEXEC)
    os.ftruncate(fd, _HEADER + nbytes)
    buf = mmap.mmap(fd, _HEADER + nbytes)
    whole = np.frombuffer(buf, dtype=np.uint8)
    pool.created += 1
    slot = _Slot((pool.pid, pool.nonce, pool.created), fd, nbytes, buf, whole[:1], whole[_HEADER:])
    pool.slots.append(slot)
    pool.by_address[slot.data.ctypes.data] = slot
    return slot


def _drop_a_free_slot(pool: _Pool) -> bool:
    """Make room for a bigger batch (a larger batch size than before) in place of a free slot."""
    free = next((s for s in pool.slots if s.flag[0] == _FREE), None)
    if free is None:
        return False
    pool.slots.remove(free)
    del pool.by_address[free.data.ctypes.data]
    os.close(free.fd)  # its mapping goes with the last view of it
    return True


def acquire(nbytes: int, limit: int = MAX_SLOTS) -> torch.Tensor | None:
    """A flat uint8 tensor of ``nbytes`` in a free slot of this process's pool (of at most ``limit``
    slots), or None when every slot is held (or memfd is unavailable): the caller then allocates as
    torch does. Used in the main process too (``limit`` small there: the pool lives as long as the
    process), where it saves a fresh allocation's page faults on every batch."""
    if not supported() or nbytes == 0:
        return None
    with _lock:
        pool = _worker_pool()
        slot = next((s for s in pool.slots if s.flag[0] == _FREE and s.capacity >= nbytes), None)
        if slot is None:
            if len(pool.slots) >= limit and not _drop_a_free_slot(pool):
                return None
            slot = _new_slot(pool, nbytes)
        slot.flag[0] = _HELD
        slot.use += 1
    view = slot.data[:nbytes]  # a new ndarray per use: its finalizer frees the slot if never sent
    weakref.finalize(view, slot.release_unsent, slot.use)
    return torch.from_numpy(view)


def slot_of(t: torch.Tensor) -> _Slot | None:
    """The worker slot holding ``t``'s storage, if any (only in the process that owns the pool)."""
    pool = _pool
    if pool is None or pool.pid != os.getpid():
        return None
    return pool.by_address.get(t.untyped_storage().data_ptr())


def reduce_slot_tensor(t: torch.Tensor, slot: _Slot) -> tuple[Any, tuple[Any, ...]]:
    """Pickle ``t`` as (slot key, geometry); with the slot's descriptor only the first time."""
    fd = None
    if slot.sent_use < 0:
        fd = reduction.DupFd(slot.fd)  # through the worker's resource sharer, as torch does
    slot.sent_use = slot.use
    geometry = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
    return _rebuild_slot_tensor, (slot.key, fd, slot.capacity, geometry)


# --- the main process's side ------------------------------------------------------------------------


class _Mapped:
    """A worker's slot mapped in this process, kept until its worker is gone."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.buf = mmap.mmap(fd, _HEADER + capacity)
        whole = np.frombuffer(self.buf, dtype=np.uint8)
        self.flag, self.data = whole[:1], whole[_HEADER:]
        self.live = 0
        self.lock = threading.Lock()

    def view(self) -> np.ndarray:
        with self.lock:
            self.live += 1
        v = self.data[:]  # a new ndarray object: the tensor's storage keeps it, then it is finalized
        weakref.finalize(v, self.release)
        return v

    def release(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live == 0:
                self.flag[0] = _FREE  # the worker may fill it again


_mapped: dict[tuple[int, str, int], _Mapped] = {}
_mapped_lock = threading.Lock()


def _rebuild_slot_tensor(
    key: tuple[int, str, int], fd: Any, capacity: int, geometry: tuple[int, tuple[int, ...], tuple[int, ...]]
) -> torch.Tensor:
    with _mapped_lock:
        if fd is not None:
            raw = fd.detach()
            try:
                _mapped[key] = _Mapped(raw, capacity)
            finally:
                os.close(raw)  # the mapping keeps the memory
            _forget_dead_workers()
        mapped = _mapped.get(key)
    if mapped is None:
        raise RuntimeError(
            f"dlstore: a DataLoader batch refers to shared-memory slot {key} whose first batch never "
            "arrived in this process; set DLSTORE_SHM_SLOTS=0 to hand batches over as torch does"
        )
    offset, shape, stride = geometry
    flat = torch.from_numpy(mapped.view())
    return flat.as_strided(shape, stride, offset)


def _forget_dead_workers() -> None:
    """Unmap the slots of workers that exited (new workers each epoch without persistent_workers)."""
    for key in [k for k, m in _mapped.items() if m.live == 0 and not _alive(k[0])]:
        del _mapped[key]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mapped_slots(pids: Collection[int] | None = None) -> int:
    """How many worker slots this process has mapped, of the workers ``pids`` or of all (for tests
    and diagnostics)."""
    return sum(1 for key in _mapped if pids is None or key[0] in pids)
