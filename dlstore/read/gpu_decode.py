"""``DecodeLoader``: batches of a payload cache (JPEG or raw pixels, fixed-size or ragged) decoded on
the device and cropped there to one size.

A background thread reads batch i+1's payloads (grouped by chunk, chunks loaded in the reader's threads,
each payload's CRC checked) while the iterating thread decodes batch i: JPEG caches in one batched nvJPEG
call (torchvision ``decode_jpeg(list, device="cuda")``), anything else (raw payloads, or no GPU) on the
CPU in the reader's threads. An image nvJPEG refuses is decoded on the CPU instead and counted in
``stats.cpu_fallbacks``. With ``cpu_decoders=N`` each JPEG batch is split: its first part is decoded by
N worker processes on the CPU (``dlstore.read.cpu_decode``; started when the first epoch starts) while
nvJPEG decodes the rest, both feeding the same crop (as one flat buffer when the transform takes
``FlatImages``); ``cpu_share`` fixes the CPU's fraction, or (None) the CPU takes what its workers
decode in one batch period at the rate they show in place, nvJPEG the rest. ``transform`` (e.g. ``dlstore.gpu.RaggedRandomResizedCrop``) turns the list of
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

import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dlstore.read.cache import Cache
from dlstore.read.cpu_decode import CpuDecoders, CpuShare
from dlstore.read.loader_core import CoreLoader, storage_sorted
from dlstore.read.targets import read_target, target_tensors, target_to_device

if TYPE_CHECKING:
    from dlstore.gpu.ragged import FlatImages

Transform = Callable[[list[torch.Tensor]], torch.Tensor]
DECODE_IN = ("stream", "thread")
# cpu_share=None: after a batch whose CPU share was ready in time (this loader waited at most
# WAIT_TOLERANCE of the batch period), the CPU decoders' fraction moves AUTO_STEP of the way to what
# they can decode in one batch period (AUTO_MARGIN of it) at the rate they showed in place (the
# workers' decode seconds per image, all workers in parallel); after a batch it waited for, it shrinks
# in proportion to the wait. nvJPEG decodes the rest, on the batch's path. Never below MIN_AUTO_SHARE;
# slots hold MAX_AUTO_SHARE. (Growing by a fixed step instead left nvJPEG ~20% of each batch where the
# CPU alone was faster: the CPU share is decoded ahead, nvJPEG's in the batch's own time; round G7.)
MIN_AUTO_SHARE, MAX_AUTO_SHARE, AUTO_STEP, AUTO_MARGIN, WAIT_TOLERANCE = 0.05, 1.0, 0.3, 0.85, 0.05
# When the workers can take the whole batch, a remaining nvJPEG part under MIN_GPU_PART of it goes to them
# too: each nvJPEG call costs a fixed time on the batch's path however few images it has (round H2: the
# split settled at 0.966, 17 images per call, and trained at 0.65 of the ceiling where all-CPU did 0.86).
MIN_GPU_PART = 0.1


@dataclass
class DecodeStats:
    """What the loader did: images decoded on the device, and those nvJPEG refused (decoded on CPU)."""

    gpu_images: int = 0
    cpu_images: int = 0
    cpu_fallbacks: int = 0
    cpu_redecoded: int = 0  # CPU-share images decoded in the loader because their worker run failed
    cpu_share: float = 0.0  # the CPU decoders' fraction of the last batch (cpu_decoders > 0)
    # Where the time went (seconds, summed over batches): reading payloads (read-ahead thread), inside
    # the batched device decode call, and the decoding thread waiting for a read batch (read-bound).
    batches: int = 0
    read_seconds: float = 0.0
    decode_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    # The CPU decode workers' own time decoding this loader's images (summed over workers): over
    # cpu_images, their per-image cost in place, to compare with one core decoding alone.
    cpu_busy_seconds: float = 0.0


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
    launching: Callable[[], None] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Batched nvJPEG decode of JPEG payloads (``data``: the same as tensors, if made already); images
    it refuses (or decodes to another shape) are decoded on the CPU instead. Returns the (C, H, W) uint8
    tensors on ``device`` and the fallback count. ``launching`` is called just before the batched call
    (which runs without the GIL)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    channels = int(shapes[0][2]) if len(shapes) else 3
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    data = as_tensors(payloads) if data is None else data
    # Quiet: torchvision ≥ 0.29 deprecates its decoders (TorchCodec's replacement needs a newer torch).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if launching is not None:
            launching()
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
            cpu = cache.payload_reader.decode(payloads[i], shapes[i], int(positions[i]))
            out[i] = torch.from_numpy(cpu).permute(2, 0, 1).to(device, non_blocking=True)
            fallbacks += 1
    return out, fallbacks  # type: ignore[return-value]


def _decode_one(data: torch.Tensor, mode: Any, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import decode_jpeg

    try:
        return decode_jpeg(data, mode=mode, device=device)
    except RuntimeError:
        return None


class DecodeLoader(CoreLoader):
    """Batches of a payload cache, decoded (nvJPEG on CUDA) and cropped on ``device``; see the module.

    ``transform`` is required for a ragged cache (images differ in size); without it a fixed-size cache
    yields (B, C, H, W) uint8. ``read_ahead`` batches are read while the current one decodes. The
    cache (a folder or a URL, with the remote-cache options), batch_size, ``order`` (``auto``/``chunk``:
    chunk-aware shuffle, ``random``, ``sequential``), seed, drop_last, window and ``num_replicas``/
    ``rank`` (each rank decodes its own equal share of every epoch) are the ``LoaderCore`` every
    loader takes.
    """

    def __init__(
        self,
        path: str | Path | Cache,
        batch_size: int,
        transform: Transform | None = None,
        device: str | torch.device = "cuda",
        *,
        read_ahead: int = 4,
        threads: int | None = None,
        decode_in: str = "thread",
        cpu_decoders: int = 0,
        cpu_share: float | None = None,
        fields: Sequence[str] | None = None,
        **core: Any,
    ) -> None:
        self._open_core(path, batch_size, core)
        self.cache.select_fields(fields)  # a cache with fields: only these are read (None: all)
        if not self.cache.reader.traits.payloads:
            raise ValueError(
                f"{self.cache.root}: this cache stores plain pixel arrays; DecodeLoader reads payload caches "
                "(--codec jpeg or --resize shorter); use PinnedLoader for this one"
            )
        if self.cache.ragged and transform is None:
            raise ValueError(
                f"{self.cache.root}: images differ in size; pass a transform that makes them one size, "
                "e.g. dlstore.gpu.RaggedRandomResizedCrop(224)"
            )
        self.transform = transform
        self.device = torch.device(device)
        self.cache.reader.threads = threads or max(self.cache.reader.threads, len(os.sched_getaffinity(0)))
        self.gpu = self.device.type == "cuda" and self.cache.reader.gpu_jpeg
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
        if cpu_share is not None and not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"cpu_share is the CPU decoders' fraction of a batch, 0..1; got {cpu_share}")
        # Split each JPEG batch between nvJPEG and CPU worker processes (None: balanced by their rates).
        self.cpu_decoders, self.fixed_share = max(0, cpu_decoders), cpu_share
        self.share = 0.5 if cpu_share is None else cpu_share
        self.cpu: CpuDecoders | None = None
        self._last_batch: float | None = None
        self._epoch_batches = 0  # batches decoded in this epoch (the auto split skips the pipeline's fill)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = list(self._next_epoch())
        self._last_batch, self._epoch_batches = None, 0
        if self.gpu and self.cpu_decoders and self.cpu is None:
            self.cpu = self._start_cpu_decoders()
        # One thread reads batches ahead (4 measured faster than 2 on the H200: 29.5k vs 24.8k img/s,
        # benchmarks/jpeg_loader_parts.py) while batch i is decoded and cropped on a side stream, in
        # this thread ("stream") or in a second one ("thread").
        gate = self._read_gate()
        reads = _Pipe(iter(batches), self._read, self.read_ahead, "dlstore-read-ahead", gate)
        decode = functools.partial(self._decode, gate=gate)
        if self.decode_in == "stream":
            try:
                for item in reads:
                    yield self._handed_over(decode(item))
            finally:
                reads.close()
                self._epoch_done(reads)
            return
        decoded = _Pipe(iter(reads), decode, 1, "dlstore-decode")
        try:
            for item in decoded:
                yield self._handed_over(item)
        finally:
            reads.stop.set()  # both first: the decode thread may be waiting on the read queue
            decoded.close()
            reads.close()
            self._epoch_done(reads)

    def _read_gate(self) -> threading.Semaphore | None:
        """Read-ahead tokens: one is given back as each batch's decode call starts, so in steady state
        the read-ahead thread reads while that call runs without the GIL. Read whenever the queue had
        room (the previous design), it ran while the decoding thread held or wanted the GIL, and each
        time that thread came back from a C call it could wait for the reader's Python (up to the
        interpreter's 5 ms switch interval); see benchmarks/RESULTS.md, issue 10 round E.

        Not with CPU decoders: there the read-ahead thread also hands each batch's CPU share to the
        decode processes, which should run as far ahead as the queue allows. The gate was measured to
        help only nvJPEG-alone decoding; with 12 CPU decoders ResNet-18 @112 ran at 0.72 / 0.81 of its
        ceiling ungated (round D) and 0.63 / 0.69 gated (rounds E and F). Those were separate runs, not
        side by side, so the ungated design is kept here until a side-by-side run decides."""
        if self.gpu and self.cpu_decoders:
            return None
        return threading.Semaphore(self.read_ahead)

    def _epoch_done(self, reads: _Pipe) -> None:
        self.stats.read_wait_seconds += reads.waited
        self._reclaim()

    def _reclaim(self) -> None:
        """CPU-decode slots of batches read ahead but never decoded (an epoch left early) are free again."""
        if self.cpu is not None:
            self.cpu.reclaim()

    def _handed_over(self, item: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch, safe to use on the caller's current stream (made on a side stream: wait for it)."""
        if len(item) == 2 or item[2] is None:
            return item[0], item[1]
        images, labels, event = item
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        # made on the side stream, used on this one: the allocator must not reuse them early
        for t in [*target_tensors(labels), *(images if isinstance(images, list) else [images])]:
            t.record_stream(stream)
        return images, labels

    def _decode(self, item: tuple[Any, ...], gate: threading.Semaphore | None = None) -> tuple[Any, Any, Any]:
        launching = _Once(gate.release if gate is not None else None)
        try:
            return self._decode_batch(item, launching)
        finally:
            launching()  # a batch with no device decode call gives its token back here

    def _decode_batch(self, item: tuple[Any, ...], launching: Callable[[], None]) -> tuple[Any, Any, Any]:
        self.stats.batches += 1
        if self.device.type != "cuda":
            return (*self._finish(*item, launching), None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            # torchvision's nvJPEG writes its outputs on a stream of its own, unordered with the stream
            # they are allocated on: memory freed on this stream (the previous batch's decoded images,
            # read by the crop still queued here) could be handed out and overwritten before that crop
            # runs. Waiting for this stream (only the previous crop, not the training step) prevents it.
            self._stream.synchronize()
            images, labels = self._finish(*item, launching)
            event = torch.cuda.Event()
            event.record(self._stream)
        return images, labels, event

    def close(self) -> None:
        """Stop the CPU decode workers (if any); iterating again starts new ones."""
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None

    def _start_cpu_decoders(self) -> CpuDecoders:
        """Workers and slots for the CPU share: a slot holds the largest share of one batch, each image
        up to twice the cache's nominal size (a batch of larger ones sends fewer to the CPU)."""
        codec = self.cache.payload_reader.image_codec
        h, w, c = self.cache.spec.shape
        most = self.fixed_share if self.fixed_share is not None else MAX_AUTO_SHARE
        per_image = 2 * int(h) * int(w) * int(c)
        slot_bytes = max(1 << 16, int(np.ceil(most * self.batch_size)) * per_image * 5 // 4)
        return CpuDecoders(
            codec.name,
            codec.quality,
            self.cpu_decoders,
            slots=self.read_ahead + 2,
            slot_bytes=slot_bytes,
            pin=self.device.type == "cuda",
        )

    def _read(self, batch: list[int]) -> tuple[np.ndarray, Any, np.ndarray | None, np.ndarray]:
        t0 = time.perf_counter()
        try:
            return self._read_batch(batch)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _read_batch(self, batch: list[int]) -> tuple[np.ndarray, Any, np.ndarray | None, np.ndarray]:
        """The batch's dataset indices in storage order, (the device share's payloads, the same as
        tensors, the CPU share in flight), the device share's shapes, the labels."""
        index = storage_sorted(self.cache, batch)
        labels = read_target(self.cache, index)  # the labels, or the collated fields of a cache with them
        if not self.gpu:
            return index, self.cache.read_images(index), None, labels
        share = self._submit_cpu_share(index)
        first = share.count if share is not None else 0
        payloads, shapes = (
            ([], np.empty((0, 3), np.int64))
            if first == len(index)
            else self.cache.read_payloads(index[first:])
        )
        return index, (payloads, as_tensors(payloads), share), shapes, labels

    def _submit_cpu_share(self, index: np.ndarray) -> CpuShare | None:
        """The batch's first images to the CPU decoders (as many as the share says and a slot holds).
        Only where their payloads lie is looked up here (numpy over the units' indexes): the workers
        read the bytes from the unit files (or find them copied into the slot) and check the CRCs."""
        count = int(round(self.share * len(index))) if self.cpu is not None else 0
        if self.cpu is None or count == 0:
            return None
        extents = self.cache.payload_extents(index[:count])
        slot = self.cpu.acquire()
        count = self.cpu.fits(self.cpu.input_bytes(extents), extents.shapes, count)
        if count == 0:
            self.cpu.release(slot)
            return None
        return self.cpu.submit(slot, extents, count)

    def _finish(
        self,
        index: np.ndarray,
        data: Any,
        shapes: np.ndarray | None,
        labels: np.ndarray,
        launching: Callable[[], None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gpu:
            positions = self.cache.positions[index]
            payloads, tensors, share = data
            first = share.count if share is not None else 0
            images: list[torch.Tensor] = []
            fallbacks = 0
            if payloads:
                t0 = time.perf_counter()
                images, fallbacks = decode_on_device(
                    self.cache,
                    payloads,
                    shapes,  # type: ignore[arg-type]
                    positions[first:],
                    self.device,
                    tensors,
                    launching=launching,
                )
                self.stats.decode_seconds += time.perf_counter() - t0
            launching()  # all on the CPU decoders: no device call to wait for
            self.stats.gpu_images += len(images) - fallbacks
            self.stats.cpu_fallbacks += fallbacks
            if share is not None:
                flat, waited, busy = self._cpu_share_on_device(share, index)
                self._balance(share.count, len(images), waited, busy)
                if getattr(self.transform, "takes_flat", False):  # no per-image tensors, no cat of them
                    flat_images = self._flat_images(flat, share, images, shapes)
                    return self._out(flat_images, labels)
                images = _views(flat, share.offsets, share.shapes) + images
        else:  # decoded by the read-ahead thread's pool already
            launching()
            images = [torch.from_numpy(a).permute(2, 0, 1).to(self.device, non_blocking=True) for a in data]
            self.stats.cpu_images += len(images)
        return self._out(images, labels)

    def _out(self, images: Any, labels: Any) -> tuple[Any, Any]:
        """(the batch through the transform, labels or the target on the device); a cache with fields
        hands its target to the transform, which moves the masks and boxes with each crop."""
        from dlstore.gpu.ragged import to_device  # here: dlstore.gpu imports Triton, which takes a while

        if isinstance(labels, dict):
            target = target_to_device(labels, self.device)
            if self.transform is not None:
                return self.transform(images, target=target)  # type: ignore[call-arg]
            return (images if isinstance(images, list) else list(images)), target
        batch = self.transform(images) if self.transform is not None else torch.stack(images)
        return batch, to_device(torch.from_numpy(labels), self.device)

    def _cpu_share_on_device(self, share: CpuShare, index: np.ndarray) -> tuple[torch.Tensor, float, float]:
        """The CPU share's images on the device, planar and back to back (one copy of the slot), the
        seconds this thread waited for the workers and the seconds they spent decoding it. A run they failed is read (CRC-checked) and decoded
        here, so a corrupt image raises the reader's error naming its dataset index and chunk."""
        assert self.cpu is not None
        t0 = time.perf_counter()
        _slowest, busy, failed = share.wait()
        waited = time.perf_counter() - t0
        self.stats.cpu_busy_seconds += busy
        block = self.cpu.block
        for first, stop in failed:
            self.stats.cpu_redecoded += stop - first
            payloads, _shapes = self.cache.read_payloads(index[first:stop])
            positions = self.cache.positions[index[first:stop]]
            for i in range(first, stop):
                h, w, c = share.shapes[i].tolist()
                hwc = self.cache.payload_reader.decode(
                    payloads[i - first], (h, w, c), int(positions[i - first])
                )
                start = share.out_start + int(share.offsets[i])
                block[start : start + h * w * c].reshape(c, h, w)[...] = hwc.transpose(2, 0, 1)
        region = torch.from_numpy(block[share.out_start : share.out_start + share.out_bytes])
        if self.device.type == "cuda":
            flat = region.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()  # the slot is written again only after this copy
            self.cpu.release(share.slot, event)
        else:
            flat = region.clone()
            self.cpu.release(share.slot)
        self.stats.cpu_images += share.count
        return flat, waited, busy

    def _flat_images(
        self, cpu_flat: torch.Tensor, share: CpuShare, gpu_images: list[torch.Tensor], gpu_shapes: np.ndarray
    ) -> FlatImages:
        """The CPU share's flat buffer (already back to back, planar) followed by nvJPEG's images."""
        from dlstore.gpu.ragged import FlatImages, to_device

        flat = torch.cat([cpu_flat, *(img.reshape(-1) for img in gpu_images)]) if gpu_images else cpu_flat
        hwc = np.concatenate([share.shapes, np.asarray(gpu_shapes, np.int64).reshape(-1, 3)])
        sizes = np.prod(hwc, axis=1)
        meta = np.stack([np.concatenate(([0], np.cumsum(sizes)[:-1])), hwc[:, 0], hwc[:, 1]]).astype(np.int64)
        meta_t = to_device(torch.from_numpy(meta), self.device)
        return FlatImages(flat, meta_t[0], meta_t[1], meta_t[2], int(hwc[0, 2]), host=meta)

    def _balance(self, cpu_count: int, gpu_count: int, waited: float, busy: float) -> None:
        """Without a fixed ``cpu_share``: the nvJPEG share is decoded in this thread, on the batch's path;
        the CPU share was decoded in other processes while earlier batches were used, so it costs this
        thread nothing while it is ready in time. The CPU therefore takes what its workers can decode in
        one batch period (at their in-place seconds per image, ``busy`` / ``cpu_count``), the period
        without the ``waited`` seconds this thread spent waiting for them; nvJPEG the rest."""
        self.stats.cpu_share = cpu_count / max(1, cpu_count + gpu_count)
        now, last = time.perf_counter(), self._last_batch
        self._last_batch = now
        self._epoch_batches += 1
        # The first read_ahead + 1 batches of an epoch were all handed to the workers at its start, with
        # no lead time: their waits are the pipeline filling, not the workers falling behind (counting
        # them halved the share every epoch in round H: it ended at 0.19 where all-CPU trained fastest).
        filling = self._epoch_batches <= self.read_ahead + 1
        if (
            self.fixed_share is not None
            or filling
            or last is None
            or now <= last
            or busy <= 0
            or self.cpu is None
        ):
            return
        self.share = auto_share(
            self.share,
            now - last,
            waited,
            busy / max(1, cpu_count),
            self.cpu.processes,
            cpu_count + gpu_count,
        )


def auto_share(
    share: float, period: float, waited: float, per_image: float, workers: int, batch: int
) -> float:
    """The CPU decoders' next fraction (see AUTO_STEP): after a batch ``period`` seconds long, of which
    the loader ``waited`` for their results, with ``per_image`` seconds of one worker's decode time per
    image (``workers`` in parallel) and ``batch`` images per batch."""
    if waited > WAIT_TOLERANCE * period:  # behind: they could not keep up
        share *= max(0.5, 1.0 - waited / period)
    else:
        target = min(MAX_AUTO_SHARE, AUTO_MARGIN * workers * period / per_image / max(1, batch))
        share += AUTO_STEP * (target - share)
        if target >= MAX_AUTO_SHARE and share > MAX_AUTO_SHARE - MIN_GPU_PART:
            share = MAX_AUTO_SHARE
    return min(MAX_AUTO_SHARE, max(MIN_AUTO_SHARE, share))


def _views(flat: torch.Tensor, offsets: np.ndarray, shapes: np.ndarray) -> list[torch.Tensor]:
    """(C, H, W) views of planar images back to back in ``flat``."""
    return [flat[o : o + h * w * c].view(c, h, w) for o, (h, w, c) in zip(offsets.tolist(), shapes.tolist())]


class _Pipe:
    """A thread applying ``fn`` to each item of ``source`` into a bounded queue; errors reach the consumer."""

    DONE = object()

    def __init__(
        self,
        source: Iterator[Any],
        fn: Callable[[Any], Any],
        depth: int,
        name: str,
        gate: threading.Semaphore | None = None,
    ) -> None:
        self.source, self.fn, self.gate = source, fn, gate
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.waited = 0.0  # seconds the consumer waited for items
        self.thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.source:
                if not self._pass_gate() or self.stop.is_set():
                    return
                self._put(self.fn(item))
        except BaseException as e:  # surfaced in the consumer's thread
            self._put(_Failed(e))
        self._put(self.DONE)

    def _pass_gate(self) -> bool:
        """Wait for a token (if gated); False once stopped."""
        while self.gate is not None and not self.gate.acquire(timeout=0.1):
            if self.stop.is_set():
                return False
        return True

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[Any]:
        while True:
            t0 = time.perf_counter()
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            finally:
                self.waited += time.perf_counter() - t0
            if item is self.DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class _Once:
    """Calls ``fn`` (if any) the first time it is called, never again."""

    def __init__(self, fn: Callable[[], Any] | None) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


@dataclass
class _Failed:
    error: BaseException
