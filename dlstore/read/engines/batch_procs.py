"""Whole batches decoded straight into shared memory by worker processes.

The reading process plans the epoch up front: for each unit, which rows of which batches its images go
to. A worker decodes the unit into a private buffer (still in its core's cache) and copies those images
into the batches' rows, in a ring of batch slots in one shared-memory block. The reading process sends
one small message per unit and waits for whole batches; no decoded byte crosses it (units decoded into
shared slots and gathered by the reader cost one more pass over every byte, in threads that share a GIL).

A unit whose images span more batches than the ring decodes once per span (a chunk-ordered epoch
decodes each unit once). A unit that fails in a worker, or whose worker died, is decoded again by the
reading process when its batch is taken, so the error names the chunk as a plain read would."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import struct
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.formats.base import CacheReader, group_runs
from dlstore.read.engines.workers import Workers, attach, opener_for, populate, shutdown, worker_connection
from dlstore.spec import read_spec

_JOB = struct.Struct("<qqq")  # job id, unit, rows (then rows x (slot, row, local) int64)
_ANS = struct.Struct("<qq")  # job id, error message length (then the message)
IN_FLIGHT = 3  # jobs queued per worker: enough to hide the round trip, few enough to balance the load


def _worker(conn: Connection) -> None:
    """Decode the units asked for and copy their rows into the ring until the pipe closes."""
    hello, shm = attach(conn)
    cls = getattr(importlib.import_module(hello["module"]), hello["reader"])
    try:
        ring = np.ndarray(tuple(hello["ring"]), np.uint8, buffer=shm.buf)
        reader = cls(Path(hello["root"]), read_spec(Path(hello["root"])))
        # One thread here: mapping chunk files beats reading them (readers that cannot map ignore it).
        reader.map_chunks = True
        buf = np.empty(tuple(hello["unit"]), np.uint8)  # reused: stays in this core's cache
        populate(ring)
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                break
            conn.send_bytes(_run_job(reader, msg, buf, ring))
        del ring
    finally:
        shm.close()


def _run_job(reader: Any, msg: bytes, buf: np.ndarray, ring: np.ndarray) -> bytes:
    job, k, n = _JOB.unpack_from(msg)
    dest = np.frombuffer(msg, np.int64, count=3 * n, offset=_JOB.size).reshape(n, 3)
    try:
        reader.decode_unit_into(k, buf)
    except Exception as e:  # the reading process decodes it again and raises, naming the chunk
        text = str(e).encode(errors="replace")[:4000]
        return _ANS.pack(job, len(text)) + text
    for slot, row, local in dest.tolist():
        ring[slot, row] = buf[local]
    return _ANS.pack(job, 0)


@dataclass
class _Job:
    unit: int
    batches: np.ndarray  # per row: the batch it goes to
    rows: np.ndarray
    locals_: np.ndarray
    lo: int
    hi: int
    targets: list[int] = field(default_factory=list)  # the distinct batches
    message: bytes = b""


@dataclass
class _Epoch:
    """One pass over a list of batches: its jobs, what each batch still waits for, what failed."""

    jobs: list[_Job]
    sizes: list[int]
    pending: np.ndarray  # per batch: jobs not answered yet
    base: int  # job ids of this epoch are base + index
    next: int = 0  # next job to send
    released: int = 0  # batches the consumer is done with: slots of batch < released + R may be filled
    failed: dict[int, list[int]] = field(default_factory=dict)  # batch -> failed job indices
    closed: bool = False


def plan_jobs(batches: list[np.ndarray], unit: int, span: int) -> tuple[list[_Job], np.ndarray]:
    """Group the images of every batch by unit; split a unit whose batches lie more than ``span``
    batches apart into one job per span. Jobs come in the order their first batch needs them."""
    sizes = np.array([len(b) for b in batches], np.int64)
    if sizes.sum() == 0:
        return [], np.zeros(len(batches), np.int64)
    pos = np.concatenate([np.asarray(b, np.int64) for b in batches])
    bidx = np.repeat(np.arange(len(batches)), sizes)
    rows = np.arange(len(pos)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    keys = pos // unit
    order = np.lexsort((bidx, keys))
    keys, bidx, rows, local = keys[order], bidx[order], rows[order], (pos % unit)[order]
    jobs: list[_Job] = []
    for k, a, b in group_runs(keys):
        start = a
        while start < b:  # one job per span of batches
            stop = start + int(np.searchsorted(bidx[start:b], bidx[start] + span, side="right"))
            sl = slice(start, stop)
            jobs.append(_Job(k, bidx[sl], rows[sl], local[sl], int(bidx[start]), int(bidx[stop - 1])))
            start = stop
    jobs.sort(key=lambda j: (j.lo, j.hi))
    pending = np.zeros(len(batches), np.int64)
    for j in jobs:
        j.targets = np.unique(j.batches).tolist()
        pending[j.targets] += 1
    return jobs, pending


class BatchProcesses:
    """``processes`` workers and a ring of ``ring`` batch slots of ``batch`` images each.

    >>> procs = BatchProcesses((ZarrReader, root), (6, 256, 256, 3), 16, ring=12, batch=256)  # doctest: +SKIP
    >>> for images in procs.epoch(batches_of_storage_positions, reader):                          # doctest: +SKIP
    ...     use(images)  # valid until the next batch is asked for
    """

    def __init__(
        self, opener: tuple[Any, ...], unit_shape: tuple[int, ...], processes: int, ring: int, batch: int
    ) -> None:
        self.unit_shape, self.batch = tuple(unit_shape), batch
        self.shape = (ring, batch, *unit_shape[1:])
        cls, root = opener
        hello = {"ring": self.shape, "unit": self.unit_shape}
        hello.update(module=cls.__module__, reader=cls.__qualname__, root=str(root))
        workers = Workers(__name__, processes, int(np.prod(self.shape)), hello)
        self.shm, self.conns, self.procs = workers.shm, workers.conns, workers.procs
        self.ring = np.ndarray(self.shape, np.uint8, buffer=self.shm.buf)
        populate(self.ring)  # this process's mapping (each worker populates its own)
        self._cond = threading.Condition()
        self._epoch: _Epoch | None = None
        self._ids = 0
        self._in_flight = [0] * processes
        self._owner: dict[int, int] = {}  # job id -> worker
        self._alive = [True] * processes
        self._collector = threading.Thread(target=self._collect, daemon=True, name="dlstore-batch-procs")
        self._collector.start()
        # Workers and the shared memory go with the interpreter even when close() is never called.
        self._finalizer = weakref.finalize(self, shutdown, self.shm, self.conns, self.procs)

    @property
    def slots(self) -> int:
        return self.shape[0]

    def epoch(self, batches: list[np.ndarray], reader: Any) -> Iterator[np.ndarray]:
        """Yield each batch (storage positions, rows in the order given) as a view of its ring slot,
        valid until the next batch is asked for. One epoch at a time per ``BatchProcesses``."""
        if any(len(b) > self.batch for b in batches):
            raise ValueError(f"batches of up to {self.batch} images fit this ring")
        lead = max(1, self.slots // 3)  # batches decoded ahead of the one being read, at least
        jobs, pending = plan_jobs(batches, self.unit_shape[0], max(0, self.slots - 1 - lead))
        for j in jobs:
            dest = np.stack([j.batches % self.slots, j.rows, j.locals_], axis=1).astype(np.int64)
            j.message = dest.tobytes()
        with self._cond:
            if self._epoch is not None and not self._epoch.closed:
                raise RuntimeError("BatchProcesses: an epoch is still running; close it first")
            ep = self._epoch = _Epoch(jobs, [len(b) for b in batches], pending, self._ids)
            self._ids += len(jobs)
            self._dispatch()
        try:
            for i in range(len(batches)):
                yield self._take(ep, i, reader)
        finally:
            self._finish(ep)

    def _take(self, ep: _Epoch, i: int, reader: Any) -> np.ndarray:
        with self._cond:
            ep.released = i  # the consumer asked for batch i: it is done with batch i - 1
            self._dispatch()
            while ep.pending[i] > 0:
                self._cond.wait(1.0)
            failed = ep.failed.pop(i, [])
        out = self.ring[i % self.slots][: ep.sizes[i]]
        for index in failed:  # decoded here: raises the chunk's own error, or recovers a dead worker's
            job = ep.jobs[index]
            mine = job.batches == i
            out[job.rows[mine]] = reader.load_unit(job.unit)[job.locals_[mine]]
        return out

    def _dispatch(self) -> None:
        """Send jobs while their batches' slots are free and a worker has room (caller holds the lock)."""
        ep = self._epoch
        if ep is None or ep.closed:
            return
        while ep.next < len(ep.jobs) and ep.jobs[ep.next].hi < ep.released + self.slots:
            job, index = ep.jobs[ep.next], ep.next
            live = [w for w, ok in enumerate(self._alive) if ok]
            if not live:
                self._fail(ep, index)
                ep.next += 1
                continue
            w = min(live, key=self._in_flight.__getitem__)
            if self._in_flight[w] >= IN_FLIGHT:
                return
            try:
                self.conns[w].send_bytes(_JOB.pack(ep.base + index, job.unit, len(job.rows)) + job.message)
            except OSError:  # gone: its answers never come; the collector fails what it held
                self._alive[w] = False
                continue
            self._in_flight[w] += 1
            self._owner[ep.base + index] = w
            ep.next += 1

    def _fail(self, ep: _Epoch, index: int) -> None:
        for b in ep.jobs[index].targets:
            ep.failed.setdefault(b, []).append(index)
        ep.pending[ep.jobs[index].targets] -= 1

    def _collect(self) -> None:
        """Count answers against their batches; a worker that goes away fails the jobs it held."""
        live = list(self.conns)
        while live:
            try:
                ready = wait(live)
            except (OSError, ValueError):  # close() closed the pipes under us
                return
            for conn in ready:
                w = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    msg = conn.recv_bytes()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    live.remove(conn)  # type: ignore[arg-type]
                    self._lost(w)
                    continue
                job_id, n = _ANS.unpack_from(msg)
                self._answered(w, job_id, bool(n))

    def _answered(self, w: int, job_id: int, failed: bool) -> None:
        with self._cond:
            self._in_flight[w] -= 1
            self._owner.pop(job_id, None)
            ep = self._epoch
            if ep is not None and ep.base <= job_id < ep.base + len(ep.jobs):
                index = job_id - ep.base
                if failed:
                    self._fail(ep, index)
                else:
                    ep.pending[ep.jobs[index].targets] -= 1
            self._dispatch()
            self._cond.notify_all()

    def _lost(self, w: int) -> None:
        with self._cond:
            self._alive[w] = False
            ep = self._epoch
            for job_id in [j for j, owner in self._owner.items() if owner == w]:
                del self._owner[job_id]
                self._in_flight[w] -= 1
                if ep is not None and ep.base <= job_id < ep.base + len(ep.jobs):
                    self._fail(ep, job_id - ep.base)
            self._dispatch()
            self._cond.notify_all()

    def _finish(self, ep: _Epoch) -> None:
        """Stop sending and wait for the jobs in flight: the next epoch reuses the slots they write."""
        with self._cond:
            ep.closed = True
            while any(self._in_flight[w] > 0 for w, ok in enumerate(self._alive) if ok):
                self._cond.wait(1.0)

    def close(self) -> None:
        """Stop the workers (each finishes the job it is on), then free the shared memory."""
        with self._cond:
            if self._epoch is not None:
                self._epoch.closed = True
        self.ring = np.zeros(0, np.uint8)
        self._finalizer()
        self._collector.join(5)


def main() -> None:
    """Worker entry (see ``dlstore.read.engines.workers``)."""
    _worker(worker_connection())


def ring_slots(batch_bytes: int, budget: int = 768 << 20, lo: int = 6, hi: int = 24) -> int:
    """How many batch slots the ring gets: as many as ``budget`` bytes hold, within [lo, hi]."""
    return int(min(hi, max(lo, budget // max(1, batch_bytes))))


def may_start_processes(reader: CacheReader) -> bool:
    """Worker processes can decode this reader's units, and this process may start children (a
    DataLoader worker is a daemon: it may not)."""
    return reader.traits.unit_arrays and not mp.current_process().daemon


class ReaderEngines:
    """The decode processes of one open cache's reader, started on demand by ``decode_batches``. They
    belong to the process that started them: a forked child starts its own."""

    def __init__(self, reader: CacheReader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._batches: BatchProcesses | None = None
        self._batches_pid = -1

    @property
    def batch_processes(self) -> BatchProcesses | None:
        """The processes and ring of ``decode_batches`` for this process, if started."""
        return self._batches if self._batches_pid == os.getpid() else None

    def decode_batches(self, batches: list[np.ndarray], processes: int) -> Iterator[np.ndarray]:
        """Each batch of storage positions decoded by ``processes`` workers into the ring (each array
        valid until the next one is asked for); the workers stay for later epochs."""
        batch, reader = max((len(b) for b in batches), default=1), self.reader
        with self._lock:
            procs = self.batch_processes
            if procs is not None and (procs.batch < batch or len(procs.conns) != processes):
                procs.close()
                procs = None
            if procs is None:
                unit_shape = (reader.unit, *reader.spec.shape)  # type: ignore[attr-defined]
                slots = ring_slots(batch * reader.spec.image_bytes)
                procs = BatchProcesses(opener_for(reader), unit_shape, processes, slots, batch)
                self._batches, self._batches_pid = procs, os.getpid()
        return procs.epoch(batches, reader)

    def close(self) -> None:
        """Stop this process's workers and free their shared memory; call after the reader's
        ``close`` (its decoded units may be views of that memory)."""
        with self._lock:
            batches, self._batches = self.batch_processes, None
        if batches is not None:
            batches.close()
