"""The decode path of ``dlstore.Loader``: batches of a payload cache (JPEG or raw pixels, fixed-size or
ragged) decoded on the device and cropped there to one size.

A read-ahead thread reads the next batches' payloads (grouped by chunk, CRC-checked) and starts each
one's batched nvJPEG call into one flat buffer (``launch_flat``, run in C++ without the GIL) while a
second thread finishes one: JPEG from that call, anything else (raw payloads, or no GPU) on the CPU in
the reader's threads; an image nvJPEG refuses is decoded on the CPU (``stats.cpu_fallbacks``). With
``cpu_decoders=N`` each JPEG batch's first part is decoded by N worker processes (``cpu_lane``); with
nvImageCodec and a GPU with hardware JPEG engines, a third lane decodes part on them (``hw_lane``).
``lanes`` picks the lanes, ``split`` fixes their fractions, else ``split.LaneSplit`` measures them.
``transform`` (e.g. ``dlstore.gpu.RaggedRandomResizedCrop``) makes the (C, H_i, W_i) images one batch::

    crop = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16).cuda()
    loader = dlstore.Loader("jpeg-cache/", batch_size=256, transform=crop)
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
from dlstore.read.decode.split import Busy, LaneSplit, decode_parts
from dlstore.read.field_targets import read_target, target_tensors, target_to_device
from dlstore.read.loader import split_batches, storage_sorted

if TYPE_CHECKING:
    from dlstore.gpu.ragged import FlatImages

Transform = Callable[[list[torch.Tensor]], torch.Tensor]
# The decode lanes, in the order the split fills them while the step is the slower side (cheapest for
# the step first). Where the GPU has NVJPG engines, torchvision's nvJPEG sends baseline JPEGs to them
# too: the two GPU lanes are then two clients of one set of engines.
LANES = ("cpu", "hw", "nvjpeg")


@dataclass
class DecodeStats:
    """What the loader did: which lane decoded what, where the time went (seconds, over batches)."""

    gpu_images: int = 0  # decoded on the device (nvJPEG and the hardware engines)
    hw_images: int = 0  # of which by the hardware engines
    cpu_images: int = 0
    cpu_fallbacks: int = 0
    cpu_redecoded: int = 0  # CPU-share images decoded in the loader because their worker run failed
    cpu_share: float = 0.0  # the CPU decoders' fraction of the last batch (cpu_decoders > 0)
    rerouted: int = 0  # images a lane failed (or refused) and another lane decoded
    lanes: list[str] = field(default_factory=list)  # the lanes this loader runs
    batches: int = 0  # then seconds: reading, in the device decode, waiting for a read batch
    read_seconds: float = 0.0
    decode_seconds: float = 0.0
    read_wait_seconds: float = 0.0
    cpu_busy_seconds: float = 0.0  # the CPU decode workers' own decode time (summed over workers)
    sync_seconds: float = 0.0  # then: for the last crop, for the CPU share, in the transform
    share_wait_seconds: float = 0.0
    transform_seconds: float = 0.0


def as_tensors(payloads: list[memoryview]) -> list[torch.Tensor]:
    """uint8 CPU tensors over the payload bytes, no copy (decode_jpeg only reads them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer of a read-only buffer
        return [torch.frombuffer(p, dtype=torch.uint8) for p in payloads]


def decode_on_device(
    cache: Cache, payloads: list[memoryview], shapes: np.ndarray, positions: np.ndarray, device: torch.device
) -> tuple[list[torch.Tensor], int]:
    """(C, H, W) uint8 tensors on ``device``, image by image (where ``launch_flat``'s batched call
    failed): nvJPEG, else the CPU for an image it refuses or decodes to another shape than the cache
    says; and how many the CPU decoded."""
    from torchvision.io import ImageReadMode, decode_jpeg

    mode = ImageReadMode.GRAY if len(shapes) and int(shapes[0][2]) == 1 else ImageReadMode.RGB
    out, fallbacks = [], 0
    hwc, tensors = np.asarray(shapes).tolist(), as_tensors(payloads)
    for data, payload, (h, w, c), at in zip(tensors, payloads, hwc, positions.tolist()):
        with warnings.catch_warnings():  # torchvision >= 0.29 deprecates its decoders
            warnings.simplefilter("ignore")
            try:
                img: torch.Tensor | None = decode_jpeg(data, mode=mode, device=device)
            except RuntimeError:
                img = None
        if img is None or tuple(img.shape) != (c, h, w):
            cpu = cache.payload_reader.decode(payload, (h, w, c), int(at))
            img = torch.from_numpy(cpu).permute(2, 0, 1).to(device, non_blocking=True)
            fallbacks += 1
        out.append(img)
    return out, fallbacks


def launch_flat(payloads: list[memoryview], shapes: np.ndarray, device: torch.device) -> FlatDecode:
    """Start the batch's batched nvJPEG decode into one flat buffer and return at once. It runs in
    TorchScript's inter-op threads (``torch.jit.fork`` in a scripted function), in C++ from start to end,
    never waiting for the GIL: batches read ahead decode back to back while the loader's and the
    training loop's Python run. ``FlatDecode.result`` waits for it."""
    hwc = np.asarray(shapes, np.int64).reshape(-1, 3)
    bounds = np.zeros(len(payloads) + 1, np.int64)
    np.cumsum([len(p) for p in payloads], out=bounds[1:])
    data = as_tensors([memoryview(b"".join(payloads))])[0]
    future = _flat_decoder()(data, bounds.tolist(), 1 if hwc[0, 2] == 1 else 3, device)
    pending = FlatDecode(future, hwc, time.perf_counter())
    future.add_done_callback(lambda _f: pending.ended.append(time.perf_counter()))  # the lane's busy time
    return pending


@dataclass
class FlatDecode:
    """One batch's nvJPEG decode in flight (``launch_flat``)."""

    future: Any  # torch.Future of (flat buffer, each image's (C, H, W))
    hwc: np.ndarray  # each image's (H, W, C), as the cache says
    launched: float  # perf_counter at the launch
    ended: list[float] = field(default_factory=list)  # perf_counter when it ended, once it has

    def result(self, launching: Callable[[], None]) -> tuple[torch.Tensor, np.ndarray] | None:
        """(the flat buffer, each image's byte offset in it), done on the device; None when the call failed
        or an image decoded to another shape (``decode_on_device`` then decides). Calls ``launching`` first."""
        launching()
        try:
            flat, got = self.future.wait()
        except RuntimeError:
            return None
        if not np.array_equal(np.asarray(got, np.int64).reshape(-1, 3), self.hwc[:, [2, 0, 1]]):
            return None
        sizes = np.prod(self.hwc, axis=1)
        return flat, np.cumsum(sizes) - sizes


def _flat_batch(
    data: torch.Tensor, bounds: list[int], mode: int, device: torch.device
) -> tuple[torch.Tensor, list[list[int]]]:
    parts = [data[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
    if device.type == "cuda":
        # A pool stream, never this thread's current one (the default stream, where the training step
        # queues): the copy into the flat buffer would wait behind the step. Done on return, so the
        # buffer can be read on any stream.
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            out = torch.ops.image.decode_jpegs_cuda(parts, mode, device)
            flat = torch.cat([x.flatten() for x in out])
        stream.synchronize()
    else:  # the CPU decoder stands in for nvJPEG (the tests)
        out = [torch.ops.image.decode_jpeg(x, mode, False) for x in parts]
        flat = torch.cat([x.flatten() for x in out])
    return flat, [x.shape for x in out]


def _flat_fork(
    data: torch.Tensor, bounds: list[int], mode: int, device: torch.device
) -> torch.jit.Future[tuple[torch.Tensor, list[list[int]]]]:
    # a copy made here has no Python object: the task dropping the caller's tensor would wait for the GIL
    return torch.jit.fork(_flat_batch, data.clone(), bounds, mode, device)


@functools.cache
def _flat_decoder() -> Callable[..., Any]:
    import torchvision.io  # noqa: F401  (registers torch.ops.image)

    with warnings.catch_warnings():  # torch >= 2.14 deprecates TorchScript: nothing else runs this GIL-free
        warnings.simplefilter("ignore")
        return torch.jit.script(_flat_fork)


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


class DecodePath:
    """Batches of a payload cache, decoded and cropped on ``device`` (see the module); without a
    ``transform`` (required for a ragged cache) a fixed-size cache yields (B, C, H, W) uint8."""

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
        self._flats: list[torch.Tensor] = []  # this batch's flat nvJPEG buffers
        self._nvjpeg_done = 0.0  # when the last nvJPEG call ended (its lane's busy time starts after it)

    def _setup_lanes(self) -> None:
        """The lanes asked for that exist here, in fill order, and the split over them (again if
        ``gpu`` was changed since). An absent hardware lane is not an error."""
        lanes, split = self._lane_args
        asked = LANES if lanes is None else lanes
        if set(asked) - set(LANES):
            raise ValueError(f"lanes are some of {', '.join(LANES)}; got {sorted(set(asked) - set(LANES))}")
        self._lanes_for, self.hw = self.gpu, None
        if self.gpu and "hw" in asked:
            from dlstore.read.decode.hw_lane import HardwareJpeg

            self.hw = HardwareJpeg.open(self.device, int(self.cache.spec.shape[2]))
        here = {"cpu": self.gpu and self.cpu_decoders > 0, "hw": self.hw is not None, "nvjpeg": self.gpu}
        # asked only for lanes absent here: nvJPEG (or the CPU path) decodes
        names = [n for n in LANES if here[n] and n in asked] or ["nvjpeg"]
        self.split = LaneSplit(names, fixed=fixed_split(split, names))
        self.stats.lanes = list(self.split.lanes)

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
        # Decoded and cropped on a side stream, never the caller's: the crop would queue behind the
        # training step, and nvJPEG's outputs could reuse memory that step still reads.
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
        period the split works to. The batch-to-batch time is what its tuner measures (not while the
        pipeline fills)."""
        t0 = time.perf_counter()
        yield batch
        now = time.perf_counter()
        self.split.period(now - t0)
        self._yielded += 1
        filling = self._yielded <= self.read_ahead + 1
        self.split.loop_period(None if filling else now - self._asked)
        self._asked = now

    def _read_gate(self) -> threading.Semaphore | None:
        """Read-ahead tokens, one given back as the decoding thread takes up each batch's nvJPEG call
        (at most ``read_ahead`` calls in flight). Not with CPU decoders: their shares should run as far
        ahead as the queue allows."""
        gated = "cpu" not in self.split.lanes
        return threading.Semaphore(self.read_ahead) if gated else None

    def _epoch_done(self, reads: _Pipe) -> None:
        self.stats.read_wait_seconds += reads.waited
        self.split.restart()  # batches split for this epoch and never consumed
        if self.cpu is not None:  # slots of batches read ahead, never decoded (an epoch left early)
            self.cpu.reclaim()

    def _handed_over(self, item: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch, safe to use on the caller's current stream (made on a side stream: wait for it)."""
        images, labels, event = item
        if event is None:
            return images, labels
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
            # nvJPEG writes its outputs on a stream of its own, unordered with this one: memory freed
            # here (the previous batch's images, the crop's own buffers) could be overwritten before
            # the crop queued here reads it. Waiting for this stream (the previous crop, not the step)
            # prevents it.
            t0 = time.perf_counter()
            self._stream.synchronize()
            self.stats.sync_seconds += time.perf_counter() - t0
            self._refs = []  # the previous batch's device images: their crop has run
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
        most = 1.0 if self.split.fixed is None else float(self.split.fixed.get("cpu", 0.0))
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
        """(storage-ordered indices, (the device part's payloads, the CPU share in flight,
        the device lanes' parts), the device part's shapes, the labels). The split decides here: the
        CPU share must start decoding now."""
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
        # the nvJPEG part's decode starts now, while the batches before it are cropped and trained on
        nv = self.split.state.get("nvjpeg")
        launched = {
            (a, b): launch_flat(payloads[a:b], shapes[a:b], self.device)
            for n, a, b in parts
            if n == "nvjpeg" and b > a and nv is not None and nv.alive
        }
        return index, (payloads, share, parts, launched), shapes, labels

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
        """The batch's first ``count`` images (as many as a slot holds) to the CPU decoders, which read
        the payloads where ``payload_extents`` says they lie and check the CRCs."""
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
            payloads, share, parts, launched = data
            self._flats = []
            first = share.count if share is not None else 0
            # A transform that takes FlatImages gets the batch where the lanes decoded it (the CPU
            # share's buffer, nvJPEG's tensors, the hardware lane's slots): no per-image tensor or copy.
            scatter = getattr(self.transform, "takes_flat", False)
            images: list[Any] = []
            if payloads:
                t0 = time.perf_counter()
                images = self._decode_device_part(
                    index[first:], payloads, shapes, parts, launched, launching, scatter
                )
                self.stats.decode_seconds += time.perf_counter() - t0
            launching()  # all on the CPU decoders: no device call to wait for
            self._refs = [*images, *self._flats]
            flat = None
            if share is None:
                self._balance(0, len(images), 0.0, 0.0)
            else:
                flat, waited, busy = self._cpu_share_on_device(share, index)
                self._balance(share.count, len(images), waited, busy)
                self._refs.append(flat)
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
        from dlstore.gpu.ragged import to_device  # here: dlstore.gpu imports Triton, which takes a while

        t0 = time.perf_counter()
        try:
            if isinstance(labels, dict):
                target = target_to_device(labels, self.device)
                if self.transform is not None:
                    return self.transform(images, target=target)  # type: ignore[call-arg]
                return (images if isinstance(images, list) else list(images)), target
            batch = self.transform(images) if self.transform is not None else torch.stack(images)
            return batch, to_device(torch.from_numpy(labels), self.device)
        finally:
            self.stats.transform_seconds += time.perf_counter() - t0

    def _cpu_share_on_device(self, share: CpuShare, index: np.ndarray) -> tuple[torch.Tensor, float, float]:
        """The CPU share's images on the device, planar and back to back (one copy of the slot), the
        seconds waited for the workers and the seconds they spent decoding. A run they failed is read
        and decoded here, so a corrupt image raises the reader's error naming its index and chunk."""
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
        # after the device lanes' call, on the batch's stream: earlier, on a stream of its own, was no faster
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
            base = base if base is not None else next(iter(self._flats), None)
            if base is None:
                assert self.hw is not None and self.hw.slots is not None
                base = self.hw.slots
        device_hwc = np.asarray(shapes, np.int64).reshape(-1, 3)

        def sources() -> list[torch.Tensor]:
            out = [] if share is None or cpu_flat is None else _views(cpu_flat, share.offsets, share.shapes)
            for x, (h, w, c) in zip(images, device_hwc.tolist()):
                out.append(x if type(x) is not int else self._view(x, (c, h, w)))
            return out

        return scattered_flat(base, addresses, hwc, sources)

    def _decode_device_part(
        self,
        index: np.ndarray,
        payloads: list[memoryview],
        shapes: Any,
        parts: list[tuple[str, int, int]],
        launched: dict[tuple[int, int], FlatDecode],
        launching: Callable[[], None],
        scatter: bool = False,
    ) -> list[Any]:
        """The device lanes' parts of a batch, decoded at once (``decode_parts``: failures to the next
        lane, else the CPU). With ``scatter`` the hardware lane gives each image's address (an int in
        its slots) instead of a tensor."""
        positions = self.cache.positions[index]
        hwc = np.asarray(shapes, np.int64).reshape(-1, 3)
        expected = [(c, h, w) for h, w, c in hwc.tolist()]

        def nvjpeg(a: int, b: int) -> list[Any]:
            pending = launched.pop((a, b), None) or launch_flat(payloads[a:b], shapes[a:b], self.device)
            got = pending.result(launching)
            # its busy time: from when it could start (launched, the previous call done) until done
            done = pending.ended[0] if pending.ended else time.perf_counter()
            busy, self._nvjpeg_done = done - max(pending.launched, self._nvjpeg_done), done
            if got is not None:  # one buffer, kept until the batch's crop has run
                self._flats.append(got[0])
                self.stats.gpu_images += b - a
                if scatter:  # each image's address: no per-image tensor
                    return Busy((got[0].data_ptr() + got[1]).tolist(), busy)
                return Busy(_views(got[0], got[1], hwc[a:b]), busy)
            out, fallbacks = decode_on_device(
                self.cache, payloads[a:b], shapes[a:b], positions[a:b], self.device
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

    def _view(self, address: int, chw: tuple[int, int, int]) -> torch.Tensor:
        """The (C, H, W) image at ``address``: in a flat nvJPEG buffer, else in the hardware lane's."""
        for buf in self._flats:
            start = address - buf.data_ptr()
            if 0 <= start < buf.numel():
                return buf[start : start + chw[0] * chw[1] * chw[2]].view(chw)
        assert self.hw is not None
        return self.hw.view(address, chw)

    def _balance(self, cpu_count: int, gpu_count: int, waited: float, busy: float) -> None:
        """The CPU decoders' rate in place for the measured split (their decode seconds over their
        processes) and the ``waited`` seconds for their share in a batch period."""
        self.stats.cpu_share = cpu_count / max(1, cpu_count + gpu_count)
        now, last = time.perf_counter(), self._last_batch
        self._last_batch = now
        self._epoch_batches += 1
        # The first read_ahead + 1 batches of an epoch reach the workers with no lead time: their waits
        # are the pipeline filling (counting them halved the CPU share every epoch).
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
            self._put(e)
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
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class _Once:
    """Calls ``fn`` (if any) the first time it is called (from any thread), never again."""

    def __init__(self, fn: Callable[[], Any] | None) -> None:
        self.fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self.fn = self.fn, None
        fn() if fn is not None else None
