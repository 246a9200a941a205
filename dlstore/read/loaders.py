"""Fast ways to get batches of a dlstore cache onto the device.

- ``PinnedLoader``: no worker processes. A background thread gathers each batch straight into one of
  a ring of pinned host buffers (``torch.index_select(..., out=)`` for a ram cache; chunk-grouped,
  thread-decoded reads for npz/zarr); the batch is copied to the GPU on a side stream, and a buffer
  is refilled only after the copy that read it has finished.
- ``ResidentLoader``: the whole uint8 cache lives in device memory; batches are an ``index_select``
  there, with no host work per batch.
Both yield ``(images, labels)``: images uint8 (B, C, H, W) (channels-last strides, as stored),
labels int64 (B,). Convert, normalise and augment on the GPU (``dlstore.gpu.GpuAugment``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.errors import DlstoreError
from dlstore.machine import usable_cores
from dlstore.read.cache import Cache
from dlstore.read.loader_core import (  # noqa: F401  (make_sampler, default_window: their old home)
    CoreLoader,
    LoaderCore,
    check_batch_size,
    default_window,
    make_sampler,
    storage_sorted,
)
from dlstore.read.targets import batch_target, read_target, target_tensors, target_to_device

Batch = tuple[torch.Tensor, torch.Tensor]


class PinnedLoader(CoreLoader):
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

    The cache, batch_size, order, seed, drop_last, window, num_replicas/rank and the remote-cache
    options are the ``LoaderCore`` every loader takes (``dlstore.read.loader_core``).
    """

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        device: str | torch.device = "cuda",
        *,
        num_buffers: int = 4,
        in_memory: bool = False,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cuda_graph: bool = False,
        decode_processes: int = 0,
        fields: Sequence[str] | None = None,
        **core: Any,
    ) -> None:
        self._open_core(path, batch_size, core, in_memory=in_memory)
        self.cache.select_fields(fields)  # a cache with fields: only these are read (None: all)
        if cuda_graph and transform is not None:
            from dlstore.gpu.graphs import CudaGraphed

            transform = CudaGraphed(transform)  # replayed, not launched op by op (see ResidentLoader)
        self.transform = transform
        self.device = torch.device(device)
        # The only process reading: let the reader's (blocking, not spinning) threads use every core.
        self.cache.reader.threads = max(self.cache.reader.threads, usable_cores())
        self.decode_processes = decode_processes
        self.num_buffers = max(2, num_buffers)
        self._ring: BufferRing | None = None
        self._last: weakref.ref[_PinnedIter] | None = None

    def __iter__(self) -> Iterator[Batch]:
        batches = self._next_epoch()
        if self._ring is None:  # buffers are kept across epochs: pinning is slow
            self._ring = BufferRing(
                self.num_buffers, (self.batch_size, *self.cache.spec.shape), pin=self.device.type == "cuda"
            )
        if self._last is not None and (last := self._last()) is not None:
            last.close()  # an epoch abandoned mid-way must give its buffers back first
        it = _PinnedIter(self.cache, self._ring, batches, self.device, self.transform, self.decode_processes)
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
        """This slot's buffers (the first ``n`` rows) for the cache's chosen fixed-shape fields (masks,
        values) of a fixed-size cache, which ``read_target`` reads straight into."""
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
        """Move ``target``'s stacked tensors (a batch's masks, values) into this slot's buffers, in
        place, with ``copy(dst, src)``: the device copy then reads pinned memory as the images' does,
        instead of the training thread pinning a fresh copy of each per batch (16 MB of 512 px masks
        per 64 images). The buffers are overwritten with the slot, after the event ``release`` got."""
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

    def __init__(self, cache: Cache, ring: BufferRing, batches: list[list[int]], processes: int = 0) -> None:
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
            self.ready.put((slot, n, self.target(index, slot)))

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
                self.ready.put((slot, n, self.target(index, slot)))
        finally:
            batches.close()  # type: ignore[attr-defined]

    def target(self, index: np.ndarray, slot: int) -> dict[str, Any] | None:
        """The batch's collated fields on the host (``dlstore.read.targets``), its stacked ones in the
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
    """Yields device batches, with the copy of the next batch already issued when that batch is
    gathered by then: its host-to-device copy runs on the side stream while the caller's step for this
    one runs, instead of the caller's stream waiting for it at the start of the next step (25 MB at
    55 GB/s is 0.45 ms, 4 % of a ResNet-18 step). Only a batch already gathered is taken ahead: waiting
    for the gather thread here would hold the training thread (and the launch of its step) up to one
    gather longer."""

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


class ResidentLoader(CoreLoader):
    """The whole cache as one uint8 tensor on the device; batches are gathered there.

    Refuses (naming both numbers) when the cache would leave less than ``headroom`` of the device's
    free memory. ``device="cpu"`` keeps it in host RAM, the same way. ``transform`` (e.g. a
    ``GpuAugment``) is applied to each batch on the device; with ``cuda_graph=True`` the gather and
    the transform of a full batch are captured once and replayed, which removes their per-kernel
    launch cost (it matters for small images and small models). The tensors it then yields are
    overwritten by the next batch: use them within the step, ``.clone()`` what you keep.

    >>> loader = ResidentLoader("cache/", batch_size=256, transform=GpuAugment(28, degrees=15),
    ...                         cuda_graph=True)                          # doctest: +SKIP

    Takes the ``LoaderCore`` every loader takes; ``order="auto"`` is ``random`` here (the images are in
    device memory: chunks do not matter). ``shuffle=`` is the old spelling of
    ``order`` (a DeprecationWarning for one round).
    """

    AUTO_ORDER = "random"

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        device: str | torch.device = "cuda",
        *,
        headroom: float = 0.2,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cuda_graph: bool = False,
        block_bytes: int = 256 << 20,
        fields: Sequence[str] | None = None,
        **core: Any,
    ) -> None:
        self._open_core(path, batch_size, core)
        cache = self.cache
        cache.select_fields(fields)  # a cache with fields: only these are read (None: all)
        self.device = torch.device(device)
        self.transform = transform
        if cuda_graph and (self.device.type != "cuda" or getattr(transform, "generator", None) is not None):
            raise ValueError("cuda_graph needs a CUDA device and a transform on the default generator")
        self.cuda_graph = cuda_graph
        self.n = len(cache)
        check_fits(cache, self.device, headroom)
        self.images = upload(cache, self.device, block_bytes)
        self.labels = torch.from_numpy(cache.labels.copy()).to(self.device)
        if cache.spec.fields and cuda_graph:
            raise ValueError("cuda_graph replays a fixed batch: not with a cache with fields (boxes vary)")
        # A cache with fields: the fixed-shape ones (masks, values) in device memory like the images;
        # the variable-length ones (boxes) read per batch on the host, one copy each.
        self.fields = upload_fields(cache, self.device) if cache.spec.fields else {}
        # A target per batch whenever the cache has fields, resident or not (boxes alone are read
        # per batch: ``self.fields`` is then empty, and a batch still carries its boxes).
        self.targets = bool(cache.spec.fields)
        self._graph: Any = None

    def __iter__(self) -> Iterator[Batch]:
        host = self._take_pass().astype(np.int64, copy=False)
        # This rank's dataset indices for the rest of the epoch, moved to the device once: the same
        # global order as every other loader's (``dlstore.read.order``), built on the host in O(n).
        order = torch.from_numpy(host).to(self.device)
        assert self._pass is not None
        for i in range(self._pass.batches):
            part = slice(i * self.batch_size, (i + 1) * self.batch_size)
            idx = order[part]
            if self.cuda_graph and len(idx) == self.batch_size:
                yield self._replay(idx)
            else:
                yield self.batch(idx, host[part]) if self.targets else self.batch(idx)

    def batch(self, idx: torch.Tensor, host: np.ndarray | None = None) -> Batch:
        """The batch of dataset indices ``idx`` (on the device); ``host``: the same on the host, so
        the variable-length fields are read without waiting for the device."""
        x = self.images.index_select(0, idx).permute(0, 3, 1, 2)
        if self.targets:
            target = self.field_target(idx, host)
            return self.transform(x, target=target) if self.transform else (x, target)
        return (self.transform(x) if self.transform else x), self.labels.index_select(0, idx)

    def read_variable(self, host: np.ndarray, names: dict[str, Any]) -> dict[str, Any]:
        """The variable-length fields of ``host`` indices (the resident ones are not read again)."""
        cache, chosen = self.cache, self.cache.field_names
        cache.field_names = tuple(names)
        try:
            return cache.read_fields(host)
        finally:
            cache.field_names = chosen

    def field_target(self, idx: torch.Tensor, host: np.ndarray | None = None) -> dict[str, Any]:
        """The batch's collated target: resident fields gathered on the device, the rest read."""
        spec = self.cache.spec
        chosen = self.cache.fields
        variable = {k: f for k, f in chosen.items() if k not in self.fields}
        target = {}
        if variable:  # read on the host
            host = idx.cpu().numpy() if host is None else host
            partial = dataclasses.replace(spec, fields=variable)
            sizes = [tuple(spec.shape[:2])] * len(host)
            target = target_to_device(
                batch_target(partial, self.read_variable(host, variable), sizes), self.device
            )
        for name, values in self.fields.items():
            picked = values.index_select(0, idx)
            target[name] = type(values)(picked) if type(values) is not torch.Tensor else picked
        return {k: target[k] for k in chosen}

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


def upload_fields(cache: Cache, device: torch.device) -> dict[str, torch.Tensor]:
    """A fixed-size cache's fixed-shape fields (masks, values, class labels) for every dataset index,
    on the device."""
    from torchvision import tv_tensors

    if cache.spec.ragged:
        return {}
    fixed = {k: f for k, f in cache.fields.items() if not f.ragged}
    if not fixed:
        return {}
    columns = cache.read_fields(np.arange(len(cache)))
    out = {}
    for name, f in fixed.items():
        t = torch.from_numpy(np.ascontiguousarray(columns[name])).to(device)
        out[name] = tv_tensors.Mask(t) if f.kind == "mask" else t
    return out


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
