"""Shared-memory batch slots that DataLoader workers reuse, so a batch crosses processes for free.

torch hands each worker batch over in a new shared-memory file: created and zero-filled by the worker,
its descriptor sent over a socket (a connection and an HMAC handshake per batch), mapped by the main
process with one page fault per 4 KiB on first read and unmapped when freed. That per-batch cost in
the main process capped 16 workers near 35k img/s of 256 px images, under a fifth of memcpy bandwidth.

Here each worker keeps a small pool of slots: anonymous shared memory (``memfd_create``: nothing can
leak in /dev/shm, even after ``kill -9``) mapped once in the worker and once in the main process. A
slot's descriptor travels with its pool's first batch; later batches send the slot's key and the
tensor's geometry. The first byte of each slot says who holds it (0 free, 1 filling or in the main
process); the main process frees it when the last tensor viewing the batch is released. When every
slot is held (a user keeping batches) the worker falls back to torch's path: nothing waits.

With ``pin_memory=True`` the main process page-locks each slot once (``cudaHostRegister``) and pins the
batch in place, instead of copying it into a fresh pinned buffer (which halved the rate at 16
workers). A page-locked slot goes back to its worker only once a CUDA event recorded at its release
(on the stream where ``images.cuda(non_blocking=True)`` ran) has completed.

A pool is made whole on its first batch (``WARM_SLOTS``, each populated in one ``madvise``): slots made
on demand appeared late, at random, each costing a page-fault-bound first fill in the middle of
training. ``DLSTORE_SHM_SLOTS=0`` hands batches over as torch does.
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

from dlstore import settings
from dlstore.machine import process_alive
from dlstore.read.engines.workers import populate

_HEADER = mmap.PAGESIZE  # the flag byte, then the batch page-aligned
_FREE, _HELD = 0, 1
MAX_SLOTS = 8  # per worker; steady state needs prefetch_factor + the batches the main process holds
MAX_LOCAL_SLOTS = 3  # in a process reading for itself (0 workers): this batch, the last, one spare
# A plain loop's steady state: prefetch_factor (2), the batch consumed, and the one the loop variable
# holds until next() returns; more are made on demand (up to MAX_SLOTS).
WARM_SLOTS = 4
# The escape hatch (forked workers inherit a change of ``enabled`` made before they start).
enabled = settings.flag("DLSTORE_SHM_SLOTS")


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
    fd_sent: bool = False  # its descriptor went to the main process (with the first batch of the pool)

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
    populate(whole, write=True)
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
    """A flat uint8 tensor of ``nbytes`` in a free slot of this process's pool (at most ``limit``
    slots), or None when every slot is held or memfd is unavailable (the caller allocates as torch
    does). In the main process too (``limit`` small), it saves a fresh allocation's page faults."""
    if not supported() or nbytes == 0:
        return None
    with _lock:
        pool = _worker_pool()
        slot = next((s for s in pool.slots if s.flag[0] == _FREE and s.capacity >= nbytes), None)
        if slot is None:
            if len(pool.slots) >= limit and not _drop_a_free_slot(pool):
                return None
            slot = _new_slot(pool, nbytes)
            if len(pool.slots) == 1:  # the pool's first batch: make the rest now
                for _ in range(min(limit, WARM_SLOTS) - 1):
                    _new_slot(pool, nbytes)
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
    """Pickle ``t`` as (slot key, geometry), with the descriptors of the pool's slots not sent yet
    (all of a warm pool with its first batch; a slot made later with its own first batch)."""
    with _lock:  # runs in the worker's queue feeder thread while its main thread may add slots
        pool = _worker_pool()
        unsent = [s for s in pool.slots if not s.fd_sent]
        # through the worker's resource sharer, as torch does
        new = tuple((s.key, reduction.DupFd(s.fd), s.capacity) for s in unsent)
        for s in unsent:
            s.fd_sent = True
        slot.sent_use = slot.use
    geometry = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
    return _rebuild_slot_tensor, (slot.key, new, geometry)


# --- the main process's side ------------------------------------------------------------------------


class _Mapped:
    """A worker's slot mapped in this process, kept until its worker is gone."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.buf = mmap.mmap(fd, _HEADER + capacity)
        whole = np.frombuffer(self.buf, dtype=np.uint8)
        populate(whole, write=False)  # now, with the pool's first batch, not at each slot's first touch
        self.flag, self.data = whole[:1], whole[_HEADER:]
        self.address, self.size = whole.ctypes.data, whole.nbytes
        self.live = 0
        self.lock = threading.Lock()
        self.registered = False  # page-locked for CUDA (pinned in place)
        self.tried = False  # registration attempted (a refused one is not retried: copies instead)
        self.fenced = False  # released, waiting for the device to finish reading it

    def view(self) -> np.ndarray:
        with self.lock:
            self.live += 1
        v = self.data[:]  # a new ndarray object: the tensor's storage keeps it, then it is finalized
        weakref.finalize(v, self.release)
        return v

    def release(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live:
                return
            if not self.registered or not _fence(self):
                self.flag[0] = _FREE  # the worker may fill it again


_mapped: dict[tuple[int, str, int], _Mapped] = {}
_mapped_lock = threading.Lock()
_by_address: dict[int, _Mapped] = {}  # each mapped slot by the address of its batch area


def _rebuild_slot_tensor(
    key: tuple[int, str, int],
    new: tuple[tuple[tuple[int, str, int], Any, int], ...],
    geometry: tuple[int, tuple[int, ...], tuple[int, ...]],
) -> torch.Tensor:
    with _mapped_lock:
        for new_key, fd, capacity in new:
            raw = fd.detach()
            try:
                _mapped[new_key] = _Mapped(raw, capacity)
                _by_address[_mapped[new_key].data.ctypes.data] = _mapped[new_key]
            finally:
                os.close(raw)  # the mapping keeps the memory
        if new:
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
    reclaim()  # a page-locked slot released at the end of the last epoch may be fenced still
    for key in [k for k, m in _mapped.items() if m.live == 0 and not m.fenced and not process_alive(k[0])]:
        m = _mapped.pop(key)
        del _by_address[m.data.ctypes.data]
        if m.registered:  # unlock before the mapping goes (no copy reads it: released, not fenced)
            _cudart().cudaHostUnregister(m.address)


def mapped_slots(pids: Collection[int] | None = None) -> int:
    """How many worker slots this process has mapped, of the workers ``pids`` or of all (for tests
    and diagnostics)."""
    return sum(1 for key in _mapped if pids is None or key[0] in pids)


# --- pinning in place (the main process, pin_memory=True) --------------------------------------------

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device, not one context
_fenced: list[tuple[_Mapped, Any]] = []  # released page-locked slots and the event each waits for
_fenced_lock = threading.Lock()
stats = {"registered": 0}  # slots page-locked (diagnostics)


def _cudart() -> Any:
    return torch.cuda.cudart()


def pin_in_place(t: torch.Tensor) -> bool:
    """True when ``t`` lies in a worker slot mapped here that is (now, registered on first use)
    page-locked for CUDA: it is pinned as it is; False (the caller copies) otherwise. Also frees the
    fenced slots the device has finished with."""
    reclaim()
    if not torch.cuda.is_available():
        return False
    m = _by_address.get(t.untyped_storage().data_ptr())
    if m is None:
        return False
    if not m.tried:
        m.tried, m.registered = True, _register(m)
    return m.registered


def _register(m: _Mapped) -> bool:
    err = _cudart().cudaHostRegister(m.address, m.size, _REGISTER_PORTABLE)
    ok = int(getattr(err, "value", err)) == 0  # refused (a limit on locked memory): copy as before
    stats["registered"] += ok
    return ok


def _fence(m: _Mapped) -> bool:
    """Hold a released page-locked slot until the device has done what was queued on this thread's
    current stream (the copy that read it). False when CUDA cannot record (interpreter exit): then
    nothing can still be copying from it."""
    try:
        event = torch.cuda.Event()
        event.record()
    except Exception:
        return False
    m.fenced = True
    with _fenced_lock:
        _fenced.append((m, event))
    return True


def reclaim() -> None:
    """Give back to their workers the fenced slots whose copies have finished."""
    if not _fenced:
        return
    with _fenced_lock:
        waiting = []
        for m, event in _fenced:
            if event.query():
                m.fenced = False
                m.flag[0] = _FREE
            else:
                waiting.append((m, event))
        _fenced[:] = waiting
