"""Parquet as Hugging Face publishes it: a file, a folder of them or a glob. The image column is found
by type (HF's ``Image`` struct or binary); classes are HF's ``ClassLabel`` names or the values; a row
without a valid label goes to ``skipped.json``. Listing reads footers and the label column into
arrays; with a shuffled order ``stage`` spools each unit's bytes once. Fingerprint: footers, sizes,
mtimes."""

from __future__ import annotations

import glob as globmod
import hashlib
import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import ImageDecodeError, SourceError
from dlstore.write.sources.encoded import (
    EncodedSource,
    IndexedNames,
    labels_from_values,
    stop_if_strict,
    unreadable,
)
from dlstore.write.sources.fieldmap import declare, requests_of
from dlstore.write.sources.registry import SourceArgs, register_source

DEFAULT_LABEL = "label"
CACHE_BYTES = 64 << 20  # row groups' image columns kept per process (bounded: conversion memory stays flat)
GLOB_CHARS = "*?["


def import_pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise SourceError("reading parquet needs pyarrow: pip install 'dlstore[parquet]'") from e
    return pq


def parquet_files(text: str) -> tuple[Path, list[Path]]:
    """(the folder names are relative to, the files) for a file, a folder of them or a glob."""
    if "://" in text:
        raise SourceError(
            f"{text}: parquet sources are read from local files (or a mounted bucket); copy the files "
            "to a local folder, or give WebDataset shards for an object store"
        )
    if any(c in text for c in GLOB_CHARS):
        files = sorted(Path(p) for p in globmod.glob(text, recursive=True) if p.endswith(".parquet"))
        base = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path(".")
    elif Path(text).is_dir():
        base = Path(text)
        files = sorted(base.glob("*.parquet"))
    else:
        base, files = Path(text).parent, [Path(text)]
    if not files:
        raise SourceError(
            f"{text}: no .parquet files found; give a .parquet file, a folder of them or a glob"
        )
    return base, files


def footer_digest(path: Path) -> tuple[int, int, str]:
    """(size, mtime_ns, sha256 of the file's metadata block): parquet's footer, read from its end."""
    st = path.stat()
    with open(path, "rb") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        if tail[4:] != b"PAR1":
            raise SourceError(f"{path}: not a parquet file (no PAR1 at its end); give .parquet files")
        length = int.from_bytes(tail[:4], "little")
        f.seek(-8 - length, os.SEEK_END)
        return st.st_size, st.st_mtime_ns, hashlib.sha256(f.read(length)).hexdigest()


def fill_nulls(col: Any) -> Any:
    """A label column's nulls filled (-1, or "" for strings), so ints stay ints in numpy."""
    import pyarrow as pa

    if col.null_count == 0:
        return col
    if pa.types.is_integer(col.type):
        return col.fill_null(pa.scalar(-1, col.type))
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.fill_null("")
    return col


def hf_features(schema: Any) -> dict[str, Any]:
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return {}
    try:
        return dict(json.loads(meta).get("info", {}).get("features", {}))
    except (ValueError, AttributeError):
        return {}


def image_column(schema: Any, features: dict[str, Any], where: str) -> tuple[str, bool]:
    """(column, is HF's struct) of the image column, by type."""
    import pyarrow as pa

    def kind(t: Any) -> str:
        if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
            return (
                "struct"
                if pa.types.is_binary(t.field("bytes").type)
                or pa.types.is_large_binary(t.field("bytes").type)
                else ""
            )
        return "binary" if pa.types.is_binary(t) or pa.types.is_large_binary(t) else ""

    found = [(f.name, kind(f.type)) for f in schema if kind(f.type)]
    declared = [n for n, _ in found if features.get(n, {}).get("_type") == "Image"]
    if declared:
        name = declared[0]
        return name, dict(found)[name] == "struct"
    if not found:
        cols = ", ".join(f"{f.name} ({f.type})" for f in schema)
        raise SourceError(
            f"{where}: no image column: expected a struct<bytes: binary, path: string> (Hugging Face's "
            f"Image feature) or a binary column; found {cols}"
        )
    return found[0][0], found[0][1] == "struct"


@dataclass
class _Scan:
    """What listing the files gathers: footers, row groups, the label column (and --field columns)."""

    label: str
    keys: list[str]  # --field columns
    unlabelled: bool = False
    footers: list[list[Any]] = field(default_factory=list)
    rg_file: list[int] = field(default_factory=list)
    rg_local: list[int] = field(default_factory=list)
    rg_rows: list[int] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    valid: list[np.ndarray] = field(default_factory=list)
    classes: tuple[str, ...] | None = None
    image_col: str = ""
    hf_struct: bool = True
    data_bytes: int = 0
    images: set[str] = field(default_factory=set)  # image-like --field columns: read by row group
    field_values: dict[str, list[Any]] = field(default_factory=dict)
    file_start: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    def read_file(self, k: int, path: Path, rel: str) -> None:
        self.footers.append([rel, *footer_digest(path)])
        pf = import_pyarrow().ParquetFile(path)
        schema = pf.schema_arrow
        if k == 0:
            features = hf_features(schema)
            self.image_col, self.hf_struct = image_column(schema, features, str(path))
            declared = features.get(self.label, {})
            self.classes = tuple(declared.get("names")) if declared.get("_type") == "ClassLabel" else None
        for key in self.keys:
            if key not in schema.names:
                raise SourceError(
                    f"{path}: no column {key!r} for --field; columns: {', '.join(schema.names)}"
                )
            if image_like(schema.field(key).type):
                self.images.add(key)
        self.unlabelled = self.unlabelled and self.label not in schema.names
        if self.label not in schema.names and not self.unlabelled:
            raise SourceError(
                f"{path}: no label column {self.label!r}; columns: {', '.join(schema.names)}; "
                "name the class column with --label COLUMN"
            )
        md = pf.metadata
        for g in range(md.num_row_groups):
            self.data_bytes += md.row_group(g).total_byte_size
            self.rg_file.append(k)
            self.rg_local.append(g)
            self.rg_rows.append(md.row_group(g).num_rows)
        small = [c for c in self.keys if c not in self.images]
        table = pf.read(columns=list(dict.fromkeys(([] if self.unlabelled else [self.label]) + small)))
        for c in small:
            self.field_values.setdefault(c, []).append(table.column(c))
        if self.unlabelled:
            self.valid.append(np.ones(md.num_rows, bool))
            self.values.append(np.zeros(md.num_rows, np.int64))
        else:
            col = table.column(self.label)
            self.valid.append(col.is_valid().to_numpy(zero_copy_only=False))
            self.values.append(fill_nulls(col).to_numpy(zero_copy_only=False))

    def labels(self, text: str) -> tuple[np.ndarray, tuple[str, ...], np.ndarray, list[tuple[str, str]]]:
        """(the rows listed, classes, every row's label, the rows not listed, named)."""
        self.file_start = np.concatenate([[0], np.cumsum([len(v) for v in self.values], dtype=np.int64)])
        raw = np.concatenate(self.values) if self.values else np.zeros(0, np.int64)
        ok = np.concatenate(self.valid) if self.valid else np.zeros(0, bool)
        present = ok.copy()
        if self.unlabelled:
            classes, labels = (), np.zeros(len(raw), np.int64)
        elif self.classes is not None:
            classes, labels = self.classes, np.where(ok, raw, -1).astype(np.int64)
            ok &= (labels >= 0) & (labels < len(classes))
        else:
            classes, labels_ok = labels_from_values(raw[ok], f"{text} column {self.label!r}")
            labels = np.full(len(raw), -1, np.int64)
            labels[ok] = labels_ok
        errors = []
        for r in np.flatnonzero(~ok)[:1000].tolist():  # named; more than 1000 are counted in the message
            shown = "null" if not present[r] else "-1 (no label)" if raw[r] == -1 else repr(raw[r])
            f = int(np.searchsorted(self.file_start, r, side="right") - 1)
            name = f"{self.footers[f][0]}#{r - self.file_start[f]}"
            errors.append((name, f"label {self.label!r} is {shown}: not one of the classes"))
        missing = int((~ok).sum())
        if missing > len(errors):
            errors.append((f"{text}", f"{missing - len(errors)} more rows without a label"))
        return np.flatnonzero(ok).astype(np.int64), classes, labels, errors

    def names(self, rows: np.ndarray) -> IndexedNames:
        file_of = (np.searchsorted(self.file_start, rows, side="right") - 1).astype(np.int32)
        return IndexedNames([f[0] for f in self.footers], file_of, rows - self.file_start[file_of])


@register_source
@dataclass
class ParquetSource(EncodedSource):
    claim_order = 100
    form = "data.parquet | a folder of .parquet files | 'data/*.parquet' [--label COLUMN]"
    field_form = "a column (numbers, lists, [[x0, y0, x1, y1], ...], an image column for a mask)"

    files: list[str] = field(default_factory=list)  # absolute paths
    image_col: str = ""
    hf_struct: bool = True
    rg_start: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # global row → row group
    rg_file: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rg_local: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # global row of each sample
    footers: list[list[Any]] = field(default_factory=list)  # [relative name, size, mtime_ns, footer sha]
    data_bytes: int = 0  # the row groups' uncompressed bytes, all columns (the footers say)
    # The spool (``stage``): per sample its unit's file under ``spool_dir``, offset and length there.
    spool_dir: str = ""
    spool_unit: np.ndarray | None = None
    spool_offset: np.ndarray | None = None
    spool_len: np.ndarray | None = None
    label_column: str = DEFAULT_LABEL
    scan_errors: list[tuple[str, str]] = field(default_factory=list)
    # --field columns: the small ones read at open (key → a pyarrow array, one item per sample); the
    # image-like ones (masks) read per row group, as the images are.
    field_columns: dict[str, Any] = field(default_factory=dict)
    field_images: tuple[str, ...] = ()

    @classmethod
    def claims(cls, text: str) -> bool:
        if text.endswith(".parquet"):
            return True
        path = Path(text)
        return not any(c in text for c in GLOB_CHARS) and path.is_dir() and any(path.glob("*.parquet"))

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> ParquetSource:
        import_pyarrow()
        base, files = parquet_files(text)
        requests = requests_of(args.fields)
        scan = _Scan(args.label or DEFAULT_LABEL, list(dict.fromkeys(r.key for r in requests)))
        # With --field and no --label, a file without the default label column has no classes.
        scan.unlabelled = bool(requests) and args.label is None
        for k, path in enumerate(files):
            scan.read_file(k, path, os.path.relpath(path, base))
        rows, classes, labels, errors = scan.labels(text)
        stop_if_strict(errors, args)
        src = cls(
            description=str(text),
            classes=tuple(classes),
            names=scan.names(rows),  # type: ignore[arg-type]
            labels=labels[rows],
            kind="parquet",
            files=[str(Path(f).resolve()) for f in files],
            image_col=scan.image_col,
            hf_struct=scan.hf_struct,
            rg_start=np.concatenate([[0], np.cumsum(scan.rg_rows, dtype=np.int64)]).astype(np.int64),
            rg_file=np.asarray(scan.rg_file, np.int32),
            rg_local=np.asarray(scan.rg_local, np.int32),
            rows=rows,
            footers=scan.footers,
            label_column=scan.label,
            scan_errors=errors,
            data_bytes=scan.data_bytes,
            field_requests=requests,
            field_columns={
                k: take_rows(v, rows) for k, v in scan.field_values.items() if k not in scan.images
            },
            field_images=tuple(sorted(scan.images)),
        )
        if requests:
            src.fields = declare(requests, src.first_values(), text)
        return src

    # --- fields -------------------------------------------------------------------------------------
    def field_value(self, i: int, key: str) -> Any:
        if key in self.field_columns:
            return self.field_columns[key][i].as_py()
        g, j = self._locate(i)
        col = self._row_group(g, key)
        if not col[j].is_valid:
            return None  # a null mask: the field's empty value
        got = self._item(col, j, i)
        if isinstance(got, BaseException):
            raise got
        return got

    def first_values(self) -> dict[str, Any]:
        """Each request's first non-null value (an image column's first row), for ``declare``."""
        out: dict[str, Any] = {}
        for r in self.field_requests:
            col = self.field_columns.get(r.key)
            if col is None:
                out[r.name] = self.field_value(0, r.key) if len(self) else None
                continue
            valid = np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False))
            out[r.name] = col[int(valid[0])].as_py() if len(valid) else None
        return out

    # --- reading ----------------------------------------------------------------------------------
    def _cache(self) -> OrderedDict[int, Any]:
        c = self.__dict__.get("_rg_cache")
        if c is None:
            c = self.__dict__["_rg_cache"] = OrderedDict()
        return c

    def _row_group(self, g: int, column: str | None = None) -> Any:
        """Row group g's image column, or an image-like ``column`` (a --field mask), cached per process."""
        cache = self._cache()
        key = g if column is None else (g, column)
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        col = self._read_row_group(g, column)
        cache[key] = col
        while len(cache) > 1 and sum(c.nbytes for c in cache.values()) > CACHE_BYTES:
            cache.popitem(last=False)
        return col

    def stage(self, order: np.ndarray, unit_size: int, folder: Path, units: list[int]) -> None:
        """Spool the samples of ``units`` by unit, reading each row group once (module docstring)."""
        n = len(self)
        if self.data_bytes <= CACHE_BYTES or not units or np.array_equal(order, np.arange(n)):
            return
        if self.field_images:  # the spool holds the images only: masks are read by row group
            return
        pos = np.empty(n, np.int64)
        pos[order] = np.arange(n, dtype=np.int64)
        unit_of = (pos // unit_size).astype(np.int32)
        wanted = np.zeros(int(unit_of.max()) + 1, bool)
        wanted[np.asarray(units, np.int64)] = True
        shutil.rmtree(folder, ignore_errors=True)  # a killed run's spool: rebuilt, never appended to
        folder.mkdir(parents=True)
        offset = np.full(n, -1, np.int64)
        length = np.zeros(n, np.int64)
        sizes = np.zeros(len(wanted), np.int64)
        pending: dict[int, list[bytes]] = {}
        buffered = 0

        def flush() -> None:
            for k, parts in pending.items():
                with open(folder / f"unit-{k:06d}.bin", "ab") as f:
                    f.write(b"".join(parts))
            pending.clear()

        for g in range(len(self.rg_file)):
            lo, hi = np.searchsorted(self.rows, self.rg_start[g : g + 2])
            members = [i for i in range(int(lo), int(hi)) if wanted[unit_of[i]]]
            if not members:
                continue
            col = self._read_row_group(g)
            for i in members:
                got = self._item(col, int(self.rows[i] - self.rg_start[g]), i)
                if isinstance(got, BaseException):
                    continue  # read_bytes reads it from its row group again, and names the failure
                k = int(unit_of[i])
                offset[i], length[i] = sizes[k], len(got)
                sizes[k] += len(got)
                pending.setdefault(k, []).append(got)
                buffered += len(got)
            if buffered > CACHE_BYTES:
                flush()
                buffered = 0
        flush()
        self.spool_dir = str(folder)
        self.spool_unit, self.spool_offset, self.spool_len = unit_of, offset, length

    def _from_spool(self, indices: np.ndarray) -> dict[int, bytes] | None:
        """The samples' bytes from their unit's spool file (one read), or None when not spooled."""
        if self.spool_offset is None or self.spool_unit is None or self.spool_len is None or not len(indices):
            return None
        units = np.unique(self.spool_unit[indices])
        if len(units) != 1:
            return None
        try:
            blob = (Path(self.spool_dir) / f"unit-{int(units[0]):06d}.bin").read_bytes()
        except OSError:
            return None  # a worker that does not see the driver's disk: read the row groups
        out = {}
        for i in indices.tolist():
            o, n = int(self.spool_offset[i]), int(self.spool_len[i])
            if o >= 0:
                out[i] = blob[o : o + n]
        return out

    def _read_row_group(self, g: int, column: str | None = None) -> Any:
        pq = import_pyarrow()
        files = self.__dict__.setdefault("_open_files", {})
        k = int(self.rg_file[g])
        if k not in files:
            files[k] = pq.ParquetFile(self.files[k])
        return (
            files[k]
            .read_row_group(int(self.rg_local[g]), columns=[column or self.image_col])
            .column(0)
            .combine_chunks()
        )

    def prefetch(self, indices: Any) -> None:
        """The samples' bytes from their spool file, else from each row group they need, read once."""
        spooled = self._from_spool(np.asarray(indices, np.int64))
        if spooled is not None and len(spooled) == len(indices):
            self.__dict__["_taken"] = spooled
            return
        rows = self.rows[np.asarray(indices, np.int64)]
        groups = np.searchsorted(self.rg_start, rows, side="right") - 1
        taken: dict[int, Any] = {}
        for g in np.unique(groups).tolist():
            col = self._row_group(g)
            for i, r in zip(np.asarray(indices)[groups == g].tolist(), rows[groups == g].tolist()):
                taken[i] = self._item(col, r - int(self.rg_start[g]), i)
        self.__dict__["_taken"] = taken

    def _item(self, col: Any, j: int, i: int) -> bytes | BaseException:
        try:
            if hasattr(col, "field"):  # HF's Image struct (the image column's or a mask column's)
                data = col.field("bytes")[j].as_py()
                if data is None:
                    path = col.field("path")[j].as_py()
                    if path is None:
                        return ImageDecodeError(f"{self.names[i]}: the image is null (no bytes, no path)")
                    return (
                        Path(self.files[int(self.rg_file[self._locate(i)[0]])]).parent / path
                    ).read_bytes()
                return data
            data = col[j].as_py()
            return data if data is not None else ImageDecodeError(f"{self.names[i]}: the image is null")
        except OSError as e:
            return unreadable(self.names[i], e)

    def _locate(self, i: int) -> tuple[int, int]:
        """(row group, row within it) of sample i."""
        r = int(self.rows[i])
        g = int(np.searchsorted(self.rg_start, r, side="right") - 1)
        return g, r - int(self.rg_start[g])

    def read_bytes(self, i: int) -> bytes:
        taken = self.__dict__.get("_taken") or {}
        got = taken.pop(i, None)
        if got is None:
            g, j = self._locate(i)
            got = self._item(self._row_group(g), j, i)
        if isinstance(got, BaseException):
            raise got
        return got

    def reopen(self) -> dict[str, Any]:
        return self.reopen_with(os.path.abspath(self.description), self.label_column)

    def source_files(self) -> list[Path]:
        return [Path(f) for f in self.files]

    # --- identity -----------------------------------------------------------------------------------
    def entries(self) -> list[list[Any]]:
        """One row per file (name, size, mtime_ns, footer digest): what a re-run names as changed."""
        return [[rel, size, mtime, sha[:16]] for rel, size, mtime, sha in self.footers]

    def fingerprint(self) -> str:
        return self.fingerprint_of([self.classes, self.label_column, self.image_col], self.footers, self.rows)

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {
            "rows": self.rows[idx],
            "spool_offset": None,
            "spool_unit": None,
            "spool_len": None,
            "field_columns": {k: take_rows(v, idx) for k, v in self.field_columns.items()},
        }

    def __getstate__(self) -> dict[str, Any]:
        return {
            k: v for k, v in super().__getstate__().items() if k not in ("_rg_cache", "_open_files", "_taken")
        }

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "entries": self.entries(),
            "files": len(self.files),
            "label_column": self.label_column,
        }


def image_like(t: Any) -> bool:
    """A column of encoded images: binary, or HF's Image struct (bytes + path)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return t.get_field_index("bytes") >= 0
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t))


def take_rows(column: Any, rows: np.ndarray) -> Any:
    """A column's items at ``rows`` (of all the files' rows), one array."""
    import pyarrow as pa

    if isinstance(column, list):
        column = pa.chunked_array(
            [c for part in column for c in (part.chunks if hasattr(part, "chunks") else [part])]
        )
    taken = column.take(pa.array(np.asarray(rows, np.int64)))
    return taken.combine_chunks() if hasattr(taken, "combine_chunks") else taken
