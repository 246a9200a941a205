"""The decode path of ``dlstore.Loader``: batches of a payload cache (JPEG or raw pixels, fixed-size or
ragged) decoded on the device and cropped there to one size.

A background thread reads batch i+1's payloads (grouped by chunk, chunks loaded in the reader's threads,
each payload's CRC checked) while a second thread decodes batch i: JPEG caches in one batched nvJPEG
call (torchvision ``decode_jpeg(list, device="cuda")``), anything else (raw payloads, or no GPU) on the
CPU in the reader's threads. An image nvJPEG refuses is decoded on the CPU instead and counted in
``stats.cpu_fallbacks``. With ``cpu_decoders=N`` each JPEG batch is split: its first part is decoded by
N worker processes on the CPU (``cpu_lane``; started when the first epoch starts) while the GPU lanes
decode the rest, all feeding the same crop. Where nvImageCodec is installed (the ``nvimgcodec`` extra)
and the GPU has hardware JPEG engines (A100, H100, H200), a third lane decodes part of each batch on
them (``hw_lane``), at the same time as nvJPEG. ``lanes`` picks the lanes (default: each of them that
exists here); ``split`` fixes each lane's fraction; otherwise ``split.LaneSplit`` sets them from each
lane's rate measured in place, so that all lanes finish each batch together, or, while the training
step is the slower side, the CPU takes what it decodes in one step. ``transform`` (e.g.
``dlstore.gpu.RaggedRandomResizedCrop``) turns the decoded (C, H_i, W_i) uint8 images into one batch::

    crop = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16,
                                   channels_last=True).cuda()
    loader = dlstore.Loader("jpeg-cache/", batch_size=256, transform=crop)
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dlstore.read.cache import Cache
from dlstore.read.decode.cpu_lane import CpuDecoders, CpuShare
from dlstore.read.decode.split import LaneSplit, decode_parts
from dlstore.read.field_targets import read_target, target_tensors, target_to_device
from dlstore.read.loader import split_batches, storage_sorted

if TYPE_CHECKING:
    from dlstore.gpu.ragged import FlatImages

Transform = Callable[[list[torch.Tensor]], torch.Tensor]
# The decode lanes, in the order the split fills them while the training step is the slower side
# (cheapest for the step first): CPU processes, the hardware JPEG engines through nvImageCodec, and
# torchvision's batched nvJPEG call. On GPUs with NVJPG engines torchvision opens nvJPEG with its
# hardware backend, so its baseline JPEGs go to the same engines: the two GPU lanes are two clients of
# one set of engines there (benchmarks/RESULTS.md).
LANES = ("cpu", "hw", "nvjpeg")
# Every lane that exists here: the hardware lane decodes into reused slots that the crop reads in
# place, which made it pay its way in training.
DEFAULT_LANES = LANES


@dataclass
class DecodeStats:
    """What the loader did: images decoded on the device, and those nvJPEG refused (decoded on CPU)."""

    gpu_images: int = 0  # decoded on the device (nvJPEG and the hardware engines)
    hw_images: int = 0  # of which by the hardware engines
    cpu_images: int = 0
    cpu_fallbacks: int = 0
    cpu_redecoded: int = 0  # CPU-share images decoded in the loader because their worker run failed
    cpu_share: float = 0.0  # the CPU decoders' fraction of the last batch (cpu_decoders > 0)
    rerouted: int = 0  # images a lane failed (or refused) and another lane decoded
    lanes: list[str] = field(default_factory=list)  # the lanes this loader runs
    # Where the time went (seconds, summed over batches): reading payloads (read-ahead thread), inside
    # the batched device decode call, and the decoding thread waiting for a read batch (read-bound).
    batches: int = 0
    read_seconds: float = 0.0
    decode_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    # The CPU decode workers' own time decoding this loader's images (summed over workers): over
    # cpu_images, their per-image cost in place, to compare with one core decoding alone.
    cpu_busy_seconds: float = 0.0
    # The decoding thread's other waits and work per batch: for the previous batch's crop to finish on
    # the device (before this batch's decode may allocate), for the CPU share's workers, and in the
    # transform (the crop's launch).
    sync_seconds: float = 0.0
    share_wait_seconds: float = 0.0
    transform_seconds: float = 0.0


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


def fixed_split(split: Mapping[str, float] | None, names: list[str]) -> dict[str, float] | None:
    """``split`` over the lanes running here: a lane absent here gives its share to the others, and
    the lanes it leaves out share what it leaves of the batch equally (``{"cpu": 0.3}``: the CPU
    decoders take 30%, the GPU lanes the rest)."""
    if split is not None and not all(0.0 <= v <= 1.0 for v in split.values()):
        raise ValueError(f"split gives each lane its fraction of a batch, 0..1; got {dict(split)}")
    if split is None or not set(split) <= set(LANES):
        return None if split is None else dict(split)  # LaneSplit names the unknown lanes
    fixed = {k: v for k, v in split.items() if k in names}
    rest = [n for n in names if n not in split]
    left = max(0.0, 1.0 - sum(split.values()))
    return fixed | dict.fromkeys(rest, left / len(rest)) if rest else fixed


def _decode_one(data: torch.Tensor, mode: Any, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import decode_jpeg

    try:
        return decode_jpeg(data, mode=mode, device=device)
    except RuntimeError:
        return None


class DecodePath:
    """Batches of a payload cache, decoded (nvJPEG on CUDA) and cropped on ``device``; see the module.

    ``transform`` is required for a ragged cache (images differ in size); without it a fixed-size cache
    yields (B, C, H, W) uint8. ``read_ahead`` batches are read while the current one decodes."""

    read_ahead = 4  # batches read while one decodes

    def __init__(
        self,
        cache: Cache,
        batch_size: int,
        transform: Transform | None,
        device: torch.device,
        cpu_decoders: int = 0,
        lanes: Sequence[str] | None = None,
        split: Mapping[str, float] | None = None,
    ) -> None:
        if cache.ragged and transform is None:
            raise ValueError(
                f"{cache.root}: images differ in size; pass a transform that makes them one size, "
                "e.g. dlstore.gpu.RaggedRandomResizedCrop(224)"
            )
        self.cache, self.batch_size, self.transform, self.device = cache, batch_size, transform, device
        cache.reader.threads = max(cache.reader.threads, len(os.sched_getaffinity(0)))
        self.gpu = device.type == "cuda" and cache.reader.gpu_jpeg
        self._stream: Any = None
        self.stats = DecodeStats()
        self.cpu_decoders = max(0, cpu_decoders)
        self._lane_args = (lanes, split)
        self._setup_lanes()
        self.cpu: CpuDecoders | None = None
        self._last_batch: float | None = None
        self._epoch_batches = 0  # batches decoded in this epoch (the auto split skips the pipeline's fill)
        self._asked, self._yielded = 0.0, 0  # when the caller asked for this epoch's last batch; how many
        self._pool: ThreadPoolExecutor | None = None  # runs the hardware lane beside nvJPEG
        self._refs: list[Any] = []

    def _setup_lanes(self) -> None:
        """The lanes that exist here and the split over them (again if ``gpu`` was changed since)."""
        lanes, split = self._lane_args
        self._lanes_for = self.gpu
        self.hw = self._open_hardware_lane(lanes)
        names = self._lane_names(lanes)
        self.split = LaneSplit(names, fixed=fixed_split(split, names))
        self.stats.lanes = list(self.split.lanes)

    def _open_hardware_lane(self, lanes: Sequence[str] | None) -> Any:
        """The hardware JPEG lane where it can run (else None: the lane is absent, not an error)."""
        if not self.gpu or "hw" not in (DEFAULT_LANES if lanes is None else lanes):
            return None
        from dlstore.read.decode.hw_lane import HardwareJpeg

        return HardwareJpeg.open(self.device, int(self.cache.spec.shape[2]))

    def _lane_names(self, lanes: Sequence[str] | None) -> list[str]:
        """The lanes this loader runs, in fill order: those asked for (DEFAULT_LANES) that exist here."""
        unknown = set(lanes or ()) - set(LANES)
        if unknown:
            raise ValueError(f"lanes are some of {', '.join(LANES)}; got {sorted(unknown)}")
        here = {"cpu": self.gpu and self.cpu_decoders > 0, "hw": self.hw is not None, "nvjpeg": self.gpu}
        names = [n for n in LANES if here[n] and n in (DEFAULT_LANES if lanes is None else lanes)]
        return names or ["nvjpeg"]  # asked only for lanes absent here: nvJPEG (or the CPU path) decodes

    @property
    def fixed_share(self) -> float | None:
        """The CPU's fixed fraction of each batch, or None when the split is measured."""
        return None if self.split.fixed is None else float(self.split.fixed.get("cpu", 0.0))

    def epoch(self, indices: np.ndarray) -> Iterator[tuple[Any, Any]]:
        """The epoch's batches (``indices``: this rank's, in order), decoded and cropped."""
        batches = split_batches(indices, self.batch_size)
        self._last_batch, self._epoch_batches = None, 0
        self._asked, self._yielded = time.perf_counter(), 0
        if self._lanes_for != self.gpu:
            self._setup_lanes()
        if "cpu" in self.split.lanes and self.cpu is None:
            self.cpu = self._start_cpu_decoders()
        if self.hw is not None and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlstore-hw-decode")
        # One thread reads batches ahead while a second one decodes and crops batch i on a side stream,
        # so the caller's next step is queued while the next batch decodes. Never on the caller's own
        # stream: the crop would queue behind the training step, and nvJPEG's outputs could reuse memory
        # that step still reads (see _decode_batch).
        gate = self._read_gate()
        reads = _Pipe(iter(batches), self._read, self.read_ahead, "dlstore-read-ahead", gate)
        decoded = _Pipe(iter(reads), functools.partial(self._decode, gate=gate), 1, "dlstore-decode")
        try:
            for item in decoded:
                yield from self._timed_yield(self._handed_over(item))
        finally:
            reads.stop.set()  # both first: the decode thread may be waiting on the read queue
            decoded.close()
            reads.close()
            self._epoch_done(reads)

    def _timed_yield(self, batch: tuple[torch.Tensor, torch.Tensor]) -> Iterator[Any]:
        """Yield ``batch``; the time until the caller asks for the next one is its step's own time, the
        consumer's period the measured split works to (the batch-to-batch period would include this
        loader's own time when it is the slower side). The batch-to-batch time (waiting for this batch
        and the step on it) is what the split's tuner measures, but not while the pipeline fills."""
        t0 = time.perf_counter()
        yield batch
        now = time.perf_counter()
        self.split.period(now - t0)
        self._yielded += 1
        filling = self._yielded <= self.read_ahead + 1
        self.split.loop_period(None if filling else now - self._asked)
        self._asked = now

    def _read_gate(self) -> threading.Semaphore | None:
        """Read-ahead tokens: one is given back as each batch's decode call starts, so in steady state
        the read-ahead thread reads while that call runs without the GIL. Read whenever the queue had
        room (the previous design), it ran while the decoding thread held or wanted the GIL, and each
        time that thread came back from a C call it could wait for the reader's Python (up to the
        interpreter's 5 ms switch interval.

        Not with CPU decoders: there the read-ahead thread also hands each batch's CPU share to the
        decode processes, which should run as far ahead as the queue allows."""
        gated = "cpu" not in self.split.lanes
        return threading.Semaphore(self.read_ahead) if gated else None

    def _epoch_done(self, reads: _Pipe) -> None:
        self.stats.read_wait_seconds += reads.waited
        self.split.restart()  # batches split for this epoch and never consumed
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
            # and the crop's own buffers, read by the crop still queued here) could be handed out and
            # overwritten before that crop runs. Waiting for this stream (only the previous crop, not
            # the training step) prevents it. (Holding the decoded images for two batches instead would
            # not cover the crop's own buffers, e.g. its flat copy of the images, freed once it is queued.)
            t0 = time.perf_counter()
            self._stream.synchronize()
            self.stats.sync_seconds += time.perf_counter() - t0
            self._refs = []  # the previous batch's hardware-lane images: their crop has run
            images, labels = self._finish(*item, launching)
            event = torch.cuda.Event()
            event.record(self._stream)
        return images, labels, event

    def close(self) -> None:
        """Stop the CPU decode workers (if any); iterating again starts new ones."""
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _start_cpu_decoders(self) -> CpuDecoders:
        """Workers and slots for the CPU share: a slot holds the largest share of one batch, each image
        up to twice the cache's nominal size (a batch of larger ones sends fewer to the CPU)."""
        codec = self.cache.payload_reader.image_codec
        h, w, c = self.cache.spec.shape
        most = self.fixed_share if self.fixed_share is not None else 1.0
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

    def _read(self, batch: np.ndarray) -> tuple[np.ndarray, Any, np.ndarray | None, np.ndarray]:
        t0 = time.perf_counter()
        try:
            return self._read_batch(batch)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _read_batch(self, batch: np.ndarray) -> tuple[np.ndarray, Any, np.ndarray | None, np.ndarray]:
        """The batch's dataset indices in storage order, (the device part's payloads, the same as
        tensors, the CPU share in flight, the device lanes' parts), the device part's shapes, the labels.
        The split decides here, as the batch is read: the CPU share must start decoding now."""
        index = storage_sorted(self.cache, batch)
        labels = read_target(self.cache, index)  # the labels, or the collated fields of a cache with them
        if not self.gpu:
            return index, self.cache.read_images(index), None, labels
        counts = self.split.counts(len(index))
        share = self._submit_cpu_share(index, counts.get("cpu", 0))
        first = share.count if share is not None else 0
        payloads, shapes = (
            ([], np.empty((0, 3), np.int64))
            if first == len(index)
            else self.cache.read_payloads(index[first:])
        )
        parts = self._parts(counts, len(payloads))
        # tensors over the payloads for nvJPEG's part only (the hardware lane takes the bytes as they are)
        tensors: list[Any] = [None] * len(payloads)
        for name, a, b in parts:
            if name == "nvjpeg":
                tensors[a:b] = as_tensors(payloads[a:b])
        return index, (payloads, tensors, share, parts), shapes, labels

    def _parts(self, counts: dict[str, int], n: int) -> list[tuple[str, int, int]]:
        """The device lanes' (lane, start, stop) parts of the ``n`` images the CPU share left; what the
        CPU could not take (a full slot) goes to the last device lane."""
        device = [name for name in self.split.lanes if name != "cpu"]
        parts, start = [], 0
        for name in device:
            stop = n if name == device[-1] else min(n, start + counts.get(name, 0))
            parts.append((name, start, stop))
            start = stop
        return parts

    def _submit_cpu_share(self, index: np.ndarray, count: int) -> CpuShare | None:
        """The batch's first ``count`` images to the CPU decoders (as many as a slot holds).
        Only where their payloads lie is looked up here (numpy over the units' indexes): the workers
        read the bytes from the unit files (or find them copied into the slot) and check the CRCs."""
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
            payloads, tensors, share, parts = data
            first = share.count if share is not None else 0
            # A transform that takes FlatImages gets the batch where the lanes decoded it (the CPU
            # share's buffer, nvJPEG's tensors, the hardware lane's slots): no per-image tensor or copy.
            scatter = getattr(self.transform, "takes_flat", False)
            images: list[Any] = []
            if payloads:
                t0 = time.perf_counter()
                images = self._decode_device_part(
                    index[first:], payloads, tensors, shapes, parts, launching, scatter
                )
                self.stats.decode_seconds += time.perf_counter() - t0
            launching()  # all on the CPU decoders: no device call to wait for
            self._refs = images
            flat = None
            if share is None:
                self._balance(0, len(images), 0.0, 0.0)
            else:
                flat, waited, busy = self._cpu_share_on_device(share, index)
                self._balance(share.count, len(images), waited, busy)
                self._refs = [*images, flat]
            if scatter:  # where the lanes left them: no per-image tensors, no copy
                return self._out(self._scattered(flat, share, images, shapes), labels)
            if share is not None:
                images = _views(flat, share.offsets, share.shapes) + images
        else:  # decoded by the read-ahead thread's pool already
            launching()
            images = [torch.from_numpy(a).permute(2, 0, 1).to(self.device, non_blocking=True) for a in data]
            self.stats.cpu_images += len(images)
        return self._out(images, labels)

    def _out(self, images: Any, labels: Any) -> tuple[Any, Any]:
        """(the batch through the transform, labels or the target on the device); a cache with fields
        hands its target to the transform, which moves the masks and boxes with each crop."""
        t0 = time.perf_counter()
        try:
            return self._transformed(images, labels)
        finally:
            self.stats.transform_seconds += time.perf_counter() - t0

    def _transformed(self, images: Any, labels: Any) -> tuple[Any, Any]:
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
        self.stats.share_wait_seconds += waited
        self.stats.cpu_busy_seconds += busy
        block = self.cpu.block
        for first, stop in failed:
            self.stats.cpu_redecoded += stop - first
            self.stats.rerouted += stop - first
            self.split.rerouted("cpu", stop - first)
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
        # After the device lanes' call returns, on the batch's stream: copying a share decoded already
        # before that call, on a stream of its own, measured no faster.
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

    def _scattered(
        self, cpu_flat: torch.Tensor | None, share: CpuShare | None, images: list[Any], shapes: Any
    ) -> FlatImages:
        """The batch where its lanes decoded it (``ragged.scattered_flat``): the CPU share in its flat
        buffer, then each device image at its address (a tensor's, or the hardware lane's slot)."""
        from dlstore.gpu.ragged import scattered_flat

        hwc = np.asarray(shapes, np.int64).reshape(-1, 3)
        addresses = np.fromiter(
            (x if type(x) is int else x.data_ptr() for x in images), np.int64, len(images)
        )
        if share is not None and cpu_flat is not None:
            base = cpu_flat
            addresses = np.concatenate([share.offsets.astype(np.int64) + base.data_ptr(), addresses])
            hwc = np.concatenate([np.asarray(share.shapes, np.int64).reshape(-1, 3), hwc])
        else:
            base = next((x for x in images if type(x) is not int), None)
            if base is None:
                assert self.hw is not None and self.hw.slots is not None
                base = self.hw.slots
        hw, device_hwc = self.hw, np.asarray(shapes, np.int64).reshape(-1, 3)

        def sources() -> list[torch.Tensor]:
            out = [] if share is None or cpu_flat is None else _views(cpu_flat, share.offsets, share.shapes)
            for x, (h, w, c) in zip(images, device_hwc.tolist()):
                out.append(hw.view(x, (c, h, w)) if type(x) is int else x)  # type: ignore[union-attr]
            return out

        return scattered_flat(base, addresses, hwc, sources)

    def _decode_device_part(
        self,
        index: np.ndarray,
        payloads: list[memoryview],
        tensors: list[torch.Tensor],
        shapes: Any,
        parts: list[tuple[str, int, int]],
        launching: Callable[[], None],
        scatter: bool = False,
    ) -> list[Any]:
        """The device lanes' parts of a batch, decoded at once (the hardware lane in its thread beside
        nvJPEG in this one); a failed lane's part and the images a lane refuses go to the next lane, and
        to the CPU in this thread when none is left. With ``scatter`` the hardware lane decodes into its
        slots and gives each image's address (an int) instead of a tensor."""
        positions = self.cache.positions[index]
        hwc = np.asarray(shapes, np.int64).reshape(-1, 3)
        expected = [(c, h, w) for h, w, c in hwc.tolist()]

        def nvjpeg(a: int, b: int) -> list[Any]:
            data = tensors[a:b]
            if any(t is None for t in data):  # another lane's images (it failed, or refused them)
                data = as_tensors(payloads[a:b])
            out, fallbacks = decode_on_device(
                self.cache,
                payloads[a:b],
                shapes[a:b],
                positions[a:b],
                self.device,
                data,
                launching=launching,
            )
            self.stats.cpu_fallbacks += fallbacks
            self.stats.gpu_images += b - a - fallbacks
            return out

        def hardware(a: int, b: int) -> list[Any]:  # in the pool's thread: no stats here
            launching()
            if scatter and self.hw.into:
                return self.hw.decode_into(payloads[a:b], np.prod(hwc[a:b], axis=1))
            out = self.hw.decode(payloads[a:b])
            return [
                img if img is not None and tuple(img.shape) == expected[a + i] else None
                for i, img in enumerate(out)
            ]

        def on_cpu(a: int, b: int) -> list[Any]:
            self.stats.cpu_fallbacks += b - a
            return [
                torch.from_numpy(self.cache.payload_reader.decode(payloads[i], shapes[i], int(positions[i])))
                .permute(2, 0, 1)
                .to(self.device, non_blocking=True)
                for i in range(a, b)
            ]

        if not parts:  # no device lane (lanes=("cpu",)): what the CPU share left is decoded here
            return on_cpu(0, len(payloads))
        before = sum(lane.rerouted for lane in self.split.state.values())
        hw_before = self.split.state["hw"].images if "hw" in self.split.state else 0
        nv_alive = "nvjpeg" in self.split.state and self.split.state["nvjpeg"].alive
        images = decode_parts(
            self.split, parts, {"hw": hardware, "nvjpeg": nvjpeg}, nvjpeg if nv_alive else on_cpu, self._pool
        )
        self.stats.rerouted += sum(lane.rerouted for lane in self.split.state.values()) - before
        hw_done = (self.split.state["hw"].images if "hw" in self.split.state else 0) - hw_before
        self.stats.hw_images += hw_done
        self.stats.gpu_images += hw_done
        return images

    def _balance(self, cpu_count: int, gpu_count: int, waited: float, busy: float) -> None:
        """The CPU decoders' rate in place for the measured split (their decode seconds over the
        processes running them), with the ``waited`` seconds this thread spent waiting for their share
        in a batch period; the device lanes report their own in ``decode_parts``, the consumer's time
        is taken where each batch is yielded."""
        self.stats.cpu_share = cpu_count / max(1, cpu_count + gpu_count)
        now, last = time.perf_counter(), self._last_batch
        self._last_batch = now
        self._epoch_batches += 1
        # The first read_ahead + 1 batches of an epoch were all handed to the workers at its start, with
        # no lead time: their waits are the pipeline filling, not the workers falling behind (counting
        # them halved the share every epoch, far below where the CPU share trained fastest).
        filling = self._epoch_batches <= self.read_ahead + 1
        if filling or last is None or now <= last:
            if cpu_count:
                self.split.observe("cpu", cpu_count, 0.0)  # counted, no rate sample
            return
        if self.cpu is not None and cpu_count and busy > 0:
            self.split.observe("cpu", cpu_count, busy / self.cpu.processes, waited, now - last)
        if self.cpu is not None and "cpu" in self.split.state and not self.cpu.alive():
            self.split.fail("cpu", "its decode processes exited")


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
    """Calls ``fn`` (if any) the first time it is called (from any thread), never again."""

    def __init__(self, fn: Callable[[], Any] | None) -> None:
        self.fn = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self.fn = self.fn, None
        if fn is not None:
            fn()


@dataclass
class _Failed:
    error: BaseException
