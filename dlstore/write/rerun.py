"""``convert`` run again on a finished DEST (local or URL) is make-like: the same source and options
are up to date; anything else is refused, naming the first difference, until ``--overwrite``. It
compares the new plan with the one rebuilt from the manifest (``conversion_plan.recorded_plan``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlstore.errors import CacheExistsError
from dlstore.sourcefiles import SourceRecord, first_difference, read_record
from dlstore.spec import CacheSpec, read_spec
from dlstore.write.conversion_plan import recorded_plan
from dlstore.write.sources import Source
from dlstore.write.staging import option_changes

_REBUILD = "pass --overwrite to rebuild it"


def is_up_to_date(dest: Path, plan: dict[str, Any], src: Source) -> bool:
    """True when DEST's cache was built from this plan; else CacheExistsError naming the difference."""
    return matches_plan(read_spec(dest), str(dest), plan, src, lambda: read_record(dest))


def matches_plan(
    spec: CacheSpec,
    where: str,
    plan: dict[str, Any],
    src: Source,
    record: Callable[[], SourceRecord | None],
) -> bool:
    """``is_up_to_date`` for a manifest read from ``where``; ``record`` loads its source record."""
    old = recorded_plan(spec)
    if old is None:
        raise CacheExistsError(
            f"{where}: already holds a cache from an older dlstore that did not record its options; {_REBUILD}"
        )
    changes = option_changes(old, plan)
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise CacheExistsError(
            f"{where}: holds a cache built with other options: {changes[0]}{more}; pass --overwrite to replace it"
        )
    if old.get("fingerprint") == plan.get("fingerprint"):
        return True
    before, now = spec.source.get("root") or spec.source.get("description"), source_place(src)
    if before != now:
        raise CacheExistsError(
            f"{where}: holds a cache of another source: {now} was {before}; pass --overwrite to replace it"
        )
    raise CacheExistsError(
        f"{where}: the source changed since the cache was built: {first_change(record(), src, spec.source)}; {_REBUILD}"
    )


def source_place(src: Source) -> str:
    """A folder source's resolved root (``photos/`` and ``/data/photos`` are the same source)."""
    root = getattr(src, "root", None)
    return str(Path(root).resolve()) if root is not None else src.description


def first_change(record: SourceRecord | None, src: Source, recorded: dict[str, Any] | None = None) -> str:
    """The first changed file: by the per-container entries the manifest recorded (parquet files,
    shards), else by the per-sample record."""
    before = (recorded or {}).get("entries")
    if isinstance(before, list):
        diff = first_difference(before, src.entries())
    else:
        diff = first_difference(record.rows(), src.entries()) if record is not None else None
    return f"first changed file {diff}" if diff else "its files differ"
