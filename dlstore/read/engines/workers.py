"""Worker interpreters that share one block of memory with the process that starts them (the plumbing
under ``batch_procs`` and ``dlstore.read.decode.cpu_lane``, each with its own protocol on top).

- Fresh interpreters (``python -c "from MODULE import main; main()" FD``), not multiprocessing's: spawn
  and forkserver re-run the user's main module (a script without a ``__main__`` guard would recurse),
  and fork would copy the parent's threads' locks.
- One socket per worker; the first message is a JSON hello naming the block, answered once the worker
  has mapped it. The parent then unlinks the name: nothing is left in /dev/shm even after ``kill -9``.
- Workers ignore Ctrl-C (the parent handles it) and exit when their socket closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import DlstoreError

_ATTACHED = b"A"
START_TIMEOUT_S = 120.0  # a loaded machine starting 16 interpreters that import numpy


class Workers:
    """``processes`` workers running ``module.main()`` over a new block of ``nbytes`` shared memory."""

    def __init__(self, module: str, processes: int, nbytes: int, hello: dict[str, Any]) -> None:
        self.shm = shared_memory.SharedMemory(create=True, size=max(1, int(nbytes)))
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            message = json.dumps({**hello, "shm": self.shm.name}).encode()
            for _ in range(max(1, processes)):
                conn, proc = _start(module)
                self.conns.append(conn)
                self.procs.append(proc)
                conn.send_bytes(message)
            self._await_attached(module)
        except BaseException:
            shutdown(self.shm, self.conns, self.procs)
            raise
        self.shm.unlink()  # every worker has it mapped; the name is not needed any more

    def _await_attached(self, module: str) -> None:
        waiting = list(self.conns)
        while waiting:
            ready = wait(waiting, timeout=START_TIMEOUT_S)
            if not ready:
                raise DlstoreError(
                    f"{module}: {len(waiting)} worker process(es) did not start within "
                    f"{START_TIMEOUT_S:.0f} s; the machine may be overloaded"
                )
            for conn in ready:
                i = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    ok = conn.recv_bytes() == _ATTACHED  # type: ignore[union-attr]
                except (EOFError, OSError):
                    ok = False
                if not ok:
                    raise DlstoreError(
                        f"{module}: a worker process exited while starting (exit code "
                        f"{_exit_code(self.procs[i])}); run `python -c 'import {module}'` to see why"
                    )
                waiting.remove(conn)  # type: ignore[arg-type]


def attach(conn: Connection) -> tuple[dict[str, Any], shared_memory.SharedMemory]:
    """In a worker: read the hello, map the block, say so. Returns the hello and the block."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; we exit when its socket closes
    hello = json.loads(conn.recv_bytes())
    shm = shared_memory.SharedMemory(name=hello["shm"])
    _untrack(shm)
    conn.send_bytes(_ATTACHED)
    return hello, shm


def worker_connection() -> Connection:
    """In a worker's ``main()``: the socket to the parent, passed as the first argument."""
    return Connection(int(sys.argv[1]))


def shutdown(
    shm: shared_memory.SharedMemory, conns: list[Connection], procs: list[Any], pinned: int = 0
) -> None:
    """Close the sockets (each worker finishes its current task and exits), reap the workers, drop CUDA's
    registration of the block (``pinned``: its address) and the parent's mapping."""
    for conn in conns:
        _hang_up(conn)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for conn in conns:
        conn.close()
    if pinned:
        import torch

        torch.cuda.cudart().cudaHostUnregister(pinned)
    with contextlib.suppress(BufferError):  # an array still over the block keeps the mapping until it goes
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()  # only when starting failed: after a good start the name is gone already


def _hang_up(conn: Connection) -> None:
    """Shut the socket down before closing it: a collector thread waiting on it wakes at once (closing
    the descriptor alone does not) and the worker sees EOF."""
    with contextlib.suppress(OSError):  # already closed, or never connected
        socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)


def _start(module: str) -> tuple[Connection, subprocess.Popen[bytes]]:
    here, there = socket.socketpair()
    for end in (here, there):  # blocking fds whatever socket.setdefaulttimeout the program set: a timeout
        end.setblocking(True)  # makes the fd non-blocking, and Connection's raw reads then fail with EAGAIN
    cmd = [sys.executable, "-c", f"from {module} import main; main()", str(there.fileno())]
    proc = subprocess.Popen(cmd, pass_fds=[there.fileno()], env=_child_env(), close_fds=True)
    there.close()
    conn = Connection(os.dup(here.fileno()))
    here.close()
    return conn, proc


def _exit_code(proc: subprocess.Popen[bytes]) -> str:
    try:
        return str(proc.wait(2))
    except subprocess.TimeoutExpired:
        return "none yet: it closed its socket"


def _child_env() -> dict[str, str]:
    """The child imports dlstore from wherever this process did (a source tree on sys.path too)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[3])  # the folder holding dlstore/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Python < 3.13 registers an attached block with the resource tracker, which would unlink it
    when this worker exits; only the creating process owns it."""
    if sys.version_info < (3, 13):
        from multiprocessing import resource_tracker

        with contextlib.suppress(Exception):  # best effort; the block is unlinked by its owner anyway
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14; elsewhere pages fault as used
_libc: Any = None


def populate(arr: np.ndarray, write: bool = True) -> bool:
    """Map every page of ``arr`` (writable) in one ``madvise`` instead of one fault per 4 KiB page on
    first use (workers write all over a shared block for several epochs before every page is mapped)."""
    addr = arr.ctypes.data
    start = addr - addr % mmap.PAGESIZE
    return madvise_populate(start, arr.nbytes + (addr - start), write)


def madvise_populate(address: int, nbytes: int, write: bool = False) -> bool:
    """``madvise(MADV_POPULATE_WRITE|READ)`` over ``nbytes`` from the page-aligned ``address``; False
    where unsupported (Linux < 5.14, no libc), and the pages then fault in as they are first used."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc or nbytes == 0:
        return False
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    return int(_libc.madvise(address, nbytes, advice)) == 0


def opener_for(reader: Any) -> tuple[type, Path]:
    """What a worker needs to open its own copy of the reader (it reads the manifest itself)."""
    return (type(reader), Path(reader.root).resolve())
