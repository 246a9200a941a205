"""``convert``: source → pre-resized cache, in parallel, through a staging directory.

Work is split into the format's units (shard, chunk, slab). Worker processes decode a unit's images
and write that unit themselves, so pixels never cross a pipe; the main process only journals which
units are done. The cache appears at DEST by one rename, after its manifest, so DEST is either absent,
the previous cache, or the new complete one. An interrupted run leaves the staging directory and its
journal next to DEST; the same command resumes it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any
from warnings import warn

import numpy as np
from PIL import Image

from dlstore import __version__
from dlstore.checksums import checksum_keys, checksum_tree, split_key
from dlstore.convert.dask_engine import (
    EarlyClient,
    count_workers,
    dask_timeline,
    is_killed_worker,
    parse_scheduler,
    run_on_dask,
)
from dlstore.convert.rerun import is_up_to_date
from dlstore.convert.sizes import human_bytes
from dlstore.convert.sources import Source, open_source
from dlstore.convert.staging import Staging
from dlstore.convert.store_units import (
    StoreUnits,
    convert_unit_to_store,
    convert_unit_to_store_in_process,
    journal_sums,
    journaled_sums,
    strip_sums,
    units_prefix,
)
from dlstore.convert.unit_work import (
    Job,
    UnitResult,
    _init_worker,
    convert_job_unit,
    convert_unit,
    disk_full_as_error,
)
from dlstore.durable import fsync_path, save_npy_durably, sync_tree, write_json_durably
from dlstore.errors import CacheExistsError, ConvertError, ImageDecodeError, SpecError, require_extra
from dlstore.formats import DEFAULT_FORMAT, get_format
from dlstore.formats.base import CacheWriter
from dlstore.machine import usable_cores
from dlstore.sourcefiles import SourceRecord
from dlstore.spec import (
    LABELS_FILE,
    MANIFEST,
    POSITIONS_FILE,
    SKIPPED_FILE,
    SOURCE_RECORD,
    STORAGE_ORDERS,
    CacheSpec,
    ImagePolicy,
    read_spec,
)
from dlstore.storage.stores import parse_store_path

Progress = Callable[[int], None]
Log = Callable[[str], None]
DECODE_TIMEOUT_S = 60.0


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
    skipped: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    up_to_date: bool = False  # DEST already held this cache (same source and options): nothing done
    # Where the time went (seconds): main-process phases, and worker time summed over workers.
    stages: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def convert(
    source: str | Path | Source,
    dest: str | Path,
    *,
    format: str = DEFAULT_FORMAT,
    size: int,
    resize: str = "crop",
    channels: int = 3,
    decode: str = "exact",
    codec: str | None = None,
    options: dict[str, Any] | None = None,
    compress: bool | None = None,
    max_side: int | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    root: Path | None = None,
    train: bool = True,
    demo_images: int = 512,
    strict: bool = False,
    max_bad: float = 0.5,
    storage_order: str = "shuffled",
    seed: int = 0,
    decode_timeout: float = DECODE_TIMEOUT_S,
    max_megapixels: float | None = None,
    scheduler: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    log: Log | None = None,
    unit_store: Any = None,
) -> ConvertResult:
    """Convert SOURCE (folder, ``torchvision:NAME``, ``demo`` or a Source) into a cache at DEST.

    ``decode="exact"`` (default) gives torchvision's ``Resize`` + ``CenterCrop`` pixels exactly;
    ``decode="fast"`` DCT-scales large JPEGs while decoding (faster, a bounded error; recorded in the
    manifest's image policy).

    ``storage_order="shuffled"`` (default) stores images in a seeded random order, so every chunk
    or shard holds a mix of classes and a chunk-aware sampler stays close to a full shuffle; dataset
    index ``i`` is still source sample ``i`` (``positions.npy`` maps it to storage).

    Undecodable images are skipped and reported (``skipped.json``); ``strict`` stops at the first one
    instead, and more than ``max_bad`` (a fraction of all images) aborts. A file whose decoding takes
    longer than ``decode_timeout`` seconds counts as undecodable. A file larger than Pillow's
    decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``, 89.5 MP) is refused before decoding, as
    undecodable; ``max_megapixels`` raises (or lowers) that limit for this conversion, e.g. for 108 MP
    phone photographs. ``log`` receives warnings as they arise (before the work starts, for the
    disk-space estimate).

    ``codec`` and ``options`` are the format's declared writer options (``dlstore.formats``: e.g.
    zarr zstd|lz4|none, npz deflate|none); what the format does not take is refused, what is not given
    takes the format's default. ``compress=True`` is the deprecated spelling of npz ``codec="deflate"``.

    ``scheduler`` runs the units as Dask tasks instead of in the built-in process pool: ``local``,
    ``local:N`` (a LocalCluster of N worker processes) or ``tcp://HOST:PORT`` (a running cluster whose
    workers see SOURCE and DEST); needs ``pip install 'dlstore[dask]'``. See ``dask_engine``.

    DEST may be a URL (``s3://bucket/prefix``; credentials from the environment or
    ``storage_options``): the cache is built in a local spool folder with all of the above, then
    published by the protocol in ``dlstore.convert.publish`` (staging prefix, manifest last, resumable).
    With ``scheduler`` as well, the workers write the units to the store themselves and only the small
    files are spooled (``dlstore.convert.store_units``; ``unit_store`` is that internal hand-over).

    >>> convert("photos/", "cache/", format="zarr", size=128)     # doctest: +SKIP
    """
    given = dict(locals())  # exactly the arguments: a URL DEST re-runs this with a local spool folder
    if max_megapixels is not None and not max_megapixels > 0:
        raise SpecError(f"max_megapixels must be a positive number of megapixels, got {max_megapixels}")
    # The limit every worker applies: the given one, else this process's (Pillow's, or the caller's own).
    max_pixels = Image.MAX_IMAGE_PIXELS if max_megapixels is None else int(max_megapixels * 1e6)
    t0, t0_mono = time.perf_counter(), time.monotonic()
    stages: dict[str, float] = {}
    dest = parse_store_path(dest)
    if isinstance(dest, str):
        from dlstore.convert.publish import convert_to_store

        def build_locally(spool: Path) -> ConvertResult:
            local = {**given, "dest": spool, "storage_options": None, "overwrite": False}
            if scheduler is not None:  # the workers write the units to the store, not to the spool
                from dlstore.storage.stores import RemoteStore

                local["unit_store"] = RemoteStore(dest, storage_options)
            try:  # a spool built by an interrupted attempt with the same options is up to date
                return convert(**local)
            except CacheExistsError:  # built with other options: replace it
                return convert(**{**local, "overwrite": True})

        return convert_to_store(dest, storage_options, overwrite, log, build_locally)
    fmt = get_format(format)
    policy = ImagePolicy(size=size, resize=resize, channels=channels, decode=decode, max_side=max_side)
    cluster = parse_scheduler(scheduler) if scheduler is not None else None
    if cluster is not None:
        require_extra("distributed", "dask", "--scheduler")
    # A local cluster starts in the background while the source is scanned and the plan staged
    # (a LocalCluster of 16 takes seconds); a re-run that may be up to date starts none yet.
    rerun_maybe = not Staging.pending(dest) and not overwrite and (dest / MANIFEST).is_file()
    early = EarlyClient(cluster, start=not rerun_maybe) if cluster is not None else None
    try:
        check_dest_outside_source(source, dest)
        pending = Staging.pending(dest)
        rerun = not pending and not overwrite and (dest / MANIFEST).is_file()
        if not pending and not rerun:
            check_destination(dest, overwrite)
        src = (
            source
            if isinstance(source, Source)
            else open_source(source, root=root, train=train, demo_images=demo_images)
        )
        stages["setup_scan_s"] = time.perf_counter() - t0
        options = fmt.writer.parse_options(requested_options(codec, options, compress))
        writer = fmt.writer_for(options, policy.ragged)(Path(), len(src), policy.shape, options)
        order = storage_permutation(len(src), storage_order, seed)
        plan = {
            "storage_order": storage_order,
            "seed": seed,
            "format": fmt.name,
            "policy": asdict(policy),
            "options": options,
            "n": len(src),
            "unit_size": writer.unit_size,
            "fingerprint": src.fingerprint(),
            "dlstore": __version__.split(".")[0],
        }
        if max_megapixels is not None:  # only when given: the default keeps earlier plans' digests
            plan["max_megapixels"] = max_megapixels
        warnings = [scan_warning(src)] if scan_errors(src) else []
        stages["setup_plan_s"] = time.perf_counter() - t0 - stages["setup_scan_s"]
        if rerun and is_up_to_date(dest, Staging.normalised(plan), src):
            return published_result(dest, fmt.name, src, t0, writer.n_units, warnings, up_to_date=True)
        with Staging(dest, plan, discard_mismatch=overwrite, entries=src.entries_json()) as staging:
            if staging.already_published:
                return published_result(dest, fmt.name, src, t0, writer.n_units, warnings)
            check_destination(dest, overwrite)
            writer.root = staging.path
            t_create = time.perf_counter()
            stages["setup_staging_s"] = t_create - t0 - stages["setup_scan_s"] - stages["setup_plan_s"]
            saved = None if staging.fresh else staging.writer_options()
            if saved is None:  # fresh, or killed before the layout was recorded (then no unit was written)
                writer.create()
                staging.save_writer_options(writer.options)
            else:
                writer.options = saved
            stages["setup_create_s"] = time.perf_counter() - t_create
            store_units = units_on_store(unit_store, cluster is not None, writer, staging)
            warnings += preflight(writer, staging)
            for w in warnings:
                if log:
                    log(w)
            todo = [k for k in range(writer.n_units) if k not in staging.done]
            if progress:
                progress(sum(len(writer.unit_range(k)) for k in staging.done))
            job = Job(
                src,
                policy,
                writer,
                strict,
                decode_timeout,
                order,
                store_units=store_units,
                max_pixels=max_pixels,
            )
            budget = BadBudget(len(src), max_bad, staging)
            stages["setup_s"] = time.perf_counter() - t0
            if cluster is None:
                n_workers = resolve_workers(workers, len(todo))
                run_units(job, todo, n_workers, staging, budget, progress)
                stages.update(budget.stages(n_workers))
            else:
                assert early is not None
                t_wait = time.perf_counter()
                client = early.client()
                stages["dask_start_wait_s"] = time.perf_counter() - t_wait
                n_workers = count_workers(client)
                run_units(job, todo, n_workers, staging, budget, progress, client, early.stamps)
                stages.update(budget.stages(n_workers))
                t_close = time.perf_counter()
                early.close()  # the cluster stops before finishing, as it always did
                stages["dask_close_s"] = time.perf_counter() - t_close
                stages.update(dask_timeline(early.stamps, t0_mono))
            bad = staging.bad()
            check_bad_fraction(bad, len(src), max_bad)
            try:
                with disk_full_as_error(writer, "finishing the cache (labels, checksums, manifest)"):
                    t_fin = time.perf_counter()
                    remote_sums = journaled_sums(staging.journal, set(staging.done)) if store_units else None
                    spec = finalize(src, policy, writer, fmt.name, staging, bad, order, stages, remote_sums)
                    stages["finalize_s"] = time.perf_counter() - t_fin
                    staging.commit(overwrite)
                    stages["commit_s"] = time.perf_counter() - t_fin - stages["finalize_s"]
            except KeyboardInterrupt:
                raise ConvertError(
                    f"interrupted: {done_images(writer, staging)} of {writer.n} done (while finishing); "
                    "re-run the same command to resume"
                ) from None
    finally:
        if early is not None:
            early.close()
    seconds = time.perf_counter() - t0
    converted = sum(len(writer.unit_range(k)) for k in todo)
    return ConvertResult(
        dest=str(dest),
        format=fmt.name,
        n=spec.n,
        n_skipped=len(bad),
        classes=list(src.classes),
        shape=list(policy.shape),
        bytes_on_disk=dir_bytes(dest),
        seconds=seconds,
        images_per_s=converted / max(seconds, 1e-9),
        workers=n_workers,
        resumed_units=writer.n_units - len(todo),
        skipped=bad,
        warnings=warnings,
        stages=stages,
    )


def published_result(
    dest: Path, fmt: str, src: Source, t0: float, n_units: int, warnings: list[str], up_to_date: bool = False
) -> ConvertResult:
    """The result for a re-run whose previous attempt finished (``up_to_date``) or was killed after
    DEST was already published: no work done."""
    spec = read_spec(dest)
    skipped = json.loads((dest / SKIPPED_FILE).read_text())
    return ConvertResult(
        dest=str(dest),
        format=fmt,
        n=spec.n,
        n_skipped=spec.n_stored - spec.n,
        classes=list(spec.classes),
        shape=list(spec.shape),
        bytes_on_disk=dir_bytes(dest),
        seconds=time.perf_counter() - t0,
        images_per_s=0.0,
        workers=0,
        resumed_units=n_units,
        skipped=skipped,
        warnings=warnings,
        up_to_date=up_to_date,
    )


def scan_errors(src: Source) -> list[tuple[str, str]]:
    return list(getattr(src, "scan_errors", []))


def scan_warning(src: Source) -> str:
    errs = scan_errors(src)
    path, reason = errs[0]
    return (
        f"{len(errs)} file(s) or folder(s) in the source could not be listed and are not in the cache "
        f"(listed in skipped.json); first: {path}: {reason}"
    )


def units_on_store(store: Any, on_dask: bool, writer: CacheWriter, staging: Staging) -> StoreUnits | None:
    """Where Dask workers write the units of a URL destination, or None: units go to the spool (no
    URL, no scheduler, or a writer whose units are not files of their own)."""
    if store is None or not on_dask or not writer.units_are_own_files:
        return None
    units = StoreUnits(store, units_prefix(staging.plan))
    units.capture(writer.root)
    return units


def plan_digest(plan: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def check_destination(dest: Path, overwrite: bool) -> None:
    if not dest.exists():
        return
    if not overwrite:
        raise CacheExistsError(f"{dest}: already exists; pass --overwrite to replace it")
    if dest.is_dir() and not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        raise CacheExistsError(
            f"{dest}: exists and is not a dlstore cache (no {MANIFEST}); "
            "refusing to replace it even with --overwrite; choose another DEST"
        )
    if not dest.is_dir():
        raise CacheExistsError(f"{dest}: exists and is a file; choose another DEST")


def check_dest_outside_source(source: str | Path | Source, dest: Path) -> None:
    """A cache inside the folder it is made from would be a class folder of that folder the next time it
    is read, by the next conversion and by ImageFolder alike."""
    if isinstance(source, Source):
        root = getattr(source, "root", None)
    elif str(source) == "demo" or str(source).startswith("torchvision:"):
        root = None
    else:
        root = Path(source)
    if root is not None and dest.resolve().is_relative_to(Path(root).resolve()):
        raise ConvertError(
            f"{dest}: DEST is inside SOURCE {source}; there it would read as a class folder of the source "
            "(to the next conversion and to torchvision's ImageFolder); choose a DEST outside it"
        )


def resolve_workers(workers: int | None, n_units: int) -> int:
    if workers is None:
        workers = usable_cores()
    return max(1, min(workers, n_units))


def requested_options(
    codec: str | None, options: dict[str, Any] | None, compress: bool | None
) -> dict[str, Any]:
    """The writer options the caller asked for (the format validates them and adds its defaults)."""
    given = dict(options or {})
    if compress is not None:
        warn(
            "convert(compress=...) is deprecated: use codec='deflate' (npz)", DeprecationWarning, stacklevel=3
        )
        if compress and codec is None:
            codec = "deflate"
    if codec is not None:
        given["codec"] = codec
    return given


def preflight(writer: CacheWriter, staging: Staging) -> list[str]:
    """Warn before any work when the cache will likely not fit on the destination's disk."""
    left = sum(len(writer.unit_range(k)) for k in range(writer.n_units) if k not in staging.done)
    need = left * writer.image_bytes * writer.size_ratio
    free = shutil.disk_usage(staging.path).free
    if need > free:
        return [
            f"{staging.path.parent}: the cache needs about {human_bytes(need)} more but only "
            f"{human_bytes(free)} is free; the conversion will stop when the disk fills "
            "(free space, then re-run the same command to resume)"
        ]
    return []


def storage_permutation(n: int, storage_order: str, seed: int) -> np.ndarray:
    """Storage position s holds source sample order[s]."""
    if storage_order == "source":
        return np.arange(n, dtype=np.int64)
    if storage_order not in STORAGE_ORDERS:
        raise ValueError(f"storage_order must be 'shuffled' or 'source', got {storage_order!r}")
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


class BadBudget:
    """Journals finished units and aborts as soon as the undecodable images exceed ``max_bad``."""

    def __init__(self, n: int, max_bad: float, staging: Staging) -> None:
        self.n, self.max_bad, self.staging = n, max_bad, staging
        self.started = time.monotonic()  # reset when the units are handed out
        self.journal_s = 0.0
        self.worker: dict[str, float] = {
            "decode": 0.0,
            "digest": 0.0,
            "write": 0.0,
            "checksum": 0.0,
            "unit_other": 0.0,
        }
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.slots: dict[float, list[float]] = {}  # slot → [units, its first start, its last end]

    def record(self, results: list[UnitResult]) -> None:
        """Journal finished units, with one fsync for all of them."""
        t0 = time.perf_counter()
        self.staging.record_many(
            [(k, bad, digests) for k, bad, digests, _, _ in results], {r[0]: r[4] for r in results if r[4]}
        )
        self.journal_s += time.perf_counter() - t0
        kinds = ("decode", "digest", "write", "checksum")
        for *_, times, _ in results:
            for key in kinds:
                self.worker[key] += times.get(key, 0.0)
            # Inside the unit but none of the four (buffers, bookkeeping, signals): per-unit overhead;
            # what is left of the workers' time after this is start-up and waiting between units.
            spent = times["end"] - times["start"]
            self.worker["unit_other"] += max(0.0, spent - sum(times.get(k, 0.0) for k in kinds))
            self.starts.append(times["start"])
            self.ends.append(times["end"])
            slot = self.slots.setdefault(times.get("slot", -1.0), [0.0, times["start"], times["end"]])
            slot[0] += 1
            slot[1], slot[2] = min(slot[1], times["start"]), max(slot[2], times["end"])
        if any(r[1] for r in results):
            check_bad_fraction(self.staging.bad(), self.n, self.max_bad, final=False)

    def stages(self, n_workers: int) -> dict[str, float]:
        """Seconds: units handed out → first unit started (process start-up), the run, the main
        process's journaling, worker time by kind (summed over workers) and what was left over."""
        now = time.monotonic()
        run = now - self.started
        out = {
            "workers": float(n_workers),
            "run_s": run,
            "startup_s": min(self.starts) - self.started if self.starts else 0.0,
            "journal_s": self.journal_s,
            "after_last_unit_s": now - max(self.ends) if self.ends else 0.0,
        }
        out.update({f"workers_{k}_s": v for k, v in self.worker.items()})
        out["workers_other_or_idle_s"] = max(0.0, n_workers * run - sum(self.worker.values()))
        out.update(self.slot_spread())
        return out

    def slot_spread(self) -> dict[str, float]:
        """How evenly the units went round (a slot: one worker process or decode process): units per
        slot, and the spread of the slots' first starts (start-up) and last ends (the tail), in
        seconds after the units were handed out."""
        if not self.slots:
            return {}
        units, firsts, lasts = zip(*self.slots.values(), strict=True)
        return {
            "slots": float(len(self.slots)),
            "units_per_slot_min": min(units),
            "units_per_slot_max": max(units),
            "slot_first_start_min_s": min(firsts) - self.started,
            "slot_first_start_max_s": max(firsts) - self.started,
            "slot_last_end_min_s": min(lasts) - self.started,
            "slot_last_end_max_s": max(lasts) - self.started,
        }


def run_units(
    job: Job,
    todo: list[int],
    n_workers: int,
    staging: Staging,
    budget: BadBudget,
    progress: Progress | None,
    client: Any = None,
    stamps: dict[str, float] | None = None,
) -> None:
    if client is not None:
        budget.started = time.monotonic()  # the units are handed out now (the cluster is up)
    try:
        if client is not None:
            # A per-file time limit needs a process's main thread: the units then run in a decode
            # process of each Dask worker (``dask_engine.unit_in_child``), which also uploads them
            # when the workers write straight to the store.
            timed = job.decode_timeout > 0
            if job.store_units is not None:

                def record(result: Any) -> None:
                    journal_sums(staging.journal, [result])  # the objects' digests first, then "done"
                    finish_unit(job, budget, progress, strip_sums(result))

                child = (_init_worker, convert_unit_to_store_in_process) if timed else None
                run_on_dask(client, job, todo, convert_unit_to_store, record, child, stamps)
            else:
                child = (_init_worker, convert_unit) if timed else None
                run_on_dask(
                    client,
                    job,
                    todo,
                    convert_job_unit,
                    lambda result: finish_unit(job, budget, progress, result),
                    child,
                    stamps,
                )
        elif n_workers <= 1:
            run_in_process(job, todo, budget, progress)
        else:
            run_in_pool(job, todo, n_workers, budget, progress)
    except KeyboardInterrupt:
        raise ConvertError(
            f"interrupted: {done_images(job.writer, staging)} of {job.writer.n} done; "
            "re-run the same command to resume"
        ) from None
    except BrokenProcessPool:
        raise ConvertError(
            f"a conversion worker died (killed, out of memory, or a decoder crashed or spun for more than "
            f"{3 * job.decode_timeout + 1:g} s of CPU); {done_images(job.writer, staging)} of {job.writer.n} "
            "done; re-run the same command to resume"
        ) from None
    except ImageDecodeError as e:
        raise ConvertError(
            f"--strict: stopped at the first undecodable image: {e}; "
            f"{done_images(job.writer, staging)} of {job.writer.n} done; fix or remove the "
            "file and re-run with --overwrite (or drop --strict to skip and report it)"
        ) from None
    except Exception as e:
        if not is_killed_worker(e):
            raise
        raise ConvertError(
            f"Dask workers kept dying on a unit ({e}); {done_images(job.writer, staging)} of {job.writer.n} "
            "done; re-run the same command to resume"
        ) from None


def done_images(writer: CacheWriter, staging: Staging) -> int:
    return sum(len(writer.unit_range(k)) for k in staging.done)


def finish_unit(job: Job, budget: BadBudget, progress: Progress | None, result: UnitResult) -> None:
    """In the driver: journal a finished unit, then report its images."""
    finish_units(job, budget, progress, [result])


def finish_units(job: Job, budget: BadBudget, progress: Progress | None, results: list[UnitResult]) -> None:
    """Several finished units: one journal fsync for all of them, then report their images."""
    budget.record(results)
    if progress:
        for res in results:
            progress(len(job.writer.unit_range(res[0])))


def run_in_process(job: Job, todo: list[int], budget: BadBudget, progress: Progress | None) -> None:
    budget.started = time.monotonic()
    limit = Image.MAX_IMAGE_PIXELS  # the caller's process: its own limit again afterwards
    try:
        for k in todo:
            finish_unit(job, budget, progress, convert_job_unit(job, k))
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def run_in_pool(
    job: Job, todo: list[int], n_workers: int, budget: BadBudget, progress: Progress | None
) -> None:
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    budget.started = time.monotonic()
    pool = ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker, initargs=(job,))
    # A bounded window of submitted units: ``wait`` walks every pending future on each call, so
    # submitting all units at once costs O(units²) in the main process on large datasets.
    queue = iter(todo)
    try:
        pending: set[Future[UnitResult]] = {
            pool.submit(convert_unit, k) for k in islice(queue, 4 * n_workers)
        }
        while pending:
            # FIRST_COMPLETED, not FIRST_EXCEPTION: without an error FIRST_EXCEPTION waits for the
            # whole window, so workers idled at the end of every window until its slowest unit was
            # done (a suspect for the worker time spent neither decoding nor writing).
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            results = [fut.result() for fut in finished]  # re-raises a worker's error here
            pending |= {pool.submit(convert_unit, k) for k in islice(queue, len(finished))}
            finish_units(job, budget, progress, results)
    except BaseException:
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """End the workers now (not after their current unit): Ctrl-C must return within seconds.
    An unfinished unit is not journaled, so it is simply redone on resume."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        p.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def check_bad_fraction(bad: list[dict[str, Any]], n: int, max_bad: float, final: bool = True) -> None:
    """More than ``max_bad`` of all n images undecodable (or all of them) aborts the conversion."""
    if not n or not bad or (len(bad) < n and len(bad) / n <= max_bad):
        return
    first = "; ".join(f"{b['path']}: {b['reason']}" for b in bad[:3])
    when = "" if final else " (stopped early)"
    raise ConvertError(
        f"{len(bad)} of {n} images could not be decoded{when}, more than --max-bad {max_bad:g} "
        f"of them; nothing was marked complete. First: {first}. Fix or remove the files and "
        "re-run with --overwrite, or raise --max-bad"
    )


# --- commit -----------------------------------------------------------------------------------------


def finalize(
    src: Source,
    policy: ImagePolicy,
    writer: CacheWriter,
    fmt: str,
    staging: Staging,
    bad: list[dict[str, Any]],
    order: np.ndarray,
    stages: dict[str, float] | None = None,
    remote_sums: dict[str, str] | None = None,
) -> CacheSpec:
    t_start = time.perf_counter()
    root = staging.path
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    bad_sources = np.asarray([b["index"] for b in bad], dtype=np.int64)
    labels = src.labels.astype(np.int64)[order]  # in storage order; -1 marks a skipped image
    labels[inverse[bad_sources]] = -1
    good = np.ones(len(order), dtype=bool)
    good[bad_sources] = False
    positions = inverse[good]  # dataset index → storage (setdiff1d would cost a 0.3 s lazy import)
    writer.finish(labels)
    writer.describe(format_attributes(src, policy, len(src) - len(bad)), positions)
    t_meta = time.perf_counter()
    save_npy_durably(root / LABELS_FILE, narrow_index(labels))
    save_npy_durably(root / POSITIONS_FILE, narrow_index(positions))
    source_record(src, staging, writer, order).save(root / SOURCE_RECORD)
    write_json_durably(root / SKIPPED_FILE, json.dumps(bad + unlisted(src), indent=1))
    remove_temp_files(root)
    t0 = time.perf_counter()
    sync_tree(root)  # every data file durable before the manifest that declares the cache complete
    t1 = time.perf_counter()
    checksums = cache_checksums(root, writer, staging)
    if remote_sums is not None:  # units the workers wrote to the object store, digested there
        checksums = dict(sorted({**checksums, **remote_sums}.items()))
    if stages is not None:
        stages.update(
            finalize_writer_s=t_meta - t_start,
            finalize_metadata_s=t0 - t_meta,
            sync_tree_s=t1 - t0,
            checksums_s=time.perf_counter() - t1,
        )
    spec = CacheSpec(
        format=fmt,
        n=len(src) - len(bad),
        n_stored=len(src),
        shape=policy.shape,
        classes=tuple(src.classes),
        image=policy,
        format_options=writer.recorded_options(),
        source={**src.info(), **root_facts(src), "plan": staging.plan},
        checksums=checksums,
        dlstore_version=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    fsync_path(root)
    write_json_durably(root / MANIFEST, spec.to_json())
    return spec


def cache_checksums(root: Path, writer: CacheWriter, staging: Staging) -> dict[str, str]:
    """Every file's checksums for the manifest. Files the writer checksums unit by unit get the keys
    of its units, digested by the workers as they wrote them (read here only for a unit journaled
    without them, e.g. by an older version); every other file is digested here."""
    unit_keys = [key for k in range(writer.n_units) for key in writer.unit_checksum_keys(k)]
    covered = tuple(sorted({split_key(key)[0] for key in unit_keys}))
    known = {key: d for sums in staging.unit_sums.values() for key, d in sums.items()}
    out = checksum_tree(root, exclude=(MANIFEST, *covered))
    computed = checksum_keys(root, [key for key in unit_keys if key not in known])
    out.update({key: known.get(key) or computed[key] for key in unit_keys})
    return out


def source_record(src: Source, staging: Staging, writer: CacheWriter, order: np.ndarray) -> SourceRecord:
    """What stale checks and ``verify --deep`` compare: (name, size, mtime_ns, label) per sample and
    the sha256 of each file as it was decoded ("" where unknown), in source order."""
    sha = [""] * len(src)
    for k, digests in staging.digests.items():
        for s, d in zip(writer.unit_range(k), digests):
            sha[int(order[s])] = d
    stats = np.asarray(src.stats, np.int64).reshape(-1, 2) if src.stats else np.zeros((len(src), 2), np.int64)
    return SourceRecord.from_columns(src.names, stats[:, 0], stats[:, 1], src.labels, sha)


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
    """The folder source's root and its mtime, for the one-``stat`` check on open (DEST is never inside
    the root: ``check_dest_outside_source``)."""
    root = getattr(src, "root", None)
    if root is None:
        return {}
    facts: dict[str, Any] = {"root": str(Path(root).resolve())}
    mtime = getattr(src, "root_mtime_ns", 0)
    if mtime:
        facts["root_mtime_ns"] = mtime
    return facts


def unlisted(src: Source) -> list[dict[str, Any]]:
    return [{"index": None, "path": p, "reason": r} for p, r in scan_errors(src)]


_TEMP_NAME = re.compile(r"^\.|\.tmp\d+$|\.partial$")


def remove_temp_files(root: Path) -> None:
    """Temp files of writers killed mid-write (ours: hidden or ``.tmpPID``; zarr's ``.partial``)."""
    for p in list(root.rglob("*")):
        if p.is_file() and _TEMP_NAME.search(p.name):
            p.unlink()


def narrow_index(array: np.ndarray) -> np.ndarray:
    """Index arrays as int32 when they fit (readers widen them): half the metadata bytes."""
    if array.dtype.kind == "i" and (array.size == 0 or (array.min() >= -(2**31) and array.max() < 2**31)):
        return array.astype(np.int32)
    return array


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
