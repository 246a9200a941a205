"""The payload layout of the chunked formats: a unit (npz shard, zarr chunk) holds its images' encoded
payloads back to back plus, per image, its offset, (H, W, C) shape and CRC-32: variable-size or JPEG
images without pickles. Reads are grouped by unit; each CRC is checked before decoding, so a corrupt
byte is an error naming the image and its unit, never wrong pixels."""

from __future__ import annotations

import mmap
import zlib
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.errors import CacheCorruptError
from dlstore.formats.base import CacheWriter, ChunkedReader, UnitCache, group_runs
from dlstore.formats.codecs import (
    DEFAULT_QUALITY,
    ERROR_SAMPLE_EVERY,
    ImageCodec,
    PayloadError,
    RawCodec,
    error_sample,
    is_image_codec,
)
from dlstore.formats.describe import Codec, Traits
from dlstore.spec import CacheSpec

Images = np.ndarray | list[np.ndarray]
PAYLOAD = "payload"  # format_options["layout"] of caches in this layout


@dataclass
class PayloadUnit:
    """One unit's payloads (``data``, a uint8 buffer) and index; ``error``: (sum |err|, count)."""

    data: Any
    offsets: np.ndarray  # (n + 1,) int64
    shapes: np.ndarray  # (n, 3) int32
    crc: np.ndarray  # (n,) uint32
    error: np.ndarray  # (2,) float64
    ends: np.ndarray | None = None  # when payloads are not back to back: item j is offsets[j]:ends[j]
    checked: np.ndarray | None = None  # (n,) bool: items whose CRC has been checked and held
    source: tuple[str, int] | None = None  # data is this file's bytes from this offset (see file_source)

    def __len__(self) -> int:
        return len(self.shapes)

    def first_failing_crc(self, items: np.ndarray) -> int | None:
        """Check the CRC of each of ``items`` not checked before (once per item while the unit is
        loaded: a random-access read of one image does not pay for the whole unit's CRCs, and a
        unit read whole pays for each item once); the first that fails, or None."""
        if self.checked is None:
            self.checked = np.zeros(len(self), bool)
        view = memoryview(self.data)
        for j in items[~self.checked[items]].tolist():
            end = self.offsets[j + 1] if self.ends is None else self.ends[j]
            if zlib.crc32(view[int(self.offsets[j]) : int(end)]) != int(self.crc[j]):
                return int(j)
            self.checked[j] = True
        return None

    def file_source(self) -> tuple[str, int] | None:
        """(path, offset) when ``data`` is its file's bytes as stored (another process may read them)."""
        data = self.data
        # only a whole map: a slice of one keeps the map's offset, not its own
        if isinstance(data, np.memmap) and data.filename and isinstance(data.base, mmap.mmap):
            return str(data.filename), int(data.offset)
        return self.source

    def payload(self, j: int) -> memoryview:
        end = self.offsets[j + 1] if self.ends is None else self.ends[j]
        return memoryview(self.data)[int(self.offsets[j]) : int(end)]


@dataclass
class PayloadExtents:
    """Where a batch's payloads lie, without touching their bytes: the units' data buffers and, per
    image, which buffer, its byte range there, its CRC-32 and its (H, W, C) shape. A decoder in another
    process reads them from the unit's file itself where the unit has one (``sources``), or gets them
    copied by ``copy_into`` (one slice per image), and checks each CRC itself: the reading process spends
    no per-image Python on them."""

    buffers: list[memoryview]
    sources: list[tuple[str, int] | None]  # per buffer: (file, offset of the buffer's byte 0) or None
    buffer: np.ndarray  # (B,) int64 index into buffers
    starts: np.ndarray  # (B,) int64
    ends: np.ndarray  # (B,) int64
    crc: np.ndarray  # (B,) int64 (the stored uint32)
    shapes: np.ndarray  # (B, 3) int64

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def sizes(self) -> np.ndarray:
        return self.ends - self.starts

    def copy_into(self, out: memoryview, rows: np.ndarray) -> np.ndarray:
        """The payloads of ``rows`` back to back into ``out`` (a byte buffer they fit); each one's start."""
        sizes = self.sizes[rows]
        at = np.zeros(len(rows), np.int64)
        np.cumsum(sizes[:-1], out=at[1:])
        rows = zip(self.buffer[rows].tolist(), self.starts[rows].tolist(), self.ends[rows].tolist())
        for d, (b, s, e) in zip(at.tolist(), rows):
            out[d : d + e - s] = self.buffers[b][s:e]
        return at


def image_codec_class(codec: Codec | None) -> type[ImageCodec] | None:
    """The one place that decides what a declared codec does to pixels: one whose ``impl`` is an
    ImageCodec encodes each image on its own (the payload layout; units stored as they are); any other
    codec, or none, compresses whole units of raw pixels (then None)."""
    impl = None if codec is None else codec.impl
    return impl if is_image_codec(impl) else None


def payload_codec(spec: CacheSpec) -> ImageCodec:
    """What a payload cache's images decode with: the manifest's one codec key, looked up in the format
    registry like the writer did. (``raw``: the name older manifests kept under ``image_codec``.)"""
    from dlstore.formats import get_format  # the registry imports this module

    quality = int(spec.writer_options.get("quality", DEFAULT_QUALITY))
    if spec.codec in (None, RawCodec.name):
        return RawCodec()
    image_codec = image_codec_class(get_format(spec.format).codec(spec.codec))
    return RawCodec() if image_codec is None else image_codec(quality)


class PayloadWriter(CacheWriter):
    """Encodes a unit's images (in the converter's worker process) into a PayloadUnit; subclasses
    store it. ``images`` may be one (B,H,W,C) array or a list of (H,W,C) arrays of any sizes. The
    declared ``--codec`` is either an image codec (JPEG: each image encoded on its own, units stored
    as they are) or the format's unit compressor over raw-pixel payloads."""

    target_unit_bytes: ClassVar[int] = 4 << 20

    def __init__(self, root: Path, n: int, shape: tuple[int, int, int], options: dict[str, Any]) -> None:
        super().__init__(root, n, shape, options)
        image_codec = image_codec_class(self.codec)
        quality = int(self.options.get("quality", DEFAULT_QUALITY))
        self.image_codec: ImageCodec = RawCodec() if image_codec is None else image_codec(quality)
        per_image = self.image_bytes // (10 if self.image_codec.lossy else 1)
        self.unit_size = int(min(4096, max(1, self.target_unit_bytes // max(1, per_image))))

    @property
    def unit_compressed(self) -> bool:
        """Whether the format's unit compressor applies (raw-pixel payloads only)."""
        return image_codec_class(self.codec) is None

    @staticmethod
    def choose_unit_size(image_bytes: int) -> int:
        return 1  # replaced in __init__, where the codec is known

    def recorded_options(self) -> dict[str, Any]:
        out = {**super().recorded_options(), "layout": PAYLOAD}
        if not self.image_codec.lossy:
            out.pop("quality", None)
        return out

    def encode_unit(self, images: Images) -> PayloadUnit:
        payloads = [self.image_codec.encode(np.asarray(img)) for img in images]
        sizes = np.fromiter((len(p) for p in payloads), np.int64, len(payloads))
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        shapes = np.asarray([np.shape(img) for img in images], np.int32).reshape(-1, 3)
        crc = np.fromiter((zlib.crc32(p) for p in payloads), np.uint32, len(payloads))
        error = np.zeros(2, np.float64)
        n = len(payloads)
        for j in sorted(set(range(0, n, ERROR_SAMPLE_EVERY)) | ({1} if n > 1 else set())):
            total, count = error_sample(self.image_codec, np.asarray(images[j]), payloads[j])
            error += (total, count)
        data = np.frombuffer(b"".join(payloads), np.uint8)
        return PayloadUnit(data, offsets, shapes, crc, error)

    @staticmethod
    def mean_error(errors: list[np.ndarray]) -> float | None:
        total = np.sum(errors, axis=0) if errors else np.zeros(2)
        return round(float(total[0] / total[1]), 4) if total[1] else None


def index_problem(unit: PayloadUnit, count: int, spec: Any, limit: int) -> str:
    """What is wrong with a unit's index (empty when nothing): see ``PayloadReader.check_index``."""
    arrays = {"offsets": unit.offsets, "shapes": unit.shapes, "crc": unit.crc}
    if unit.ends is not None:
        arrays["ends"] = unit.ends
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
            return f"{name} is {getattr(arr, 'dtype', type(arr).__name__)}, not integers"
    n, size = len(unit.shapes), len(unit.data)
    offsets = unit.offsets.astype(np.int64)
    if n < count or unit.shapes.shape[1:] != (3,) or len(offsets) != n + 1 or len(unit.crc) != n:
        return f"{n} entries, expected ≥ {count}"
    ends = offsets[1:] if unit.ends is None else unit.ends.astype(np.int64)
    if len(ends) != n or (n and (offsets.min() < 0 or ends.max() > size or np.any(ends < offsets[:-1]))):
        return f"payload offsets outside the {size} bytes of data or not ascending"
    if unit.ends is None and np.any(np.diff(offsets) < 0):
        return "payload offsets not ascending"
    shapes = unit.shapes.astype(np.int64)
    h, w, c = shapes[:count].T if n else (np.zeros(0),) * 3
    size_, channels = spec.image.size, spec.image.channels
    if np.any(c != channels) or np.any(h < 1) or np.any(w < 1):
        return f"image shapes with other than {channels} channels, or empty"
    if not spec.ragged and np.any((h != size_) | (w != size_)):
        return f"image shapes other than the manifest's {size_}x{size_}"
    longest = spec.image.max_side or (1 << 16)
    if spec.ragged and np.any((np.minimum(h, w) > size_) | (np.maximum(h, w) > longest)):
        return f"image shapes beyond the policy (shorter side {size_}, longer at most {longest})"
    pixels = h * w * c  # one image's decode buffer: the cache's one bound (base.decode_limit)
    if np.any(pixels > limit):
        j = int(np.argmax(pixels > limit))
        length = int(ends[j] - offsets[j])
        return (
            f"image {j} is said to be {tuple(shapes[j])} ({int(pixels[j]) / 1e6:.1f} MB) from {length} bytes "
            f"of payload, beyond the {limit / 1e6:.1f} MB one image of this cache may decode to"
        )
    return ""


def payload_bound(shapes: np.ndarray, limit: int) -> int:
    """The most bytes a unit's raw-pixel payloads may inflate to: ``shapes``' pixels, at most ``limit``."""
    pixels = np.prod(np.asarray(shapes, np.float64).reshape(len(shapes), -1).clip(0), axis=1).sum()
    return int(min(limit, pixels))


def corrupt_at(position: int, message: str) -> CacheCorruptError:
    """A CacheCorruptError that carries the storage position, so the Cache can name the dataset index."""
    error = CacheCorruptError(message)
    error.position = position  # type: ignore[attr-defined]
    return error


class PayloadReader(ChunkedReader):
    """Reads payloads grouped by unit (units loaded in threads, the most recent kept), checks each
    payload's CRC, decodes on the CPU in threads (``read_images``) or hands the bytes to a GPU decoder
    (``read_payloads``). Traits: ``ragged`` (images differ in size), ``gpu_jpeg`` (payloads are JPEG
    files nvJPEG can decode)."""

    # Units are payloads plus an index, never one pixel array: no decode into a worker's unit slot.
    traits: ClassVar[Traits] = Traits(
        loads_into_ram=False, unit_grouped=True, fork_safe=True, opens_files_per_read=True, payloads=True
    )

    def __init__(
        self, root: Path, spec: CacheSpec, in_memory: bool = False, unit: int = 1, max_units: int = 64
    ) -> None:
        super().__init__(root, spec, in_memory, unit=unit)
        self.image_codec = payload_codec(spec)
        self.ragged = spec.ragged
        self.gpu_jpeg = self.image_codec.gpu_jpeg
        self._units = UnitCache(max_units)

    def unit_path(self, k: int) -> Path:
        return self.root / self.unit_file(k)

    @abstractmethod
    def load_payload_unit(self, k: int) -> PayloadUnit:
        """Read unit k's payloads and index (CacheCorruptError naming the file when it cannot)."""

    def load_unit(self, k: int) -> np.ndarray:
        raise NotImplementedError("payload units are read with payload_unit()")

    def payload_unit(self, k: int) -> PayloadUnit:
        unit = self._units.lookup(k)  # type: ignore[assignment]
        if unit is None:
            unit = self.load_payload_unit(k)
            self.check_index(k, unit)
            self._units.put(k, unit)  # type: ignore[arg-type]
        return unit  # type: ignore[return-value]

    def check_index(self, k: int, unit: PayloadUnit) -> None:
        """Every number of a unit's index against the bytes present and the manifest, before any
        payload is decoded or any output allocated: integer arrays of the right lengths, offsets
        ascending within the data, shapes the image policy allows and that the payload's bytes can
        decode to within the cache's one bound (``base.decode_limit``)."""
        count = min(self.unit, self.spec.n_stored - k * self.unit)
        problem = index_problem(unit, count, self.spec, self.decode_limit)
        if problem:
            raise CacheCorruptError(
                f"{self.unit_path(k)}: chunk {k}'s index is inconsistent ({problem}); "
                f"run `dlstore verify {self.root}` and rebuild"
            )

    def read_payloads(self, positions: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
        """Payloads (CRC-checked) and (B, 3) shapes of the images at ``positions``, in that order."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        order = np.argsort(positions, kind="stable")
        sorted_pos = positions[order]
        runs = group_runs(sorted_pos // self.unit)
        payloads: list[memoryview] = [memoryview(b"")] * len(positions)
        shapes = np.empty((len(positions), 3), np.int64)

        def fetch(run: tuple[int, int, int]) -> None:
            k, a, b = run
            unit = self.payload_unit(k)
            local = sorted_pos[a:b] - k * self.unit
            starts = unit.offsets[local].tolist()
            ends = (unit.offsets[local + 1] if unit.ends is None else unit.ends[local]).tolist()
            view = memoryview(unit.data)
            dst = order[a:b]
            shapes[dst] = unit.shapes[local]
            j = unit.first_failing_crc(local)
            if j is not None:
                p = k * self.unit + j
                raise corrupt_at(
                    p,
                    f"{self.unit_path(k)}: the image at storage position {p} (chunk {k}, item {j}) "
                    f"fails its CRC check: the cache is corrupt; run `dlstore verify {self.root}` "
                    "and rebuild",
                )
            for d, s, e in zip(dst.tolist(), starts, ends):
                payloads[d] = view[s:e]

        def unchecked(k: int, a: int, b: int) -> bool:  # a unit to read or CRCs to check: GIL-free work
            checked = getattr(self._units.lookup(k), "checked", None)
            return checked is None or not checked[sorted_pos[a:b] - k * self.unit].all()

        # Threads only for that work: slicing loaded, checked units is Python and would hand the GIL round.
        self.parallel(fetch, runs, sum(unchecked(*run) for run in runs) << 22)
        return payloads, shapes

    def payload_extents(self, positions: np.ndarray) -> PayloadExtents:
        """Where the payloads at ``positions`` lie (in that order), CRCs unchecked (the decoder that gets
        the bytes checks them); units not loaded yet are loaded in this reader's threads."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        order = np.argsort(positions, kind="stable")
        sorted_pos = positions[order]
        runs = group_runs(sorted_pos // self.unit)
        missing = [k for k in dict.fromkeys(k for k, _, _ in runs) if self._units.lookup(k) is None]
        self.parallel(self.payload_unit, missing, len(missing) << 22)
        n = len(positions)
        out = PayloadExtents([], [], *(np.empty(n, np.int64) for _ in range(4)), np.empty((n, 3), np.int64))
        for k, a, b in runs:
            unit = self.payload_unit(k)
            local = sorted_pos[a:b] - k * self.unit
            dst = order[a:b]
            out.buffer[dst] = len(out.buffers)
            out.buffers.append(memoryview(unit.data).cast("B"))
            out.sources.append(unit.file_source())
            out.starts[dst] = unit.offsets[local]
            out.ends[dst] = unit.offsets[local + 1] if unit.ends is None else unit.ends[local]
            out.crc[dst] = unit.crc[local]
            out.shapes[dst] = unit.shapes[local]
        return out

    def decode(self, payload: Any, shape: Any, position: int) -> np.ndarray:
        """CPU decode of one payload; a failure names the image and its chunk."""
        out = np.empty(tuple(int(s) for s in shape), np.uint8)
        self.decode_into(payload, out, position)
        return out

    def decode_into(self, payload: Any, out: np.ndarray, position: int) -> None:
        try:
            self.image_codec.decode_into(payload, out.shape, out)  # type: ignore[arg-type]
        except PayloadError as e:
            k = position // self.unit
            raise corrupt_at(
                position,
                f"{self.unit_path(k)}: the image at storage position {position} (chunk {k}) does not "
                f"decode: {e}; rebuild the cache",
            ) from None

    def read_images(self, positions: np.ndarray) -> list[np.ndarray]:
        """(H, W, C) uint8 images at ``positions``, decoded in this reader's threads."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        payloads, shapes = self.read_payloads(positions)
        outs = [np.empty(s, np.uint8) for s in map(tuple, shapes.tolist())]
        self._decode_all(payloads, outs, positions)
        return outs

    def read_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """Fixed-size caches only (the Cache refuses ragged ones): each image decoded into its row."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        payloads, shapes = self.read_payloads(positions)
        bad = np.flatnonzero(np.any(shapes != np.asarray(out.shape[1:]), axis=1))
        if len(bad):
            raise CacheCorruptError(
                f"{self.root}: image at storage position {int(positions[bad[0]])} has shape "
                f"{tuple(shapes[bad[0]].tolist())} in a {out.shape[1:]} cache; rebuild the cache"
            )
        self._decode_all(payloads, list(out), positions)

    def _decode_all(self, payloads: list[memoryview], outs: list[np.ndarray], positions: np.ndarray) -> None:
        """Decode into ``outs``; with threads, each thread takes one contiguous slice of the batch (one
        pool task per thread, not per image: the per-task hand-over needs the GIL, the decode does not)."""
        n = len(outs)
        todo = list(zip(payloads, outs, positions.tolist()))
        if n > 1 and self.threads > 1 and self.image_codec.lossy:
            parts = min(self.threads, n)
            bounds = [n * i // parts for i in range(parts + 1)]

            def work(i: int) -> None:
                for payload, out, p in todo[bounds[i] : bounds[i + 1]]:
                    self.decode_into(payload, out, p)

            list(self._thread_pool().map(work, range(parts)))
            return
        for payload, out, p in todo:
            self.decode_into(payload, out, p)
