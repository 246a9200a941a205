"""Fast ways to get batches of a dlstore cache onto the device.

- ``PinnedLoader``: no worker processes. A background thread gathers each batch straight into one of
  a ring of pinned host buffers (``torch.index_select(..., out=)`` for a ram cache; chunk-grouped,
  thread-decoded reads for npz/zarr); the batch is copied to the GPU on a side stream, and a buffer
  is refilled only after the copy that read it has finished.
- ``ResidentLoader``: the whole uint8 cache lives in device memory; batches are an ``index_select``
  there, with no host work per batch.
- ``batch_dataloader``: torch's DataLoader with worker processes, each producing a whole batch
  (one storage pass, written straight into shared memory) and passed through without a collate copy.

All three yield ``(images, labels)``: images uint8 (B, C, H, W) (channels-last strides, as stored),
labels int64 (B,). Convert, normalise and augment on the GPU (``dlstore.gpu.GpuAugment``).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.errors import DlstoreError
from dlstore.formats.base import ChunkedReader
from dlstore.machine import usable_cores
from dlstore.read.batch import ImageBatch, in_worker, labels_tensor, new_batch
from dlstore.read.cache import Cache, open_cache
from dlstore.read.sampler import ChunkSampler

Batch = tuple[torch.Tensor, torch.Tensor]


def make_sampler(
    cache: Cache,
    order: str,
    seed: int = 0,
    window: int | None = None,
    num_replicas: int = 1,
    rank: int = 0,
) -> torch.utils.data.Sampler[int]:
    """``chunk`` (chunk-aware, default for npz/zarr), ``random`` (full shuffle) or ``sequential``.

    With ``num_replicas`` > 1 (one process per GPU) each rank gets its own equal-length share of the
    epoch (``ChunkSampler``'s contiguous slice, or ``DistributedSampler`` for ``random``), so every
    rank runs the same number of steps and DDP never waits on a rank that ran out."""
    if order == "auto":
        order = "chunk" if isinstance(cache.reader, ChunkedReader) else "random"
    if order == "chunk":
        unit = getattr(cache.reader, "unit", 1)
        window = window or default_window(cache)
        return ChunkSampler(
            cache.positions, unit, window=window, seed=seed, num_replicas=num_replicas, rank=rank
        )
    if order in ("random", "sequential") and num_replicas > 1:
        return torch.utils.data.DistributedSampler(
            range(len(cache)), num_replicas=num_replicas, rank=rank, shuffle=order == "random", seed=seed
        )
    if order == "random":
        return torch.utils.data.RandomSampler(
            range(len(cache)), generator=torch.Generator().manual_seed(seed)
        )
    if order == "sequential":
        return torch.utils.data.SequentialSampler(range(len(cache)))
    raise ValueError(f"order must be auto, chunk, random or sequential, got {order!r}")


def default_window(cache: Cache, images: int = 4096) -> int:
    """Mix about `images` images at a time, but never more units than half the reader keeps decoded."""
    reader = cache.reader
    if not isinstance(reader, ChunkedReader):
        return 1
    return max(1, min(reader.max_units // 2, -(-images // reader.unit)))


class PinnedLoader:
    """Main-process loader: background gather into pinned buffers, side-stream copy to the device.

    >>> loader = PinnedLoader("cache/", batch_size=256, device="cuda")    # doctest: +SKIP
    >>> for epoch in range(10):
    ...     for images, labels in loader:                                  # uint8 on the GPU
    ...         step(augment(images), labels)

    ``transform`` (e.g. a ``GpuAugment``) is applied to each batch on the device; with
    ``cuda_graph=True`` it is replayed from a CUDA graph (``dlstore.gpu.graphs.CudaGraphed``) and the
    images it yields are overwritten by the next batch, as with ``ResidentLoader``.

    A chunked cache (zarr, npz) decodes the chunks of the next two batches ahead in the reader's
    threads; with ``decode_processes=N``, N worker processes decode each chunk once and copy its
    images straight into the epoch's batches in shared memory (``Cache.read_batches``), and the
    gather thread only copies each finished batch into a pinned buffer.
    """

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        device: str | torch.device = "cuda",
        order: str = "auto",
        drop_last: bool = True,
        seed: int = 0,
        num_buffers: int = 4,
        in_memory: bool = False,
        window: int | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cuda_graph: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        decode_processes: int = 0,
    ) -> None:
        self.cache = (
            path
            if isinstance(path, Cache)
            else open_cache(path, in_memory=in_memory, storage_options=storage_options, cache_dir=cache_dir)
        )
        if cuda_graph and transform is not None:
            from dlstore.gpu.graphs import CudaGraphed

            transform = CudaGraphed(transform)  # replayed, not launched op by op (see ResidentLoader)
        self.transform = transform
        self.batch_size, self.drop_last, self.seed = check_batch_size(batch_size), drop_last, seed
        self.device = torch.device(device)
        self.sampler = make_sampler(self.cache, order, seed, window, num_replicas, rank)
        # The only process reading: let the reader's (blocking, not spinning) threads use every core.
        self.cache.reader.threads = max(self.cache.reader.threads, usable_cores())
        self.decode_processes = decode_processes
        self.num_buffers = max(2, num_buffers)
        self.epoch = 0
        self._ring: BufferRing | None = None
        self._last: weakref.ref[_PinnedIter] | None = None

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The order of the next epoch is the one of ``epoch`` (resuming at an epoch boundary);
        without calls, each iteration advances the epoch by one."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        if self._ring is None:  # buffers are kept across epochs: pinning is slow
            self._ring = BufferRing(
                self.num_buffers, (self.batch_size, *self.cache.spec.shape), pin=self.device.type == "cuda"
            )
        if self._last is not None and (last := self._last()) is not None:
            last.close()  # an epoch abandoned mid-way must give its buffers back first
        batches = torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)
        it = _PinnedIter(self.cache, self._ring, batches, self.device, self.transform, self.decode_processes)
        self._last = weakref.ref(it)
        return it


class BufferRing:
    """Host buffers handed out in turn; one comes back to the producer only with the event of the
    device copy that reads it, and the producer waits on that event before overwriting it."""

    def __init__(self, k: int, shape: tuple[int, ...], pin: bool) -> None:
        self.images = [torch.empty(shape, dtype=torch.uint8, pin_memory=pin) for _ in range(k)]
        self.labels = [torch.empty(shape[0], dtype=torch.int64, pin_memory=pin) for _ in range(k)]
        self.free: queue.Queue[tuple[int, Any]] = queue.Queue()
        for i in range(k):
            self.free.put((i, None))

    def acquire(self) -> int:
        slot, event = self.free.get()
        if event is not None:
            event.synchronize()  # the copy that reads this buffer is done
        return slot

    def release(self, slot: int, event: Any) -> None:
        self.free.put((slot, event))


def storage_sorted(cache: Cache, indices: list[int]) -> np.ndarray:
    """A batch's indices in storage order: chunked readers then copy each unit's rows in one slice.
    The order of samples inside a batch does not matter to training; the labels follow the images."""
    index = np.asarray(indices, dtype=np.int64)
    return index[np.argsort(cache.positions[index], kind="stable")]


PREFETCH_BATCHES = 2  # zarr 256 px: a batch of 256 can need ~100 new chunks, half the decode-ahead bound


class _Producer:
    """The gather thread's state, kept apart from the iterator so an abandoned iterator can be
    collected (and close the producer) while the thread is still running."""

    DONE = object()

    def __init__(self, cache: Cache, ring: BufferRing, batches: list[list[int]], processes: int = 0) -> None:
        self.cache, self.ring, self.batches, self.processes = cache, ring, batches, processes
        self.ready: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="dlstore-gather")
        self.thread.start()

    def run(self) -> None:
        try:
            if self.processes > 0 and getattr(self.cache.reader, "decode_batches", None) is not None:
                self.run_decoded()
            else:
                self.run_reads()
        except BaseException as e:  # surfaced in the consumer's thread
            self.ready.put(e)
        self.ready.put(self.DONE)

    def run_reads(self) -> None:
        for i, idx in enumerate(self.batches):
            ahead = self.batches[i + 1 : i + 1 + PREFETCH_BATCHES]
            if ahead:  # a remote cache downloads, a chunked one decodes, their units meanwhile
                self.cache.prefetch(np.concatenate([np.asarray(b, np.int64) for b in ahead]))
            slot = self.ring.acquire()
            if self.stop.is_set():
                self.ring.release(slot, None)
                break
            index = storage_sorted(self.cache, idx)
            n = len(index)
            self.cache.read(index, out=self.ring.images[slot][:n].numpy())
            self.ring.labels[slot][:n] = torch.from_numpy(self.cache.labels[index])
            self.ready.put((slot, n))

    def run_decoded(self) -> None:
        """Batches decoded by worker processes into shared memory (Cache.read_batches): copy each
        into a pinned buffer, in the reader's threads (one thread copies ~5-10 GB/s)."""
        indices = [storage_sorted(self.cache, idx) for idx in self.batches]
        batches = self.cache.read_batches(indices, processes=self.processes)
        try:
            for index, images in zip(indices, batches):
                slot = self.ring.acquire()
                if self.stop.is_set():
                    self.ring.release(slot, None)
                    break
                n = len(index)
                copy_parallel(self.cache.reader, self.ring.images[slot][:n].numpy(), images)
                self.ring.labels[slot][:n] = torch.from_numpy(self.cache.labels[index])
                self.ready.put((slot, n))
        finally:
            batches.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop and join: hand back every buffer the thread filled so it is never left waiting."""
        self.stop.set()
        while self.thread.is_alive():
            try:
                item = self.ready.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, tuple):
                self.ring.release(item[0], None)
        while not self.ready.empty():
            item = self.ready.get_nowait()
            if isinstance(item, tuple):
                self.ring.release(item[0], None)


def copy_parallel(reader: Any, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src in slices of 16 rows, in the reader's threads (numpy drops the GIL for each)."""
    parts = [slice(a, a + 16) for a in range(0, len(dst), 16)]
    reader.parallel(lambda part: np.copyto(dst[part], src[part]), parts, dst.nbytes)


class _PinnedIter:
    """Yields device batches, with the copy of the next batch already issued when that batch is
    gathered by then: its host-to-device copy runs on the side stream while the caller's step for this
    one runs, instead of the caller's stream waiting for it at the start of the next step (25 MB at
    55 GB/s is 0.45 ms, 4 % of a ResNet-18 step). Only a batch already gathered is taken ahead: waiting
    for the gather thread here would hold the training thread (and the launch of its step) up to one
    gather longer (H200 round B: 0.932 -> 0.875 of the ResNet-18 ceiling with a blocking fetch)."""

    _END = object()
    copy_ahead = True  # class switch for the benchmark's A/B

    def __init__(
        self,
        cache: Cache,
        ring: BufferRing,
        batches: Any,
        device: torch.device,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        processes: int = 0,
    ) -> None:
        self.ring, self.device, self.transform = ring, device, transform
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.producer = _Producer(cache, ring, list(batches), processes)
        self._ahead: Any = None  # (x, y, copy event) in flight, _END, the producer's exception, or None

    def __iter__(self) -> _PinnedIter:
        return self

    def __next__(self) -> Batch:
        current = self._ahead if self._ahead is not None else self._fetch(block=True)
        self._ahead = None
        if current is self._END:
            self._ahead = self._END
            raise StopIteration
        if isinstance(current, BaseException):
            self._ahead = self._END
            raise current
        if self.copy_ahead:  # issue the next copy before this batch is used, if it is gathered
            self._ahead = self._fetch(block=False)
        x, y, done = current
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        x = x.permute(0, 3, 1, 2)
        return (self.transform(x) if self.transform else x), y

    def _fetch(self, block: bool) -> Any:
        """The next batch's copy issued, _END or the producer's exception; None when not blocking
        and the gather thread has nothing ready."""
        try:
            item = self.producer.ready.get(block=block)
        except queue.Empty:
            return None
        if item is _Producer.DONE or isinstance(item, BaseException):
            return self._END if item is _Producer.DONE else item
        slot, n = item
        host_x, host_y = self.ring.images[slot][:n], self.ring.labels[slot][:n]
        if not self.cuda:
            x, y = host_x.clone(), host_y.clone()
            self.ring.release(slot, None)
            return x, y, None
        return self._copy(host_x, host_y, slot)

    def _copy(self, host_x: torch.Tensor, host_y: torch.Tensor, slot: int) -> tuple[Any, ...]:
        assert self.stream is not None
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            x = host_x.to(self.device, non_blocking=True)
            y = host_y.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        x.record_stream(main)  # the allocator must not reuse x's memory before main is done with it
        y.record_stream(main)
        self.ring.release(slot, done)
        return x, y, done

    def close(self) -> None:
        self.producer.close()

    def __del__(self) -> None:
        self.close()


class ResidentLoader:
    """The whole cache as one uint8 tensor on the device; batches are gathered there.

    Refuses (naming both numbers) when the cache would leave less than ``headroom`` of the device's
    free memory. ``device="cpu"`` keeps it in host RAM, the same way. ``transform`` (e.g. a
    ``GpuAugment``) is applied to each batch on the device; with ``cuda_graph=True`` the gather and
    the transform of a full batch are captured once and replayed, which removes their per-kernel
    launch cost (it matters for small images and small models). The tensors it then yields are
    overwritten by the next batch: use them within the step, ``.clone()`` what you keep.

    >>> loader = ResidentLoader("cache/", batch_size=256, transform=GpuAugment(28, degrees=15),
    ...                         cuda_graph=True)                          # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        device: str | torch.device = "cuda",
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        headroom: float = 0.2,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cuda_graph: bool = False,
        block_bytes: int = 256 << 20,
    ) -> None:
        check_batch_size(batch_size)
        cache = path if isinstance(path, Cache) else open_cache(path)
        self.device = torch.device(device)
        self.batch_size, self.shuffle, self.drop_last, self.seed = batch_size, shuffle, drop_last, seed
        self.transform = transform
        if cuda_graph and (self.device.type != "cuda" or getattr(transform, "generator", None) is not None):
            raise ValueError("cuda_graph needs a CUDA device and a transform on the default generator")
        self.cuda_graph = cuda_graph
        self.n = len(cache)
        check_fits(cache, self.device, headroom)
        self.images = upload(cache, self.device, block_bytes)
        self.labels = torch.from_numpy(cache.labels.copy()).to(self.device)
        self.epoch = 0
        self._graph: Any = None

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        g = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        order = (
            torch.randperm(self.n, device=self.device, generator=g)
            if self.shuffle
            else torch.arange(self.n, device=self.device)
        )
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            if self.cuda_graph and len(idx) == self.batch_size:
                yield self._replay(idx)
            else:
                yield self.batch(idx)

    def batch(self, idx: torch.Tensor) -> Batch:
        x = self.images.index_select(0, idx).permute(0, 3, 1, 2)
        return (self.transform(x) if self.transform else x), self.labels.index_select(0, idx)

    def _replay(self, idx: torch.Tensor) -> Batch:
        if self._graph is None:
            self._capture()
        static_idx, graph, out = self._graph
        static_idx.copy_(idx)
        graph.replay()
        return out

    def _capture(self) -> None:
        static_idx = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the graph (cudnn/allocator first-use work)
            for _ in range(3):
                self.batch(static_idx)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.batch(static_idx)
        self._graph = (static_idx, graph, out)


def check_fits(cache: Cache, device: torch.device, headroom: float) -> None:
    need = len(cache) * cache.spec.image_bytes
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        from dlstore.machine import available_memory

        free = available_memory()[0]
        if free is None:
            return
    if need > free * (1 - headroom):
        raise DlstoreError(
            f"{cache.root}: {need / 1e9:.2f} GB of images do not fit in {device} with "
            f"{headroom:.0%} headroom ({free / 1e9:.2f} GB free); use PinnedLoader instead"
        )


def upload(cache: Cache, device: torch.device, block_bytes: int) -> torch.Tensor:
    """Read the cache in dataset order, block by block through one pinned buffer."""
    n, shape = len(cache), cache.spec.shape
    out = torch.empty((n, *shape), dtype=torch.uint8, device=device)
    block = max(1, block_bytes // cache.spec.image_bytes)
    staging = torch.empty(
        (min(block, max(n, 1)), *shape), dtype=torch.uint8, pin_memory=device.type == "cuda"
    )
    for start in range(0, n, block):
        stop = min(n, start + block)
        host = staging[: stop - start]
        cache.read(np.arange(start, stop), out=host.numpy())
        out[start:stop].copy_(host, non_blocking=False)
    return out


class BatchDataset(torch.utils.data.Dataset):
    """A cache indexed by *lists* of indices: one storage pass per batch, written into shared memory
    in DataLoader workers so handing the batch to the main process copies nothing."""

    def __init__(self, path: str | Path, in_memory: bool = False) -> None:
        from dlstore.read.dataset import CachedDataset

        self.dataset = CachedDataset(path, in_memory=in_memory)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> Batch:
        cache = self.dataset.cache
        idx = storage_sorted(cache, indices)
        x = new_batch((len(idx), *cache.spec.shape), shared=in_worker())
        cache.read(idx, out=x.numpy())
        return x.permute(0, 3, 1, 2).as_subclass(ImageBatch), labels_tensor(cache.labels[idx])


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` when it is a positive int (in torch BatchSampler's words otherwise)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
    return batch_size


def batch_dataloader(
    path: str | Path,
    batch_size: int,
    num_workers: int = 2,
    order: str = "auto",
    drop_last: bool = True,
    seed: int = 0,
    pin_memory: bool = True,
    in_memory: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
    **kw: Any,
) -> torch.utils.data.DataLoader:
    """A DataLoader whose workers each build whole batches (see BatchDataset). Under DDP pass
    ``num_replicas``/``rank`` and call ``loader.sampler.sampler.set_epoch(e)`` each epoch."""
    ds = BatchDataset(path, in_memory=in_memory)
    sampler = make_sampler(ds.dataset.cache, order, seed, num_replicas=num_replicas, rank=rank)
    batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
    return torch.utils.data.DataLoader(
        ds,
        sampler=batches,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        **kw,
    )
