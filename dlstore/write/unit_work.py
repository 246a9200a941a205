"""What a worker does for one unit: decode its images (each under a per-file time limit), write the
unit through the format's writer, checksum its bytes. ``convert_job_unit`` runs in pool workers (as
``convert_unit``, the job installed once by ``_init_worker``), the driver and Dask tasks."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from dlstore.errors import ImageDecodeError
from dlstore.formats.base import CacheWriter
from dlstore.machine import process_alive
from dlstore.spec import ImagePolicy
from dlstore.write.diskfull import disk_full_as_error
from dlstore.write.sources import Source
from dlstore.write.staging import release_inherited_locks
from dlstore.write.targets import empty_targets

if TYPE_CHECKING:
    from dlstore.write.store_units import StoreUnits


@dataclass
class Job:
    """What every worker needs; inherited by fork (or pickled once per worker under spawn)."""

    src: Source
    policy: ImagePolicy
    writer: CacheWriter
    strict: bool
    decode_timeout: float
    order: np.ndarray  # storage position s holds source sample order[s]
    hard_limit: bool = False  # in pool workers: a CPU-time backstop for decoders stuck inside C code
    store_units: StoreUnits | None = None  # Dask tasks write the units to the object store
    max_pixels: int | None = Image.MAX_IMAGE_PIXELS


_JOB: Job | None = None


class DecodeTimeout(TimeoutError):
    """One file took longer than the per-file limit (raised from SIGALRM inside the decoder)."""


def _init_worker(job: Job) -> None:
    global _JOB
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    release_inherited_locks()  # the destination's lock is the driver's alone (forked copies)
    die_with_parent()
    _JOB = Job(**{**job.__dict__, "hard_limit": True})


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A worker dies with its driver (orphans hold the lock and CPU): PDEATHSIG, else a sentinel thread."""
    import multiprocessing as mp
    import os

    parent = mp.parent_process()
    if parent is None:
        return
    if os.getppid() == parent.pid:
        arm_parent_death_signal()
    if os.getppid() != parent.pid and not process_alive(parent.pid):
        os._exit(1)  # the driver is already gone
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is not None:
        threading.Thread(
            target=_exit_when_closed, args=(sentinel,), daemon=True, name="dlstore-parent"
        ).start()


def arm_parent_death_signal() -> None:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    with suppress(OSError, AttributeError):  # no prctl: the sentinel thread remains
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _exit_when_closed(sentinel: int) -> None:
    """The parent's end of this pipe closes when it dies: then end this worker at once."""
    import os
    from multiprocessing.connection import wait

    try:
        wait([sentinel])
    except OSError:
        return
    os._exit(1)


def _on_alarm(signum: int, frame: object) -> None:
    raise DecodeTimeout("decoding took longer than the per-file limit")


@contextmanager
def time_limit(seconds: float, hard: bool) -> Iterator[None]:
    """SIGALRM after ``seconds``; with ``hard`` a CPU limit of 3x that ends a worker stuck in C."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    if hard:
        signal.setitimer(signal.ITIMER_PROF, 3 * seconds + 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if hard:
            signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGALRM, old)


def decode_sample(
    job: Job, i: int, times: dict[str, float] | None = None
) -> tuple[np.ndarray, str, dict[str, np.ndarray], dict[str, int]]:
    """Image i, its file's sha256, its field rows and boxes dropped; ``times`` sums the seconds."""
    path = job.src.names[i]
    try:
        with time_limit(job.decode_timeout, job.hard_limit):
            t0 = time.perf_counter()
            rows: dict[str, np.ndarray] = {}
            dropped: dict[str, int] = {}
            if job.src.fields:
                image, digest, hashed, rows, dropped = job.src.decode_targets_and_digest(i, job.policy)
            else:
                image, digest, hashed = job.src.decode_and_digest(i, job.policy)
            if times is not None:
                times["decode"] += time.perf_counter() - t0 - hashed
                times["digest"] += hashed
            return image, digest, rows, dropped
    except DecodeTimeout:
        raise ImageDecodeError(
            f"{path}: decoding took longer than {job.decode_timeout:g} s; skipped "
            "(raise --decode-timeout if the file is legitimately huge)"
        ) from None


# (unit, undecodable images, file digests, timings, checksums of the unit's bytes {key: sha256})
UnitResult = tuple[int, list[dict[str, Any]], list[str], dict[str, float], dict[str, str]]


def convert_unit(k: int) -> UnitResult:
    """Decode and store unit k in a pool worker."""
    return convert_job_unit(installed_job(), k)


def installed_job() -> Job:
    """The job ``_init_worker`` installed in this worker process."""
    assert _JOB is not None, "no job installed: _init_worker runs first in each worker"
    return _JOB


def convert_job_unit(job: Job, k: int) -> UnitResult:
    """``convert_unit`` with the job passed in (also the driver's and Dask tasks')."""
    # "slot": the thread's system-wide id, for each worker's share of the units (``UnitLedger``).
    times = {
        "start": time.monotonic(),
        "decode": 0.0,
        "digest": 0.0,
        "slot": float(threading.get_native_id()),
    }
    Image.MAX_IMAGE_PIXELS = job.max_pixels  # Pillow reads its limit from this global
    r = job.writer.unit_range(k)
    # Variable-size images go as a list (a skipped one: a 1x1 placeholder); every row is assigned below.
    out: Any = [] if job.policy.ragged else np.empty((len(r), *job.policy.shape), np.uint8)
    bad: list[dict[str, Any]] = []
    digests: list[str] = []
    fields = {name: [] for name in job.writer.fields}  # type: dict[str, list[np.ndarray]]
    dropped: dict[str, int] = {}
    job.src.prefetch(job.order[r.start : r.stop])
    for j, s in enumerate(r):
        i = int(job.order[s])
        try:
            image, digest, rows, lost = decode_sample(job, i, times)
        except ImageDecodeError as e:
            if job.strict:
                raise
            bad.append({"index": i, "path": job.src.names[i], "reason": str(e)})
            digest = job.src.digest(i, missing_ok=True)
            image = np.zeros((1, 1, job.policy.channels) if job.policy.ragged else job.policy.shape, np.uint8)
            rows, lost = (empty_targets(job.writer.fields, image.shape) if fields else {}), {}
        if job.policy.ragged:
            out.append(image)
        else:
            out[j] = image
        digests.append(digest)
        for name in fields:
            fields[name].append(rows[name] if name in rows else np.zeros(0))
        for name, count in lost.items():
            dropped[name] = dropped.get(name, 0) + count
    writer = job.writer
    with disk_full_as_error(writer.root, f"writing unit {k}", writer.n * writer.image_bytes):
        t0 = time.perf_counter()
        job.writer.write_unit(k, out)  # durable when it returns: the journal may record it
        job.writer.write_fields(k, fields, dropped)
        t1 = time.perf_counter()
    sums = job.writer.unit_checksums(k, out)
    times.update(write=t1 - t0, checksum=time.perf_counter() - t1, end=time.monotonic())
    return k, bad, digests, times, sums
