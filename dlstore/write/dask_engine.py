"""Running a conversion's units as Dask tasks (``convert(..., scheduler=)``, ``--scheduler``).

``DaskRunner`` is the one implementation of the conversion's ``Runner`` interface
(``dlstore.write.runners``) for Dask; the built-in runners are the process pool and in-process
ones there. This one hands the same units to a
``distributed`` cluster: ``local`` / ``local:N`` starts a cluster of N task threads on this machine
(``start_local_cluster``: Dask's ``SubprocessCluster``, worker processes of up to 4 threads, each thread
with its decode process, so N processes decode), ``tcp://HOST:PORT`` (or ``tls://``) uses a running scheduler whose workers see SOURCE and
DEST at the same paths. Each task is ``convert_unit``: it decodes and writes its unit into the staging
directory itself, exactly as a pool worker does, and returns only the bad files and digests; the
driver journals each finished unit, so resume, the bad-file budget, the atomic publish and the result
are the built-in engine's. With a URL destination the tasks write their units to the object store
instead (``store_units.convert_unit_to_store``), so no worker needs the driver's spool folder.

The per-file ``decode_timeout``: Dask runs tasks in worker threads, where SIGALRM (the pool's way to
interrupt a decoder) cannot be used. So each Dask worker runs its units in a decode process of its own
(``unit_in_child``; one per task thread), started once per conversion and worker, whose main thread takes the pool worker's
time limits: a file that hangs becomes a named bad file, and a decoder stuck inside C code ends that
process (a clear error, resumable) instead of hanging the cluster. Pixels still never cross a pipe: the
decode process writes its unit itself and returns only the bad files and digests.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any

from dlstore.errors import ConvertError, require_extra
from dlstore.machine import usable_cores
from dlstore.write.dask_cleanup import close_cluster

_ADDRESS = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")


@dataclass(frozen=True)
class SchedulerSpec:
    """``local`` with a worker count, or the address of an existing scheduler."""

    local_workers: int | None = None
    address: str | None = None

    def describe(self) -> str:
        return self.address or f"local:{self.local_workers}"


def parse_scheduler(text: str) -> SchedulerSpec:
    """``local`` (one worker per core), ``local:N`` or ``tcp://HOST:PORT``."""
    if text == "local":
        return SchedulerSpec(local_workers=usable_cores())
    if text.startswith("local:"):
        count = text.partition(":")[2]
        if not count.isdigit() or int(count) < 1:
            raise ConvertError(f"--scheduler {text}: expected local:N with N >= 1 worker processes")
        return SchedulerSpec(local_workers=int(count))
    if _ADDRESS.match(text):
        return SchedulerSpec(address=text)
    raise ConvertError(
        f"--scheduler {text!r}: expected local, local:N or a scheduler address such as tcp://HOST:8786"
    )


# Our own cluster's workers only wait for their decode processes, on every core: what would only
# take CPU from those (each worker's statistical profiler walking every stack each 10 ms, event-loop
# health ticks every 20 ms, system and memory monitors several times a second) is off or slowed.
# (Round C on the H200: Dask's decode processes took 7 % longer per image than the pool's workers on a
# default running cluster, 5 % with profiling off.)
QUIET_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "1s",
}
LOCAL_THREADS_PER_WORKER = 4  # local:16 = 4 worker processes of 4 task threads (see local_layout)
WORKER_CLASS = "dlstore.write.dask_worker.ConversionWorker"
WORKERS_START_S = 60


def local_layout(slots: int, most_threads: int = LOCAL_THREADS_PER_WORKER) -> tuple[int, int]:
    """(worker processes, task threads each) for ``local:N``: N task threads in all, each with a
    decode process of its own, in as few worker processes as hold at most ``most_threads`` each
    (the worker count divides N, so every worker gets the same number of threads).

    Fewer, larger worker processes: every task thread only waits on its decode process, so more
    worker processes would only add interpreters to start, scheduler connections and event loops.
    """
    first = -(-slots // max(1, most_threads))
    workers = next(w for w in range(first, slots + 1) if slots % w == 0)
    return workers, slots // workers


def start_local_cluster(slots: int, most_threads: int = LOCAL_THREADS_PER_WORKER) -> Any:
    """The cluster of ``local:N`` (also for benchmarks that want it running beforehand): a scheduler in
    this process and worker processes started as ``python -m dask spec`` subprocesses (Dask's
    ``SpecCluster`` with the ``SubprocessWorker`` of its ``SubprocessCluster``). Not ``LocalCluster``:
    its workers are started by multiprocessing's spawn, which re-imports the caller's ``__main__``
    script in every worker (a training or benchmark script that imports torch made each of 16 workers
    import torch: 8 s before the cluster was up on the H200, and again in every decode process). The
    scheduler stays in this process (a scheduler subprocess would start first and alone, about a
    second more). No nanny: our decode processes already isolate the decoders (a crash kills a decode
    process, not the worker), and closing the cluster kills its processes at once.
    ``cluster.close()`` stops it; ``cluster.scheduler_address`` is its address."""
    import dask
    from distributed import Scheduler, SpecCluster
    from distributed.deploy.subprocess import SubprocessWorker

    workers, threads = local_layout(slots, most_threads)
    worker = {
        "cls": SubprocessWorker,
        "options": {
            "worker_class": WORKER_CLASS,
            # the workers hold no data: no memory limit, no memory monitor
            "worker_kwargs": {
                "host": "127.0.0.1",
                "nthreads": threads,
                "memory_limit": 0,
                "silence_logs": logging.WARN,  # as LocalCluster: no INFO lines on the user's terminal
                "driver_pid": os.getpid(),  # the workers die with this process (kill -9 included)
            },
        },
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "port": 0, "dashboard": False, "dashboard_address": "127.0.0.1:0"},
    }
    # The scheduler's ticks quieted as the workers' (they set their own). Worker saturation 1.5: a
    # worker of 4 threads then holds 2 queued units instead of 1 (Dask's 1.1 rounds 4.4 up to 5), so
    # two threads finishing together both start their next unit without a round trip to the scheduler.
    with dask.config.set({**QUIET_CONFIG, "distributed.scheduler.worker-saturation": 1.5}):
        return SpecCluster(
            workers=dict.fromkeys(range(workers), worker),
            scheduler=scheduler,
            worker=worker,
            name="dlstore-local",
            silence_logs=logging.WARN,
        )


def open_client(spec: SchedulerSpec, stamps: dict[str, float] | None = None) -> tuple[Any, Any]:
    """A connected ``distributed.Client`` and the local cluster it runs on (None for an address).
    Not entered as context managers: ``Client.__enter__`` makes it the thread's current client, and
    ``EarlyClient`` opens it in one thread and closes it in another. ``stamps`` receives
    ``time.monotonic()`` at each step (cluster up, client connected, workers registered)."""
    require_extra("distributed", "dask", "--scheduler")
    from distributed import Client

    if spec.address is not None:
        try:
            client = Client(spec.address, timeout="20s")
        except OSError as e:
            raise ConvertError(
                f"--scheduler {spec.address}: cannot connect ({e}); is the scheduler running?"
            ) from None
        _stamp(stamps, "client")
        return client, None
    assert spec.local_workers is not None
    cluster = start_local_cluster(spec.local_workers)
    _stamp(stamps, "cluster")
    try:
        client = Client(cluster)
        _stamp(stamps, "client")
        # SubprocessCluster returns once the worker processes are launched: wait until they have
        # all registered, or the first units would all go to the first worker up.
        try:
            client.wait_for_workers(len(cluster.workers), timeout=WORKERS_START_S)
        except TimeoutError:
            raise ConvertError(
                f"--scheduler {spec.describe()}: the Dask workers did not start within {WORKERS_START_S} s "
                f"(`{sys.executable} -m dask spec` must run {WORKER_CLASS}); try a running cluster's address"
            ) from None
        _stamp(stamps, "workers")
        return client, cluster
    except BaseException:
        close_cluster(cluster)
        raise


def _stamp(stamps: dict[str, float] | None, name: str) -> None:
    if stamps is not None:
        stamps[name] = time.monotonic()


def open_warm_client(spec: SchedulerSpec, stamps: dict[str, float] | None = None) -> tuple[Any, Any]:
    """``open_client``, then each worker starts its decode processes' fork server (importing the
    converter takes about 0.5 s) before any unit is handed out: with ``EarlyClient`` this happens
    while the driver is still scanning the source. (Our own cluster's workers start it as they start;
    a running cluster's workers start it here.)"""
    client, cluster = open_client(spec, stamps)
    try:
        client.run(warm_decode_forkserver)
    except Exception:  # noqa: BLE001 - only a head start: the first unit starts it otherwise
        pass
    _stamp(stamps, "warm")
    return client, cluster


DECODE_MODULE = "dlstore.write.unit_work"  # what a decode process runs, imported by its fork server


TRACKER_LEAK_WARNING = "ignore:resource_tracker:UserWarning"


def warm_decode_forkserver() -> None:
    """On a Dask worker: start the fork server of ``_child_pool`` with the converter imported.

    The resource tracker it starts takes this process's warning options: a worker killed -9 leaves its
    decode pool's semaphores to the tracker, which cleans them up and would warn about each on the
    user's terminal, before dlstore's one line about the dead worker."""
    if TRACKER_LEAK_WARNING not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_LEAK_WARNING)
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload([DECODE_MODULE])
    forkserver.ensure_running()


class EarlyClient:
    """``open_client(spec)`` in a background thread from the conversion's start, so a local cluster
    boots (seconds for 16 worker processes) while the driver scans the source and stages the plan;
    ``client()`` waits for it, ``close()`` (idempotent) disconnects and stops a local cluster (a
    cluster given by address keeps running). With ``start=False`` nothing starts before ``client()``."""

    def __init__(self, spec: SchedulerSpec, start: bool = True) -> None:
        self.spec = spec
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[tuple[Any, Any]] | None = None
        self.stamps: dict[str, float] = {}  # time.monotonic() of each start step (see open_client)
        if start:
            self._start()

    def _start(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlstore-dask-start")
        self.stamps["start"] = time.monotonic()
        self._future = self._pool.submit(open_warm_client, self.spec, self.stamps)

    def client(self) -> Any:
        if self._future is None:
            self._start()
        assert self._future is not None
        return self._future.result()[0]  # a failed start (no scheduler there) raises its error here

    def close(self) -> None:
        if self._future is None:
            return
        future, self._future = self._future, None
        try:
            client, cluster = future.result()  # a start under way finishes first: nothing left behind
        except BaseException:  # noqa: BLE001 - it failed to start: nothing to stop
            return
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        try:
            client.close()
        finally:
            if cluster is not None:
                close_cluster(cluster)  # and every process its workers started, reaped


def dask_timeline(stamps: dict[str, float], t0: float) -> dict[str, float]:
    """The start steps of a Dask conversion, in seconds after ``t0`` (the conversion's start, from
    ``time.monotonic()``): cluster thread started, cluster up (scheduler running, workers launched),
    client connected, all workers registered, decode fork servers started, job on the workers, first
    units submitted."""
    steps = ("start", "cluster", "client", "workers", "warm", "scattered", "submitted")
    return {f"dask_{name}_at_s": stamps[name] - t0 for name in steps if name in stamps}


def count_workers(client: Any) -> int:
    """Task threads in the cluster (each runs one unit at a time): the conversion's parallelism."""
    workers = client.scheduler_info().get("workers", {}).values()
    return sum(int(w.get("nthreads", 1)) for w in workers)


SUBMITTED_PER_THREAD = 4  # units handed to the scheduler ahead of the cluster's task threads
POLL_S = 2.0  # how often the driver looks for a cluster left without workers while it waits
NO_WORKERS_GRACE_S = 20.0  # a running cluster's nannies restart killed workers within this


class LostWorkerNoise(logging.Filter):
    """Drops Dask's own log lines about a worker lost or its results rescheduled (the scheduler's and
    client's, in the driver): dlstore reruns those units, or says in one line what died."""

    PREFIXES = ("Removing worker", "Couldn't gather", "Lost all workers")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


class AbandonedGatherNoise(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a result wait the driver gave up on
    (``outcome``'s poll) that ended when the client closed: ``AllExit`` is Dask's "stop waiting"."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception=AllExit()" not in record.getMessage()


LOST_WORKER_LOGGERS = ("distributed.scheduler", "distributed.client")
_ASYNCIO_NOISE = AbandonedGatherNoise()


class WorkersLostError(RuntimeError):
    """Every Dask worker died (or the units' results were lost with them): nothing can run the rest."""


@dataclass(frozen=True)
class TaskFailed:
    """A unit's error handed back as a value, not raised in the worker: a raised one makes every
    worker log "Compute Failed" with a traceback on the user's terminal before dlstore's one line."""

    error: BaseException


def _the_job(job: Any) -> Any:
    return job


def guarded(job: Any, k: int, *, task: Callable[[Any, int], Any]) -> Any:
    try:
        return task(job, k)
    except Exception as e:  # noqa: BLE001 - re-raised by the driver (``outcome``)
        return TaskFailed(e)


def outcome(future: Any, lost: Callable[[], str], still_workers: Callable[[], None]) -> Any:
    """A finished task's result, its error raised here, or WorkersLostError for a unit cancelled
    because the cluster lost what it needed (its workers). A result held by a worker that died is
    recomputed: waited for while ``still_workers`` finds the cluster has some."""
    from distributed.client import FutureCancelledError

    while True:
        try:
            result = future.result(timeout=POLL_S)
            break
        except FutureCancelledError:
            raise WorkersLostError(lost()) from None
        except TimeoutError:
            still_workers()
    if isinstance(result, TaskFailed):
        raise result.error
    return result


def run_on_dask(
    client: Any,
    job: Any,
    todo: list[int],
    unit: Callable[[Any, int], Any],
    record: Callable[[Any], None],
    child: tuple[Callable[[Any], None], Callable[[int], Any]] | None = None,
    stamps: dict[str, float] | None = None,
    no_workers_grace_s: float = NO_WORKERS_GRACE_S,
) -> None:
    """Run every unit as a task, ``record`` each result in the driver as it finishes; on any error the
    remaining tasks are cancelled (unfinished units are not journaled and are redone on resume).

    With ``child`` = (init, unit_by_index), each worker runs its units in a decode process of its own
    (``unit_in_child``) where ``init(job)`` ran first; else ``unit(job, k)`` runs in the task thread.

    Units go out in a bounded window (``SUBMITTED_PER_THREAD`` per task thread), refilled by one
    ``client.map`` per batch of finished units: one graph message per batch instead of one per unit
    (2,341 single ``submit`` calls kept the driver busy before the first unit ran), and a conversion of
    millions of images never holds millions of tasks in the scheduler. ``stamps`` receives
    ``time.monotonic()`` after the job is on the workers and after the first window is submitted.

    A worker killed mid-convert (F6): the job is a task's result, not scattered data, so the scheduler
    recomputes it and reruns the lost units on the workers left; when none is left for
    ``no_workers_grace_s`` (a nanny restarts its worker sooner), WorkersLostError names the dead."""
    from distributed import wait

    token = uuid.uuid4().hex  # keys of their own: two conversions may share one cluster
    shared = client.submit(_the_job, job, key=f"dlstore-job-{token}", pure=False)
    wait([shared])  # on a worker before the units: the first units need not wait for it
    seen = set(client.scheduler_info()["workers"])  # every worker seen, to name the dead ones
    _stamp(stamps, "scattered")
    inner = unit if child is None else partial(unit_in_child, init=child[0], unit=child[1], token=token)
    task = partial(guarded, task=inner)
    queue = iter(todo)
    pending: set[Any] = set()

    def submit(count: int) -> None:
        ks = list(islice(queue, count))
        if ks:
            keys = [f"dlstore-unit-{token}-{k}" for k in ks]
            pending.update(client.map(task, [shared] * len(ks), ks, key=keys, pure=False))

    def lost() -> str:
        dead = sorted(seen - set(client.scheduler_info()["workers"]))
        named = f"worker{'s' if len(dead) > 1 else ''} {', '.join(dead)}" if dead else "workers"
        return (
            f"the Dask {named} died (killed, out of memory or crashed) and no worker is left to run "
            "the conversion's units"
        )

    noise = LostWorkerNoise()
    logging.getLogger("asyncio").addFilter(_ASYNCIO_NOISE)  # logged as late as the exit: kept
    for name in LOST_WORKER_LOGGERS:
        logging.getLogger(name).addFilter(noise)
    submit(SUBMITTED_PER_THREAD * max(1, count_workers(client)))
    _stamp(stamps, "submitted")
    no_workers_since: list[float] = []  # since when the cluster has had no worker

    def still_workers() -> None:
        """WorkersLostError once the cluster has had no worker for ``no_workers_grace_s``."""
        now_seen = set(client.scheduler_info()["workers"])
        seen.update(now_seen)
        if now_seen:
            no_workers_since.clear()
            return
        no_workers_since[:] = no_workers_since or [time.monotonic()]
        if time.monotonic() - no_workers_since[0] >= no_workers_grace_s:
            raise WorkersLostError(lost())

    try:
        while pending:
            try:
                finished = wait(list(pending), timeout=POLL_S, return_when="FIRST_COMPLETED").done
            except TimeoutError:  # none finished within POLL_S
                still_workers()
                continue
            pending.difference_update(finished)
            submit(len(finished))
            for fut in finished:
                # a unit's error (e.g. --strict's ImageDecodeError) is raised here
                record(outcome(fut, lost, still_workers))
    except BaseException:
        client.cancel([*pending, shared])
        raise
    finally:
        if child is not None:
            stop_children(client)
        for name in LOST_WORKER_LOGGERS:
            logging.getLogger(name).removeFilter(noise)


# --- the decode process of each Dask worker -------------------------------------------------------

_CHILD: dict[str, Any] = {}  # in a Dask worker: {"token": conversion, "pool": its decode process(es)}
_CHILD_LOCK = threading.Lock()


def unit_in_child(
    job: Any, k: int, *, init: Callable[[Any], None], unit: Callable[[int], Any], token: str
) -> Any:
    """A Dask task: unit k, run by this worker's decode process for conversion ``token``. A process
    that dies (a decoder that crashed, or spun past the CPU-time backstop) raises BrokenProcessPool,
    which the driver reports as the pool's dead worker."""
    pool = _child_pool(job, init, token)
    try:
        return pool.submit(unit, k).result()
    except BrokenProcessPool:
        close_child()
        raise


def _child_pool(job: Any, init: Callable[[Any], None], token: str) -> ProcessPoolExecutor:
    with _CHILD_LOCK:
        if _CHILD.get("token") != token:
            close_child(locked=True)
            # Not fork: a Dask worker is multi-threaded (its event loop, its comms).
            ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
            if ctx.get_start_method() == "forkserver":
                # The fork server lives as long as this worker: later conversions fork decode
                # processes with the converter already imported (about 0.3 s each, otherwise).
                ctx.set_forkserver_preload([init.__module__])  # = DECODE_MODULE, as warmed
            # Dask starts its workers as daemonic processes, which multiprocessing forbids to have
            # children (a daemon is ended without joining them). Ours are ended by ``close_child``
            # after each conversion, and exit by themselves when this worker's end of the pipe closes.
            mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
            # The job goes to each decode process once, pickled as the pool's does under spawn.
            pool = ProcessPoolExecutor(
                _worker_threads(), mp_context=ctx, initializer=_start_decode_process, initargs=(init, job)
            )
            _CHILD.update(token=token, pool=pool)
        return _CHILD["pool"]


def _start_decode_process(init: Callable[[Any], None], job: Any) -> None:
    _undo_dask_malloc_tuning()
    init(job)


def _undo_dask_malloc_tuning() -> None:
    """Dask's nanny starts its workers with ``MALLOC_TRIM_THRESHOLD_=65536`` (to hand freed memory back
    to the OS), which the decode processes inherit. Setting it also turns off glibc's adaptive mmap
    threshold, so every large decode buffer becomes an mmap/munmap pair and its pages fault in again
    (on a dev VM that variable alone made one-process decoding 10-30% slower; on the H200 the decode
    processes took 26-43% longer per image than the pool's workers). Restore the adaptive behaviour's
    ceiling (buffers up to 32 MB from the heap, trimmed above 64 MB) in these processes only."""
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to undo
        return


def _worker_threads() -> int:
    """One decode process per task thread of this worker."""
    try:
        from distributed import get_worker

        return max(1, int(get_worker().state.nthreads))
    except (ImportError, ValueError, AttributeError):
        return 1


def close_child(locked: bool = False) -> None:
    """End this worker's decode processes now (a stuck decoder must not outlive its conversion)."""
    if not locked:
        with _CHILD_LOCK:
            close_child(locked=True)
        return
    pool = _CHILD.pop("pool", None)
    _CHILD.pop("token", None)
    if pool is None:
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def stop_children(client: Any) -> None:
    """After a conversion: no decode process stays behind on any worker (best effort: a worker that
    died or a cluster that is closing has none left to stop)."""
    try:
        client.run(close_child)
    except Exception:  # noqa: BLE001 - clean-up only; the conversion's own outcome stands
        pass


def is_killed_worker(error: BaseException) -> bool:
    """A task whose workers kept dying (killed, out of memory, crashed decoder)."""
    return type(error).__name__ == "KilledWorker"


class DaskRunner:
    """The conversion's ``Runner`` on a Dask cluster. A local cluster starts in the background at
    construction (``start=True``), while the driver scans the source and stages the plan (a
    LocalCluster of 16 takes seconds); ``start`` waits for it. With a per-file time limit each worker
    runs its units in a decode process of its own (``unit_in_child``); with ``job.store_units`` the
    tasks upload their units to the object store and hand back the objects' checksums too."""

    def __init__(self, scheduler: str, start: bool = True) -> None:
        require_extra("distributed", "dask", "--scheduler")
        self._term = terminate_as_interrupt()
        self.early = EarlyClient(parse_scheduler(scheduler), start=start)
        self.client: Any = None
        self.stages: dict[str, float] = {}

    def start(self, n_units: int) -> int:
        t_wait = time.perf_counter()
        self.client = self.early.client()
        self.stages["dask_start_wait_s"] = time.perf_counter() - t_wait
        return count_workers(self.client)

    def run(self, job: Any, todo: list[int], done: Callable[[list[Any]], None]) -> None:
        from dlstore.write.store_units import convert_unit_to_store, convert_unit_to_store_in_process
        from dlstore.write.unit_work import _init_worker, convert_job_unit, convert_unit

        if job.store_units is not None:
            unit, in_child = convert_unit_to_store, convert_unit_to_store_in_process
        else:
            unit, in_child = convert_job_unit, convert_unit
        # A per-file time limit needs a process's main thread: the units then run in a decode process.
        child = (_init_worker, in_child) if job.decode_timeout > 0 else None
        # dlstore's own cluster has no nanny to restart a killed worker: no worker left is final at once
        grace = NO_WORKERS_GRACE_S if self.early.spec.address else 0.0
        run_on_dask(
            self.client, job, todo, unit, lambda result: done([result]), child, self.early.stamps, grace
        )

    def lost_worker(self, error: BaseException) -> str | None:
        if isinstance(error, WorkersLostError):
            return str(error)
        if isinstance(error, BrokenProcessPool):
            return (
                "a decode process of a Dask worker died (killed, out of memory, or a decoder crashed "
                "or spun past its CPU-time limit)"
            )
        return f"Dask workers kept dying on a unit ({error})" if is_killed_worker(error) else None

    def finish(self, t0: float) -> dict[str, float]:
        """Stop the cluster (before the cache is finished, as it always was); the start-up timeline."""
        t_close = time.perf_counter()
        self.close()
        self.stages["dask_close_s"] = time.perf_counter() - t_close
        self.stages.update(dask_timeline(self.early.stamps, t0))
        return self.stages

    def close(self) -> None:
        try:
            self.early.close()
        finally:
            if self._term is not None:
                signal.signal(signal.SIGTERM, self._term)
                self._term = None


def terminate_as_interrupt() -> Any:
    """SIGTERM (``kill``, a job scheduler's stop) as Ctrl-C while a Dask conversion runs: its cluster
    is then closed and reaped like on Ctrl-C, where the default action ended the driver at once and left
    the workers' processes behind. Returns the handler to restore (None outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:  # the caller handles it already
        return None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return previous
