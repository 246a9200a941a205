"""Running a conversion's units as Dask tasks (``convert(..., scheduler=)``, ``--scheduler``).

The built-in engine is the process pool in ``conversion.py``; this one hands the same units to a
``distributed`` cluster: ``local`` / ``local:N`` starts a ``LocalCluster`` of N single-threaded worker
processes, ``tcp://HOST:PORT`` (or ``tls://``) uses a running scheduler whose workers see SOURCE and
DEST at the same paths. Each task is ``convert_unit``: it decodes and writes its unit into the staging
directory itself, exactly as a pool worker does, and returns only the bad files and digests; the
driver journals each finished unit, so resume, the bad-file budget, the atomic publish and the result
are the built-in engine's. With a URL destination the tasks write their units to the object store
instead (``store_units.convert_unit_to_store``), so no worker needs the driver's spool folder.

The per-file ``decode_timeout``: Dask runs tasks in worker threads, where SIGALRM (the pool's way to
interrupt a decoder) cannot be used. So each Dask worker runs its units in a decode process of its own
(``unit_in_child``), started once per conversion and worker, whose main thread takes the pool worker's
time limits: a file that hangs becomes a named bad file, and a decoder stuck inside C code ends that
process (a clear error, resumable) instead of hanging the cluster. Pixels still never cross a pipe: the
decode process writes its unit itself and returns only the bad files and digests.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any

from dlstore.errors import ConvertError, require_extra
from dlstore.machine import usable_cores

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


def open_client(spec: SchedulerSpec) -> tuple[Any, Any]:
    """A connected ``distributed.Client`` and the local cluster it runs on (None for an address).
    Not entered as context managers: ``Client.__enter__`` makes it the thread's current client, and
    ``EarlyClient`` opens it in one thread and closes it in another."""
    require_extra("distributed", "dask", "--scheduler")
    from distributed import Client, LocalCluster

    if spec.address is not None:
        try:
            return Client(spec.address, timeout="20s"), None
        except OSError as e:
            raise ConvertError(
                f"--scheduler {spec.address}: cannot connect ({e}); is the scheduler running?"
            ) from None
    import dask

    # Our own cluster's workers only wait for their decode processes, on every core: what would
    # only take CPU from those (16 workers' statistical profilers walking every stack each 10 ms,
    # event-loop health ticks every 20 ms, system and memory monitors several times a second, in
    # 16 workers, 16 nannies and the scheduler) is off or slowed; the nanny hands these settings
    # to the workers it starts. (Round C on the H200: Dask's decode processes took 7 % longer per
    # image than the pool's workers on a default running cluster, 5 % with profiling off.)
    # Workers are spawned: from a fork server the 16-worker cluster started slower there (3.3 s
    # against about 2.3 s): its one process imports distributed and every package it knows before
    # the first fork, while spawned workers import in parallel.
    quiet = {
        "distributed.worker.profile.enabled": False,
        "distributed.admin.tick.interval": "500ms",
        "distributed.admin.system-monitor.interval": "2s",
        "distributed.worker.memory.monitor-interval": "1s",
    }
    with dask.config.set(quiet):
        cluster = LocalCluster(
            n_workers=spec.local_workers,
            threads_per_worker=1,  # decoding is CPU-bound and holds the GIL part of the time: processes
            processes=True,
            dashboard_address=":0",  # a free port: never collide with a running dashboard
        )
    try:
        return Client(cluster), cluster
    except BaseException:
        cluster.close()
        raise


def open_warm_client(spec: SchedulerSpec) -> tuple[Any, Any]:
    """``open_client``, then each worker starts its decode processes' fork server (importing the
    converter takes about 0.5 s) before any unit is handed out: with ``EarlyClient`` this happens
    while the driver is still scanning the source."""
    client, cluster = open_client(spec)
    try:
        client.run(warm_decode_forkserver)
    except Exception:  # noqa: BLE001 - only a head start: the first unit starts it otherwise
        pass
    return client, cluster


DECODE_MODULE = "dlstore.build.conversion"  # what a decode process runs, imported by its fork server


def warm_decode_forkserver() -> None:
    """On a Dask worker: start the fork server of ``_child_pool`` with the converter imported."""
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
        self._spec = spec
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[tuple[Any, Any]] | None = None
        if start:
            self._start()

    def _start(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlstore-dask-start")
        self._future = self._pool.submit(open_warm_client, self._spec)

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
                cluster.close()


def count_workers(client: Any) -> int:
    return len(client.scheduler_info().get("workers", {}))


def run_on_dask(
    client: Any,
    job: Any,
    todo: list[int],
    unit: Callable[[Any, int], Any],
    record: Callable[[Any], None],
    child: tuple[Callable[[Any], None], Callable[[int], Any]] | None = None,
) -> None:
    """Submit every unit, ``record`` each result in the driver as it finishes; on any error the
    remaining tasks are cancelled (unfinished units are not journaled and are redone on resume).

    With ``child`` = (init, unit_by_index), each worker runs its units in a decode process of its own
    (``unit_in_child``) where ``init(job)`` ran first; else ``unit(job, k)`` runs in the task thread."""
    from distributed import as_completed

    shared = client.scatter(job, broadcast=True)  # sent once per worker, not once per task
    task = (
        unit
        if child is None
        else partial(unit_in_child, init=child[0], unit=child[1], token=uuid.uuid4().hex)
    )
    futures = [client.submit(task, shared, k, key=f"dlstore-unit-{k}", pure=False) for k in todo]
    try:
        for fut in as_completed(futures):
            record(fut.result())  # re-raises a task's error (e.g. --strict's ImageDecodeError) here
    except BaseException:
        client.cancel(futures)
        raise
    finally:
        if child is not None:
            stop_children(client)


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
