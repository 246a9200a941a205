"""Nothing left behind by a Dask conversion (issue 20 part 4): closing dlstore's own local cluster ends
every process it started, and reaps them before the command exits.

Each worker of ``--scheduler local:N`` starts a ``forkserver``, a ``resource_tracker`` and decode
processes. Closing the cluster kills the worker processes and their children (Dask's
``SubprocessWorker.close``); a killed worker cannot reap its children, so they were left as orphans
(zombies of PID 1, or of nobody in a container whose PID 1 does not reap) after the command had exited.
Here the driver becomes their reaper for the close (Linux's ``PR_SET_CHILD_SUBREAPER``): the orphans
of the close are re-parented to it, and it waits for exactly those processes (the workers' process
trees, listed before the close) and nothing else of the caller's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
REAP_S = 10.0  # a killed process is gone within this (SIGKILL); then we stop waiting


def close_cluster(cluster: Any) -> None:
    """``cluster.close()``, then every process the workers had started is gone and reaped."""
    tree = worker_trees(cluster)
    with reaper():
        try:
            cluster.close()
        finally:
            end_processes(tree)


def worker_trees(cluster: Any) -> list[int]:
    """The pids under each worker process of a ``SpecCluster`` of ``SubprocessWorker``\\s (children
    first found by /proc, without psutil)."""
    roots = []
    for worker in getattr(cluster, "workers", {}).values():
        proc = getattr(worker, "process", None)
        if proc is not None and getattr(proc, "pid", None):
            roots.append(int(proc.pid))
    return descendants(roots)


def descendants(roots: list[int]) -> list[int]:
    parents: dict[int, list[int]] = {}
    for pid, ppid in process_parents():
        parents.setdefault(ppid, []).append(pid)
    found, todo = [], list(roots)
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_parents() -> Iterator[tuple[int, int]]:
    if not os.path.isdir("/proc"):
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            yield int(entry), ppid


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
    """Kill each of ``pids`` still running and reap those that are (now) this process's children;
    wait up to ``within_s`` for the others to disappear."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    left = set(pids)
    deadline = time.monotonic() + within_s
    while left and time.monotonic() < deadline:
        for pid in list(left):
            if reaped_or_gone(pid):
                left.discard(pid)
        if left:
            time.sleep(0.02)


def reaped_or_gone(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:  # not ours (yet): gone once /proc no longer lists it
        return not os.path.exists(f"/proc/{pid}")
