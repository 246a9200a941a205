"""``ReaderEngines``: the worker processes one open cache runs over its reader, started on demand.

The reader (``dlstore.formats``) decodes; this decides when other processes do it for it: a whole epoch
of batches goes to ``BatchProcesses``, which drives the reader's primitives. They belong to the
process that started them: a forked child starts its own (or, as a DataLoader worker, none).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from typing import cast

import numpy as np

from dlstore.formats.base import CacheReader, ChunkedReader
from dlstore.read.engines.batch_procs import BatchProcesses, ring_slots
from dlstore.read.engines.workers import opener_for


def may_start_processes(reader: CacheReader) -> bool:
    """Worker processes can decode this reader's units, and this process may start children (a
    DataLoader worker is a daemon: it may not)."""
    return reader.traits.unit_arrays and not mp.current_process().daemon


class ReaderEngines:
    """The decode processes of one reader (``decode_batches``)."""

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
        """Each batch of storage positions (rows in the order given), decoded by ``processes`` worker
        processes straight into a ring of shared-memory batch slots (``batch_procs``): each yielded
        array is valid until the next one is asked for. The workers stay for later epochs."""
        procs = self._batch_processes(max((len(b) for b in batches), default=1), processes)
        return procs.epoch(batches, self.reader)

    def _batch_processes(self, batch: int, processes: int) -> BatchProcesses:
        reader = cast(ChunkedReader, self.reader)
        with self._lock:
            procs = self.batch_processes
            if procs is not None and (procs.batch < batch or len(procs.conns) != processes):
                procs.close()
                procs = None
            if procs is None:
                unit_shape = (reader.unit, *reader.spec.shape)
                slots = ring_slots(batch * reader.spec.image_bytes)
                procs = BatchProcesses(opener_for(reader), unit_shape, processes, slots, batch)
                self._batches, self._batches_pid = procs, os.getpid()
            return procs

    def close(self) -> None:
        """Stop this process's workers and free their shared memory; call after the reader's
        ``close`` (its decoded units may be views of that memory)."""
        with self._lock:
            batches, self._batches = self.batch_processes, None
        if batches is not None:
            batches.close()
