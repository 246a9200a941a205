"""``zarr``: the cache root is a zarr v3 group with ``images`` (N,H,W,C) uint8 and ``labels``.

Writing goes through zarr. Reading decodes chunk files directly with the codec zarr wrote
(numcodecs' zstd/blosc), after validating the array metadata against an allowlist: zarr's own
per-call machinery costs milliseconds per chunk, which dominates small random reads.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.durable import fsync_path
from dlstore.errors import CacheCorruptError, SpecError
from dlstore.formats.base import BufferPool, CacheWriter, ChunkedReader
from dlstore.formats.codecs import quality_option
from dlstore.formats.describe import Codec, CodecTable, Option
from dlstore.formats.payload import Images, PayloadReader, PayloadUnit, PayloadWriter, payload_bound
from dlstore.formats.zarr_shards import (
    ShardIndexes,
    Sharding,
    decompress_within,
    load_array_meta,
    parse_sharding,
)
from dlstore.spec import CacheSpec

_ALLOWED_COMPRESSORS = {"zstd", "blosc"}


@dataclass(frozen=True)
class Compressor:
    """A zarr ``--codec``'s ``impl``: called, the compressors the writer gives zarr; ``stored`` is the
    name zarr.json then lists after ``bytes`` (None: raw chunks). Readers decode with what the
    manifest's codec declares here and check that zarr.json agrees, so the manifest's one codec key
    is the one thing that decides how pixels are read."""

    stored: str | None
    make: Callable[[], list[Any]]

    def __call__(self) -> list[Any]:
        return self.make()


def _zstd() -> list[Any]:
    from zarr.codecs import ZstdCodec

    return [ZstdCodec(level=3)]


def _lz4() -> list[Any]:
    from zarr.codecs import BloscCodec

    return [BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle")]


def chunk_path(root: Path, k: int) -> Path:
    """Chunk k of ``images`` (default chunk key encoding, one chunk across the other axes)."""
    return Path(root) / "images" / "c" / str(k) / "0" / "0" / "0"


SHARD_OPTION = Option(
    "shard_mb",
    0,
    "zarr: pixels per shard object in MB (zarr v3 sharding codec: the ~1 MB chunks inside one object, "
    "read by byte range; for object stores, see docs/scale.md); 0 = one file per chunk.",
    kind=float,
    min=0,
    max=4096,
)


class ZarrWriter(CacheWriter):
    """One unit = one chunk of ≥ 1 MB, or with ``shard_mb`` one shard of whole chunks; units are whole,
    so parallel writers never share a file."""

    units_are_own_files = True
    name = "zarr"
    extra_options = (quality_option(), SHARD_OPTION)
    field_layout = "zarr"

    def field_compression(self) -> Any:
        return self.codecs[self.options["codec"]].impl()

    def __init__(self, root: Path, n: int, shape: tuple[int, int, int], options: dict[str, Any]) -> None:
        super().__init__(root, n, shape, options)
        self.chunk_size = self.unit_size  # images per chunk; a shard (the unit) holds whole chunks
        shard_bytes = int(float(self.options.get("shard_mb") or 0) * (1 << 20))
        if shard_bytes:
            chunks = max(1, shard_bytes // (self.chunk_size * self.image_bytes))
            self.unit_size = self.chunk_size * min(chunks, max(1, -(-n // self.chunk_size)))

    codecs: ClassVar[CodecTable] = CodecTable(
        "zstd",
        Codec("zstd", "zstd level 3", 0.8, Compressor("zstd", _zstd)),
        Codec("lz4", "blosc lz4, fastest decode", 0.8, Compressor("blosc", _lz4)),
        Codec("none", "raw chunks, memory-mapped on read", 1.0, Compressor(None, list)),
    )

    def recorded_options(self) -> dict[str, Any]:
        # --quality belongs to --codec jpeg, which the payload writer handles; pixels have none.
        # shard_mb 0 is left out so an unsharded cache's manifest is what it was before the option.
        out = {k: v for k, v in super().recorded_options().items() if k != "quality"}
        if not out.get("shard_mb"):
            out.pop("shard_mb", None)
        return out

    @staticmethod
    def choose_unit_size(image_bytes: int) -> int:
        return int(min(4096, max(1, math.ceil((1 << 20) / max(1, image_bytes)))))

    def create(self) -> None:
        import zarr

        group = zarr.open_group(self.root, mode="a", zarr_format=3)
        sharded = self.unit_size != self.chunk_size or bool(self.options.get("shard_mb"))
        group.create_array(
            "images",
            shape=(self.n, *self.shape),
            chunks=(self.chunk_size, *self.shape),
            shards=(self.unit_size, *self.shape) if sharded else None,
            dtype="uint8",
            compressors=self.codecs[self.options["codec"]].impl(),
            fill_value=0,
            overwrite=True,
            dimension_names=("sample", "y", "x", "channel"),
        )
        group.create_array(
            "labels",
            shape=(self.n,),
            chunks=(max(1, self.n),),
            dtype="int64",
            fill_value=-1,
            overwrite=True,
            dimension_names=("sample",),
        )

    def write_unit(self, k: int, images: np.ndarray) -> None:
        import zarr

        # A chunk of all-black images equals the fill value: zarr would skip writing it, and a missing
        # chunk means damage to the reader (and there is no file to fsync).
        with zarr.config.set({"array.write_empty_chunks": True}):
            arr = zarr.open_array(self.root / "images", mode="r+", zarr_format=3)
            r = self.unit_range(k)
            arr[r.start : r.stop] = images  # a whole shard: zarr writes its object once, index included
        fsync_path(chunk_path(self.root, k))  # zarr does not fsync; the contract says durable

    def finish(self, labels: np.ndarray) -> None:
        import zarr

        zarr.open_array(self.root / "labels", mode="r+", zarr_format=3)[:] = labels

    def describe(self, attributes: dict[str, Any], positions: np.ndarray) -> None:
        describe_group(self.root, attributes, positions)


def describe_group(root: Path, attributes: dict[str, Any], positions: np.ndarray) -> None:
    """A first-class zarr group: the spec in its attributes, ``positions`` beside ``images`` and
    ``labels``, every array with dimension names (xarray needs them), and consolidated metadata, so
    ``zarr.open_group(DEST)`` and ``xarray.open_zarr(DEST)`` list its members from ``zarr.json`` and
    never meet dlstore's own files (manifest, index arrays, source record)."""
    import zarr

    group = zarr.open_group(root, mode="r+", zarr_format=3)
    group.create_array(
        "positions",
        shape=positions.shape,
        chunks=(max(1, len(positions)),),
        dtype="int64",
        fill_value=-1,
        overwrite=True,
        dimension_names=("index",),  # dataset index → storage row; may be shorter than "sample"
    )[:] = positions
    group.attrs.update({"dlstore": attributes})
    with warnings.catch_warnings():
        # "not part of the v3 specification (yet)": zarr-python reads it by default, which is the point
        warnings.simplefilter("ignore", UserWarning)
        zarr.consolidate_metadata(root, zarr_format=3)


def manifest_compressor(spec: CacheSpec) -> str | None:
    """The compressor the manifest's codec (its one ``codec`` key) stores zarr chunks with; None for
    raw chunks and for image codecs, whose units zarr does not compress."""
    name = spec.codec or ZarrWriter.codecs.default
    try:
        impl = ZarrWriter.codecs[name].impl
    except KeyError:
        raise SpecError(
            f"the manifest's codec {name!r} is not a zarr codec ({', '.join(ZarrWriter.codecs.names())}); "
            "rebuild the cache with `dlstore convert SOURCE DEST --format zarr --overwrite`"
        ) from None
    return impl.stored if isinstance(impl, Compressor) else None


def parse_array_meta(
    path: Path, n: int, shape: tuple[int, int, int], stored: str | None
) -> tuple[int, Callable[[bytes], Any] | None, Sharding | None]:
    """Validate ``images/zarr.json`` before any chunk is decoded; return (chunk length, decoder,
    sharding). ``stored``: the compressor the manifest's codec declares. For a sharded array the
    grid's chunk is the shard (one file) and the chunk length is the inner chunk's."""
    meta, chunk = checked_meta(path, [n, *shape], "uint8")
    keys = meta.get("chunk_key_encoding", {})
    if keys.get("name") != "default" or keys.get("configuration", {}).get("separator", "/") != "/":
        raise SpecError(f"{path}: unsupported chunk key encoding {keys}")
    codecs = meta.get("codecs")
    if isinstance(codecs, list) and codecs and isinstance(codecs[0], dict):
        if codecs[0].get("name") == "sharding_indexed":
            if len(codecs) != 1:
                raise SpecError(f"{path}: codecs after sharding_indexed are not supported ({codecs[1:]})")
            sharding = parse_sharding(path, codecs[0], chunk, shape)
            return sharding.chunk, _decoder(path, sharding.codecs, stored), sharding
    return chunk, _decoder(path, codecs, stored), None


def checked_meta(path: Path, shape: list[int], dtype: str) -> tuple[dict[str, Any], int]:
    """``zarr.json`` of an array of ``shape`` and ``dtype`` (the manifest's), chunked along its first
    axis only (1 ≤ k ≤ 65536), without storage transformers; (the metadata, k)."""
    meta = load_array_meta(path)
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise SpecError(f"{path}: not zarr v3 array metadata")
    if meta.get("shape") != shape or meta.get("data_type") != dtype:
        raise SpecError(
            f"{path}: array is {meta.get('data_type')}{meta.get('shape')}, manifest says {dtype}{shape}"
        )
    grid = meta.get("chunk_grid", {})
    chunk = grid.get("configuration", {}).get("chunk_shape") if grid.get("name") == "regular" else None
    ok = isinstance(chunk, list) and len(chunk) == len(shape) and chunk[1:] == shape[1:]
    if not (ok and isinstance(chunk[0], int) and 1 <= chunk[0] <= 1 << 16):
        raise SpecError(
            f"{path}: chunk shape {chunk} not (k, {', '.join(map(str, shape[1:]))}) with 1 ≤ k ≤ 65536"
        )
    if meta.get("storage_transformers"):
        raise SpecError(f"{path}: storage transformers are not supported")
    return meta, chunk[0]


def _decoder(path: Path, codecs: Any, stored: str | None) -> Callable[[bytes], Any] | None:
    """The decoder for the manifest's compressor ``stored``, once zarr.json's chain is checked to be
    ``bytes`` then exactly that (at most one of zstd/blosc; pickle or object codecs are refused)."""
    if (
        not isinstance(codecs, list)
        or not codecs
        or not isinstance(codecs[0], dict)
        or codecs[0].get("name") != "bytes"
    ):
        raise SpecError(f"{path}: codec chain {codecs} must start with 'bytes'")
    rest = codecs[1:]
    if len(rest) > 1 or any(
        not isinstance(c, dict) or c.get("name") not in _ALLOWED_COMPRESSORS for c in rest
    ):
        names = [c.get("name") if isinstance(c, dict) else c for c in rest]
        raise SpecError(f"{path}: codec(s) {names} not allowed; only one of {sorted(_ALLOWED_COMPRESSORS)}")
    listed = rest[0]["name"] if rest else None
    if listed != stored:
        raise SpecError(
            f"{path}: zarr.json compresses chunks with {listed or 'nothing'}, the manifest's codec with "
            f"{stored or 'nothing'}; rebuild the cache with `dlstore convert SOURCE DEST --overwrite`"
        )
    if stored is None:
        return None  # raw chunks: memory-mapped instead of decoded (see ZarrReader.load_unit)
    if stored == "zstd":
        from numcodecs.zstd import Zstd

        from dlstore.formats.zstd_direct import direct_zstd_decoder

        direct = direct_zstd_decoder()  # one context per thread instead of one per chunk
        return direct.decode if direct is not None else Zstd().decode
    from numcodecs.blosc import Blosc

    return Blosc().decode


class ZarrReader(ChunkedReader):
    """Groups a batch by chunk, decodes each chunk once (in threads), keeps recent chunks decoded."""

    field_layout = "zarr"

    def __init__(self, root: Path, spec: Any, in_memory: bool = False, cache_bytes: int = 256 << 20) -> None:
        chunk, self.decode, self.sharding = parse_array_meta(
            Path(root) / "images" / "zarr.json", spec.n_stored, spec.shape, manifest_compressor(spec)
        )
        super().__init__(root, spec, in_memory, unit=chunk, cache_bytes=cache_bytes)
        self._indexes = ShardIndexes(self.sharding) if self.sharding is not None else None
        self._buffers = BufferPool((chunk, *spec.shape))
        self._scratch = threading.local()  # per-thread buffer for the compressed bytes
        # Decode a whole-file chunk from a read-only mapping: no copy out of the page cache (a quarter
        # of a chunk's decode time). Only in one-thread processes: every munmap interrupts other threads.
        self.map_chunks = False

    def recycle(self, evicted: list[np.ndarray]) -> None:
        self._buffers.give(evicted)

    @classmethod
    def unit_file(cls, k: int) -> str:
        """Chunk k's file, or shard k's (the manifest's ``unit_size`` is then the shard length)."""
        return chunk_path(Path(), k).as_posix()

    def files_for(self, positions: np.ndarray) -> list[str]:
        per_file = self.unit * (self.sharding.per_shard if self.sharding is not None else 1)
        return [self.unit_file(int(k)) for k in np.unique(np.asarray(positions) // per_file)]

    def load_unit(self, k: int) -> np.ndarray:
        if self.decode is None:
            path, offset, length = self._where(k)
            try:
                rows = self.unit if length is None else length // self.spec.image_bytes
                return np.memmap(path, np.uint8, "r", offset=offset, shape=(rows, *self.spec.shape))
            except FileNotFoundError:
                raise CacheCorruptError(
                    f"{path}: chunk {k} missing (zarr would read it as zeros); rebuild"
                ) from None
        out = self._buffers.take()
        self.decode_unit_into(k, out)
        return out

    def _where(self, k: int) -> tuple[Path, int, int | None]:
        """Chunk k's file; sharded: its shard file and the chunk's byte range (from the shard index)."""
        if self._indexes is None:
            return chunk_path(self.root, k), 0, None
        per_shard = self._indexes.sharding.per_shard
        path = chunk_path(self.root, k // per_shard)
        try:
            return (path, *self._indexes.chunk_range(path, k % per_shard))
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}: shard of chunk {k} missing; rebuild the cache") from None
        except OSError as e:
            raise CacheCorruptError(f"{path}: shard index unreadable ({e}); rebuild the cache") from None

    def decode_unit_into(self, k: int, out: np.ndarray) -> None:
        path, offset, length = self._where(k)
        try:
            if self.decode is None:
                out[...] = np.fromfile(path, np.uint8, count=out.size, offset=offset).reshape(out.shape)
                return
            if self.map_chunks and length is None:
                self._decode_mapped(path, out)
                return
            # decoding into a reused buffer must fill all of it
            decompress_within(self.decode, self._read_compressed(path, offset, length), out.nbytes, out)
        except CacheCorruptError:
            raise  # a damaged shard index already names its file
        except FileNotFoundError:
            raise CacheCorruptError(
                f"{path}: chunk {k} missing (zarr would read it as zeros); rebuild"
            ) from None
        except (OSError, RuntimeError, ValueError) as e:
            raise CacheCorruptError(f"{path}: chunk {k} does not decode ({e}); rebuild the cache") from None

    def _decode_mapped(self, path: Path, out: np.ndarray) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:  # MAP_POPULATE: the file's pages mapped in one call, not one fault per 4 KiB
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(fd, os.fstat(fd).st_size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        raw = memoryview(mapped)
        try:
            decompress_within(self.decode, raw, out.nbytes, out)
        finally:
            try:
                raw.release()
                mapped.close()
            except BufferError:  # a decoder still holds a view: the mapping goes with it
                pass

    def _read_compressed(self, path: Path, offset: int = 0, length: int | None = None) -> memoryview:
        """The chunk file's bytes (or ``length`` bytes at ``offset``: an inner chunk of a shard) in this
        thread's reused buffer. Three system calls, each one GIL release (``open()`` + ``fstat`` +
        ``readinto`` through a buffered file object take twice that, and every GIL hand-over counts
        when many threads read chunks)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None:  # a zstd/blosc chunk is at most a little larger than its decoded bytes
            buf = self._scratch.buf = bytearray(self.unit * self.spec.image_bytes + (1 << 16))
        fd = os.open(path, os.O_RDONLY)
        try:
            if length is not None:
                if length > len(buf):
                    buf = self._scratch.buf = bytearray(length)
                n = os.preadv(fd, [memoryview(buf)[:length]], offset)
                if n != length:
                    raise ValueError(f"inner chunk at byte {offset} cut off ({n} of {length} bytes)")
                return memoryview(buf)[:n]
            n = os.readv(fd, [buf])
            if n == len(buf):  # larger than any chunk we wrote: read the rest the slow way
                rest = os.read(fd, os.fstat(fd).st_size)
                buf = self._scratch.buf = bytearray(buf + rest)
                n = len(buf)
        finally:
            os.close(fd)
        return memoryview(buf)[:n]


# --- payload layout ---------------------------------------------------------------------------------
# ``images`` is a 1-D zarr array of variable-length bytes (one payload per image, chunk = unit, zstd /
# blosc on top for raw pixels); ``shapes`` (n, 3) int32, ``crc`` (n,) uint32 and ``error`` (units, 2)
# float64 are plain arrays chunked by unit, so parallel writers never share a chunk file. Any zarr
# reader opens it (``zarr.open_group(root)["images"][i]`` is image i's JPEG file).


def _quiet_vlen() -> Any:
    """zarr warns that variable-length bytes have no final v3 spec yet; we read the chunks ourselves."""
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


class ZarrPayloadWriter(PayloadWriter):
    name = "zarr"
    codecs = ZarrWriter.codecs
    extra_options = ZarrWriter.extra_options
    field_layout = "zarr"

    def field_compression(self) -> Any:
        return _zstd()  # masks beside JPEG or variable-size payloads: lossless zstd

    def __init__(self, root: Path, n: int, shape: tuple[int, int, int], options: dict[str, Any]) -> None:
        if options.get("shard_mb"):
            raise SpecError(
                "--shard-mb is for zarr pixel caches; a JPEG or variable-size (payload) zarr "
                "cache is not sharded: leave --shard-mb out, or use --format npz for large objects"
            )
        super().__init__(root, n, shape, {k: v for k, v in options.items() if k != "shard_mb"})

    def compressors(self) -> list[Any]:
        return self.codec.impl() if self.unit_compressed and self.codec is not None else []

    def create(self) -> None:
        import zarr
        from zarr.core.dtype import VariableLengthBytes

        group = zarr.open_group(self.root, mode="a", zarr_format=3)
        u, n = self.unit_size, self.n
        ctx = _quiet_vlen()
        try:
            group.create_array(
                "images",
                shape=(n,),
                chunks=(u,),
                dtype=VariableLengthBytes(),
                compressors=self.compressors(),
                overwrite=True,
                dimension_names=("sample",),
            )
        finally:
            ctx.__exit__(None, None, None)
        # Every index chunk is written, even all zeros: a missing one must mean damage, not "fill value".
        plain = {"compressors": None, "overwrite": True, "config": {"write_empty_chunks": True}}
        dims = {"shapes": ("sample", "hwc"), "crc": ("sample",), "error": ("unit", "mean_max")}
        group.create_array(
            "shapes", shape=(n, 3), chunks=(u, 3), dtype="int32", dimension_names=dims["shapes"], **plain
        )
        group.create_array(
            "crc", shape=(n,), chunks=(u,), dtype="uint32", dimension_names=dims["crc"], **plain
        )
        group.create_array(
            "error",
            shape=(self.n_units, 2),
            chunks=(1, 2),
            dtype="float64",
            dimension_names=dims["error"],
            **plain,
        )
        group.create_array(
            "labels",
            shape=(n,),
            chunks=(max(1, n),),
            dtype="int64",
            fill_value=-1,
            overwrite=True,
            dimension_names=("sample",),
        )

    def write_unit(self, k: int, images: Images) -> None:
        import zarr

        unit = self.encode_unit(images)
        r = self.unit_range(k)
        payloads = np.empty(len(unit), dtype=object)
        payloads[:] = [bytes(unit.payload(j)) for j in range(len(unit))]
        ctx = _quiet_vlen()
        try:
            zarr.open_array(self.root / "images", mode="r+", zarr_format=3)[r.start : r.stop] = payloads
        finally:
            ctx.__exit__(None, None, None)
        with zarr.config.set({"array.write_empty_chunks": True}):
            zarr.open_array(self.root / "shapes", mode="r+", zarr_format=3)[r.start : r.stop] = unit.shapes
            zarr.open_array(self.root / "crc", mode="r+", zarr_format=3)[r.start : r.stop] = unit.crc
            zarr.open_array(self.root / "error", mode="r+", zarr_format=3)[k] = unit.error
        for name in ("images/c", "crc/c"):  # zarr does not fsync; the journal may record durable units only
            fsync_path(self.root / name / str(k))
        fsync_path(self.root / "shapes" / "c" / str(k) / "0")
        fsync_path(self.root / "error" / "c" / str(k) / "0")

    def finish(self, labels: np.ndarray) -> None:
        import zarr

        zarr.open_array(self.root / "labels", mode="r+", zarr_format=3)[:] = labels
        errors = zarr.open_array(self.root / "error", mode="r", zarr_format=3)[:]
        self.options["mean_abs_error"] = self.mean_error(list(errors))

    def describe(self, attributes: dict[str, Any], positions: np.ndarray) -> None:
        ctx = _quiet_vlen()
        try:
            describe_group(self.root, attributes, positions)
        finally:
            ctx.__exit__(None, None, None)


class ZarrPayloadReader(PayloadReader):
    """Reads the chunk files directly after validating ``images/zarr.json`` (vlen-bytes, then at most
    one of zstd/blosc); the vlen chunk is (u32 count, then u32 length + bytes per item)."""

    field_layout = "zarr"

    def __init__(self, root: Path, spec: Any, in_memory: bool = False) -> None:
        unit, self.decompress = parse_payload_meta(
            Path(root) / "images" / "zarr.json", spec.n_stored, manifest_compressor(spec)
        )
        super().__init__(root, spec, in_memory, unit=unit, max_units=64)  # ~4 MB chunks: 256 MB

    @classmethod
    def unit_file(cls, k: int) -> str:
        return f"images/c/{k}"

    @classmethod
    def unit_and_index_files(cls, k: int) -> list[str]:
        """Every file a read of unit k opens: the payloads, then its shapes and CRCs."""
        return [cls.unit_file(k), f"shapes/c/{k}/0", f"crc/c/{k}"]

    @classmethod
    def unit_files(cls, spec: CacheSpec) -> list[str]:
        unit = int(spec.format_options["unit_size"])
        return [f for k in range(-(-spec.n_stored // unit)) for f in cls.unit_and_index_files(k)]

    def files_for(self, positions: np.ndarray) -> list[str]:
        units = np.unique(np.asarray(positions) // self.unit)
        return [f for k in units.tolist() for f in self.unit_and_index_files(k)]

    def load_payload_unit(self, k: int) -> PayloadUnit:
        path = self.unit_path(k)
        try:
            shapes = np.fromfile(self.root / "shapes" / "c" / str(k) / "0", "<i4").reshape(-1, 3)
            crc = np.fromfile(self.root / "crc" / "c" / str(k), "<u4")
            raw: Any = path.read_bytes()
            if self.decompress is not None:  # raw pixels: the indexed images, and a length per item
                count = min(self.unit, self.spec.n_stored - k * self.unit)  # a whole chunk past the end
                limit = payload_bound(shapes[:count], self.decode_limit) + 4 * (self.unit + 1)
                raw = decompress_within(self.decompress, raw, limit)
            data, offsets, ends = parse_vlen_chunk(memoryview(raw))
            shapes, crc = shapes[: len(ends)], crc[: len(ends)]
        except FileNotFoundError as e:
            raise CacheCorruptError(f"{e.filename}: chunk {k} missing; rebuild the cache") from None
        except (OSError, RuntimeError, ValueError) as e:
            raise CacheCorruptError(f"{path}: chunk {k} does not decode ({e}); rebuild the cache") from None
        source = (str(path), 0) if self.decompress is None else None  # the chunk file as stored
        return PayloadUnit(data, offsets, shapes, crc, np.zeros(2), ends, source=source)


def parse_vlen_chunk(buf: memoryview) -> tuple[memoryview, np.ndarray, np.ndarray]:
    """(the chunk bytes, item starts + the end of the last, item ends) of a zarr vlen-bytes chunk."""
    if len(buf) < 4:
        raise ValueError("vlen chunk shorter than its header")
    count = int.from_bytes(buf[:4], "little")
    starts = np.empty(count + 1, np.int64)
    ends = np.empty(count, np.int64)
    pos = 4
    for i in range(count):
        if pos + 4 > len(buf):
            raise ValueError(f"vlen chunk cut off at item {i} of {count}")
        size = int.from_bytes(buf[pos : pos + 4], "little")
        starts[i] = pos + 4
        pos += 4 + size
        ends[i] = pos
    if pos > len(buf):
        raise ValueError(f"vlen chunk declares {pos} bytes, holds {len(buf)}")
    starts[count] = pos
    return buf, starts, ends


def parse_payload_meta(path: Path, n: int, stored: str | None) -> tuple[int, Callable[[bytes], Any] | None]:
    """Validate the payload ``images`` array's metadata; return (chunk length, decompressor)."""
    meta, chunk = checked_meta(path, [n], "variable_length_bytes")
    codecs = meta.get("codecs")
    if not isinstance(codecs, list) or not codecs or codecs[0] != {"name": "vlen-bytes", "configuration": {}}:
        raise SpecError(f"{path}: codec chain {codecs} must start with 'vlen-bytes'")
    return chunk, _decoder(path, [{"name": "bytes"}, *codecs[1:]], stored)
