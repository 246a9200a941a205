"""Units decoded ahead in worker processes, straight into shared-memory slots.

Threads decoding zstd chunks release the GIL inside the decode, but every chunk still costs a handful
of GIL hand-overs (open, read, close, the decode call, the future, the copy); with 16 threads those
hand-overs, not the decoding, bound a one-process reader (issue 13: 0.24 of the codec's all-core rate).
A worker process has a GIL of its own: it reads and decodes unit k into slot s of one shared-memory
block mapped once, and answers with 16 bytes. The reading process pays one message per unit.

Workers are fresh interpreters (started once per reader, in parallel); each opens its own reader
from (class, root) and calls its ``decode_unit_into``. A worker that dies fails the units it held, naming them.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import CacheCorruptError
from dlstore.spec import read_spec

_REQ = struct.Struct("<qq")  # unit, slot
_ANS = struct.Struct("<qqq")  # unit, slot, error message length (then the message)


def _worker(conn: Connection) -> None:
    """Decode the units asked for into their slots until the pipe closes. The first message (JSON)
    says which block and which reader: shared-memory name, slots shape, reader class, cache root."""
    hello = json.loads(conn.recv_bytes())
    cls = getattr(importlib.import_module(hello["module"]), hello["reader"])
    root, shape = Path(hello["root"]), tuple(hello["shape"])
    shm = shared_memory.SharedMemory(name=hello["shm"])
    _untrack(shm)
    try:
        slots = np.ndarray(shape, np.uint8, buffer=shm.buf)
        populate(slots)
        reader = cls(root, read_spec(root))
        while True:
            try:
                k, slot = _REQ.unpack(conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                reader.decode_unit_into(k, slots[slot])
                conn.send_bytes(_ANS.pack(k, slot, 0))
            except Exception as e:  # the reading process raises it, naming the chunk
                msg = str(e).encode(errors="replace")[:4000]
                conn.send_bytes(_ANS.pack(k, slot, len(msg)) + msg)
        del slots
    finally:
        shm.close()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Python < 3.13 registers an attached block with the resource tracker, which would unlink it
    when this worker exits; only the creating process owns it."""
    if sys.version_info < (3, 13):
        from multiprocessing import resource_tracker

        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:  # the tracker is best effort; the block is unlinked by its owner anyway
            pass


class UnitProcesses:
    """``processes`` workers and ``slots`` unit-sized slots; ``submit(k)`` returns a Future of the
    slot's array, or None when every slot is still referenced (by the unit cache, a copy, a future)."""

    def __init__(
        self, opener: tuple[Any, ...], unit_shape: tuple[int, ...], processes: int, slots: int
    ) -> None:
        self.shape = (slots, *unit_shape)
        nbytes = int(np.prod(self.shape))
        self.shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes))
        self.slots = np.ndarray(self.shape, np.uint8, buffer=self.shm.buf)
        populate(self.slots)  # the pages exist before the workers map them
        # The array last handed out per slot, weakly: the slot is free again once nobody holds it
        # (the unit cache, a copy in flight, a future).
        self._handed: list[weakref.ref[np.ndarray] | None] = [None] * slots
        self._busy = [False] * slots  # submitted and not answered yet
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, Future[np.ndarray], int]] = {}  # slot -> (unit, future, worker)
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        cls, root = opener
        hello = json.dumps(
            {
                "shm": self.shm.name,
                "shape": self.shape,
                "module": cls.__module__,
                "reader": cls.__qualname__,
                "root": str(root),
            }
        ).encode()
        for _ in range(processes):
            here, there = socket.socketpair()
            # A fresh interpreter, not multiprocessing's spawn/forkserver: those re-run the user's main
            # module in the child (scripts without a __main__ guard would recurse), and fork would
            # copy the reader's threads' locks.
            cmd = [sys.executable, "-c", "import sys; from dlstore.formats.unit_procs import main; main()"]
            proc = subprocess.Popen(
                [*cmd, str(there.fileno())], pass_fds=[there.fileno()], env=_child_env(), close_fds=True
            )
            there.close()
            conn = Connection(os.dup(here.fileno()))
            here.close()
            conn.send_bytes(hello)
            self.conns.append(conn)
            self.procs.append(proc)
        self._next = itertools.cycle(range(processes))
        self._closed = False
        self._collector = threading.Thread(target=self._collect, daemon=True, name="dlstore-unit-procs")
        self._collector.start()
        # Workers and the shared memory go with the interpreter even when close() is never called.
        self._finalizer = weakref.finalize(self, _shutdown, self.shm, self.conns, self.procs)

    def submit(self, k: int) -> Future[np.ndarray] | None:
        with self._lock:
            if self._closed:
                return None
            slot = self._free_slot()
            if slot is None:
                return None
            worker = next(self._next)
            future: Future[np.ndarray] = Future()
            self._busy[slot] = True
            self._pending[slot] = (k, future, worker)
            try:
                self.conns[worker].send_bytes(_REQ.pack(k, slot))
            except OSError:  # the worker is gone: the read decodes the unit itself
                del self._pending[slot]
                self._busy[slot] = False
                return None
        return future

    def _free_slot(self) -> int | None:
        for s, ref in enumerate(self._handed):
            if not self._busy[s] and (ref is None or ref() is None):
                return s
        return None

    def _collect(self) -> None:
        """Resolve futures as answers arrive; a worker that goes away fails the units it held."""
        live = list(self.conns)
        while live:
            try:
                ready = wait(live)
            except (OSError, ValueError):  # close() closed the pipes under us
                return
            for conn in ready:
                try:
                    msg = conn.recv_bytes()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    live.remove(conn)  # type: ignore[arg-type]
                    self._fail_worker(self.conns.index(conn))  # type: ignore[arg-type]
                    continue
                k, slot, n = _ANS.unpack_from(msg)
                if self._closed:
                    return
                view = self.slots[slot]
                with self._lock:
                    _, future, _ = self._pending.pop(slot)
                    self._handed[slot] = weakref.ref(view)
                    self._busy[slot] = False
                if n:
                    future.set_exception(CacheCorruptError(msg[_ANS.size :].decode(errors="replace")))
                else:
                    future.set_result(view)
                del view

    def _fail_worker(self, worker: int) -> None:
        with self._lock:
            lost = [(s, k, f) for s, (k, f, w) in self._pending.items() if w == worker]
            for s, _, _ in lost:
                del self._pending[s]
                self._busy[s] = False
        for _, k, f in lost:
            if not f.done():
                f.set_exception(
                    CacheCorruptError(f"unit {k}: its decode process exited ({self._why(worker)})")
                )

    def _why(self, worker: int) -> str:
        if self._closed:
            return "closed"
        try:
            return f"exit code {self.procs[worker].wait(0.5)}"
        except subprocess.TimeoutExpired:
            return "its pipe closed"

    def close(self) -> None:
        """Stop the workers (each finishes the unit it is on), then free the shared memory."""
        with self._lock:
            self._closed = True
        self.slots = np.zeros(0, np.uint8)
        self._finalizer()
        self._collector.join(5)


def _shutdown(shm: shared_memory.SharedMemory, conns: list[Connection], procs: list[Any]) -> None:
    for conn in conns:
        conn.close()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    try:
        shm.close()
    except BufferError:  # a unit array still in use keeps the mapping; the name goes anyway
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _child_env() -> dict[str, str]:
    """The child imports dlstore from wherever this process did (a source tree on sys.path too)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def populate(arr: np.ndarray) -> None:
    """Map every page of ``arr`` writable in one ``madvise`` instead of one fault per 4 KiB page on
    first write. Workers write all over a shared block: without this, each process takes a fault
    on most of its writes for the first several epochs (one per page it has not written yet). A no-op where unsupported."""
    if os.environ.get("DLSTORE_PREFAULT", "1") == "0" or arr.nbytes == 0:  # benchmarks' A/B switch
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return
    addr = arr.ctypes.data
    start = addr - addr % mmap.PAGESIZE
    libc.madvise(start, arr.nbytes + (addr - start), _MADV_POPULATE_WRITE)


def main() -> None:
    """Worker entry: ``python -c '...main()' FD`` (see UnitProcesses)."""
    _worker(Connection(int(sys.argv[1])))


def opener_for(reader: Any) -> tuple[type, Path]:
    """What a worker needs to open its own copy of the reader (it reads the manifest itself)."""
    return (type(reader), Path(reader.root).resolve())
