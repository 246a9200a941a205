"""JPEG payloads decoded on the CPU in worker processes, into slots of one shared-memory block.

``dlstore.Loader(cpu_decoders=N)`` on a JPEG cache gives part of each batch to N of these workers
(simplejpeg, or Pillow). Each worker decodes its contiguous run of the share and writes every image
planar (C, H, W) into the slot's output area, back to back, so the GPU gets the share in one copy
(pinned when the block could be registered with CUDA), read by the crop like nvJPEG's outputs.

The loader's process (whose GIL is the training loop's) touches no payload bytes where it can help
it: it locates them with ``PayloadExtents`` and sends each worker rows of (where, CRC, shape). A
payload of a unit stored as a file is read by the worker from that file (memory-mapped); any other is
copied into the slot's input area first. Workers check every CRC, import no torch
(``dlstore.read.engines.workers``), and answer each run with its decode time, which balances the split. A
run a worker fails (or loses by dying) is decoded again in the loader, where a corrupt payload
becomes the reader's error naming the image and its chunk.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import queue
import selectors
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from dlstore.read.engines.workers import Workers, attach, shutdown, worker_connection

if TYPE_CHECKING:
    from dlstore.formats.payload import PayloadExtents

_REQ = struct.Struct("<qq")  # run id, images (then an int64 (n, COLUMNS) table, then file paths)
_ANS = struct.Struct("<qqq")  # run id, decode nanoseconds, error message length (then the message)
# per image: input start, input end, output start, H, W, C, the payload's CRC-32 (-1: checked already),
# and where the input range is: -1 the block, i >= 0 the i-th file path sent with the run
COLUMNS = 8
MAX_OPEN_FILES = 64  # memory maps a worker keeps open (an LRU of unit files)


def _worker(conn: Connection) -> None:
    """Decode the runs asked for until the pipe closes; the first message (JSON) names the block and
    the codec."""
    from dlstore.formats.codecs import get_codec

    hello, shm = attach(conn)
    codec = get_codec(hello["codec"], int(hello["quality"]))
    block = np.ndarray((hello["size"],), np.uint8, buffer=shm.buf)
    scratch = np.empty(0, np.uint8)
    files = MappedFiles(MAX_OPEN_FILES)
    try:
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                break
            run, n = _REQ.unpack_from(msg)
            table = np.frombuffer(msg, np.int64, n * COLUMNS, _REQ.size).reshape(n, COLUMNS)
            names = msg[_REQ.size + table.nbytes :]
            paths = [os.fsdecode(p) for p in names.split(b"\0")] if names else []
            t0 = time.perf_counter_ns()
            try:
                scratch = decode_table(codec, block, table, scratch, functools.partial(files.get_nth, paths))
                conn.send_bytes(_ANS.pack(run, time.perf_counter_ns() - t0, 0))
            except Exception as e:  # the loader decodes the run again itself, naming the image
                err = f"{type(e).__name__}: {e}".encode(errors="replace")[:4000]
                conn.send_bytes(_ANS.pack(run, 0, len(err)) + err)
        del block
    finally:
        files.clear()
        shm.close()


class MappedFiles:
    """Read-only memory maps of the most recently used files (a worker's unit files), as uint8 arrays."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._maps: OrderedDict[str, np.ndarray] = OrderedDict()

    def get(self, path: str) -> np.ndarray:
        arr = self._maps.get(path)
        if arr is None:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                arr = (
                    np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
                    if size
                    else np.empty(0, np.uint8)
                )
            self._maps[path] = arr
            while len(self._maps) > self.keep:
                self._maps.popitem(last=False)  # unmapped once the array goes
        self._maps.move_to_end(path)
        return arr

    def get_nth(self, paths: list[str], i: int) -> np.ndarray:
        return self.get(paths[i])

    def clear(self) -> None:
        self._maps.clear()


def decode_table(
    codec: Any,
    block: np.ndarray,
    table: np.ndarray,
    scratch: np.ndarray,
    file: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """Check each row's payload (``block[start:end]``, or ``file(i)[start:end]``) against its CRC,
    decode it to (H, W, C) in ``scratch`` (grown as needed and returned), then write it planar
    (C, H, W) at its output offset in ``block``."""
    for row, (start, end, out, h, w, c, crc, where) in enumerate(table.tolist()):
        src = block if where < 0 or file is None else file(where)
        if end > len(src) or start > end:
            raise ValueError(f"row {row}: bytes {start}:{end} beyond the {len(src)} bytes of its source")
        payload = src[start:end]
        if crc >= 0 and zlib.crc32(payload) != crc:
            raise ValueError(f"row {row}: the payload fails its CRC check")
        if scratch.size < h * w * c:
            scratch = np.empty(h * w * c, np.uint8)
        hwc = scratch[: h * w * c].reshape(h, w, c)
        codec.decode_into(payload, (h, w, c), hwc)
        np.copyto(block[out : out + h * w * c].reshape(c, h, w), hwc.transpose(2, 0, 1))
    return scratch


@dataclass
class CpuShare:
    """One batch's CPU share in flight: images ``0..count`` of the batch, decoded into ``slot``."""

    slot: int
    count: int
    out_start: int  # the slot's output area: [out_start, out_start + out_bytes) of the block
    out_bytes: int
    shapes: np.ndarray  # (count, 3) H, W, C
    offsets: np.ndarray  # (count,) each image's output offset within the output area
    runs: list[tuple[int, int, Future[int]]]  # (first, stop, decode ns) per worker run

    def wait(self) -> tuple[float, float, list[tuple[int, int]]]:
        """Seconds the slowest run took to decode, the runs' decode seconds summed (the workers' busy
        time), and the (first, stop) runs that failed."""
        slowest, total, failed = 0, 0, []
        for first, stop, fut in self.runs:
            try:
                ns = fut.result()
                slowest, total = max(slowest, ns), total + ns
            except Exception:
                failed.append((first, stop))
        return slowest / 1e9, total / 1e9, failed


class CpuDecoders:
    """``processes`` decode workers over ``slots`` slots of ``slot_bytes`` each (a quarter input, the
    rest output); ``pin=True`` registers the block with CUDA so copies from it are asynchronous DMA."""

    def __init__(
        self, codec: str, quality: int, processes: int, slots: int, slot_bytes: int, pin: bool = False
    ) -> None:
        self.slot_bytes = int(slot_bytes) // 64 * 64
        self.in_bytes = self.slot_bytes // 4
        self.size = slots * self.slot_bytes
        hello = {"size": self.size, "codec": codec, "quality": quality}
        workers = Workers(__name__, processes, self.size, hello)
        self.shm, self.conns, self.procs = workers.shm, workers.conns, workers.procs
        self.block = np.ndarray((self.size,), np.uint8, buffer=self.shm.buf)
        self.pinned = _register(self.block) if pin else False
        # Runs a share is split into, each to the next worker in turn (fewer: fewer messages per batch).
        self.runs = len(self.conns)
        self._free: queue.Queue[tuple[int, Any]] = queue.Queue()
        for s in range(slots):
            self._free.put((s, None))
        self._held: dict[int, CpuShare | None] = {}  # acquired slots (and their share once submitted)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future[int], int]] = {}  # run -> (future, worker)
        self._ids = itertools.count()
        self._next = itertools.cycle(range(len(self.conns)))
        self._closed = False
        self._collector = threading.Thread(target=self._collect, daemon=True, name="dlstore-cpu-decode")
        self._collector.start()
        self._finalizer = weakref.finalize(
            self, shutdown, self.shm, self.conns, self.procs, self.block.ctypes.data if self.pinned else 0
        )

    @property
    def processes(self) -> int:
        return len(self.conns)

    def alive(self) -> bool:
        """Whether any decode process is still running."""
        return any(p.poll() is None for p in self.procs)

    def acquire(self) -> int:
        """A free slot, once the copy that last read it has finished (its CUDA event, if any)."""
        slot, event = self._free.get()
        if event is not None:
            event.synchronize()
        with self._lock:
            self._held[slot] = None
        return slot

    def release(self, slot: int, event: Any = None) -> None:
        """The slot may be reused once ``event`` (a CUDA event after the copy out of it) completes."""
        with self._lock:
            self._held.pop(slot, None)
        self._free.put((slot, event))

    def reclaim(self) -> None:
        """Free the slots of shares nobody will consume (an epoch left early), once their workers are
        done writing them. Only while no other thread uses these decoders."""
        with self._lock:
            held = list(self._held.items())
        for slot, share in held:
            if share is not None:
                share.wait()
            self.release(slot)

    def fits(self, sizes: np.ndarray, shapes: np.ndarray, count: int) -> int:
        """How many of the first ``count`` images (payload ``sizes``, (H, W, C) ``shapes``) fit a slot's
        input and output areas."""
        pixels = np.prod(np.asarray(shapes[:count], np.int64), axis=1)
        ok = (np.cumsum(sizes[:count]) <= self.in_bytes) & (
            np.cumsum(pixels) <= self.slot_bytes - self.in_bytes
        )
        return int(np.argmin(ok)) if not ok.all() else count

    @staticmethod
    def input_bytes(extents: PayloadExtents) -> np.ndarray:
        """Bytes each payload takes in a slot's input area: none for those the workers read from their
        unit's file."""
        from_file = np.array([s is not None for s in extents.sources], bool)
        return np.where(from_file[extents.buffer], 0, extents.sizes)

    def submit(self, slot: int, extents: PayloadExtents, count: int) -> CpuShare:
        """Decode the first ``count`` payloads of ``extents`` (which fit, see ``fits``) into ``slot``,
        split over the workers, which read those of file-backed units from the files, find the others
        copied into the slot's input area, and check every CRC."""
        paths: list[str] = []
        where = np.full(len(extents.buffers), -1, np.int64)
        shift = np.zeros(len(extents.buffers), np.int64)
        for b, source in enumerate(extents.sources):
            if source is not None:
                where[b], shift[b] = len(paths), source[1]
                paths.append(source[0])
        buffer = extents.buffer[:count]
        table = np.empty((count, COLUMNS), np.int64)
        table[:, 0] = extents.starts[:count] + shift[buffer]
        table[:, 7] = where[buffer]
        copied = np.flatnonzero(table[:, 7] < 0)
        if copied.size:
            base = slot * self.slot_bytes
            area = memoryview(self.block)[base : base + self.in_bytes]
            table[copied, 0] = base + extents.copy_into(area, copied)
        table[:, 1] = table[:, 0] + extents.sizes[:count]
        table[:, 3:6] = extents.shapes[:count]
        table[:, 6] = extents.crc[:count]
        # outputs back to back in the slot's output area; the rows to the workers in contiguous runs
        shapes = table[:, 3:6].copy()
        pixels = np.prod(shapes, axis=1)
        offsets = np.zeros(count, np.int64)
        np.cumsum(pixels[:-1], out=offsets[1:])
        out_start = slot * self.slot_bytes + self.in_bytes
        table[:, 2] = out_start + offsets
        parts = min(self.runs, count)
        bounds = [count * i // parts for i in range(parts + 1)]
        names = b"\0".join(os.fsencode(p) for p in paths)
        runs = [(a, b, self._send(table[a:b], names)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        share = CpuShare(slot, count, out_start, int(pixels.sum()), shapes, offsets, runs)
        with self._lock:
            self._held[slot] = share
        return share

    def _send(self, table: np.ndarray, names: bytes = b"") -> Future[int]:
        future: Future[int] = Future()
        with self._lock:
            run, worker = next(self._ids), next(self._next)
            if self._closed:
                future.set_exception(RuntimeError("the CPU decoders are closed"))
                return future
            self._pending[run] = (future, worker)
            try:
                self.conns[worker].send_bytes(_REQ.pack(run, len(table)) + table.tobytes() + names)
            except OSError as e:  # the worker is gone: the loader decodes the run itself
                del self._pending[run]
                future.set_exception(e)
        return future

    def _collect(self) -> None:
        """Answers of every worker, as they come, through one poll set for the pipes' lifetime
        (``connection.wait`` registers every pipe again on each wake-up: GIL time per answer)."""
        selector = (
            selectors.PollSelector() if hasattr(selectors, "PollSelector") else selectors.SelectSelector()
        )
        with selector:
            for i, conn in enumerate(self.conns):
                selector.register(conn.fileno(), selectors.EVENT_READ, i)
            live = len(self.conns)
            while live:
                try:
                    ready = selector.select()
                except (OSError, ValueError):  # close() closed the pipes under us
                    return
                for key, _events in ready:
                    if not self._answer(self.conns[key.data]):
                        selector.unregister(key.fd)
                        live -= 1
                        self._fail_worker(key.data)

    def _answer(self, conn: Connection) -> bool:
        """Settle the run one answer is for; False when the worker is gone (its pipe closed)."""
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return False
        run, ns, n = _ANS.unpack_from(msg)
        with self._lock:
            future, _ = self._pending.pop(run)
        if n:
            future.set_exception(RuntimeError(msg[_ANS.size :].decode(errors="replace")))
        else:
            future.set_result(ns)
        return True

    def _fail_worker(self, worker: int) -> None:
        with self._lock:
            lost = [r for r, (_, w) in self._pending.items() if w == worker]
            futures = [self._pending.pop(r)[0] for r in lost]
        for f in futures:
            f.set_exception(RuntimeError("its decode process exited"))

    def close(self) -> None:
        """Stop the workers, unregister and free the shared memory."""
        with self._lock:
            self._closed = True
        self.block = np.zeros(0, np.uint8)  # drop the view, so the block can be unmapped
        self._finalizer()
        self._collector.join(5)


def _register(block: np.ndarray) -> bool:
    """Page-lock the block for CUDA (asynchronous copies); False where CUDA refuses or is absent."""
    import torch

    if not torch.cuda.is_available() or block.size == 0:
        return False
    return int(torch.cuda.cudart().cudaHostRegister(block.ctypes.data, block.nbytes, 0)) == 0


def main() -> None:
    """Worker entry (see ``dlstore.read.engines.workers``)."""
    _worker(worker_connection())
