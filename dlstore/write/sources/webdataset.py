"""WebDataset tar shards (``shards-{000000..000099}.tar``, local or on a store): a sample is the
members sharing a key, its image the one with an image extension, its label ``.cls`` (``--label``:
another member, or a ``.json`` field). Listing streams each shard once into arrays; an image is one
ranged read; a truncated shard keeps what came before the cut. Fingerprint: names, sizes, mtimes."""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from dlstore.errors import SourceError
from dlstore.sourcefiles import IMAGE_EXTENSIONS
from dlstore.storage.stores import RemoteStore, is_url
from dlstore.write.sources.encoded import (
    EncodedSource,
    IndexedNames,
    labels_from_values,
    stop_if_strict,
    unreadable,
)
from dlstore.write.sources.fieldmap import declare, requests_of
from dlstore.write.sources.registry import SourceArgs, register_source

DEFAULT_LABEL = "cls"
IMAGE_EXTS = {e.lstrip(".") for e in IMAGE_EXTENSIONS}
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_BRACES = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` → a-000.tar, a-001.tar, a-002.tar (padding kept); ``{x,y}`` lists."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.groups()
        width = len(lo) if lo.startswith("0") else 0
        items = [str(k).zfill(width) for k in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [out for item in items for out in expand_braces(head + item + tail)]


def join_arrays(parts: list[np.ndarray], dtype: Any = None) -> np.ndarray:
    """The shards' arrays as one (label values mixing ints and text: all text)."""
    parts = [p for p in parts if p.size] or [np.zeros(0, dtype or np.int64)]
    if dtype is None and len({p.dtype.kind for p in parts}) > 1:
        parts = [p.astype(str) for p in parts]
    return np.concatenate(parts) if dtype is None else np.concatenate(parts).astype(dtype, copy=False)


@register_source
@dataclass
class WebDatasetSource(EncodedSource):
    claim_order = 110
    form = "'shards-{000000..000099}.tar' (local, s3://, gs://) [--label cls|txt|JSON_FIELD]"
    field_form = "a member extension (seg.png for a mask, boxes.json, ...) or else a key of the .json"

    base: str = "."  # the shards' folder or URL prefix
    shards: list[str] = field(default_factory=list)  # names under ``base``
    shard_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shard_stats: list[list[Any]] = field(default_factory=list)  # [name, size, mtime or ETag]
    label_key: str = DEFAULT_LABEL
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    scan_errors: list[tuple[str, str]] = field(default_factory=list)
    # --field values per sample: KEY → a JSON value, or an image member's (offset, size) as a Member
    field_data: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def claims(cls, text: str) -> bool:
        return bool(re.search(r"\.tar(\}|$)", text)) and not text.startswith("torchvision:")

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> WebDatasetSource:
        base, slash, name = text.rpartition("/")
        base, shards = base if slash else ".", expand_braces(name)
        label = args.label or DEFAULT_LABEL
        src = cls(
            description=text,
            classes=(),
            names=[],
            labels=np.zeros(0, np.int64),
            kind="webdataset",
            base=base,
            shards=shards,
            label_key=label,
            storage_options=args.storage_options,
            field_requests=requests_of(args.fields),
        )
        src.__dict__["_label_optional"] = bool(args.fields) and args.label is None
        parts: dict[str, list[np.ndarray]] = {
            n: [] for n in ("shard_of", "offsets", "sizes", "keys", "values")
        }
        errors: list[tuple[str, str]] = []
        for k, shard in enumerate(shards):  # each shard's listing becomes arrays at once
            src.shard_stats.append([shard, *src._stat(shard)])
            got: dict[str, list[Any]] = {"offsets": [], "sizes": [], "keys": [], "values": []}
            with src._open(shard) as f:
                src._list_shard(f, shard, got["keys"], got["offsets"], got["sizes"], got["values"], errors)
            parts["shard_of"].append(np.full(len(got["keys"]), k, np.int32))
            for name, dtype in (("offsets", np.int64), ("sizes", np.int64), ("keys", str), ("values", None)):
                parts[name].append(np.asarray(got[name], dtype))
            stop_if_strict(errors, args)
        src.shard_of = join_arrays(parts["shard_of"], np.int32)
        src.offsets = join_arrays(parts["offsets"], np.int64)
        src.sizes = join_arrays(parts["sizes"], np.int64)
        src.names = IndexedNames(shards, src.shard_of, join_arrays(parts["keys"], str))  # type: ignore[assignment]
        src.classes, src.labels = src._classes(parts["values"], f"{text} label {label!r}")
        src.scan_errors = errors
        src.__dict__.pop("_label_optional", None)
        if src.field_requests:
            first = {r.name: src.first_value(r.key) for r in src.field_requests}
            src.fields = declare(src.field_requests, first, text)
        return src

    def _classes(self, parts: list[np.ndarray], where: str) -> tuple[tuple[str, ...], np.ndarray]:
        """Classes and labels (none when no sample has one: --field without --label)."""
        missing = np.concatenate(
            [np.array([v is None for v in p.tolist()], bool) if p.dtype == object else np.zeros(len(p), bool)
             for p in parts] or [np.zeros(0, bool)]
        )  # fmt: skip
        if len(missing) and missing.all():  # --field without labels: no classes
            return (), np.zeros(len(missing), np.int64)
        if missing.any():
            raise SourceError(
                f"{self.names[int(np.flatnonzero(missing)[0])]}: no label (.{self.label_key} member or .json "
                f"field) while others have one; give every sample one, or name another with --label"
            )
        return labels_from_values(join_arrays(parts), where)

    # --- fields -------------------------------------------------------------------------------------
    def field_value(self, i: int, key: str) -> Any:
        value = self.field_data[i].get(key)
        if isinstance(value, Member):
            return self._read_range(i, int(self.shard_of[i]), value.offset, value.size)
        return value

    def first_value(self, key: str) -> Any:
        """The first value of ``key`` (for ``declare``)."""
        i = next((i for i, row in enumerate(self.field_data) if row.get(key) is not None), None)
        return None if i is None else self.field_value(i, key)

    def _list_shard(
        self,
        f: IO[bytes],
        shard: str,
        keys: list[str],
        offsets: list[int],
        sizes: list[int],
        values: list[Any],
        errors: list[tuple[str, str]],
    ) -> None:
        """Stream one shard's members; append its samples (image offset, size, key, label value)."""
        current: str | None = None
        image: tuple[int, int] | None = None
        found: dict[str, bytes] = {}
        members: dict[str, Member] = {}
        wanted = {r.key for r in self.field_requests}
        optional = bool(self.__dict__.get("_label_optional"))

        def close() -> None:
            if current is None:
                return
            name = f"{shard}#{current}"
            value = self._label(found, name, errors, optional)
            if image is None:
                errors.append((name, f"no image member (extensions {', '.join(sorted(IMAGE_EXTS))})"))
            elif value is not None or optional:
                row = self._field_row(found, members, name, errors) if wanted else {}
                if row is None:
                    return
                keys.append(current)
                offsets.append(image[0])
                sizes.append(image[1])
                values.append(value)
                if wanted:
                    self.field_data.append(row)

        try:
            with tarfile.open(fileobj=f, mode="r|") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    m = _KEY.match(member.name)
                    if m is None:
                        continue
                    key, ext = m.group(1), m.group(2).lower()
                    if key != current:
                        close()
                        current, image, found, members = key, None, {}, {}
                    last = ext.rsplit(".", 1)[-1]
                    if ext in wanted and last in IMAGE_EXTS:  # a mask: read when its sample is
                        members[ext] = Member(member.offset_data, member.size)
                    elif last in IMAGE_EXTS and image is None:
                        image = (member.offset_data, member.size)
                    elif ext in wanted or ext in (self.label_key, "json") and member.size <= 1 << 20:
                        data = tar.extractfile(member)
                        found[ext] = data.read() if data is not None else b""
                close()
        except (tarfile.TarError, EOFError, OSError) as e:
            errors.append(
                (shard, f"shard cut off or corrupt after {len(keys)} samples ({type(e).__name__}: {e})")
            )

    def _label(
        self, found: dict[str, bytes], name: str, errors: list[tuple[str, str]], optional: bool = False
    ) -> Any:
        if self.label_key in found:
            text = found[self.label_key].decode("utf-8", "replace").strip()
            return int(text) if re.fullmatch(r"-?\d+", text) else text
        if "json" in found:
            try:
                doc = json.loads(found["json"])
            except ValueError as e:
                errors.append((name, f"its .json is not JSON ({e})"))
                return None
            if isinstance(doc, dict) and isinstance(doc.get(self.label_key), (int, str)):
                return doc[self.label_key]
        if not optional:
            errors.append(
                (name, f"no label: no .{self.label_key} member and no {self.label_key!r} field in a .json")
            )
        return None

    def _field_row(
        self, found: dict[str, bytes], members: dict[str, Member], name: str, errors: list[tuple[str, str]]
    ) -> dict[str, Any] | None:
        """A sample's --field values; None (named in ``errors``) when one is not readable."""
        doc: Any = None
        row: dict[str, Any] = {}
        for r in self.field_requests:
            if r.key in members:
                row[r.key] = members[r.key]
            elif r.key in found:
                try:
                    row[r.key] = member_value(r.key, found[r.key])
                except ValueError as e:
                    errors.append((name, f"its .{r.key} (--field {r.text}) is not JSON ({e})"))
                    return None
            elif "json" in found:
                if doc is None:
                    try:
                        doc = json.loads(found["json"])
                    except ValueError as e:
                        errors.append((name, f"its .json is not JSON ({e})"))
                        return None
                row[r.key] = doc.get(r.key) if isinstance(doc, dict) else None
        return row

    # --- the shards, local or remote --------------------------------------------------------------
    def _store(self) -> RemoteStore:
        store = self.__dict__.get("_store_obj")
        if store is None:
            store = self.__dict__["_store_obj"] = RemoteStore(self.base, self.storage_options)
        return store

    def _stat(self, shard: str) -> tuple[int, Any]:
        if is_url(self.base):
            store = self._store()
            info = store.call("HEAD", shard, lambda: store.fs.info(store.key(shard)))
            return int(info.get("size", 0)), str(
                info.get("LastModified") or info.get("ETag") or info.get("mtime", "")
            )
        try:
            st = os.stat(os.path.join(self.base, shard))
        except OSError as e:
            raise SourceError(f"{os.path.join(self.base, shard)}: cannot read shard ({e.strerror})") from e
        return st.st_size, st.st_mtime_ns

    def _open(self, shard: str) -> IO[bytes]:
        if is_url(self.base):
            store = self._store()
            return store.call("GET", shard, lambda: store.fs.open(store.key(shard), "rb"))  # type: ignore[no-any-return]
        return open(os.path.join(self.base, shard), "rb")

    def read_bytes(self, i: int) -> bytes:
        return self._read_range(i, int(self.shard_of[i]), int(self.offsets[i]), int(self.sizes[i]))

    def _read_range(self, i: int, k: int, start: int, size: int) -> bytes:
        """``size`` bytes at ``start`` of shard k, for sample i (named in errors)."""
        shard = self.shards[k]
        try:
            if is_url(self.base):
                store = self._store()
                return store.call(
                    "GET", shard, lambda: store.fs.cat_file(store.key(shard), start=start, end=start + size)
                )  # type: ignore[no-any-return]
            with open(os.path.join(self.base, shard), "rb") as f:
                f.seek(start)
                data = f.read(size)
        except OSError as e:
            raise unreadable(self.names[i], e) from e
        if len(data) != size:
            raise unreadable(
                self.names[i], EOFError(f"{len(data)} of {size} bytes (shard shorter than listed)")
            )
        return data

    def reopen(self) -> dict[str, Any]:
        text = self.description if is_url(self.base) else os.path.abspath(self.description)
        return self.reopen_with(text, self.label_key)

    def source_files(self) -> list[Path]:
        return [] if is_url(self.base) else [Path(self.base) / s for s in self.shards]

    # --- identity ---------------------------------------------------------------------------------
    def entries(self) -> list[list[Any]]:
        return [[name, size, mtime, 0] for name, size, mtime in self.shard_stats]

    def fingerprint(self) -> str:
        return self.fingerprint_of([self.classes, self.label_key, self.shard_stats], self.offsets)

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        rows = {"field_data": [self.field_data[i] for i in idx]} if self.field_data else {}
        return {
            "shard_of": self.shard_of[idx],
            "offsets": self.offsets[idx],
            "sizes": self.sizes[idx],
            **rows,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__getstate__().items() if k != "_store_obj"}

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "entries": self.entries(),
            "shards": len(self.shards),
            "label": self.label_key,
        }


@dataclass(frozen=True)
class Member:
    """An image member of a sample (a --field mask): where its bytes are in the shard."""

    offset: int
    size: int


def member_value(ext: str, data: bytes) -> Any:
    """A --field member's bytes: JSON when it parses (always for .json), else text."""
    text = data.decode("utf-8", "replace").strip()
    if ext.endswith("json"):
        return json.loads(text)
    try:
        return json.loads(text)
    except ValueError:
        return text
