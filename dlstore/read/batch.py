"""Whole batches for torch's DataLoader: one copy from the cache, and a pin path that is not one thread.

With a plain ``DataLoader(CachedDataset(...))``:

1. the worker gathers the batch's images straight into a shared-memory (B,H,W,C) block, one of its
   reused slots (``dlstore.read.slots``): the only copy in the worker (``BatchSamples`` is collated by
   handing that block over);
2. the block crosses to the main process as its slot's key (no copy), the labels inside the pickle;
3. with ``pin_memory=True`` the pin thread calls ``ImageBatch.pin_memory``: a worker slot is pinned in
   place (page-locked once); any other batch is copied into pinned memory in several threads, each
   pre-faulting its part in one ``madvise`` (torch's one-thread copy takes a page fault per 4 KiB of a
   fresh block, which caps it near 2 GB/s).

Images are (B,C,H,W) uint8 with channels-last strides (the block seen as CHW), which ``.cuda()`` and
channels-last models take without another copy; call ``.contiguous()`` for NCHW.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import collate as _collate

from dlstore.machine import usable_cores
from dlstore.read import slots
from dlstore.read.engines.workers import populate

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PIN_SPLIT_BYTES = 4 << 20  # below this a single copy is as fast as several


class ImageBatch(torch.Tensor):
    """A uint8 image batch that pins itself quickly. Behaves as a plain tensor: every operation on it
    returns a plain ``torch.Tensor`` (torch functions are not overridden)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def pin_memory(self, device: Any = None) -> torch.Tensor:  # type: ignore[override]
        plain = self.as_subclass(torch.Tensor)
        if slots.pin_in_place(plain):  # a worker slot page-locked once: no copy at all
            return plain
        return pin_parallel(plain)


def _rebuild_image_batch(rebuild: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    return rebuild(*args).as_subclass(ImageBatch)


def _reduce_image_batch(t: ImageBatch) -> tuple[Any, ...]:
    """Across processes by its worker slot's key (see ``dlstore.read.slots``), else like any tensor
    (its storage by file descriptor); arriving as an ImageBatch."""
    plain = t.as_subclass(torch.Tensor)
    slot = slots.slot_of(plain)
    if slot is not None:
        rebuild, args = slots.reduce_slot_tensor(plain, slot)
    else:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(plain)
    return _rebuild_image_batch, (rebuild, args)


ForkingPickler.register(ImageBatch, _reduce_image_batch)


class InlineTensor(torch.Tensor):
    """A small tensor (a batch's labels) sent to another process by value, inside the pickle: torch
    would put it in a shared-memory file of its own and hand its descriptor over a socket, which
    costs about as much per batch as the handover of the whole image block. Arrives as a plain tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def _rebuild_inline(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)


def _reduce_inline(t: InlineTensor) -> tuple[Any, ...]:
    return _rebuild_inline, (t.as_subclass(torch.Tensor).numpy().copy(),)


ForkingPickler.register(InlineTensor, _reduce_inline)


def labels_tensor(labels: np.ndarray) -> torch.Tensor:
    """int64 labels as a tensor; in a DataLoader worker, one that travels by value (InlineTensor)."""
    t = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    return t.as_subclass(InlineTensor) if in_worker() else t


def new_batch(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """An uninitialised uint8 tensor in one of this process's reused slots when one is free
    (``dlstore.read.slots``: a worker's batch then crosses processes without a copy; a fresh tensor is
    a fresh mmap, one page fault per 4 KiB as it is filled), else new: in a new shared-memory file when
    ``shared`` (``share_memory_()`` would allocate twice and copy), in ordinary memory otherwise."""
    nbytes = int(np.prod(shape))
    flat = slots.acquire(nbytes, slots.MAX_SLOTS if shared else slots.MAX_LOCAL_SLOTS)
    if flat is not None:
        return flat.view(shape)
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # an older torch: the copying way
        return torch.empty(shape, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes)).view(shape)


def in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


# --- pinning ----------------------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _threads() -> int:
    return max(1, min(8, usable_cores()))


def _copy_pool() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # threads do not survive a fork
            _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="dlstore-pin")
            _pool_pid = os.getpid()
        return _pool


def pin_parallel(src: torch.Tensor) -> torch.Tensor:
    """A pinned copy of ``src`` with the same strides, copied in several threads over its dense
    storage order. Falls back to ``Tensor.pin_memory`` for anything that is not one dense block."""
    if not src.is_contiguous() and not _dense_permutation(src):
        return src.pin_memory()
    dst = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, pin_memory=True)
    s, d = _flat_storage_view(src), _flat_storage_view(dst)
    if s.nbytes < _PIN_SPLIT_BYTES:
        np.copyto(d, s)
        return dst
    step = -(-len(s) // _threads())
    step += -step % _PAGE

    def part(a: int) -> None:
        populate(s[a : a + step], write=False)  # one madvise, not a fault per page
        np.copyto(d[a : a + step], s[a : a + step])  # releases the GIL

    list(_copy_pool().map(part, range(0, len(s), step)))
    return dst


def _dense_permutation(t: torch.Tensor) -> bool:
    """True when t's elements fill one block without gaps in some axis order (e.g. channels-last)."""
    order = sorted(range(t.dim()), key=lambda i: t.stride(i))
    expected = 1
    for i in order:
        if t.size(i) != 1 and t.stride(i) != expected:
            return False
        expected *= t.size(i)
    return True


def _flat_storage_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a dense tensor, in memory order, as a flat uint8 numpy view."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    return t.permute(order).contiguous().view(torch.uint8).reshape(-1).numpy()


# --- collation --------------------------------------------------------------------------------------


class Sample(tuple):  # type: ignore[type-arg]
    """(image, label) of a sample read as part of a batch; a plain tuple to anything but collate."""

    __slots__ = ()


class BatchSamples(Sequence[Sample]):
    """What ``CachedDataset.__getitems__`` returns: the batch's samples, made on demand. torch's
    default collate finds ``Sample`` registered and hands the block on as it is
    (``collate_batch_samples``); anything else sees ordinary (CHW image, int label) tuples."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels  # (B,C,H,W) uint8, (B,) int64

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Sample((self.images[i].as_subclass(torch.Tensor), int(self.labels[i])))

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def collated(self) -> list[torch.Tensor]:
        """What default_collate makes of (image, int) tuples, without stacking: [images, labels]."""
        return [self.images, labels_tensor(self.labels)]


def collate_batch_samples(batch: Sequence[Any], *, collate_fn_map: dict[Any, Any] | None = None) -> Any:
    if isinstance(batch, BatchSamples):
        return batch.collated()
    # Samples regrouped by the user (e.g. a list comprehension): collate them as plain tuples.
    return _collate.collate([tuple(s) for s in batch], collate_fn_map=collate_fn_map)


# default_collate looks the element's exact type up in this map before anything else (torch's
# documented way to extend it); workers, forked or spawned, import this module with the dataset.
_collate.default_collate_fn_map[Sample] = collate_batch_samples
