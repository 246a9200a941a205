"""``npz``: shards of many images, ``np.savez`` (codec ``none``) or ``np.savez_compressed`` (``deflate``)."""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.durable import write_bytes_durably
from dlstore.errors import CacheCorruptError
from dlstore.formats.base import CacheWriter, ChunkedReader, clamp_units
from dlstore.formats.codecs import quality_option
from dlstore.formats.describe import Codec, CodecTable
from dlstore.formats.npy_headers import NPY_HEADERS
from dlstore.formats.payload import Images, PayloadReader, PayloadUnit, PayloadWriter, payload_bound

SHARD_DIR = "shards"


def shard_name(k: int) -> str:
    return f"{SHARD_DIR}/shard-{k:06d}.npz"


class NpzWriter(CacheWriter):
    """One unit = one shard of about 32 MB of pixels, written to a temp name and renamed."""

    units_are_own_files = True
    name = "npz"
    extra_options = (quality_option(),)
    codecs: ClassVar[CodecTable] = CodecTable(
        "none",
        Codec("none", "stored: shards are memory-mapped, no decode", 1.0, np.savez),
        Codec("deflate", "zip deflate (np.savez_compressed), decoded in threads", 0.8, np.savez_compressed),
    )

    def field_compression(self) -> Any:
        return self.options["codec"] == "deflate"  # masks deflated when the pixels are

    def recorded_options(self) -> dict[str, Any]:
        # --quality belongs to --codec jpeg, which the payload writer handles; pixels have none
        return {k: v for k, v in super().recorded_options().items() if k != "quality"}

    @staticmethod
    def choose_unit_size(image_bytes: int) -> int:
        return clamp_units(32 << 20, image_bytes, 16, 4096)

    def create(self) -> None:
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    def write_unit(self, k: int, images: np.ndarray) -> None:
        buf = io.BytesIO()
        self.codecs[self.options["codec"]].impl(buf, images=np.ascontiguousarray(images, dtype=np.uint8))
        write_bytes_durably(self.root / shard_name(k), buf.getbuffer())


class NpzReader(ChunkedReader):
    """A stored (uncompressed) shard is memory-mapped in place inside its zip, so reading it costs no
    decode at all; a deflated shard is decoded once (in a thread) and the most recent ones are kept."""

    def __init__(self, root: Path, spec: Any, in_memory: bool = False, cache_bytes: int = 512 << 20) -> None:
        super().__init__(
            root, spec, in_memory, unit=int(spec.format_options["unit_size"]), cache_bytes=cache_bytes
        )

    @classmethod
    def unit_file(cls, k: int) -> str:
        return shard_name(k)

    def load_unit(self, k: int) -> np.ndarray:
        path = self.root / shard_name(k)
        count = min(self.unit, self.spec.n_stored - k * self.unit)
        expected = (count, *self.spec.shape)
        with shard_errors(path, k, self.root):
            arr = map_stored_member(path, "images.npy")
            if arr is None:
                with zipfile.ZipFile(path) as zf:
                    arr = read_member(zf, "images.npy", int(np.prod(expected)), expected)
        if arr.shape != expected or arr.dtype != np.uint8:
            raise CacheCorruptError(
                f"{path}: holds {arr.dtype}{arr.shape}, expected uint8{expected}; rebuild"
            )
        return arr


@contextmanager
def shard_errors(path: Path, k: int, root: Path) -> Iterator[None]:
    """Reading shard ``k``: a missing or unreadable file becomes a CacheCorruptError naming it and the fix."""
    try:
        yield
    except FileNotFoundError:
        raise CacheCorruptError(
            f"{path}: shard {k} missing; run `dlstore verify {root}` and rebuild"
        ) from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, struct.error) as e:
        raise CacheCorruptError(
            f"{path}: shard {k} unreadable ({type(e).__name__}: {e}); rebuild the cache"
        ) from None


def read_member(
    zf: zipfile.ZipFile, member: str, limit: int, expected: tuple[int, ...] | None = None
) -> np.ndarray:
    """A .npy member of a zip, its header read first: one declaring Fortran order, objects, more than
    ``limit`` bytes or (when given) another shape than uint8 ``expected`` allocates nothing, and the
    stream must decode to exactly what the header declares, never more (a deflated member may inflate
    ~1000x)."""
    with zf.open(member) as f:
        shape, fortran, dtype = npy_header(f)
        size = float(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        wrong = expected is not None and (tuple(shape) != tuple(expected) or dtype != np.uint8)
        if wrong or fortran or dtype.hasobject or size > limit:
            want = f"uint8{tuple(expected)}" if expected is not None else f"at most {limit} bytes"
            raise ValueError(f"{member} declares {dtype}{tuple(shape)}, expected {want}")
        out = np.empty(shape, dtype)
        view = memoryview(out).cast("B")
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{member}: {got} of {len(view)} bytes")
            got += n
        if f.read(1):
            raise ValueError(f"{member}: more data than its header declares")
    return out


def npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) from a .npy stream, read up to its data."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    with NPY_HEADERS:
        return read(f)


def map_stored_member(path: Path, member: str) -> np.ndarray | None:
    """Memory-map a .npy stored uncompressed inside a zip; None if it is compressed."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"no local header for {member}")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        shape, fortran, dtype = npy_header(f)
        offset = f.tell()
    if (
        fortran
        or dtype != np.uint8
        or offset - info.header_offset > info.file_size + 30 + name_len + extra_len
    ):
        raise ValueError(f"{member} is not a C-ordered uint8 array")
    if info.file_size != offset - (info.header_offset + 30 + name_len + extra_len) + int(np.prod(shape)):
        raise ValueError(f"{member}: zip entry size {info.file_size} does not match the array {shape}")
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)


class NpzPayloadWriter(PayloadWriter):
    """Payload layout: a shard holds ``data`` (the payloads back to back), ``offsets``, ``shapes``,
    ``crc`` and ``error`` (the sampled encode error); stored, or deflated with ``compress``."""

    name = "npz"
    codecs = NpzWriter.codecs
    extra_options = NpzWriter.extra_options
    target_unit_bytes = 8 << 20  # JPEG shards of ~500 images at 256 px: enough units to convert in parallel

    def create(self) -> None:
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    def write_unit(self, k: int, images: Images) -> None:
        unit = self.encode_unit(images)
        buf = io.BytesIO()
        save = self.codec.impl if self.unit_compressed and self.codec is not None else np.savez
        save(buf, data=unit.data, offsets=unit.offsets, shapes=unit.shapes, crc=unit.crc, error=unit.error)
        write_bytes_durably(self.root / shard_name(k), buf.getbuffer())

    def finish(self, labels: np.ndarray) -> None:
        errors = []
        for k in range(self.n_units):
            path = self.root / shard_name(k)
            with np.load(path, allow_pickle=False) as z:
                errors.append(z["error"])
        self.options["mean_abs_error"] = self.mean_error(errors)


class NpzPayloadReader(PayloadReader):
    """The ``data`` member of a stored shard is memory-mapped; the small index members are loaded. The
    mapped pages are the OS page cache's, not this process's, so keeping many shards open is cheap:
    64, like zarr's chunks, where 8 made every shuffled batch of a small JPEG cache (20 shards of
    ~4 MB) reload every shard in each DataLoader worker."""

    def __init__(self, root: Path, spec: Any, in_memory: bool = False) -> None:
        super().__init__(root, spec, in_memory, unit=int(spec.format_options["unit_size"]), max_units=64)

    @classmethod
    def unit_file(cls, k: int) -> str:
        return shard_name(k)

    def load_payload_unit(self, k: int) -> PayloadUnit:
        path = self.unit_path(k)
        count = min(self.unit, self.spec.n_stored - k * self.unit)
        with shard_errors(path, k, self.root), zipfile.ZipFile(path) as zf:
            small = 24 * (self.unit + 1)  # the index: (n + 1) offsets, n shapes of 3, n CRCs, 2 errors
            index = {m: read_member(zf, f"{m}.npy", small) for m in ("offsets", "shapes", "crc", "error")}
            data = map_stored_member(path, "data.npy")
            if data is None:  # deflated raw pixels: at most the indexed images' pixels
                data = read_member(zf, "data.npy", payload_bound(index["shapes"][:count], self.decode_limit))
            return PayloadUnit(data, **index)
