"""``convert`` run again on a finished DEST: make-like. The same source and options → up to date, no
work; other options, another source or a changed source → refused, naming the first difference, until
``--overwrite`` rebuilds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlstore.convert.sources import Source
from dlstore.convert.staging import option_changes
from dlstore.errors import CacheExistsError
from dlstore.sourcefiles import first_difference, read_record
from dlstore.spec import read_spec

_REBUILD = "pass --overwrite to rebuild it"


def is_up_to_date(dest: Path, plan: dict[str, Any], src: Source) -> bool:
    """True when the complete cache at DEST was built from this plan; raises CacheExistsError naming
    the first difference otherwise."""
    spec = read_spec(dest)
    old = spec.source.get("plan")
    if not isinstance(old, dict):
        raise CacheExistsError(
            f"{dest}: already holds a cache from an older dlstore that did not record its options; {_REBUILD}"
        )
    changes = option_changes(old, plan)
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise CacheExistsError(
            f"{dest}: holds a cache built with other options: {changes[0]}{more}; pass --overwrite to replace it"
        )
    if old.get("fingerprint") == plan.get("fingerprint"):
        return True
    before, now = spec.source.get("root") or spec.source.get("description"), where(src)
    if before != now:
        raise CacheExistsError(
            f"{dest}: holds a cache of another source: {now} was {before}; pass --overwrite to replace it"
        )
    raise CacheExistsError(
        f"{dest}: the source changed since the cache was built: {first_change(dest, src)}; {_REBUILD}"
    )


def where(src: Source) -> str:
    """A folder source's resolved root (``photos/`` and ``/data/photos`` are the same source)."""
    root = getattr(src, "root", None)
    return str(Path(root).resolve()) if root is not None else src.description


def first_change(dest: Path, src: Source) -> str:
    record = read_record(dest)
    diff = first_difference(record.rows(), src.entries()) if record is not None else None
    return f"first changed file {diff}" if diff else "its files differ"
