"""``convert``: source → pre-resized cache, in parallel, through a staging directory.

Work is split into the format's units (shard, chunk, slab). Worker processes decode a unit's images
and write that unit themselves, so pixels never cross a pipe; the main process only journals which
units are done. The cache appears at DEST by one rename, after its manifest, so DEST is either absent,
the previous cache, or the new complete one. An interrupted run leaves the staging directory and its
journal next to DEST; the same command resumes it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.thread import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore._version import __version__
from dlstore.errors import CacheExistsError, ConvertError, ImageDecodeError
from dlstore.formats import get_format
from dlstore.formats.base import CacheWriter
from dlstore.sources import Source, open_source
from dlstore.spec import (LABELS_FILE, MANIFEST, POSITIONS_FILE, SKIPPED_FILE, SOURCES_FILE, CacheSpec, ImagePolicy, fsync_dir,
                          write_json_durably)
from dlstore.staging import Staging

Progress = Callable[[int], None]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def convert(source: str | Path | Source, dest: str | Path, *, format: str = "ram", size: int,
            resize: str = "crop", channels: int = 3, codec: str = "zstd", compress: bool = False,
            workers: int | None = None, overwrite: bool = False, root: Path | None = None, train: bool = True,
            demo_images: int = 512, strict: bool = False, max_bad: float = 0.5, storage_order: str = "shuffled",
            seed: int = 0, progress: Progress | None = None) -> ConvertResult:
    """Convert SOURCE (folder, ``torchvision:NAME``, ``demo`` or a Source) into a cache at DEST.

    ``storage_order="shuffled"`` (default) stores images in a seeded random order, so every chunk
    or shard holds a mix of classes and a chunk-aware sampler stays close to a full shuffle; dataset
    index ``i`` is still source sample ``i`` (``positions.npy`` maps it to storage).

    >>> convert("photos/", "cache/", format="zarr", size=128)     # doctest: +SKIP
    """
    t0 = time.perf_counter()
    dest = Path(dest)
    fmt = get_format(format)
    policy = ImagePolicy(size=size, resize=resize, channels=channels)
    check_destination(dest, overwrite)
    src = source if isinstance(source, Source) else open_source(source, root=root, train=train,
                                                                demo_images=demo_images)
    options = {"codec": codec} if fmt.name == "zarr" else {"compress": bool(compress)} if fmt.name == "npz" else {}
    writer = fmt.writer(Path(), len(src), policy.shape, options)
    order = storage_permutation(len(src), storage_order, seed)
    plan = {"storage_order": storage_order, "seed": seed, "format": fmt.name, "policy": asdict(policy), "options": options, "n": len(src),
            "unit_size": writer.unit_size, "fingerprint": src.fingerprint(), "dlstore": __version__.split(".")[0]}
    with Staging(dest, plan, discard_mismatch=overwrite) as staging:
        writer.root = staging.path
        if staging.fresh:
            writer.create()
            staging.save_writer_options(writer.options)
        else:
            writer.options = staging.writer_options()
        warnings = preflight(writer, staging, fmt.name, compress or fmt.name == "zarr")
        todo = [k for k in range(writer.n_units) if k not in staging.done]
        if progress:
            progress(sum(len(writer.unit_range(k)) for k in staging.done))
        n_workers = resolve_workers(workers, len(todo))
        run_units((src, policy, writer, strict, order), todo, n_workers, staging, progress)
        bad = staging.bad()
        check_bad_fraction(bad, len(src), max_bad, staging)
        spec = finalize(src, policy, writer, fmt.name, staging, bad, order)
        staging.commit(overwrite)
    seconds = time.perf_counter() - t0
    converted = sum(len(writer.unit_range(k)) for k in todo)
    return ConvertResult(dest=str(dest), format=fmt.name, n=spec.n, n_skipped=len(bad),
                         classes=list(src.classes), shape=list(policy.shape),
                         bytes_on_disk=dir_bytes(dest), seconds=seconds,
                         images_per_s=converted / max(seconds, 1e-9),
                         workers=n_workers, resumed_units=writer.n_units - len(todo), skipped=bad, warnings=warnings)


def check_destination(dest: Path, overwrite: bool) -> None:
    if not dest.exists():
        return
    if not overwrite:
        raise CacheExistsError(f"{dest}: already exists; pass --overwrite to replace it")
    if dest.is_dir() and not (dest / MANIFEST).is_file() and any(dest.iterdir()):
        raise CacheExistsError(f"{dest}: exists and is not a dlstore cache (no {MANIFEST}); "
                               "refusing to replace it even with --overwrite; choose another DEST")
    if not dest.is_dir():
        raise CacheExistsError(f"{dest}: exists and is a file; choose another DEST")


def resolve_workers(workers: int | None, n_units: int) -> int:
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(workers, n_units))


def preflight(writer: CacheWriter, staging: Staging, fmt: str, compressed: bool) -> list[str]:
    need = writer.n * writer.image_bytes * (0.8 if compressed else 1.0)
    free = shutil.disk_usage(staging.path).free
    if need > free:
        return [f"{staging.path.parent}: the cache may need about {need / 1e9:.2f} GB but only "
                f"{free / 1e9:.2f} GB is free; the conversion will stop if the disk fills"]
    return []


# --- the parallel part ------------------------------------------------------------------------------

WorkerState = tuple[Source, ImagePolicy, CacheWriter, bool, np.ndarray]
_STATE: WorkerState | None = None


def storage_permutation(n: int, storage_order: str, seed: int) -> np.ndarray:
    """Storage position s holds source sample order[s]."""
    if storage_order == "source":
        return np.arange(n, dtype=np.int64)
    if storage_order != "shuffled":
        raise ValueError(f"storage_order must be 'shuffled' or 'source', got {storage_order!r}")
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def _init_worker(state: WorkerState) -> None:
    global _STATE
    _STATE = state


def convert_unit(k: int) -> tuple[int, list[dict[str, Any]]]:
    """Decode and store unit k (in a worker process); return the images that could not be decoded."""
    assert _STATE is not None
    src, policy, writer, strict, order = _STATE
    r = writer.unit_range(k)
    out = np.zeros((len(r), *policy.shape), np.uint8)
    bad: list[dict[str, Any]] = []
    for j, s in enumerate(r):
        i = int(order[s])
        try:
            out[j] = src.decode(i, policy)
        except ImageDecodeError as e:
            if strict:
                raise
            bad.append({"index": i, "path": src.names[i], "reason": str(e)})
    try:
        writer.write_unit(k, out)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConvertError(f"disk full while writing unit {k} under {writer.root}: "
                               f"{shutil.disk_usage(writer.root).free / 1e6:.0f} MB free; free space and "
                               "re-run the same command to resume") from None
        raise
    return k, bad


def run_units(state: WorkerState, todo: list[int], n_workers: int, staging: Staging,
              progress: Progress | None) -> None:
    writer = state[2]
    if n_workers <= 1:
        _init_worker(state)
        for k in todo:
            staging.record(*convert_unit(k))
            if progress:
                progress(len(writer.unit_range(k)))
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker, initargs=(state,))
    try:
        pending: set[Future[tuple[int, list[dict[str, Any]]]]] = {pool.submit(convert_unit, k) for k in todo}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in finished:
                k, bad = fut.result()  # re-raises a worker's error here
                staging.record(k, bad)
                if progress:
                    progress(len(writer.unit_range(k)))
    except BaseException as e:
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, KeyboardInterrupt):
            raise ConvertError(f"interrupted: {len(staging.done)} of {writer.n_units} units done; "
                               "re-run the same command to resume") from None
        raise
    pool.shutdown(wait=True)


def check_bad_fraction(bad: list[dict[str, Any]], n: int, max_bad: float, staging: Staging) -> None:
    if n and (len(bad) == n or len(bad) / n > max_bad):
        first = "; ".join(f"{b['path']}: {b['reason']}" for b in bad[:3])
        raise ConvertError(f"{len(bad)} of {n} images could not be decoded (more than --max-bad {max_bad:g}); "
                           f"nothing was marked complete; first: {first}")


# --- commit -----------------------------------------------------------------------------------------

def finalize(src: Source, policy: ImagePolicy, writer: CacheWriter, fmt: str, staging: Staging,
             bad: list[dict[str, Any]], order: np.ndarray) -> CacheSpec:
    root = staging.path
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    bad_sources = np.asarray([b["index"] for b in bad], dtype=np.int64)
    labels = src.labels.astype(np.int64)[order]  # in storage order; -1 marks a skipped image
    labels[inverse[bad_sources]] = -1
    positions = inverse[np.setdiff1d(np.arange(len(order)), bad_sources)]  # dataset index → storage
    writer.finish(labels)
    save_npy_durably(root / LABELS_FILE, labels)
    save_npy_durably(root / POSITIONS_FILE, positions)
    write_json_durably(root / SOURCES_FILE, json.dumps({"root": getattr(src, "root", None) and str(src.root),
                                                        "entries": src.entries()}))
    write_json_durably(root / SKIPPED_FILE, json.dumps(bad, indent=1))
    spec = CacheSpec(format=fmt, n=len(src) - len(bad), n_stored=len(src), shape=policy.shape,
                     classes=tuple(src.classes), image=policy, format_options=writer.recorded_options(),
                     source=src.info(), checksums=checksum_tree(root), dlstore_version=__version__,
                     created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    fsync_dir(root)
    write_json_durably(root / MANIFEST, spec.to_json())
    return spec


def save_npy_durably(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def checksum_tree(root: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in exclude)
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as ex:
        digests = list(ex.map(file_sha256, files))
    return {p.relative_to(root).as_posix(): d for p, d in zip(files, digests)}


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
