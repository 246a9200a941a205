"""The source folder a cache was built from: scanning it (ImageFolder's rules), the per-file record a
cache keeps (``sources.npz``: columnar, deflated, ~20 bytes an image; names relative, so a moved
dataset root keeps its cache valid, only unchecked) and the staleness checks, which look at the source
only when asked (``check_source=True``) beyond one ``stat`` of its root on open (``root_warning``).

>>> status = source_status("cache/")           # doctest: +SKIP
>>> status.stale, status.message               # doctest: +SKIP
"""

from __future__ import annotations

import os
import stat
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.durable import durable_file
from dlstore.errors import SourceError, SpecError, StaleCacheError, StaleCacheWarning
from dlstore.spec import SOURCE_RECORD, CacheSpec, parse_relpath, read_spec

# torchvision's IMG_EXTENSIONS plus GIF, which Pillow reads (first frame).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
DIGEST_BYTES = 8  # of each source file's sha256: enough to notice an edit, not a security claim


@dataclass
class FolderScan:
    """What a scan of an ImageFolder tree found; ``errors``: (relative path, reason) not listed."""

    root: Path
    classes: tuple[str, ...]
    names: list[str]
    labels: np.ndarray
    stats: list[tuple[int, int]]  # (size, mtime_ns) per image
    errors: list[tuple[str, str]] = field(default_factory=list)
    root_mtime_ns: int = 0  # taken before the walk, so a change during it shows later

    def rows(self) -> list[list[Any]]:
        return [[n, s, m, int(lab)] for n, (s, m), lab in zip(self.names, self.stats, self.labels)]


def scan_tree(root: Path) -> FolderScan:
    """List an ImageFolder tree: class folders sorted by name, images in ImageFolder's order."""
    root = Path(root)
    if not root.is_dir():
        raise SourceError(
            f"{root}: not a directory; give a folder of class subfolders, "
            f"'torchvision:NAME --root DIR' or 'demo'"
        )
    root_mtime_ns = os.stat(root).st_mtime_ns
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise SourceError(
            f"{root}: no class subfolders found; expected ROOT/<class>/<image> like ImageFolder"
        )
    names: list[str] = []
    labels: list[int] = []
    stats: list[tuple[int, int]] = []
    errors: list[tuple[str, str]] = []
    # A link back to the root or to a class folder would copy images into another class: never follow.
    blocked = {_inode(root)} | {_inode(root / c) for c in classes}
    for idx, cls in enumerate(classes):
        # Plain strings and os.stat, not pathlib: three Path objects per file cost more than the stat
        # itself on a large tree (about 60 µs of a 70 µs per-file scan on Python 3.12).
        top = os.path.join(root, cls)
        for rel in _walk_images(top, errors, blocked):
            name = f"{cls}/{rel}"
            try:
                st = os.stat(os.path.join(top, rel))
            except OSError as e:
                errors.append((name, f"cannot stat: {e.strerror}"))
                continue
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device named .jpg would block or never end
                errors.append((name, "not a regular file (FIFO, device or socket)"))
                continue
            names.append(name)
            labels.append(idx)
            stats.append((st.st_size, st.st_mtime_ns))
    present = set(labels)
    empty = [c for i, c in enumerate(classes) if i not in present]
    if empty:
        raise SourceError(
            f"{root}: class folder(s) without any image file: {', '.join(empty)}; "
            f"add images or remove the folder (extensions read: {' '.join(IMAGE_EXTENSIONS)})"
        )
    return FolderScan(root, tuple(classes), names, np.asarray(labels, np.int64), stats, errors, root_mtime_ns)


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk_images(top: str, errors: list[tuple[str, str]], blocked: set[tuple[int, int]]) -> list[str]:
    """Image paths relative to ``top`` ('/'-joined), in ImageFolder's order (sorted os.walk, sorted
    names), with loop-safe link following."""
    seen: set[tuple[int, int]] = set()
    walked: list[tuple[str, list[str]]] = []

    def onerror(e: OSError) -> None:
        errors.append((str(e.filename), f"cannot list folder: {e.strerror}"))

    for dirpath, dirnames, filenames in os.walk(top, followlinks=True, onerror=onerror):
        key = _inode(Path(dirpath))
        if key in seen or (key in blocked and dirpath != top):
            dirnames[:] = []
            continue
        seen.add(key)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        walked.append((dirpath, filenames))
    out = []
    for dirpath, filenames in sorted(walked):
        prefix = os.path.relpath(dirpath, top).replace(os.sep, "/") + "/" if dirpath != top else ""
        for name in sorted(filenames):
            if not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS):
                out.append(prefix + name)
    return out


@dataclass
class SourceRecord:
    """Per source sample, in source order: relative name, size, mtime_ns, label, and the first
    ``DIGEST_BYTES`` of the file's sha256 as it was decoded (zeros where unknown)."""

    names: list[str]
    sizes: np.ndarray
    mtimes_ns: np.ndarray
    labels: np.ndarray
    digests: np.ndarray  # (n, DIGEST_BYTES) uint8

    @classmethod
    def from_columns(
        cls, names: list[str], sizes: Any, mtimes_ns: Any, labels: Any, sha256_hex: list[str]
    ) -> SourceRecord:
        """What a conversion records: its columns as they are (no row per file in between)."""
        digests = np.zeros((len(names), DIGEST_BYTES), np.uint8)
        for i, h in enumerate(sha256_hex):
            if h:
                digests[i] = np.frombuffer(bytes.fromhex(h[: 2 * DIGEST_BYTES]), np.uint8)
        return cls(
            names=names if isinstance(names, Sequence) else list(names),  # a parquet source's are computed
            sizes=np.asarray(sizes, np.int64),
            mtimes_ns=np.asarray(mtimes_ns, np.int64),
            labels=np.asarray(labels, np.int32),
            digests=digests,
        )

    def rows(self) -> list[list[Any]]:
        columns = (self.names, self.sizes.tolist(), self.mtimes_ns.tolist(), self.labels.tolist())
        return [list(row) for row in zip(*columns)]

    def digest(self, i: int) -> str:
        """Hex prefix of sample i's sha256, "" where unknown."""
        d = self.digests[i]
        return bytes(d).hex() if d.any() else ""

    def save(self, path: Path) -> None:
        """Deflated columns; mtimes as differences, which files written together keep small."""
        joined = b"\0".join(n.encode("utf-8", "surrogateescape") for n in self.names)
        mt = np.diff(self.mtimes_ns, prepend=np.int64(0))
        with durable_file(path) as f:
            np.savez_compressed(
                f,
                names=np.frombuffer(joined, np.uint8),
                sizes=self.sizes,
                mtime_deltas_ns=mt,
                labels=self.labels,
                digests=self.digests,
            )

    @classmethod
    def load(cls, path: Path) -> SourceRecord:
        with np.load(path, allow_pickle=False) as z:
            raw = z["names"].tobytes()
            names = [b.decode("utf-8", "surrogateescape") for b in raw.split(b"\0")] if raw else []
            return cls(names, z["sizes"], np.cumsum(z["mtime_deltas_ns"]), z["labels"], z["digests"])


def read_record(cache_root: Path) -> SourceRecord | None:
    """The cache's source record, or None when it has none (or an unreadable one)."""
    try:
        return SourceRecord.load(Path(cache_root) / SOURCE_RECORD)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None


def first_difference(old: list[list[Any]], new: list[list[Any]]) -> str | None:
    """The first (sorted) relative path that was added, removed or changed (size, mtime, label)."""
    before = {str(e[0]): e[1:] for e in old}
    after = {str(e[0]): e[1:] for e in new}
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        if a is None:
            return f"{name} (added)"
        if b is None:
            return f"{name} (removed)"
        if a[:2] != b[:2]:
            return (
                f"{name} (size/mtime changed: {a[0]} bytes, mtime_ns {a[1]} -> {b[0]} bytes, mtime_ns {b[1]})"
            )
        return f"{name} (label changed: {a[2]} -> {b[2]})"
    return None


@dataclass(frozen=True)
class SourceStatus:
    """``stale``: the source changed (``message`` names the first changed path); ``checked``: False when
    there was nothing to compare against (no folder source, or its root is gone)."""

    checked: bool
    stale: bool = False
    message: str = ""


def recorded_root(spec: CacheSpec) -> Path | None:
    root = spec.source.get("root")
    return Path(root) if root else None


def inside_root(root: Path, names: Sequence[str]) -> list[Path | None]:
    """Each record name's file in the source root, or None where the name leaves it (nothing opened):
    a relative name without ``..``, and one a scan of the root finds now (the links it follows, as the
    conversion did) or that resolves inside the root (a file gone since)."""
    try:
        found = set(scan_tree(root).names)
    except SourceError:
        found = set()
    out: list[Path | None] = []
    for name in names:
        try:
            path = root / parse_relpath(name, root)
        except SpecError:
            path = None
        ok = path is not None and (name in found or path.resolve().is_relative_to(root.resolve()))
        out.append(path if ok else None)
    return out


def source_status(cache_root: str | Path, source: str | Path | None = None) -> SourceStatus:
    """Compare the cache's recorded source files with the folder as it is now (size and mtime)."""
    cache_root = Path(cache_root)
    spec = read_spec(cache_root)
    recorded = recorded_root(spec)
    record = read_record(cache_root) if (source is not None or recorded) else None
    if record is None:
        return SourceStatus(checked=False, message="no folder source recorded; nothing to compare")
    root = Path(source) if source is not None else recorded
    assert root is not None
    if not root.is_dir():
        return SourceStatus(checked=False, message=f"source root {root} not found (moved?); not checked")
    try:
        now = scan_tree(root)
    except SourceError as e:
        return SourceStatus(checked=True, stale=True, message=f"source {root} can no longer be scanned: {e}")
    if list(spec.classes) != list(now.classes):
        added = sorted(set(now.classes) - set(spec.classes))
        return SourceStatus(
            checked=True,
            stale=True,
            message=(
                f"class folders of {root} changed ({', '.join(added) or 'some removed'}"
                f"{' added' if added else ''}); label indices shifted since the cache was built"
            ),
        )
    diff = first_difference(record.rows(), now.rows())
    if diff is None:
        return SourceStatus(checked=True)
    return SourceStatus(
        checked=True, stale=True, message=f"source changed since the cache was built: {root}/{diff}"
    )


def check_source(cache_root: str | Path, strict: bool = False) -> SourceStatus:
    """Warn (or with ``strict`` raise StaleCacheError) when the cache's source changed (a full scan)."""
    status = source_status(cache_root)
    if status.stale:
        text = (
            f"{cache_root}: stale cache: {status.message}; rebuild it with "
            f"`dlstore convert ... {cache_root} --overwrite`"
        )
        if strict:
            raise StaleCacheError(text)
        warnings.warn(StaleCacheWarning(text), stacklevel=3)
    return status


def root_warning(spec: CacheSpec, cache_root: Path) -> None:
    """One ``stat`` of the source root, never a walk: its mtime changes when a class folder is added,
    removed or renamed (not when a file inside a class folder changes). Warns; never raises."""
    root, recorded = spec.source.get("root"), spec.source.get("root_mtime_ns")
    if not root or not isinstance(recorded, int):
        return  # not a folder source, or DEST lived inside it (the commit itself changed its mtime)
    try:
        now = os.stat(root).st_mtime_ns
    except OSError:
        return  # moved or unmounted: unchecked, as documented
    if now != recorded:
        warnings.warn(
            StaleCacheWarning(
                f"{cache_root}: the source folder {root} was modified since the cache was built (a class "
                f"folder added, removed or renamed?); check with `dlstore verify {cache_root}` or open "
                "with check_source=True"
            ),
            stacklevel=3,
        )
