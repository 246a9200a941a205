"""Is a cache still a faithful copy of its source folder?

``sources.json`` in a cache records the source root, and per sample (relative name, size, mtime_ns,
label) plus the sha256 of the file as it was decoded. A quick check re-scans the recorded root and
compares names, sizes and mtimes; a deep check (``verify --deep``) re-hashes every file, which is the
only way to notice an edit that kept the size and had its mtime restored. Names are relative, so a
dataset root that moved keeps its cache valid: a recorded root that no longer exists is not stale,
only unchecked (pass the new location as ``source=`` to check it there).

>>> status = source_status("cache/")           # doctest: +SKIP
>>> status.stale, status.message               # doctest: +SKIP
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlstore.errors import SourceError, StaleCacheError, StaleCacheWarning
from dlstore.spec import SOURCES_FILE


@dataclass(frozen=True)
class SourceStatus:
    """``stale``: the source changed (``message`` names the first changed path); ``checked``: False when
    there was nothing to compare against (no folder source, or its root is gone)."""

    checked: bool
    stale: bool = False
    message: str = ""


def read_sources(cache_root: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((Path(cache_root) / SOURCES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("entries"), list) else None


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


def source_status(cache_root: str | Path, source: str | Path | None = None) -> SourceStatus:
    """Compare the cache's recorded source files with the folder as it is now (size and mtime)."""
    from dlstore.build.sources import scan_folder

    doc = read_sources(Path(cache_root))
    if doc is None or (source is None and not doc.get("root")):
        return SourceStatus(checked=False, message="no folder source recorded; nothing to compare")
    root = Path(source) if source is not None else Path(doc["root"])
    if not root.is_dir():
        return SourceStatus(checked=False, message=f"source root {root} not found (moved?); not checked")
    try:
        now = scan_folder(root)
    except SourceError as e:
        return SourceStatus(checked=True, stale=True, message=f"source {root} can no longer be scanned: {e}")
    old_classes = doc.get("classes")
    if isinstance(old_classes, list) and old_classes != list(now.classes):
        added = sorted(set(now.classes) - set(old_classes))
        return SourceStatus(
            checked=True,
            stale=True,
            message=(
                f"class folders of {root} changed ({', '.join(added) or 'some removed'}"
                f"{' added' if added else ''}); label indices shifted since the cache was built"
            ),
        )
    diff = first_difference(doc["entries"], now.entries())
    if diff is None:
        return SourceStatus(checked=True)
    return SourceStatus(
        checked=True, stale=True, message=f"source changed since the cache was built: {root}/{diff}"
    )


def check_source(cache_root: str | Path, strict: bool = False) -> SourceStatus:
    """Warn (or with ``strict`` raise StaleCacheError) when the cache's source changed."""
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
