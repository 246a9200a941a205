"""``DecodeLoader``: batches of a payload cache (JPEG or raw pixels, fixed-size or ragged) decoded on
the device and cropped there to one size.

A background thread reads batch i+1's payloads (grouped by chunk, chunks loaded in the reader's threads,
each payload's CRC checked) while the iterating thread decodes batch i: JPEG caches in one batched nvJPEG
call (torchvision ``decode_jpeg(list, device="cuda")``), anything else (raw payloads, or no GPU) on the
CPU in the reader's threads. An image nvJPEG refuses is decoded on the CPU instead and counted in
``stats.cpu_fallbacks``. ``transform`` (e.g. ``dlstore.gpu.RaggedRandomResizedCrop``) turns the list of
decoded (C, H_i, W_i) uint8 tensors into one batch::

    from dlstore.gpu import RaggedRandomResizedCrop
    from dlstore.read.gpu_decode import DecodeLoader

    crop = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16,
                                   channels_last=True).cuda()
    loader = DecodeLoader("jpeg-cache/", batch_size=256, transform=crop)
    for epoch in range(epochs):
        for images, labels in loader:          # (256, 3, 224, 224) bf16 and (256,) int64 on the GPU
            ...
"""

from __future__ import annotations

import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.read.cache import Cache, open_cache
from dlstore.read.loaders import make_sampler, storage_sorted

Transform = Callable[[list[torch.Tensor]], torch.Tensor]
DECODE_IN = ("stream", "thread")


@dataclass
class DecodeStats:
    """What the loader did: images decoded on the device, and those nvJPEG refused (decoded on CPU)."""

    gpu_images: int = 0
    cpu_images: int = 0
    cpu_fallbacks: int = 0


def as_tensors(payloads: list[memoryview]) -> list[torch.Tensor]:
    """uint8 CPU tensors over the payload bytes, no copy (decode_jpeg only reads them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer of a read-only buffer
        return [torch.frombuffer(p, dtype=torch.uint8) for p in payloads]


def decode_on_device(
    cache: Cache,
    payloads: list[memoryview],
    shapes: np.ndarray,
    positions: np.ndarray,
    device: torch.device,
    data: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Batched nvJPEG decode of JPEG payloads (``data``: the same as tensors, if made already); images
    it refuses (or decodes to another shape) are decoded on the CPU instead. Returns the (C, H, W) uint8
    tensors on ``device`` and the fallback count."""
    from torchvision.io import ImageReadMode, decode_jpeg

    channels = int(shapes[0][2]) if len(shapes) else 3
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    data = as_tensors(payloads) if data is None else data
    # Quiet: torchvision ≥ 0.29 deprecates its decoders (TorchCodec's replacement needs a newer torch).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out: list[torch.Tensor | None] = list(decode_jpeg(data, mode=mode, device=device))
        except RuntimeError:  # one bad image fails the whole batched call: retry one by one
            out = [_decode_one(d, mode, device) for d in data]
    expected = [(c, h, w) for h, w, c in shapes.tolist()]
    if [None if img is None else tuple(img.shape) for img in out] == expected:
        return out, 0  # type: ignore[return-value]
    fallbacks = 0
    for i, img in enumerate(out):
        if img is None or tuple(img.shape) != expected[i]:
            cpu = cache.reader.decode(payloads[i], shapes[i], int(positions[i]))  # type: ignore[attr-defined]
            out[i] = torch.from_numpy(cpu).permute(2, 0, 1).to(device, non_blocking=True)
            fallbacks += 1
    return out, fallbacks  # type: ignore[return-value]


def _decode_one(data: torch.Tensor, mode: Any, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import decode_jpeg

    try:
        return decode_jpeg(data, mode=mode, device=device)
    except RuntimeError:
        return None


class DecodeLoader:
    """Batches of a payload cache, decoded (nvJPEG on CUDA) and cropped on ``device``; see the module.

    ``transform`` is required for a ragged cache (images differ in size); without it a fixed-size cache
    yields (B, C, H, W) uint8. ``order``: ``auto``/``chunk`` (chunk-aware shuffle), ``random``,
    ``sequential``. ``read_ahead`` batches are read while the current one decodes.
    """

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        transform: Transform | None = None,
        device: str | torch.device = "cuda",
        order: str = "auto",
        drop_last: bool = True,
        seed: int = 0,
        window: int | None = None,
        read_ahead: int = 4,
        threads: int | None = None,
        decode_in: str = "thread",
    ) -> None:
        self.cache = path if isinstance(path, Cache) else open_cache(path)
        if not hasattr(self.cache.reader, "read_payloads"):
            raise ValueError(
                f"{self.cache.root}: this cache stores plain pixel arrays; DecodeLoader reads payload caches "
                "(--codec jpeg or --resize shorter); use PinnedLoader for this one"
            )
        if self.cache.ragged and transform is None:
            raise ValueError(
                f"{self.cache.root}: images differ in size; pass a transform that makes them one size, "
                "e.g. dlstore.gpu.RaggedRandomResizedCrop(224)"
            )
        self.batch_size, self.transform, self.drop_last = batch_size, transform, drop_last
        self.device = torch.device(device)
        self.sampler = make_sampler(self.cache, order, seed, window)
        self.cache.reader.threads = threads or max(self.cache.reader.threads, len(os.sched_getaffinity(0)))
        self.gpu = self.device.type == "cuda" and bool(getattr(self.cache.reader, "gpu_jpeg", False))
        self.read_ahead = max(1, read_ahead)
        if decode_in not in DECODE_IN:
            raise ValueError(f"decode_in must be one of {', '.join(DECODE_IN)}, got {decode_in!r}")
        # "stream": decode and crop in the caller's thread on a side stream (the caller's stream waits
        # on an event); "thread": a second thread does that, so the caller's next step is queued while
        # the next batch decodes. Never on the caller's own stream: the crop would queue behind the
        # training step, and nvJPEG's outputs could reuse memory that step still reads (see below).
        self.decode_in = decode_in
        self._stream: Any = None
        self.stats = DecodeStats()
        self.epoch = 0

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        batches = list(torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last))
        # One thread reads batches ahead (4 measured faster than 2 on the H200: 29.5k vs 24.8k img/s,
        # benchmarks/jpeg_loader_parts.py) while batch i is decoded and cropped on a side stream, in
        # this thread ("stream") or in a second one ("thread").
        reads = _Pipe(iter(batches), self._read, self.read_ahead, "dlstore-read-ahead")
        if self.decode_in == "stream":
            try:
                for item in reads:
                    yield self._handed_over(self._decode(item))
            finally:
                reads.close()
            return
        decoded = _Pipe(iter(reads), self._decode, 1, "dlstore-decode")
        try:
            for item in decoded:
                yield self._handed_over(item)
        finally:
            reads.stop.set()  # both first: the decode thread may be waiting on the read queue
            decoded.close()
            reads.close()

    def _handed_over(self, item: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch, safe to use on the caller's current stream (made on a side stream: wait for it)."""
        if len(item) == 2 or item[2] is None:
            return item[0], item[1]
        images, labels, event = item
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        # made on the side stream, used on this one: the allocator must not reuse them early
        for t in [labels, *(images if isinstance(images, list) else [images])]:
            t.record_stream(stream)
        return images, labels

    def _decode(self, item: tuple[Any, ...]) -> tuple[Any, Any, Any]:
        if self.device.type != "cuda":
            return (*self._finish(*item), None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            # torchvision's nvJPEG writes its outputs on a stream of its own, unordered with the stream
            # they are allocated on: memory freed on this stream (the previous batch's decoded images,
            # read by the crop still queued here) could be handed out and overwritten before that crop
            # runs. Waiting for this stream (only the previous crop, not the training step) prevents it.
            self._stream.synchronize()
            images, labels = self._finish(*item)
            event = torch.cuda.Event()
            event.record(self._stream)
        return images, labels, event

    def _read(self, batch: list[int]) -> tuple[np.ndarray, Any, np.ndarray | None, np.ndarray]:
        index = storage_sorted(self.cache, batch)
        labels = self.cache.labels[index]
        if not self.gpu:
            return index, self.cache.read_images(index), None, labels
        payloads, shapes = self.cache.read_payloads(index)
        return index, (payloads, as_tensors(payloads)), shapes, labels

    def _finish(
        self, index: np.ndarray, data: Any, shapes: np.ndarray | None, labels: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gpu:
            positions = self.cache.positions[index]
            payloads, tensors = data
            images, fallbacks = decode_on_device(
                self.cache, payloads, shapes, positions, self.device, tensors
            )  # type: ignore[arg-type]
            self.stats.gpu_images += len(images) - fallbacks
            self.stats.cpu_fallbacks += fallbacks
        else:
            images = [torch.from_numpy(a).permute(2, 0, 1).to(self.device, non_blocking=True) for a in data]
            self.stats.cpu_images += len(images)
        batch = self.transform(images) if self.transform is not None else torch.stack(images)
        return batch, torch.from_numpy(labels).to(self.device, non_blocking=True)


class _Pipe:
    """A thread applying ``fn`` to each item of ``source`` into a bounded queue; errors reach the consumer."""

    DONE = object()

    def __init__(self, source: Iterator[Any], fn: Callable[[Any], Any], depth: int, name: str) -> None:
        self.source, self.fn = source, fn
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.source:
                if self.stop.is_set():
                    return
                self._put(self.fn(item))
        except BaseException as e:  # surfaced in the consumer's thread
            self._put(_Failed(e))
        self._put(self.DONE)

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            if item is self.DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@dataclass
class _Failed:
    error: BaseException
