"""A conversion's units as Dask tasks (``--scheduler``): ``DaskRunner``, the ``Runner`` on a cluster,
``local[:N]`` (``start_local_cluster``) or a running scheduler whose workers see SOURCE and DEST. Each
task writes its unit itself (``convert_unit``) and returns only bad files and digests; the driver
journals, so resume and the atomic publish are the pool's. SIGALRM (``decode_timeout``) needs a main
thread, so each worker runs its units in decode processes of its own (``unit_in_child``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

from dlstore.errors import ConvertError, require_extra
from dlstore.machine import usable_cores

_ADDRESS = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")


@dataclass(frozen=True)
class SchedulerSpec:
    """``local`` with a worker count, or the address of an existing scheduler."""

    local_workers: int | None = None
    address: str | None = None


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


# Our own cluster's workers only wait for their decode processes: the profiler and monitors that would
# take CPU from those are off or slowed (decoding measured 5-7 % slower with Dask's defaults).
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
    """(worker processes, threads each) for ``local:N``: fewest workers of ≤ ``most_threads`` dividing N."""
    first = -(-slots // max(1, most_threads))
    workers = next(w for w in range(first, slots + 1) if slots % w == 0)
    return workers, slots // workers


def start_local_cluster(slots: int, most_threads: int = LOCAL_THREADS_PER_WORKER) -> Any:
    """``local:N``: a scheduler here, ``python -m dask spec`` workers (not re-importing ``__main__``)."""
    import dask
    from distributed import Scheduler, SpecCluster
    from distributed.deploy.subprocess import SubprocessWorker

    workers, threads = local_layout(slots, most_threads)
    worker_kwargs = {
        "host": "127.0.0.1",
        "nthreads": threads,
        "memory_limit": 0,  # the workers hold no data
        "silence_logs": logging.WARN,  # as LocalCluster: no INFO lines on the user's terminal
        "driver_pid": os.getpid(),  # the workers die with this process (kill -9 included)
    }
    worker = {
        "cls": SubprocessWorker,
        "options": {"worker_class": WORKER_CLASS, "worker_kwargs": worker_kwargs},
    }
    scheduler = {
        "cls": Scheduler,
        "options": {"host": "127.0.0.1", "port": 0, "dashboard": False, "dashboard_address": "127.0.0.1:0"},
    }
    # Saturation 1.5: a worker of 4 threads holds 2 queued units, so two threads finishing together
    # both start their next unit without a round trip to the scheduler.
    with dask.config.set({**QUIET_CONFIG, "distributed.scheduler.worker-saturation": 1.5}):
        return SpecCluster(
            workers=dict.fromkeys(range(workers), worker),
            scheduler=scheduler,
            worker=worker,
            name="dlstore-local",
            silence_logs=logging.WARN,
        )


def open_client(spec: SchedulerSpec, stamps: dict[str, float] | None = None) -> tuple[Any, Any]:
    """A connected Client and its local cluster (None for an address); ``stamps``: each step's time."""
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
        try:  # else the first units would all go to the first worker up
            client.wait_for_workers(len(cluster.workers), timeout=WORKERS_START_S)
        except TimeoutError:
            raise ConvertError(
                f"--scheduler local:{spec.local_workers}: the Dask workers did not start within {WORKERS_START_S} s "
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
    """``open_client``, then each worker starts its decode fork server before any unit is handed out."""
    client, cluster = open_client(spec, stamps)
    with contextlib.suppress(Exception):  # only a head start: the first unit starts it otherwise
        client.run(warm_decode_forkserver)
    _stamp(stamps, "warm")
    return client, cluster


DECODE_MODULE = "dlstore.write.unit_work"  # what a decode process runs, imported by its fork server
TRACKER_LEAK_WARNING = "ignore:resource_tracker:UserWarning"


def warm_decode_forkserver() -> None:
    """On a worker: ``_child_pool``'s fork server, converter imported, quiet about leaked semaphores."""
    if TRACKER_LEAK_WARNING not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_LEAK_WARNING)
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload([DECODE_MODULE])
    forkserver.ensure_running()


class EarlyClient:
    """``open_client`` in a background thread (a cluster boots while the source is scanned)."""

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
                close_cluster(cluster)


def count_workers(client: Any) -> int:
    """Task threads in the cluster (each runs one unit at a time): the conversion's parallelism."""
    workers = client.scheduler_info().get("workers", {}).values()
    return sum(int(w.get("nthreads", 1)) for w in workers)


SUBMITTED_PER_THREAD = 4  # units handed to the scheduler ahead of the cluster's task threads
POLL_S = 2.0  # how often the driver looks for a cluster left without workers while it waits
NO_WORKERS_GRACE_S = 20.0  # a running cluster's nannies restart killed workers within this


class LostWorkerNoise(logging.Filter):
    """Drops Dask's lines about lost workers and abandoned waits: dlstore says in one line what died."""

    PREFIXES = ("Removing worker", "Couldn't gather", "Lost all workers")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return "exception=AllExit()" not in record.getMessage()
        return not str(record.msg).startswith(self.PREFIXES)


LOST_WORKER_LOGGERS = ("distributed.scheduler", "distributed.client")
_NOISE = LostWorkerNoise()


class WorkersLostError(RuntimeError):
    """Every Dask worker died (or the units' results were lost with them): nothing can run the rest."""


@dataclass(frozen=True)
class TaskFailed:
    """A unit's error as a value (raised, every worker logs a traceback on the user's terminal)."""

    error: BaseException


def _the_job(job: Any) -> Any:
    return job


def guarded(job: Any, k: int, *, task: Callable[[Any, int], Any]) -> Any:
    try:
        return task(job, k)
    except Exception as e:  # noqa: BLE001 - re-raised by the driver (``UnitWindow.outcome``)
        return TaskFailed(e)


@dataclass
class UnitWindow:
    """The units of one conversion on the cluster: a bounded window of tasks, refilled per batch of
    finished units by one ``client.map``. A killed worker's units rerun on the others; none left for
    ``grace_s`` is WorkersLostError, naming the dead."""

    client: Any
    task: Callable[..., Any]
    shared: Any
    token: str
    queue: Iterator[int]
    grace_s: float
    pending: set[Any] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # every worker seen, to name the dead ones
    no_workers_since: float | None = None

    def submit(self, count: int) -> None:
        ks = list(islice(self.queue, count))
        if ks:
            keys = [f"dlstore-unit-{self.token}-{k}" for k in ks]
            self.pending.update(self.client.map(self.task, [self.shared] * len(ks), ks, key=keys, pure=False))

    def lost(self) -> str:
        dead = sorted(self.seen - set(self.client.scheduler_info()["workers"]))
        named = f"worker{'s' if len(dead) > 1 else ''} {', '.join(dead)}" if dead else "workers"
        return (
            f"the Dask {named} died (killed, out of memory or crashed) and no worker is left to run "
            "the conversion's units"
        )

    def still_workers(self) -> None:
        """WorkersLostError once the cluster has had no worker for ``grace_s``."""
        now_seen = set(self.client.scheduler_info()["workers"])
        self.seen.update(now_seen)
        if now_seen:
            self.no_workers_since = None
            return
        self.no_workers_since = self.no_workers_since or time.monotonic()
        if time.monotonic() - self.no_workers_since >= self.grace_s:
            raise WorkersLostError(self.lost())

    def outcome(self, future: Any) -> Any:
        """A finished task's result or its error; a result lost with its worker is recomputed, waited for."""
        from distributed.client import FutureCancelledError

        while True:
            try:
                result = future.result(timeout=POLL_S)
                break
            except FutureCancelledError:
                raise WorkersLostError(self.lost()) from None
            except TimeoutError:
                self.still_workers()
        if isinstance(result, TaskFailed):
            raise result.error
        return result

    def drain(self, record: Callable[[Any], None]) -> None:
        from distributed import wait

        while self.pending:
            try:
                finished = wait(list(self.pending), timeout=POLL_S, return_when="FIRST_COMPLETED").done
            except TimeoutError:  # none finished within POLL_S
                self.still_workers()
                continue
            self.pending.difference_update(finished)
            self.submit(len(finished))
            for fut in finished:
                record(self.outcome(fut))  # a unit's error (e.g. --strict's) is raised here


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
    """Run every unit as a task, ``record`` each result; on an error the rest are cancelled."""
    from distributed import wait

    token = uuid.uuid4().hex  # keys of their own: two conversions may share one cluster
    shared = client.submit(_the_job, job, key=f"dlstore-job-{token}", pure=False)
    wait([shared])  # on a worker before the units: the first units need not wait for it
    inner = unit if child is None else partial(unit_in_child, init=child[0], unit=child[1], token=token)
    window = UnitWindow(client, partial(guarded, task=inner), shared, token, iter(todo), no_workers_grace_s)
    window.seen = set(client.scheduler_info()["workers"])
    _stamp(stamps, "scattered")
    loggers = [logging.getLogger(name) for name in LOST_WORKER_LOGGERS]
    logging.getLogger("asyncio").addFilter(_NOISE)  # logged as late as the exit: kept
    for logger in loggers:
        logger.addFilter(_NOISE)
    window.submit(SUBMITTED_PER_THREAD * max(1, count_workers(client)))
    _stamp(stamps, "submitted")
    try:
        window.drain(record)
    except BaseException:
        client.cancel([*window.pending, shared])
        raise
    finally:
        if child is not None:
            with contextlib.suppress(Exception):  # no decode process stays behind (best effort)
                client.run(close_child)
        for logger in loggers:
            logger.removeFilter(_NOISE)


# --- the decode processes of each Dask worker -----------------------------------------------------

_CHILD: dict[str, Any] = {}  # in a Dask worker: {"token": conversion, "pool": its decode process(es)}
_CHILD_LOCK = threading.Lock()


def unit_in_child(
    job: Any, k: int, *, init: Callable[[Any], None], unit: Callable[[int], Any], token: str
) -> Any:
    """A Dask task: unit k in this worker's decode process (one that dies raises BrokenProcessPool)."""
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
            if ctx.get_start_method() == "forkserver":  # lives as long as this worker, converter imported
                ctx.set_forkserver_preload([init.__module__])  # = DECODE_MODULE, as warmed
            # Dask's workers are daemonic, which multiprocessing forbids to have children; ours are
            # ended by ``close_child`` and exit by themselves when this worker's pipe end closes.
            mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
            pool = ProcessPoolExecutor(
                _worker_threads(), mp_context=ctx, initializer=_start_decode_process, initargs=(init, job)
            )
            _CHILD.update(token=token, pool=pool)
        return _CHILD["pool"]


def _start_decode_process(init: Callable[[Any], None], job: Any) -> None:
    """Undo the inherited ``MALLOC_TRIM_THRESHOLD_`` (every buffer an mmap: decoding 10-43 % slower)."""
    if "MALLOC_TRIM_THRESHOLD_" in os.environ:
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to undo
            libc = ctypes.CDLL(None)
            libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    init(job)


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


class DaskRunner:
    """The conversion's ``Runner`` on a Dask cluster, started in the background at construction."""

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
        if type(error).__name__ == "KilledWorker":
            return f"Dask workers kept dying on a unit ({error})"
        return None

    def finish(self, t0: float) -> dict[str, float]:
        """Stop the cluster (before the cache is finished); the start-up timeline."""
        t_close = time.perf_counter()
        self.close()
        self.stages["dask_close_s"] = time.perf_counter() - t_close
        steps = ("start", "cluster", "client", "workers", "warm", "scattered", "submitted")
        stamps = self.early.stamps  # the start steps, in seconds after the conversion's start
        self.stages.update({f"dask_{name}_at_s": stamps[name] - t0 for name in steps if name in stamps})
        return self.stages

    def close(self) -> None:
        try:
            self.early.close()
        finally:
            if self._term is not None:
                signal.signal(signal.SIGTERM, self._term)
                self._term = None


def terminate_as_interrupt() -> Any:
    """SIGTERM as Ctrl-C, so the cluster is closed and reaped; the handler to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:  # the caller handles it already
        return None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return previous


# --- closing dlstore's own local cluster: nothing left behind ---------------------------------------
# A killed worker cannot reap its children (fork server, resource tracker, decode processes): they were
# left as orphans. For the close the driver becomes their reaper (Linux's PR_SET_CHILD_SUBREAPER) and
# waits for exactly the workers' process trees, listed before the close, and nothing else of the caller's.

PR_SET_CHILD_SUBREAPER = 36
REAP_S = 10.0  # a killed process is gone within this (SIGKILL); then we stop waiting


def close_cluster(cluster: Any) -> None:
    """``cluster.close()``, then every process the workers had started is gone and reaped."""
    procs = [getattr(w, "process", None) for w in getattr(cluster, "workers", {}).values()]
    tree = descendants([int(p.pid) for p in procs if getattr(p, "pid", None)])
    with reaper():
        try:
            cluster.close()
        finally:
            end_processes(tree)


def descendants(roots: list[int]) -> list[int]:
    """Every pid below ``roots``, found by /proc (without psutil)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.isdigit():
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(roots)
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def reaper() -> Iterator[None]:
    """This process adopts the orphans of its descendants while inside (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    on = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        if on:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def end_processes(pids: list[int], within_s: float = REAP_S) -> None:
    """Kill ``pids``, reap our children among them, wait up to ``within_s`` for the others."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    left = set(pids)
    deadline = time.monotonic() + within_s
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if not reaped_or_gone(pid)}
        if left:
            time.sleep(0.02)


def reaped_or_gone(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # not ours (yet): gone once /proc no longer lists it
        return not os.path.exists(f"/proc/{pid}")
