"""``convert``: source → pre-resized cache, through a staging folder. Plan (``conversion_plan``), run
(``runners``: pool, this process or Dask; workers write whole units), finish (``finish``: manifest
last); the cache appears at DEST by one rename and an interrupted run resumes. A URL DEST is built in
a local spool folder, then published (``publish``)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dlstore.errors import CacheExistsError, ConvertInterrupted, DlstoreError
from dlstore.formats.base import CacheWriter
from dlstore.sourcefiles import SourceRecord, read_record
from dlstore.spec import MANIFEST, SKIPPED_FILE, SOURCE_RECORD, CacheSpec
from dlstore.storage.mirror import fetch_manifest
from dlstore.storage.stores import RemoteStore, RemoteStoreError, parse_store_path
from dlstore.write.conversion_plan import (
    Plan,
    check_dest_outside_source,
    check_destination,
    is_up_to_date,
    make_plan,
    matches_plan,
    open_plan_source,
    preflight,
)
from dlstore.write.diskfull import disk_full_as_error
from dlstore.write.finish import (
    ConvertResult,
    converted_result,
    finalize,
    local_unchanged_result,
    unchanged_result,
)
from dlstore.write.options import ConvertOptions, fold_shortcuts
from dlstore.write.progress import IMAGES, Progress, ProgressCounter
from dlstore.write.publish import check_ownership, check_writable, publish, spool_dir
from dlstore.write.runners import (
    Runner,
    UnitLedger,
    check_bad_fraction,
    done_images,
    local_runner,
    run_units,
    workers_reason,
)
from dlstore.write.sources import Source
from dlstore.write.staging import Staging
from dlstore.write.store_units import StoreUnits, journaled_sums, units_prefix
from dlstore.write.unit_work import Job

__all__ = ["ConvertOptions", "ConvertResult", "convert"]

Log = Callable[[str], None]


def convert(
    source: str | Path | Source,
    dest: str | Path,
    options: ConvertOptions | None = None,
    *,
    progress: Progress | None = None,
    log: Log | None = None,
    **shortcuts: Any,
) -> ConvertResult:
    """Convert SOURCE (a SOURCE argument, a Source or a map-style Dataset) into a cache at DEST, as
    ``options`` (``ConvertOptions``) say, or keywords that are its fields (``convert(src, dest,
    size=64)``), not both.

    Undecodable images are skipped and listed in ``skipped.json`` (``strict`` stops, ``max_bad``
    aborts). A finished DEST is make-like: the same source and options are "up to date", others are
    refused, naming the first difference, until ``overwrite``. DEST may be a URL (``s3://bucket/prefix``).
    ``progress`` receives ``ConvertProgress`` events (images written, then bytes uploaded); ``log`` the
    warnings.

    >>> convert("photos/", "cache/", ConvertOptions(size=128, format="zarr"))     # doctest: +SKIP"""
    options = fold_shortcuts(options, shortcuts)
    target = parse_store_path(dest)
    if isinstance(target, str):
        return convert_to_store(source, target, options, progress, log)
    return convert_locally(source, target, options, progress, log)


def convert_locally(
    source: str | Path | Source,
    dest: Path,
    options: ConvertOptions,
    progress: Progress | None = None,
    log: Log | None = None,
    unit_store: RemoteStore | None = None,
) -> ConvertResult:
    """``convert`` to a local folder; ``unit_store``: where Dask workers write the units of a URL DEST."""
    t0, t0_mono = time.perf_counter(), time.monotonic()
    # A local cluster boots while the source is scanned; a re-run that may be up to date starts none yet.
    rerun = not Staging.pending(dest) and not options.overwrite and (dest / MANIFEST).is_file()
    dask = None
    if options.scheduler is not None:
        from dlstore.write.dask_engine import DaskRunner

        dask = DaskRunner(options.scheduler, start=not rerun)
    try:
        with disk_full_as_error(dest.parent, f"setting up {dest.name}"):
            check_dest_outside_source(source, dest)
            if not Staging.pending(dest) and not rerun:
                check_destination(dest, options.overwrite)
            src = open_plan_source(source, options)
            stages = {"setup_scan_s": time.perf_counter() - t0}
            plan = make_plan(src, options)
            stages["setup_plan_s"] = time.perf_counter() - t0 - stages["setup_scan_s"]
            if rerun and is_up_to_date(dest, plan.record, src):
                return local_unchanged_result(dest, plan, t0, up_to_date=True)
            return build(plan, dest, dask, unit_store, progress, log, (t0, t0_mono, stages))
    finally:
        if dask is not None:
            dask.close()


def build(
    plan: Plan,
    dest: Path,
    dask: Runner | None,
    unit_store: RemoteStore | None,
    progress: Progress | None,
    log: Log | None,
    clock: tuple[float, float, dict[str, float]],
) -> ConvertResult:
    """Stage, run, finish and publish the plan at DEST (resuming a staged run of the same plan)."""
    t0, t0_mono, stages = clock
    overwrite, writer = plan.options.overwrite, plan.writer
    entries = plan.src.entries_json()
    with (
        Staging(dest, plan.record, discard_mismatch=overwrite, entries=entries) as staging,
        disk_full_as_error(staging.path, "writing the cache", writer.n * writer.image_bytes),
    ):
        if staging.already_published:
            return local_unchanged_result(dest, plan, t0)
        check_destination(dest, overwrite)
        t_create = time.perf_counter()
        stages["setup_staging_s"] = t_create - t0 - stages["setup_scan_s"] - stages["setup_plan_s"]
        writer.root = staging.path  # the layout: made now, or as a resumed run recorded it
        saved = None if staging.fresh else staging.writer_options()
        if saved is None:  # fresh, or killed before the layout was recorded (then no unit was written)
            writer.create()
            writer.create_fields()
            staging.save_writer_options(writer.options)
        else:
            writer.options = saved
        stages["setup_create_s"] = time.perf_counter() - t_create
        store_units = units_on_store(unit_store, dask is not None, writer, staging)
        plan.warnings += preflight(writer, set(staging.done), staging.path)
        for w in plan.warnings:
            if log:
                log(w)
        todo = [k for k in range(writer.n_units) if k not in staging.done]
        counter = ProgressCounter(progress, IMAGES, "images", writer.n, done_images(writer, staging))
        t_stage = time.perf_counter()
        plan.src.stage(plan.order, writer.unit_size, staging.journal / "source-spool", todo)
        stages["setup_source_s"] = time.perf_counter() - t_stage
        o = plan.options
        job = Job(
            plan.src,
            o.policy,
            writer,
            o.strict,
            o.decode_timeout,
            plan.order,
            False,
            store_units,
            plan.max_pixels,
        )
        ledger = UnitLedger(len(plan.src), plan.options.max_bad, staging)
        stages["setup_s"] = time.perf_counter() - t0
        runner = dask if dask is not None else local_runner(plan.options.workers, len(todo))
        n_workers = runner.start(len(todo))
        why_workers = workers_reason(
            plan.options.workers, n_workers, len(todo), writer.unit_size, dask is not None
        )
        run_units(runner, job, todo, staging, ledger, counter)
        stages.update(ledger.stages(n_workers))
        stages.update(runner.finish(t0_mono))
        bad = staging.bad()
        check_bad_fraction(bad, len(plan.src), plan.options.max_bad)
        remote_sums = journaled_sums(staging.journal, set(staging.done)) if store_units else None
        spec = finish(plan, staging, bad, stages, remote_sums)
    result = converted_result(plan, dest, spec, bad, todo, n_workers, t0, stages)
    result.workers_reason = why_workers
    return result


def finish(
    plan: Plan,
    staging: Staging,
    bad: list[dict[str, Any]],
    stages: dict[str, float],
    remote_sums: dict[str, str] | None,
) -> CacheSpec:
    """Finish the cache and publish it at DEST; a full disk or Ctrl-C here is one clear message."""
    try:
        w = plan.writer
        with disk_full_as_error(
            w.root, "finishing the cache (labels, checksums, manifest)", w.n * w.image_bytes
        ):
            t_fin = time.perf_counter()
            spec = finalize(plan, staging, bad, stages, remote_sums)
            stages["finalize_s"] = time.perf_counter() - t_fin
            staging.commit(plan.options.overwrite)
            stages["commit_s"] = time.perf_counter() - t_fin - stages["finalize_s"]
            return spec
    except KeyboardInterrupt:
        raise ConvertInterrupted(
            f"interrupted: {done_images(plan.writer, staging)} of {plan.writer.n} done (while finishing); "
            "re-run the same command to resume"
        ) from None


def units_on_store(
    store: RemoteStore | None, on_dask: bool, writer: CacheWriter, staging: Staging
) -> StoreUnits | None:
    """Where Dask workers write a URL DEST's units; None: to the spool (as without them)."""
    if store is None or not on_dask or not writer.units_are_own_files or writer.fields:
        return None
    units = StoreUnits(store, units_prefix(staging.plan))
    units.capture(writer.root)
    return units


# --- a URL DEST: built in a local spool folder, then published (publish.py) ------------------------------


def convert_to_store(
    source: str | Path | Source, url: str, options: ConvertOptions, progress: Progress | None, log: Log | None
) -> ConvertResult:
    """Build locally (resumable, as any conversion), publish to ``url``, drop the spool folder."""
    store = RemoteStore(url, dict(options.storage_options or {}))
    try:
        return build_and_publish(source, store, options, progress, log)
    except FileNotFoundError as e:
        on_store = str(e.filename or "").startswith((url.rstrip("/"), store.key("")))
        if isinstance(e, DlstoreError) or not on_store:  # worded already, or a local file's
            raise
        # An object of this run gone (an outage): all that was built is in the spool, so a re-run resumes.
        raise RemoteStoreError(
            f"{e.filename or url}: an object of this conversion is missing from the store (lost in an "
            "outage or removed meanwhile); re-run the same command to resume"
        ) from None


def build_and_publish(
    source: str | Path | Source,
    store: RemoteStore,
    options: ConvertOptions,
    progress: Progress | None,
    log: Log | None,
) -> ConvertResult:
    t0 = time.perf_counter()
    url = store.url
    there = check_ownership(store)  # refuse before any work
    src = open_plan_source(source, options)
    if there.has_cache and not options.overwrite:  # make-like, as a local DEST
        plan = make_plan(src, options)
        _, spec = fetch_manifest(store)
        if matches_plan(spec, store.url, plan.record, src, lambda: remote_record(store)):
            try:
                skipped = json.loads(store.get_bytes(SKIPPED_FILE))
            except (FileNotFoundError, ValueError):
                skipped = []
            return unchanged_result(
                url, spec, skipped, sum(there.objects.values()), plan, t0, up_to_date=True
            )
    check_writable(store)
    spool = spool_dir(url)
    # The cache in the spool folder; with a scheduler the workers write the units to the store.
    local = replace(options, overwrite=False, storage_options=None)
    unit_store = RemoteStore(store.url, store.storage_options) if options.scheduler is not None else None
    try:  # a spool built by an interrupted attempt with the same options is up to date
        result = convert_locally(src, spool, local, progress, log, unit_store)
    except CacheExistsError:  # built with other options: replace it
        result = convert_locally(src, spool, replace(local, overwrite=True), progress, log, unit_store)
    published = publish(spool, store, options.overwrite, log, progress)
    result.bytes_on_disk, result.dest, result.up_to_date = published.bytes, url, False
    result.resumed_upload = published.already_staged
    shutil.rmtree(spool.parent, ignore_errors=True)
    return result


def remote_record(store: RemoteStore) -> SourceRecord | None:
    """The remote cache's source record (to name the first changed file), fetched to a temp folder."""
    with tempfile.TemporaryDirectory(prefix="dlstore-record-") as tmp:
        try:
            (Path(tmp) / SOURCE_RECORD).write_bytes(store.get_bytes(SOURCE_RECORD))
        except FileNotFoundError:
            return None
        return read_record(Path(tmp))
