"""Phase 1 of a conversion, the plan: source, writer, storage order and the plan record (what the
journal keeps and a re-run compares), from one ``ConvertOptions``; and the checks of DEST."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dlstore import __version__
from dlstore.errors import CacheExistsError, ConvertError, SpecError
from dlstore.formats import Format, get_format
from dlstore.formats.base import CacheWriter
from dlstore.sourcefiles import SourceRecord, first_difference, read_record
from dlstore.spec import MANIFEST, CacheSpec, read_spec
from dlstore.write.options import ConvertOptions, from_old_plan, recorded_options
from dlstore.write.sizes import human_bytes
from dlstore.write.sources import DatasetSource, Source, SourceArgs, local_root, open_source
from dlstore.write.staging import option_changes


@dataclass
class Plan:
    """What one conversion will build; ``record``: the plan as data."""

    options: ConvertOptions
    fmt: Format
    src: Source
    writer: CacheWriter  # its root is set once the staging folder exists
    order: np.ndarray  # storage position s holds source sample order[s]
    record: dict[str, Any]
    max_pixels: int  # the decompression-bomb limit every worker applies
    warnings: list[str] = field(default_factory=list)


def open_plan_source(source: str | Path | Source | Any, options: ConvertOptions) -> Source:
    """A Source as given, a map-style Dataset object (``DatasetSource``), or a SOURCE argument."""
    if isinstance(source, Source):
        return source
    if not isinstance(source, (str, Path)):
        return DatasetSource.of(source, args=SourceArgs(label=options.label, fields=options.fields))
    return open_source(
        source,
        root=options.root,
        train=options.train,
        demo_images=options.demo_images,
        label=options.label,
        strict=options.strict,
        storage_options=dict(options.storage_options or {}),
        fields=options.fields,
    )


def make_plan(src: Source, options: ConvertOptions) -> Plan:
    fmt = get_format(options.format)
    policy = options.policy
    writer_options = options.resolved_writer_options
    writer = fmt.writer_for(writer_options, policy.ragged)(Path(), len(src), policy.shape, writer_options)
    writer.declare_fields(src.fields, policy.ragged)
    record = plan_record(options.record(), len(src), writer.unit_size, src.fingerprint())
    # The given limit, else this process's (Pillow's, or one the caller set).
    mp = options.max_megapixels
    max_pixels = Image.MAX_IMAGE_PIXELS if mp is None else int(mp * 1e6)
    n = len(src)  # storage position s holds source sample order[s]
    order = (
        np.arange(n)
        if options.storage_order == "source"
        else np.random.default_rng(options.seed).permutation(n)
    )
    errs = scan_errors(src)
    listing = f"{len(errs)} file(s) or folder(s) in the source could not be listed and are not in the cache"
    warnings = [f"{listing} (listed in skipped.json); first: {errs[0][0]}: {errs[0][1]}"] if errs else []
    warnings += source_warnings(src)
    return Plan(options, fmt, src, writer, order.astype(np.int64), record, max_pixels, warnings)


def plan_record(
    options: dict[str, Any], n: int, unit_size: int, fingerprint: str, version: str | None = None
) -> dict[str, Any]:
    """The plan as it reads back from JSON; ``version``: the dlstore that built it (default: this one)."""
    version = __version__ if version is None else version
    plan = {
        "options": options,
        "n": n,
        "unit_size": unit_size,
        "fingerprint": fingerprint,
        "dlstore": version.split(".")[0],
    }
    return json.loads(json.dumps(plan))


def recorded_plan(spec: CacheSpec) -> dict[str, Any] | None:
    """The plan a cache was built from, rebuilt from its manifest; None when it does not say."""
    try:
        options = recorded_options(spec)
    except (SpecError, KeyError, TypeError):  # an older plan this version cannot take as options
        return None
    if options is None:
        return None
    old = spec.source.get("plan") if not spec.options else None
    if isinstance(old, dict):
        return upgraded_plan(old)
    facts = (spec.n_stored, spec.format_options.get("unit_size"), spec.source.get("fingerprint"))
    return plan_record(options.record(), *facts, spec.dlstore_version)  # type: ignore[arg-type]


def upgraded_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan journaled before ``ConvertOptions`` in today's layout (its run resumes); others as they are."""
    if "policy" not in plan:
        return plan
    try:
        options = from_old_plan(plan)
    except (SpecError, KeyError, TypeError):
        return plan  # not one this version can read: the staging refuses it, naming the fix
    # Its "dlstore" is already a major version: "0." splits back to "0".
    facts = (plan.get("n"), plan.get("unit_size"), plan.get("fingerprint"), f"{plan.get('dlstore')}.")
    return plan_record(options.record(), *facts)  # type: ignore[arg-type]


def scan_errors(src: Source) -> list[tuple[str, str]]:
    return list(getattr(src, "scan_errors", []))


def source_warnings(src: Source) -> list[str]:
    """What is legal but almost always a mistake in a source (the bench shows these too)."""
    one = one_class_warning(src)
    return [one] if one else []


def one_class_warning(src: Source) -> str | None:
    """A folder of one class subfolder: every label is 0 (SOURCE is nearly always one level off)."""
    root = getattr(src, "root", None)
    if root is None or len(src.classes) != 1:
        return None
    root = Path(root)
    only = root / src.classes[0]
    return (
        f"{root}: has 1 class subfolder ({src.classes[0]}), so every image gets label 0; SOURCE should be "
        f"the folder whose subfolders are the classes: its parent {root.resolve().parent} if "
        f"{root.name or root} is one class of several, or {only} if that folder holds the classes"
    )


def check_destination(dest: Path, overwrite: bool) -> None:
    if not dest.exists():
        return
    if os.path.ismount(dest):
        raise ConvertError(  # a mount point cannot take the rename that publishes a cache (EBUSY)
            f"{dest}: DEST is a mount point; a cache is published by renaming a folder onto DEST, which a "
            f"mount point cannot take; use a folder inside it as DEST (e.g. {dest / 'cache'})"
        )
    if not dest.is_dir():
        raise CacheExistsError(f"{dest}: exists and is a file; choose another DEST")
    if not (dest / MANIFEST).is_file() and any(dest.iterdir()):  # --overwrite would not help: say so now
        raise CacheExistsError(f"{dest}: not a dlstore cache (no {MANIFEST}); choose another DEST")
    if not overwrite:
        raise CacheExistsError(f"{dest}: already exists; pass --overwrite to replace it")


def check_dest_outside_source(source: str | Path | Source | Any, dest: Path) -> None:
    """A cache inside its source folder would read as a class folder of it the next time."""
    if isinstance(source, (str, Path)):
        root = local_root(source)
    else:
        root = getattr(source, "root", None) if isinstance(source, Source) else None
    if root is not None and dest.resolve().is_relative_to(Path(root).resolve()):
        raise ConvertError(
            f"{dest}: DEST is inside SOURCE {source}; there it would read as a class folder of the source "
            "(to the next conversion and to torchvision's ImageFolder); choose a DEST outside it"
        )


def preflight(writer: CacheWriter, done: set[int], folder: Path) -> list[str]:
    """Warn before any work when the cache will likely not fit on DEST's disk."""
    left = sum(len(writer.unit_range(k)) for k in range(writer.n_units) if k not in done)
    need = left * writer.image_bytes * writer.size_ratio
    free = shutil.disk_usage(folder).free
    if need > free:
        return [
            f"{folder.parent}: the cache needs about {human_bytes(need)} more but only "
            f"{human_bytes(free)} is free; the conversion will stop when the disk fills "
            "(free space, then re-run the same command to resume)"
        ]
    return []


# --- a re-run on a finished DEST: up to date, or refused naming the first difference ---------------------

_REBUILD = "pass --overwrite to rebuild it"


def is_up_to_date(dest: Path, plan: dict[str, Any], src: Source) -> bool:
    """True when DEST's cache was built from this plan; else CacheExistsError naming the difference."""
    return matches_plan(read_spec(dest), str(dest), plan, src, lambda: read_record(dest))


def matches_plan(
    spec: CacheSpec, where: str, plan: dict[str, Any], src: Source, record: Callable[[], SourceRecord | None]
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
    root = getattr(src, "root", None)  # resolved: ``photos/`` and ``/data/photos`` are one source
    now = str(Path(root).resolve()) if root is not None else src.description
    before = spec.source.get("root") or spec.source.get("description")
    if before != now:
        raise CacheExistsError(
            f"{where}: holds a cache of another source: {now} was {before}; pass --overwrite to replace it"
        )
    raise CacheExistsError(
        f"{where}: the source changed since the cache was built: {first_change(record(), src, spec.source)}; {_REBUILD}"
    )


def first_change(record: SourceRecord | None, src: Source, recorded: dict[str, Any] | None = None) -> str:
    """The first changed file, by the manifest's per-container entries, else the per-sample record."""
    before = (recorded or {}).get("entries")
    if isinstance(before, list):
        diff = first_difference(before, src.entries())
    else:
        diff = first_difference(record.rows(), src.entries()) if record is not None else None
    return f"first changed file {diff}" if diff else "its files differ"
