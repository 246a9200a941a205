"""The pinned path of ``dlstore.Loader``: no worker processes. A background thread gathers each batch
into one of a ring of pinned host buffers (``index_select(..., out=)`` for a ram cache; chunk-grouped,
thread-decoded reads for npz/zarr); the batch is copied to the device on a side stream, and a buffer is
refilled only after the copy that read it has finished.

Batches are ``(images, labels)``: uint8 (B, C, H, W) (channels-last strides, as stored) and int64 (B,),
or ``(images, target dict)`` for a cache with fields.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from dlstore.machine import usable_cores
from dlstore.read.cache import Cache
from dlstore.read.field_targets import read_target, target_tensors, target_to_device
from dlstore.read.loader import split_batches, storage_sorted

Batch = tuple[torch.Tensor, torch.Tensor]
NUM_BUFFERS = 4


class PinnedPath:
    """Gather into pinned buffers, copy on a side stream. A chunked cache decodes the next two batches'
    chunks ahead in the reader's threads; with ``cpu_decoders=N``, N processes decode each chunk once
    straight into the epoch's batches in shared memory (``Cache.read_batches``), which the gather
    thread copies into pinned buffers. ``cuda_graph``: the transform replayed from a CUDA graph."""

    def __init__(
        self,
        cache: Cache,
        batch_size: int,
        device: torch.device,
        transform: Callable[..., Any] | None,
        cuda_graph: bool,
        cpu_decoders: int,
    ) -> None:
        if cuda_graph and transform is not None:
            from dlstore.gpu.graphs import CudaGraphed

            transform = CudaGraphed(transform)
        self.cache, self.batch_size, self.device, self.transform = cache, batch_size, device, transform
        # The only process reading: let the reader's (blocking, not spinning) threads use every core.
        cache.reader.threads = max(cache.reader.threads, usable_cores())
        self.cpu_decoders = max(0, cpu_decoders)
        self._ring: BufferRing | None = None
        self._last: weakref.ref[_PinnedIter] | None = None

    def epoch(self, indices: np.ndarray) -> Iterator[Batch]:
        if self._ring is None:  # buffers are kept across epochs: pinning is slow
            shape = (self.batch_size, *self.cache.spec.shape)
            self._ring = BufferRing(NUM_BUFFERS, shape, pin=self.device.type == "cuda")
        if self._last is not None and (last := self._last()) is not None:
            last.close()  # an epoch abandoned mid-way must give its buffers back first
        batches = split_batches(indices, self.batch_size)
        it = _PinnedIter(self.cache, self._ring, batches, self.device, self.transform, self.cpu_decoders)
        self._last = weakref.ref(it)
        return it


class BufferRing:
    """Host buffers handed out in turn; one comes back to the producer only with the event of the
    device copy that reads it, and the producer waits on that event before overwriting it."""

    def __init__(self, k: int, shape: tuple[int, ...], pin: bool) -> None:
        self.pin = pin
        self.images = [torch.empty(shape, dtype=torch.uint8, pin_memory=pin) for _ in range(k)]
        self.labels = [torch.empty(shape[0], dtype=torch.int64, pin_memory=pin) for _ in range(k)]
        # Per slot, a buffer for each fixed-shape field (masks, values), made on first use and kept.
        self.fields: list[dict[str, torch.Tensor]] = [{} for _ in range(k)]
        self.free: queue.Queue[tuple[int, Any]] = queue.Queue()
        for i in range(k):
            self.free.put((i, None))

    def field_buffers(self, slot: int, cache: Cache, n: int) -> dict[str, torch.Tensor]:
        """This slot's buffers (the first ``n`` rows) for a fixed-size cache's fixed-shape fields,
        which ``read_target`` reads straight into."""
        if cache.spec.ragged:
            return {}
        buffers = self.fields[slot]
        out = {}
        for name, f in cache.fields.items():
            if f.ragged or f.kind == "class":
                continue
            shape = (len(self.images[slot]), *(cache.spec.shape[:2] if f.kind == "mask" else f.shape))
            dtype = getattr(torch, f.dtype)
            buf = buffers.get(name)
            if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
                buf = buffers[name] = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            out[name] = buf[:n]
        return out

    def stage(
        self, slot: int, target: dict[str, Any], copy: Callable[[np.ndarray, np.ndarray], None]
    ) -> None:
        """Move ``target``'s stacked tensors into this slot's pinned buffers with ``copy(dst, src)``, so
        the training thread does not pin a fresh copy of each per batch (16 MB of 512 px masks per 64
        images)."""
        buffers = self.fields[slot]
        for name, value in target.items():
            if not isinstance(value, torch.Tensor) or value.is_pinned():
                continue
            plain = value.as_subclass(torch.Tensor)
            buf = buffers.get(name)
            if (
                buf is None
                or buf.dtype != plain.dtype
                or buf.shape[1:] != plain.shape[1:]
                or len(buf) < len(plain)
            ):
                buf = buffers[name] = torch.empty(
                    (len(self.images[slot]), *plain.shape[1:]), dtype=plain.dtype, pin_memory=self.pin
                )
            dst = buf[: len(plain)]
            copy(dst.numpy(), plain.numpy())
            target[name] = type(value)(dst) if type(value) is not torch.Tensor else dst

    def acquire(self) -> int:
        slot, event = self.free.get()
        if event is not None:
            event.synchronize()  # the copy that reads this buffer is done
        return slot

    def release(self, slot: int, event: Any) -> None:
        self.free.put((slot, event))


PREFETCH_BATCHES = 2  # zarr 256 px: a batch of 256 can need ~100 new chunks, half the decode-ahead bound


class _Producer:
    """The gather thread's state, kept apart from the iterator so an abandoned iterator can be
    collected (and close the producer) while the thread is still running."""

    DONE = object()

    def __init__(self, cache: Cache, ring: BufferRing, batches: list[np.ndarray], processes: int = 0) -> None:
        self.cache, self.ring, self.batches, self.processes = cache, ring, batches, processes
        self.ready: queue.Queue[Any] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="dlstore-gather")
        self.thread.start()

    def run(self) -> None:
        try:
            if self.processes > 0 and self.cache.reader.traits.unit_arrays:
                self.run_decoded()
            else:
                self.fill(self.reads())
        except BaseException as e:  # surfaced in the consumer's thread
            self.ready.put(e)
        self.ready.put(self.DONE)

    def reads(self) -> Iterator[tuple[np.ndarray, Callable[[np.ndarray], Any]]]:
        for i, idx in enumerate(self.batches):
            ahead = self.batches[i + 1 : i + 1 + PREFETCH_BATCHES]
            if ahead:  # a remote cache downloads, a chunked one decodes, their units meanwhile
                self.cache.prefetch(np.concatenate([np.asarray(b, np.int64) for b in ahead]))
            index = storage_sorted(self.cache, idx)
            yield index, lambda out, index=index: self.cache.read(index, out=out)

    def run_decoded(self) -> None:
        """Batches decoded by worker processes into shared memory (Cache.read_batches), each copied
        into a pinned buffer in the reader's threads (one thread copies ~5-10 GB/s)."""
        indices = [storage_sorted(self.cache, idx) for idx in self.batches]
        batches = self.cache.read_batches(indices, processes=self.processes)
        reader = self.cache.reader
        try:
            self.fill(
                (index, lambda out, images=images: copy_parallel(reader, out, images))
                for index, images in zip(indices, batches)
            )
        finally:
            batches.close()  # type: ignore[attr-defined]

    def fill(self, batches: Iterable[tuple[np.ndarray, Callable[[np.ndarray], Any]]]) -> None:
        """Each batch's images (``fill(buffer)``), labels and target into the next free slot."""
        for index, fill in batches:
            slot = self.ring.acquire()
            if self.stop.is_set():
                self.ring.release(slot, None)
                break
            n = len(index)
            fill(self.ring.images[slot][:n].numpy())
            self.ring.labels[slot][:n] = torch.from_numpy(self.cache.labels[index])
            self.ready.put((slot, n, self.target(index, slot)))

    def target(self, index: np.ndarray, slot: int) -> dict[str, Any] | None:
        """The batch's collated fields on the host (``dlstore.read.field_targets``), its stacked ones in the
        slot's pinned buffers; None without fields."""
        if not self.cache.spec.fields:
            return None
        into = self.ring.field_buffers(slot, self.cache, len(index)) if self.ring.pin else None
        target = read_target(self.cache, index, into)
        if self.ring.pin:  # whatever is not in the slot's buffers yet
            self.ring.stage(slot, target, lambda dst, src: copy_parallel(self.cache.reader, dst, src))
        return target

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
    """Yields device batches, with the next batch's copy already issued when it is gathered by then:
    it runs on the side stream during the caller's step instead of the next step waiting for it (25
    MB at 55 GB/s is 4 % of a ResNet-18 step). Only a batch already gathered is taken ahead: waiting
    for the gather thread would hold up the training thread."""

    _END = object()

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
        self._ahead = self._fetch(block=False)  # the next copy issued now, if that batch is gathered
        x, y, done = current
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        x = x.permute(0, 3, 1, 2)
        if isinstance(y, dict):  # a cache with fields: the transform moves its masks and boxes too
            return self.transform(x, target=y) if self.transform else (x, y)
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
        slot, n, target = item
        host_x, host_y = self.ring.images[slot][:n], self.ring.labels[slot][:n]
        if not self.cuda:
            x, y = host_x.clone(), host_y.clone()
            self.ring.release(slot, None)
            return x, (y if target is None else target_to_device(target, self.device)), None
        return self._copy(host_x, host_y, slot, target)

    def _copy(
        self, host_x: torch.Tensor, host_y: torch.Tensor, slot: int, target: dict[str, Any] | None = None
    ) -> tuple[Any, ...]:
        assert self.stream is not None
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            x = host_x.to(self.device, non_blocking=True)
            y = (
                host_y.to(self.device, non_blocking=True)
                if target is None
                else target_to_device(target, self.device)
            )
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in [x, *target_tensors(y)]:  # the allocator must not reuse them before main is done
            t.record_stream(main)
        self.ring.release(slot, done)
        return x, y, done

    def close(self) -> None:
        self.producer.close()

    def __del__(self) -> None:
        self.close()
