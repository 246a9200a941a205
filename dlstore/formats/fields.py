"""Named per-sample fields beside the images (``CacheSpec.fields``), in the layout a format picks
(``CacheWriter.field_layout``); a class field is the cache's ``labels``, nothing stored here.

* ``arrays`` (ram): each fixed-shape field one memory-mapped ``fields/NAME.npy`` (n, ...); variable-length
  fields in unit files as below.
* ``files`` (npz): one ``fields/unit-KKKKKK.npz`` per image unit: a fixed-shape field as one (unit, ...)
  member ``NAME``; a variable-length one (boxes, ragged, json; masks of a ragged cache) as
  ``NAME.values`` (rows back to back), ``NAME.offsets`` (unit + 1) and ``NAME.shapes`` (ragged masks'
  (h, w)); deflated when the images are.
* ``zarr``: plain zarr v3: a fixed-shape field is the array ``fields/NAME`` chunked like the images; a
  variable-length one the group ``fields/NAME`` (``values``, ``offsets``, ``shapes``), gathered at
  ``finish`` from the workers' unit files (``fields/parts/``).
"""

from __future__ import annotations

import io
import shutil
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.durable import fsync_path, write_bytes_durably
from dlstore.errors import CacheCorruptError
from dlstore.formats.npy_headers import NPY_HEADERS
from dlstore.formats.zarr_shards import decompress_within, load_array_meta
from dlstore.spec import CacheSpec, FieldSpec

FIELDS_DIR = "fields"
PARTS_DIR = "fields/parts"

# One sample's value of each stored field, as the conversion hands it over.
Row = np.ndarray
Rows = dict[str, list[Row]]


def stored(fields: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The fields with bytes of their own (a class field is the labels)."""
    return {k: f for k, f in fields.items() if f.kind != "class"}


def is_variable(f: FieldSpec, ragged_images: bool) -> bool:
    """Stored as values + offsets: rows per sample vary (boxes, JSON), or masks of differing sizes."""
    return f.ragged or (f.kind == "mask" and ragged_images)


def unit_file(k: int, parts: bool = False) -> str:
    return f"{PARTS_DIR if parts else FIELDS_DIR}/unit-{k:06d}.npz"


def pack_unit(
    fields: dict[str, FieldSpec], rows: Rows, shape: tuple[int, ...], ragged: bool
) -> dict[str, np.ndarray]:
    """One unit's rows → the npz members described above. ``shape``: the image (H, W) of a fixed-size
    cache (a mask's shape)."""
    out: dict[str, np.ndarray] = {}
    for name, f in stored(fields).items():
        values = [np.asarray(v, dtype=f.dtype) for v in rows[name]]
        if not is_variable(f, ragged):
            want = shape if f.kind == "mask" else f.shape
            out[name] = (
                np.stack(values).reshape(len(values), *want) if values else np.zeros((0, *want), f.dtype)
            )
            continue
        if f.kind == "mask":
            out[f"{name}.shapes"] = np.asarray([v.shape for v in values], np.int64).reshape(-1, 2)
            values = [v.reshape(-1) for v in values]
        else:
            values = [v.reshape(-1, *f.row_shape) for v in values]
        lengths = np.asarray([len(v) for v in values], np.int64)
        out[f"{name}.offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        row = () if f.kind == "mask" else f.row_shape
        out[f"{name}.values"] = np.concatenate(values) if values else np.zeros((0, *row), f.dtype)
    return out


def save_npz(path: Path, members: dict[str, np.ndarray], compress: bool) -> None:
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **members)
    write_bytes_durably(path, buf.getbuffer())


def load_npz(path: Path, what: str) -> dict[str, np.ndarray]:
    try:
        with NPY_HEADERS, np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CacheCorruptError(
            f"{path}: {what} missing; run `dlstore verify` and rebuild the cache"
        ) from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise CacheCorruptError(
            f"{path}: {what} unreadable ({type(e).__name__}: {e}); rebuild the cache"
        ) from None


def unpack(f: FieldSpec, name: str, members: dict[str, np.ndarray], rows: np.ndarray, ragged: bool) -> Any:
    """Rows ``rows`` (indices into the members' samples) of one field: an array, or a list per sample."""
    if not is_variable(f, ragged):
        return members[name][rows]
    values, offsets = members[f"{name}.values"], members[f"{name}.offsets"]
    shapes = members.get(f"{name}.shapes")
    out = []
    for r in rows.tolist():
        v = values[offsets[r] : offsets[r + 1]]
        out.append(v.reshape(shapes[r]) if shapes is not None else v)
    return out


class FieldWriter:
    """Writes a cache's fields unit by unit (in any worker) and finishes them (main process)."""

    def __init__(
        self,
        root: Path,
        fields: dict[str, FieldSpec],
        n: int,
        unit_size: int,
        image_shape: tuple[int, ...],
        ragged: bool,
        compress: bool,
    ) -> None:
        self.root, self.fields, self.n, self.unit_size = Path(root), fields, n, unit_size
        self.image_shape, self.ragged, self.compress = tuple(image_shape[:2]), ragged, compress

    @property
    def n_units(self) -> int:
        return -(-self.n // self.unit_size)

    def create(self) -> None:
        (self.root / FIELDS_DIR).mkdir(parents=True, exist_ok=True)

    def write_unit(self, k: int, rows: Rows, dropped: dict[str, int]) -> None:
        members = pack_unit(self.fields, rows, self.image_shape, self.ragged)
        members.update({f"{name}.dropped": np.int64(c) for name, c in dropped.items()})
        save_npz(self.root / unit_file(k), members, self.compress)

    def dropped(self, folder: str = FIELDS_DIR) -> dict[str, int]:
        """Boxes dropped per boxes field, summed over the units."""
        total = {name: 0 for name, f in self.fields.items() if f.kind == "boxes"}
        for k in range(self.n_units):
            path = self.root / folder / f"unit-{k:06d}.npz"
            with np.load(path, allow_pickle=False) as z:
                for name in total:
                    total[name] += int(z[f"{name}.dropped"]) if f"{name}.dropped" in z.files else 0
        return total

    def finish(self) -> dict[str, int]:
        """Main process, after every unit: anything global; returns the boxes dropped per field."""
        return self.dropped()


class ArrayFieldWriter(FieldWriter):
    """ram: each fixed-shape field one ``fields/NAME.npy`` (n, ...) like ``images.npy``, memory-mapped
    by readers (random rows, pages shared by every process); workers write their unit's rows in place.
    Variable-length fields go to the unit files as in ``files``."""

    def create(self) -> None:
        super().create()
        for name, f in self.fixed().items():
            shape = (self.n, *(self.image_shape if f.kind == "mask" else f.shape))
            np.lib.format.open_memmap(
                self.root / array_file(name), mode="w+", dtype=f.dtype, shape=shape
            ).flush()

    def fixed(self) -> dict[str, FieldSpec]:
        return {k: f for k, f in stored(self.fields).items() if not is_variable(f, self.ragged)}

    def write_unit(self, k: int, rows: Rows, dropped: dict[str, int]) -> None:
        fixed = self.fixed()
        members = pack_unit(self.fields, rows, self.image_shape, self.ragged)
        start = k * self.unit_size
        for name in fixed:
            path = self.root / array_file(name)
            mm = np.load(path, mmap_mode="r+", allow_pickle=False)
            mm[start : start + len(members[name])] = members[name]
            mm.flush()  # msync: durable before the journal records the unit
            del mm
        rest = {m: v for m, v in members.items() if m.split(".")[0] not in fixed}
        rest.update({f"{name}.dropped": np.int64(c) for name, c in dropped.items()})
        save_npz(self.root / unit_file(k), rest, self.compress)


def array_file(name: str) -> str:
    return f"{FIELDS_DIR}/{name}.npy"


class ZarrFieldWriter(FieldWriter):
    """Fixed-shape fields straight into zarr arrays unit by unit; variable-length ones through unit
    files (``fields/parts``) gathered into one zarr group per field at ``finish``."""

    def create(self) -> None:
        import zarr

        (self.root / PARTS_DIR).mkdir(parents=True, exist_ok=True)
        group = zarr.open_group(self.root, mode="a", zarr_format=3).require_group(FIELDS_DIR)
        for name, f in stored(self.fields).items():
            if is_variable(f, self.ragged):
                continue
            shape = self.image_shape if f.kind == "mask" else f.shape
            group.create_array(
                name,
                shape=(self.n, *shape),
                chunks=(self.unit_size, *shape),
                dtype=f.dtype,
                compressors=self.compress or None,  # the image codec's
                fill_value=0,
                overwrite=True,
                config={"write_empty_chunks": True},  # a missing chunk means damage, not zeros
                dimension_names=(
                    "sample",
                    *(("y", "x") if f.kind == "mask" else [f"{name}_{i}" for i in range(len(shape))]),
                ),
            )

    def write_unit(self, k: int, rows: Rows, dropped: dict[str, int]) -> None:
        import zarr

        members = pack_unit(self.fields, rows, self.image_shape, self.ragged)
        start = k * self.unit_size
        parts = {f"{name}.dropped": np.int64(c) for name, c in dropped.items()}
        for name, f in stored(self.fields).items():
            if is_variable(f, self.ragged):
                parts.update({m: v for m, v in members.items() if m.startswith(f"{name}.")})
                continue
            arr = zarr.open_array(self.root / FIELDS_DIR / name, mode="r+", zarr_format=3)
            arr[start : start + len(members[name])] = members[name]
            fsync_path(zarr_chunk(self.root / FIELDS_DIR / name, k, arr.ndim))
        save_npz(self.root / unit_file(k, parts=True), parts, compress=False)

    def finish(self) -> dict[str, int]:
        import zarr

        group = zarr.open_group(self.root / FIELDS_DIR, mode="a", zarr_format=3)
        units = [load_npz(self.root / unit_file(k, parts=True), "field unit") for k in range(self.n_units)]
        for name, f in stored(self.fields).items():
            if not is_variable(f, self.ragged):
                continue
            sub = group.require_group(name)
            for member, array in gather_variable(name, units).items():
                sub.create_array(
                    member,
                    shape=array.shape,
                    chunks=tuple(max(1, d) for d in array.shape),
                    dtype=array.dtype,
                    compressors=None,
                    fill_value=0,
                    overwrite=True,
                    config={"write_empty_chunks": True},
                )[...] = array
        dropped = self.dropped(PARTS_DIR)
        shutil.rmtree(self.root / PARTS_DIR)
        return dropped


def gather_variable(name: str, units: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The per-unit members of one variable-length field → whole-cache values, offsets (n + 1), shapes."""
    values = np.concatenate([u[f"{name}.values"] for u in units])
    lengths = np.concatenate([np.diff(u[f"{name}.offsets"]) for u in units])
    out = {"values": values, "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    if f"{name}.shapes" in units[0]:
        out["shapes"] = np.concatenate([u[f"{name}.shapes"] for u in units])
    return out


def zarr_chunk(array_dir: Path, k: int, ndim: int) -> Path:
    """Chunk k (along the sample axis; one chunk across the others) of a zarr v3 array."""
    return array_dir.joinpath("c", str(k), *(["0"] * (ndim - 1)))


class FieldReader:
    """Reads fields by storage position: the unit files, the most recent ones kept decoded."""

    masks_in_unit_files = True  # (ArrayFieldReader maps them instead)

    def __init__(self, root: Path, spec: CacheSpec, unit_size: int, cache_bytes: int = 256 << 20) -> None:
        self.root, self.spec, self.unit = Path(root), spec, max(1, unit_size)
        self.fields = stored(spec.fields)
        self.ragged = spec.ragged
        # Masks in the unit files make a unit as large as its images' pixels; boxes, labels and records
        # are a few KB: then every unit of any practical cache stays decoded (a bound of 256 MB
        # estimated at 16 KB per unit; a smaller one made random batches reload unit files).
        masks_in_units = any(f.kind == "mask" for f in self.fields.values()) and self.masks_in_unit_files
        per_unit = self.unit * spec.shape[0] * spec.shape[1] * 2 if masks_in_units else 16 << 10
        self.max_units = max(2, cache_bytes // max(1, per_unit))
        self._units: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    def parallel(self, fn: Any, items: list[Any], nbytes: int) -> None:
        """Run ``fn`` over ``items`` (the format reader hands its threads in: ``read_fields``)."""
        for item in items:
            fn(item)

    def read(
        self,
        positions: np.ndarray,
        fields: dict[str, FieldSpec] | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """name → (B, ...) array for a fixed-shape field, a list of B arrays otherwise (of ``fields``,
        default all). ``out``: arrays some fixed-shape fields may be gathered into (else copied)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        units = positions // self.unit
        out: dict[str, Any] = {}
        for name, f in (self.fields if fields is None else fields).items():
            variable = is_variable(f, self.ragged)
            parts = [
                self._rows(name, f, int(k), positions[units == k] - k * self.unit) for k in np.unique(units)
            ]
            order = np.argsort(np.argsort(units, kind="stable"), kind="stable")
            if variable:
                flat = [row for part in parts for row in part]
                out[name] = [flat[i] for i in order.tolist()]
            else:
                out[name] = np.concatenate(parts)[order] if parts else np.zeros((0,), f.dtype)
        return out

    def _rows(self, name: str, f: FieldSpec, k: int, rows: np.ndarray) -> Any:
        return unpack(f, name, self.unit_members(k), rows, self.ragged)

    def unit_members(self, k: int) -> dict[str, np.ndarray]:
        members = self._units.get(k)
        if members is None:
            members = load_npz(self.root / unit_file(k), f"field unit {k}")
            self._units[k] = members
            while len(self._units) > self.max_units:
                self._units.popitem(last=False)
        else:
            self._units.move_to_end(k)
        return members


class ArrayFieldReader(FieldReader):
    """ram: fixed-shape fields memory-mapped whole (``ArrayFieldWriter``); the rest from unit files."""

    masks_in_unit_files = False

    def __init__(self, root: Path, spec: CacheSpec, unit_size: int, cache_bytes: int = 256 << 20) -> None:
        super().__init__(root, spec, unit_size, cache_bytes)
        self._arrays: dict[str, np.ndarray] = {}

    def read(
        self,
        positions: np.ndarray,
        fields: dict[str, FieldSpec] | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """Fixed-shape fields: a row gather from the mapped array, in the reader's threads, straight
        into ``out[name]`` when given (a loader's pinned buffer); the rest per unit file."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        chosen = self.fields if fields is None else fields
        rest = {k: f for k, f in chosen.items() if is_variable(f, self.ragged)}
        got = super().read(positions, rest) if rest else {}
        for name, f in chosen.items():
            if name not in rest:
                arr = self._arrays.get(name)
                if arr is None:
                    arr = self._arrays[name] = load_array(self.root / array_file(name), f, self.spec)
                dest = (out or {}).get(name)
                if dest is None:
                    dest = np.empty((len(positions), *arr.shape[1:]), arr.dtype)
                got[name] = gather_rows(arr, positions, dest, self.parallel)
        return got


def gather_rows(arr: np.ndarray, positions: np.ndarray, dest: np.ndarray, parallel: Any) -> np.ndarray:
    """``dest[:] = arr[positions]`` in slices over ``parallel``'s threads. ``mode="clip"``: positions are
    checked by the Cache, and the default "raise" makes numpy buffer ``dest`` (a second copy)."""
    step = max(1, -(-len(positions) // 8))
    parts = [slice(i, i + step) for i in range(0, len(positions), step)]

    def take(part: slice) -> None:
        np.take(arr, positions[part], axis=0, out=dest[part], mode="clip")

    parallel(take, parts, dest.nbytes)
    return dest


def load_array(path: Path, f: FieldSpec, spec: CacheSpec) -> np.ndarray:
    shape = (spec.n_stored, *(spec.shape[:2] if f.kind == "mask" else f.shape))
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: field array missing; run `dlstore verify` and rebuild") from None
    except ValueError as e:
        raise CacheCorruptError(f"{path}: unreadable or truncated ({e}); rebuild the cache") from None
    if arr.shape != shape or arr.dtype != np.dtype(f.dtype):
        raise CacheCorruptError(
            f"{path}: holds {arr.dtype}{arr.shape}, manifest says {f.dtype}{shape}; rebuild"
        )
    return arr


class ZarrFieldReader(FieldReader):
    """Reads the zarr arrays' chunk files directly (zarr's own machinery does not survive a fork into
    DataLoader workers), after checking each array's metadata; variable-length fields whole, at open."""

    masks_in_unit_files = True  # its chunks are kept like units

    def __init__(self, root: Path, spec: CacheSpec, unit_size: int, cache_bytes: int = 256 << 20) -> None:
        super().__init__(root, spec, unit_size, cache_bytes)
        self._whole: dict[str, dict[str, np.ndarray]] = {}

    def _rows(self, name: str, f: FieldSpec, k: int, rows: np.ndarray) -> Any:
        if is_variable(f, self.ragged):
            if name not in self._whole:
                self._whole[name] = {
                    f"{name}.{m}": read_whole_array(self.root / FIELDS_DIR / name / m)
                    for m in ("values", "offsets", "shapes")
                    if (self.root / FIELDS_DIR / name / m).is_dir()
                }
            return unpack(f, name, self._whole[name], rows + k * self.unit, self.ragged)
        key = hash((name, k))
        members = self._units.get(key)
        if members is None:
            members = {name: read_chunk(self.root / FIELDS_DIR / name, k, self.spec.n_stored, self.unit)}
            self._units[key] = members
            while len(self._units) > self.max_units:
                self._units.popitem(last=False)
        return members[name][rows]


def array_meta(array_dir: Path) -> dict[str, Any]:
    path = array_dir / "zarr.json"
    meta = load_array_meta(path)
    if (
        not isinstance(meta, dict)
        or meta.get("node_type") != "array"
        or meta.get("data_type") not in ("uint8", "uint16", "int32", "int64", "float32", "float64")
    ):
        raise CacheCorruptError(f"{path}: not a numeric zarr v3 array; rebuild the cache")
    return meta


def decode_chunk(array_dir: Path, k: int, meta: dict[str, Any]) -> np.ndarray:
    """Chunk k (sample axis) of a zarr v3 array as stored: the full chunk shape."""
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    path = zarr_chunk(array_dir, k, len(chunk))
    decode = chunk_decoder(array_dir / "zarr.json", meta.get("codecs"))
    try:
        raw: Any = path.read_bytes()
        dtype = np.dtype(meta["data_type"]).newbyteorder("<")
        if decode is not None:  # no more than the chunk its zarr.json declares
            raw = decompress_within(decode, raw, int(np.prod(chunk, dtype=np.float64)) * dtype.itemsize)
        arr = np.frombuffer(raw, dtype=dtype)
        return arr.reshape(chunk).astype(meta["data_type"], copy=False)
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: field chunk {k} missing; rebuild the cache") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CacheCorruptError(f"{path}: field chunk {k} does not decode ({e}); rebuild the cache") from None


def chunk_decoder(path: Path, codecs: Any) -> Any:
    """``bytes`` then at most one of zstd/blosc (the chain the field writer wrote); anything else
    (pickle, object codecs) is refused."""
    names = [c.get("name") if isinstance(c, dict) else c for c in codecs] if isinstance(codecs, list) else []
    if (
        not names
        or names[0] != "bytes"
        or len(names) > 2
        or (names[1:] and names[1] not in ("zstd", "blosc"))
    ):
        raise CacheCorruptError(f"{path}: codec chain {names} is not bytes + zstd/blosc; rebuild the cache")
    if len(names) == 1:
        return None
    if names[1] == "zstd":
        from numcodecs.zstd import Zstd

        return Zstd().decode
    from numcodecs.blosc import Blosc

    return Blosc().decode


def read_chunk(array_dir: Path, k: int, n: int, unit: int) -> np.ndarray:
    chunk = decode_chunk(array_dir, k, array_meta(array_dir))
    return chunk[: min(unit, n - k * unit)]


def read_whole_array(array_dir: Path) -> np.ndarray:
    meta = array_meta(array_dir)
    shape = meta["shape"]
    if 0 in shape:
        return np.zeros(shape, meta["data_type"])
    return decode_chunk(array_dir, 0, meta)[tuple(slice(0, d) for d in shape)]


FIELD_WRITERS: dict[str, type[FieldWriter]] = {
    "files": FieldWriter,
    "arrays": ArrayFieldWriter,
    "zarr": ZarrFieldWriter,
}
FIELD_READERS: dict[str, type[FieldReader]] = {
    "files": FieldReader,
    "arrays": ArrayFieldReader,
    "zarr": ZarrFieldReader,
}
