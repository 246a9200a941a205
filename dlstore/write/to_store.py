"""``convert`` to a URL: a re-run of a finished conversion is "up to date"; else the cache is
built in a local spool folder and published (``publish.py``)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dlstore.errors import CacheExistsError, DlstoreError
from dlstore.sourcefiles import SourceRecord, read_record
from dlstore.spec import SKIPPED_FILE, SOURCE_RECORD, CacheSpec
from dlstore.storage.mirror import fetch_manifest
from dlstore.storage.stores import RemoteStore, RemoteStoreError
from dlstore.write.conversion import convert_locally
from dlstore.write.conversion_plan import Plan, make_plan, open_plan_source
from dlstore.write.finish import ConvertResult, unchanged_result
from dlstore.write.options import ConvertOptions
from dlstore.write.progress import Progress
from dlstore.write.publish import check_ownership, check_writable, publish, spool_dir
from dlstore.write.rerun import matches_plan
from dlstore.write.sources import Source

Log = Callable[[str], None]


def convert_to_store(
    source: str | Path | Source,
    url: str,
    options: ConvertOptions,
    progress: Progress | None,
    log: Log | None,
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
            return remote_unchanged_result(store, spec, plan, sum(there.objects.values()), t0)
    check_writable(store)
    spool = spool_dir(url)
    result = build_spool(src, spool, options, store, progress, log)
    published = publish(spool, store, options.overwrite, log, progress)
    result.bytes_on_disk, result.dest, result.up_to_date = published.bytes, url, False
    result.resumed_upload = published.already_staged
    shutil.rmtree(spool.parent, ignore_errors=True)
    return result


def build_spool(
    src: Source,
    spool: Path,
    options: ConvertOptions,
    store: RemoteStore,
    progress: Progress | None,
    log: Log | None,
) -> ConvertResult:
    """The cache in the spool folder; with a scheduler the workers write the units to the store."""
    local = replace(options, overwrite=False, storage_options=None)
    unit_store = RemoteStore(store.url, store.storage_options) if options.scheduler is not None else None
    try:  # a spool built by an interrupted attempt with the same options is up to date
        return convert_locally(src, spool, local, progress, log, unit_store)
    except CacheExistsError:  # built with other options: replace it
        return convert_locally(src, spool, replace(local, overwrite=True), progress, log, unit_store)


def remote_record(store: RemoteStore) -> SourceRecord | None:
    """The remote cache's source record (to name the first changed file), fetched to a temp folder."""
    with tempfile.TemporaryDirectory(prefix="dlstore-record-") as tmp:
        try:
            (Path(tmp) / SOURCE_RECORD).write_bytes(store.get_bytes(SOURCE_RECORD))
        except FileNotFoundError:
            return None
        return read_record(Path(tmp))


def remote_unchanged_result(
    store: RemoteStore, spec: CacheSpec, plan: Plan, size: int, t0: float
) -> ConvertResult:
    try:
        skipped = json.loads(store.get_bytes(SKIPPED_FILE))
    except (FileNotFoundError, ValueError):
        skipped = []
    return unchanged_result(store.url, spec, skipped, size, plan, t0, up_to_date=True)
