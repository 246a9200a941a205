"""Phase 3 of a conversion, the finish: labels, positions, source record and checksums beside the
units, the manifest last (it declares the cache complete); and the result a conversion returns."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dlstore import __version__
from dlstore.checksums import checksum_keys, checksum_tree, split_key
from dlstore.durable import fsync_path, save_npy_durably, sync_tree, write_json_durably
from dlstore.formats.base import CacheWriter
from dlstore.sourcefiles import DIGEST_BYTES, SourceRecord
from dlstore.spec import (
    LABELS_FILE,
    MANIFEST,
    POSITIONS_FILE,
    SKIPPED_FILE,
    SOURCE_RECORD,
    CacheSpec,
    ImagePolicy,
    read_spec,
)
from dlstore.write.conversion_plan import Plan, scan_errors
from dlstore.write.sources import Source
from dlstore.write.staging import Staging


@dataclass
class ConvertResult:
    """What a conversion did; the CLI renders it, tests assert on it."""

    dest: str
    format: str
    n: int
    n_skipped: int
    classes: list[str]
    shape: list[int]
    bytes_on_disk: int
    seconds: float
    images_per_s: float
    workers: int
    resumed_units: int = 0
    resumed_images: int = 0  # images of those units: what a user counts
    workers_reason: str = ""  # why ``workers`` (e.g. fewer units than workers asked for)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    up_to_date: bool = False  # DEST already held this cache (same source and options): nothing done
    resumed_upload: int = 0  # objects of a URL DEST that an interrupted upload had already staged
    # Where the time went (seconds): main-process phases, and worker time summed over workers.
    stages: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def finalize(
    plan: Plan,
    staging: Staging,
    bad: list[dict[str, Any]],
    stages: dict[str, float],
    remote_sums: dict[str, str] | None = None,
) -> CacheSpec:
    """Everything beside the units, durably, then the manifest (``remote_sums``: units on a store)."""
    t_start = time.perf_counter()
    src, writer, order, policy = plan.src, plan.writer, plan.order, plan.options.policy
    root = staging.path
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    bad_sources = np.asarray([b["index"] for b in bad], dtype=np.int64)
    labels = src.labels.astype(np.int64)[order]  # in storage order; -1 marks a skipped image
    labels[inverse[bad_sources]] = -1
    good = np.ones(len(order), dtype=bool)
    good[bad_sources] = False
    positions = inverse[good]  # dataset index → storage (setdiff1d would cost a 0.3 s lazy import)
    dropped = writer.finish_fields()
    writer.finish(labels)
    writer.describe(format_attributes(src, policy, len(src) - len(bad)), positions)
    t_meta = time.perf_counter()
    save_npy_durably(root / LABELS_FILE, narrow_index(labels))
    save_npy_durably(root / POSITIONS_FILE, narrow_index(positions))
    source_record(src, staging, writer, order).save(root / SOURCE_RECORD)
    write_json_durably(root / SKIPPED_FILE, json.dumps(bad + unlisted(src), indent=1))
    for p in list(root.rglob("*")):  # temp files of writers killed mid-write
        if p.is_file() and _TEMP_NAME.search(p.name):
            p.unlink()
    t0 = time.perf_counter()
    sync_tree(root)  # every data file durable before the manifest that declares the cache complete
    t1 = time.perf_counter()
    checksums = cache_checksums(root, writer, staging)
    if remote_sums is not None:
        checksums = dict(sorted({**checksums, **remote_sums}.items()))
    stages.update(
        finalize_writer_s=t_meta - t_start,
        finalize_metadata_s=t0 - t_meta,
        sync_tree_s=t1 - t0,
        checksums_s=time.perf_counter() - t1,
    )
    declared = {o.name for o in plan.fmt.options}  # the writer's own facts beyond its options (unit size)
    facts = {k: v for k, v in writer.recorded_options().items() if k not in declared}
    spec = CacheSpec(
        format=plan.fmt.name,
        n=len(src) - len(bad),
        n_stored=len(src),
        shape=policy.shape,
        classes=tuple(src.classes),
        image=policy,
        format_options=facts,
        source={**src.info(), **root_facts(src)},
        checksums=checksums,
        dlstore_version=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        options=staging.plan["options"],  # the plan's record: a re-run rebuilds the same plan from it
        fields={k: replace(f, dropped=dropped.get(k, 0)) for k, f in src.fields.items()},
    )
    fsync_path(root)
    write_json_durably(root / MANIFEST, spec.to_json())
    return spec


def cache_checksums(root: Path, writer: CacheWriter, staging: Staging) -> dict[str, str]:
    """Every file's checksums; a unit's as its worker took them (else read here)."""
    unit_keys = [key for k in range(writer.n_units) for key in writer.unit_checksum_keys(k)]
    covered = tuple(sorted({split_key(key)[0] for key in unit_keys}))
    known = {key: d for sums in staging.unit_sums.values() for key, d in sums.items()}
    out = checksum_tree(root, exclude=(MANIFEST, *covered))
    computed = checksum_keys(root, [key for key in unit_keys if key not in known])
    out.update({key: known.get(key) or computed[key] for key in unit_keys})
    return out


def source_record(src: Source, staging: Staging, writer: CacheWriter, order: np.ndarray) -> SourceRecord:
    """Per sample in source order: name, size, mtime_ns, label and the sha256 of the bytes decoded."""
    digests = np.zeros((len(src), DIGEST_BYTES), np.uint8)
    for k, packed in staging.digests.items():
        got = np.frombuffer(packed, np.uint8).reshape(-1, DIGEST_BYTES)
        r = writer.unit_range(k)
        digests[order[r.start : r.start + len(got)]] = got
    stats = np.asarray(src.stats, np.int64).reshape(-1, 2) if src.stats else np.zeros((len(src), 2), np.int64)
    record = SourceRecord.from_columns(src.names, stats[:, 0], stats[:, 1], src.labels, [])
    record.digests = digests
    return record


def format_attributes(src: Source, policy: ImagePolicy, n: int) -> dict[str, Any]:
    """What a format records in its own metadata for tools that do not know dlstore."""
    return {
        "classes": list(src.classes),
        "policy": asdict(policy),
        "shape": list(policy.shape),
        "n": n,
        "n_stored": len(src),
        "source": {k: v for k, v in src.info().items() if k in ("kind", "description", "count")},
        "labels": "label per stored image, storage order; -1 marks an image skipped as undecodable",
        "positions": "storage row of each dataset index: images[positions[i]] is sample i",
        "dlstore_version": __version__,
    }


def root_facts(src: Source) -> dict[str, Any]:
    """A folder source's root and mtime, for the one-``stat`` check on open."""
    root = getattr(src, "root", None)
    if root is None or not getattr(src, "folder_tree", True):  # images listed by a file: no tree to rescan
        return {}
    facts: dict[str, Any] = {"root": str(Path(root).resolve())}
    mtime = getattr(src, "root_mtime_ns", 0)
    if mtime:
        facts["root_mtime_ns"] = mtime
    return facts


def unlisted(src: Source) -> list[dict[str, Any]]:
    return [{"index": None, "path": p, "reason": r} for p, r in scan_errors(src)]


# Temp files of writers killed mid-write: ours (hidden or ``.tmpPID``) and zarr's ``.partial``.
_TEMP_NAME = re.compile(r"^\.|\.tmp\d+$|\.partial$")


def narrow_index(array: np.ndarray) -> np.ndarray:
    """Index arrays as int32 when they fit (readers widen them)."""
    if array.dtype.kind == "i" and (array.size == 0 or (array.min() >= -(2**31) and array.max() < 2**31)):
        return array.astype(np.int32)
    return array


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def converted_result(
    plan: Plan,
    dest: Path,
    spec: CacheSpec,
    bad: list[dict[str, Any]],
    todo: list[int],
    workers: int,
    t0: float,
    stages: dict[str, float],
) -> ConvertResult:
    seconds = time.perf_counter() - t0
    converted = sum(len(plan.writer.unit_range(k)) for k in todo)
    more = dict(
        seconds=seconds, images_per_s=converted / max(seconds, 1e-9), resumed_images=plan.writer.n - converted
    )
    more.update(resumed_units=plan.writer.n_units - len(todo), workers=workers, stages=stages)
    return unchanged_result(str(dest), spec, bad, dir_bytes(dest), plan, t0, False, **more)


def unchanged_result(
    dest: str,
    spec: CacheSpec,
    skipped: list[dict[str, Any]],
    size: int,
    plan: Plan,
    t0: float,
    up_to_date: bool,
    **more: Any,
) -> ConvertResult:
    """The result of a run (``more``: its figures), or of one that found the cache already built."""
    result = {"dest": dest, "format": spec.format, "n": spec.n, "n_skipped": spec.n_stored - spec.n}
    result.update(classes=list(spec.classes), shape=list(spec.shape), bytes_on_disk=size, skipped=skipped)
    result.update(seconds=time.perf_counter() - t0, images_per_s=0.0, workers=0, up_to_date=up_to_date)
    return ConvertResult(
        **{**result, "resumed_units": plan.writer.n_units, "warnings": plan.warnings, **more}
    )


def local_unchanged_result(dest: Path, plan: Plan, t0: float, up_to_date: bool = False) -> ConvertResult:
    skipped = json.loads((dest / SKIPPED_FILE).read_text())
    return unchanged_result(str(dest), read_spec(dest), skipped, dir_bytes(dest), plan, t0, up_to_date)
