"""Units decoded ahead in worker processes, straight into shared-memory slots.

Threads decoding zstd chunks release the GIL inside the decode, but every chunk still costs a handful
of GIL hand-overs (open, read, close, the decode call, the future, the copy); with 16 threads those
hand-overs, not the decoding, bound a one-process reader (a quarter of the codec's all-core rate).
A worker process has a GIL of its own: it reads and decodes unit k into slot s of one shared-memory
block mapped once, and answers with 16 bytes. The reading process pays one message per unit.

Workers are fresh interpreters (started once per reader, in parallel); each opens its own reader
from (class, root) and calls its ``decode_unit_into``. A worker that dies fails the units it held, naming them.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import mmap
import struct
import subprocess
import threading
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import CacheCorruptError
from dlstore.read.engines.workers import Workers, attach, shutdown, worker_connection
from dlstore.spec import read_spec

_REQ = struct.Struct("<qq")  # unit, slot
_ANS = struct.Struct("<qqq")  # unit, slot, error message length (then the message)


def _worker(conn: Connection) -> None:
    """Decode the units asked for into their slots until the pipe closes. The hello says which block
    and which reader: slots shape, reader class, cache root."""
    hello, shm = attach(conn)
    cls = getattr(importlib.import_module(hello["module"]), hello["reader"])
    root, shape = Path(hello["root"]), tuple(hello["shape"])
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


class UnitProcesses:
    """``processes`` workers and ``slots`` unit-sized slots; ``submit(k)`` returns a Future of the
    slot's array, or None when every slot is still referenced (by the unit cache, a copy, a future)."""

    def __init__(
        self, opener: tuple[Any, ...], unit_shape: tuple[int, ...], processes: int, slots: int
    ) -> None:
        self.shape = (slots, *unit_shape)
        cls, root = opener
        hello = {"shape": self.shape, "module": cls.__module__, "reader": cls.__qualname__, "root": str(root)}
        workers = Workers(__name__, processes, int(np.prod(self.shape)), hello)
        self.shm, self.conns, self.procs = workers.shm, workers.conns, workers.procs
        self.slots = np.ndarray(self.shape, np.uint8, buffer=self.shm.buf)
        populate(self.slots)
        # The array last handed out per slot, weakly: the slot is free again once nobody holds it
        # (the unit cache, a copy in flight, a future).
        self._handed: list[weakref.ref[np.ndarray] | None] = [None] * slots
        self._busy = [False] * slots  # submitted and not answered yet
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, Future[np.ndarray], int]] = {}  # slot -> (unit, future, worker)
        self._next = itertools.cycle(range(processes))
        self._closed = False
        self._collector = threading.Thread(target=self._collect, daemon=True, name="dlstore-unit-procs")
        self._collector.start()
        # Workers and the shared memory go with the interpreter even when close() is never called.
        self._finalizer = weakref.finalize(self, shutdown, self.shm, self.conns, self.procs)

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


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14; elsewhere pages fault as used
_libc: Any = None


def populate(arr: np.ndarray) -> None:
    """Map every page of ``arr`` writable in one ``madvise`` instead of one fault per 4 KiB page on
    first write. Workers write all over a shared block: without this, each process takes a fault
    on most of its writes for the first several epochs (one per page it has not written yet)."""
    addr = arr.ctypes.data
    start = addr - addr % mmap.PAGESIZE
    madvise_populate(start, arr.nbytes + (addr - start), write=True)


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


def main() -> None:
    """Worker entry (see ``dlstore.read.engines.workers``)."""
    _worker(worker_connection())


def opener_for(reader: Any) -> tuple[type, Path]:
    """What a worker needs to open its own copy of the reader (it reads the manifest itself)."""
    return (type(reader), Path(reader.root).resolve())
