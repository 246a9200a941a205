"""The Writer/Reader contract every cache format implements."""

from __future__ import annotations

import os
import sys
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from dlstore.checksums import extents, regular_files
from dlstore.errors import CacheCorruptError, SpecError
from dlstore.formats.describe import Codec, CodecTable, Option, Traits, parse_options
from dlstore.formats.fields import FIELD_READERS, FIELD_WRITERS, FieldReader, FieldWriter, Rows
from dlstore.machine import usable_cores
from dlstore.spec import CacheSpec, FieldSpec


class CacheWriter(ABC):
    """Writes images in *units* (shard, chunk, slab): unit ``k`` holds images ``[k*unit_size,
    (k+1)*unit_size)``. ``create`` runs once in the main process; ``write_unit`` in any worker, touching
    only that unit's bytes. Options: ``codecs`` (the ``codec`` option) plus ``extra_options``, checked by
    ``parse_options``; ``recorded_options`` is what the manifest keeps."""

    name: ClassVar[str]
    codecs: ClassVar[CodecTable | None] = None
    extra_options: ClassVar[tuple[Option, ...]] = ()
    # Each unit is files of its own that nothing else writes or reads back (not a slab of a shared
    # file, not re-read by ``finish``): a unit may be written elsewhere (a Dask worker) and moved.
    units_are_own_files: ClassVar[bool] = False
    # How the cache's named fields are stored (``dlstore.formats.fields``): unit files, or zarr arrays.
    field_layout: ClassVar[str] = "files"

    def __init__(self, root: Path, n: int, shape: tuple[int, int, int], options: dict[str, Any]) -> None:
        self.root, self.n, self.shape, self.options = Path(root), n, tuple(shape), dict(options)
        self.unit_size = self.choose_unit_size(self.image_bytes)
        self.fields: dict[str, FieldSpec] = {}  # named per-sample fields (declare_fields)
        self.ragged_images = False

    def declare_fields(self, fields: dict[str, FieldSpec], ragged_images: bool) -> None:
        """The fields every unit carries beside its images (none: a classification cache, unchanged)."""
        self.fields, self.ragged_images = dict(fields), ragged_images

    def field_compression(self) -> Any:
        """What the field layout compresses masks with, lossless and like the images: ``files``: a truth
        value (deflate); ``zarr``: the zarr compressors. Default: stored."""
        return False

    def field_writer(self) -> FieldWriter:
        return FIELD_WRITERS[self.field_layout](
            self.root,
            self.fields,
            self.n,
            self.unit_size,
            self.shape,
            self.ragged_images,
            self.field_compression(),
        )

    def create_fields(self) -> None:
        """Main process, after ``create``: lay out the fields' storage (nothing without fields)."""
        if self.fields:
            self.field_writer().create()

    def write_fields(self, k: int, rows: Rows, dropped: dict[str, int]) -> None:
        """Any worker, after ``write_unit(k)``: unit k's field rows (one per image, storage order), durably."""
        if self.fields:
            self.field_writer().write_unit(k, rows, dropped)

    def finish_fields(self) -> dict[str, int]:
        """Main process, before ``finish``: gather what the units wrote; the boxes dropped per field."""
        return self.field_writer().finish() if self.fields else {}

    @classmethod
    def declared_options(cls) -> tuple[Option, ...]:
        if cls.codecs is None:
            return cls.extra_options
        codec = Option("codec", cls.codecs.default, "How each unit's pixels are stored.", cls.codecs.names())
        return (codec, *cls.extra_options)

    @classmethod
    def parse_options(cls, given: dict[str, Any]) -> dict[str, Any]:
        return parse_options(cls.declared_options(), given, cls.name)

    @property
    def codec(self) -> Codec | None:
        return None if self.codecs is None else self.codecs[self.options["codec"]]

    @property
    def size_ratio(self) -> float:
        """Expected stored bytes per raw byte (for the disk-space warning)."""
        return 1.0 if self.codec is None else self.codec.size_ratio

    @property
    def image_bytes(self) -> int:
        h, w, c = self.shape
        return h * w * c

    @property
    def n_units(self) -> int:
        return -(-self.n // self.unit_size)

    def unit_range(self, k: int) -> range:
        return range(k * self.unit_size, min(self.n, (k + 1) * self.unit_size))

    @staticmethod
    @abstractmethod
    def choose_unit_size(image_bytes: int) -> int: ...

    @abstractmethod
    def create(self) -> None:
        """Lay out empty storage (main process, before any write_unit)."""

    @abstractmethod
    def write_unit(self, k: int, images: np.ndarray) -> None:
        """Store unit k durably (fsync of every file it wrote) before returning: the converter
        journals the unit as done as soon as this returns."""

    def unit_checksum_keys(self, k: int) -> list[str]:
        """The manifest's checksum keys (``name`` or ``name@offset+length``) that cover exactly unit
        k's bytes, when the writer can digest them as it writes (``unit_checksums``); the files they
        name are then checksummed unit by unit, every byte of them in some unit's keys. Default: none
        (the converter digests the finished files)."""
        return []

    def unit_checksums(self, k: int, images: np.ndarray) -> dict[str, str]:
        """In the worker, after ``write_unit(k, images)``: sha256 of each of ``unit_checksum_keys(k)``,
        computed from what was just written (no second read of the cache)."""
        return {}

    def finish(self, labels: np.ndarray) -> None:
        """Main process, after every unit: anything global (labels copies, final flush)."""

    def describe(self, attributes: dict[str, Any], positions: np.ndarray) -> None:
        """Main process, after ``finish``: say what the cache holds in the format's own metadata, for
        tools that open the files without dlstore (zarr: group attributes). Default: nothing."""

    def recorded_options(self) -> dict[str, Any]:
        return {**self.options, "unit_size": self.unit_size}


class CacheReader(ABC):
    """Reads images by storage position; ``traits`` say what the format's readers can do (a reader
    that is not ``fork_safe`` is re-opened per process by the dataset). The attributes below are what
    every reader has, so callers read them instead of probing for them."""

    traits: ClassVar[Traits]
    # Images per storage unit (a shard, a chunk): what a chunk-aware sampler groups by; 1 for a reader
    # of single images.
    unit: int = 1
    # The payloads are JPEG files nvJPEG can decode (payload layouts with ``--codec jpeg``).
    gpu_jpeg: bool = False
    # Decode a whole-file chunk straight from a read-only mapping of its file, where the format can:
    # worth it in a process of one thread (a decode worker), not in a threaded reader (every munmap
    # interrupts the other threads). Readers that cannot map ignore it.
    map_chunks: bool = False
    field_layout: ClassVar[str] = "files"  # the writer's (``CacheWriter.field_layout``)

    def __init__(
        self, root: Path, spec: CacheSpec, in_memory: bool = False, threads: int | None = None
    ) -> None:
        self.root, self.spec, self.in_memory = Path(root), spec, in_memory
        self._fields: FieldReader | None = None
        # Plain threads, not OpenMP: idle OpenMP teams spin-wait and starve the training thread.
        self.threads = threads if threads is not None else min(4, usable_cores())
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._pool_size = 0

    @property
    def fork_safe(self) -> bool:
        return self.traits.fork_safe

    @property
    def max_units(self) -> int:
        """Decoded units this reader keeps per process (a sampler window should stay within it)."""
        return 1

    @abstractmethod
    def read_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """Fill ``out`` (B,H,W,C) uint8 with the images at ``positions`` (any order, duplicates allowed)."""

    def read_fields(
        self,
        positions: np.ndarray,
        fields: dict[str, FieldSpec] | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """The stored fields (of ``fields``, default all) of the samples at ``positions`` (any order):
        name → a (B, ...) array for a fixed-shape field, a list of B arrays for a variable-length one;
        {} for a cache without fields. ``out``: arrays to fill for some fixed-shape fields (a loader's
        pinned buffers), returned in their place."""
        if not self.spec.fields:
            return {}
        if self._fields is None:
            unit = int(self.spec.format_options.get("unit_size", 1))
            self._fields = FIELD_READERS[self.field_layout](self.root, self.spec, unit)
            self._fields.parallel = self.parallel  # row gathers in this reader's threads
        chosen = self.spec.fields if fields is None else fields
        got = self._fields.read(positions, {k: f for k, f in chosen.items() if f.kind != "class"}, out)
        for name, dest in (out or {}).items():
            if name in got and got[name] is not dest:
                np.copyto(dest, got[name])
                got[name] = dest
        return got

    @classmethod
    def unit_files(cls, spec: CacheSpec) -> list[str]:
        """Files (relative to the root) read unit by unit: a remote cache fetches them on first use.
        Every other file is read when the reader opens. Default: none, all at open."""
        return []

    def files_for(self, positions: np.ndarray) -> list[str]:
        """Which of ``unit_files`` a read of these storage positions touches."""
        return []

    def prefetch(self, positions: np.ndarray) -> None:
        """Start preparing a later read of these storage positions in the background (chunked
        formats decode their units ahead). Default: nothing to do."""

    def parallel(self, fn: Callable[[Any], None], items: list[Any], nbytes: int) -> None:
        """Run fn over items in this reader's threads when there is enough to copy to be worth it."""
        if len(items) > 1 and self.threads > 1 and nbytes >= (4 << 20):
            list(self._thread_pool().map(fn, items))
        else:
            for item in items:
                fn(item)

    def _thread_pool(self) -> ThreadPoolExecutor:
        # A new pool after a fork (threads do not survive it) or when ``threads`` was changed since
        # (e.g. DecodeLoader sets it to the core count): the old one would cap the parallelism.
        if self._pool is None or self._pool_pid != os.getpid() or self._pool_size != self.threads:
            if self._pool is not None and self._pool_pid == os.getpid():
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dlstore-read")
            self._pool_pid, self._pool_size = os.getpid(), self.threads
        return self._pool

    def shutdown_threads(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None

    def close(self) -> None:
        """Release handles; the reader may not be used afterwards."""


class ChunkedReader(CacheReader):
    """Formats stored in units of many images (npz shards, zarr chunks): a batch is grouped by unit, each
    unit decoded once; units missing from a bounded per-process cache are decoded in threads (zstd and
    zlib release the GIL), so one process can use several cores."""

    # No handle outlives a read (the thread pool is re-made per pid), so forked children may use it.
    traits: ClassVar[Traits] = Traits(
        loads_into_ram=False, unit_grouped=True, fork_safe=True, opens_files_per_read=True, unit_arrays=True
    )

    def __init__(
        self,
        root: Path,
        spec: CacheSpec,
        in_memory: bool = False,
        unit: int = 1,
        cache_bytes: int = 512 << 20,
        threads: int | None = None,
    ) -> None:
        if in_memory:
            raise SpecError(
                f"{root}: a {spec.format} cache is read unit by unit and cannot be loaded into memory "
                "(in_memory=True); open it without in_memory, or convert it with --format ram"
            )
        super().__init__(root, spec, in_memory, threads)
        self.unit = unit
        self.decode_limit, held = decode_limit(root, spec)
        # Payload units (JPEG, ragged) decode image by image: each image is checked by its index instead.
        if not self.traits.payloads:
            unit_bytes = unit * spec.image_bytes  # a zarr chunk is whole even past the last image
            what = f"a unit of {unit} images of {spec.shape}"
            check_decoded_size(Path(root) / self.unit_file(0), what, unit_bytes, self.decode_limit, held)
        budget = min(cache_bytes, self.decode_limit)
        self._units = UnitCache(max(2, budget // max(1, unit * spec.image_bytes)))
        # Units being decoded ahead (prefetch): unit -> its decode, and the pid that owns them.
        self._ahead: OrderedDict[int, tuple[Future[np.ndarray], int]] = OrderedDict()
        self._reads = 0  # read_into calls so far: how old a unit decoded ahead is
        self._ahead_lock = threading.Lock()
        self._ahead_pid = os.getpid()
        self._ahead_executor: ThreadPoolExecutor | None = None
        # Where units decoded ahead go instead of this reader's threads, when the read side attached
        # one in this process (worker processes, each with a GIL of its own: dlstore.read.engines).
        # The reader only submits to it; whoever attached it starts and stops it.
        self.unit_decoder: UnitDecoder | None = None

    @property
    def max_units(self) -> int:
        return self._units.max_units

    @abstractmethod
    def load_unit(self, k: int) -> np.ndarray:
        """Decode unit k into (unit_len, H, W, C) uint8."""

    def decode_unit_into(self, k: int, out: np.ndarray) -> None:
        """Decode unit k into ``out`` (a decode process's shared-memory slot). Readers that can decode
        in place override this; the default copies (a short last unit fills the first rows)."""
        arr = self.load_unit(k)
        out[: len(arr)] = arr

    @classmethod
    @abstractmethod
    def unit_file(cls, k: int) -> str:
        """The file holding unit k, relative to the root."""

    @classmethod
    def unit_files(cls, spec: CacheSpec) -> list[str]:
        unit = int(spec.format_options["unit_size"])
        return [cls.unit_file(k) for k in range(-(-spec.n_stored // unit))]

    def files_for(self, positions: np.ndarray) -> list[str]:
        return [self.unit_file(int(k)) for k in np.unique(np.asarray(positions) // self.unit)]

    def read_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """Per unit: decode (if not cached) and copy its images out, units in parallel threads. Ascending
        positions (the dlstore loaders sort each batch so) copy a unit's rows in one ``np.take``; any
        other order is sorted first and scattered back row by row, a GIL hand-over per image."""
        self._reads += 1
        ascending = positions.size < 2 or bool(np.all(positions[1:] >= positions[:-1]))
        order = None if ascending else np.argsort(positions, kind="stable")
        sorted_pos = positions if order is None else positions[order]
        runs = group_runs(sorted_pos // self.unit)
        big_rows = self.spec.image_bytes >= (16 << 10)

        def copy(run: tuple[int, int, int]) -> None:
            k, a, b = run
            # a plain view: indexing an np.memmap (a stored npz shard) runs Python per row, GIL held
            unit = np.asarray(self.unit_array(k))
            local = sorted_pos[a:b] - k * self.unit
            if order is None:
                np.take(unit, local, axis=0, out=out[a:b], mode="clip")
            elif big_rows:  # row by row: no temporary, and each copy releases the GIL
                for dst, src in zip(order[a:b].tolist(), local.tolist()):
                    out[dst] = unit[src]
            else:
                out[order[a:b]] = unit[local]

        if len(runs) <= 1 or self.threads <= 1 or out.nbytes < (4 << 20):
            for run in runs:
                copy(run)
            return
        # One task per thread, each taking the next run from a shared iterator (atomic under the GIL),
        # not one task per run: a 256-image batch has ~100 runs, and every task is a future and a few
        # GIL hand-overs more for the decode threads to wait on.
        shared = iter(runs)

        def drain(_: int) -> None:
            for run in shared:
                copy(run)

        list(self._thread_pool().map(drain, range(min(self.threads, len(runs)))))

    def unit_array(self, k: int) -> np.ndarray:
        with self._ahead_lock:  # one look at both: a unit is either cached, decoding ahead, or neither
            self._forget_other_process()
            arr = self._units.lookup(k)
            ahead = self._ahead.pop(k, None) if arr is None else None
        if arr is not None:
            return arr
        if ahead is not None:  # decoded ahead: wait for it
            try:
                arr = ahead[0].result()
            except Exception:  # decoded again here: raises its error naming the chunk (or recovers
                arr = None  # a unit whose decode process went away)
        if arr is None:
            arr = self.load_unit(k)
        self.recycle(self._units.put(k, arr))
        return arr

    @property
    def max_ahead(self) -> int:
        """Units decoded ahead and not read yet, at most: half the unit cache (so up to 1.5 times
        ``cache_bytes`` are held). They wait outside the cache until read, so they never evict the
        units of the current sampler window, and the window's units never evict them."""
        return max(1, self._units.max_units // 2)

    def prefetch(self, positions: np.ndarray) -> None:
        """Decode the units these positions need in threads of their own, in the order given, while
        the caller does something else (copies the current batch, trains): the read that needs a unit
        then waits only for what is not done yet. Each unit is decoded once, by whichever of the
        prefetch and the read gets to it first; a decode error is raised by the read that needs it."""
        keys = np.asarray(positions, dtype=np.int64).reshape(-1) // self.unit
        _, first = np.unique(keys, return_index=True)
        with self._ahead_lock:
            self._forget_other_process()
            self._drop_stale()
            procs = self.unit_decoder
            pool = self._ahead_pool() if procs is None else None
            for k in keys[np.sort(first)].tolist():  # the caller's order: the next read's units first
                if len(self._ahead) >= self.max_ahead:
                    break
                if k in self._ahead or self._units.lookup(k) is not None:
                    continue
                future = pool.submit(self.load_unit, k) if pool is not None else procs.submit(k)  # type: ignore[union-attr]
                if future is None:  # every shared-memory slot still in use
                    break
                self._ahead[k] = (future, self._reads)

    def _drop_stale(self) -> None:
        """Units decoded ahead that no read took within STALE_READS reads (the caller changed its
        order, or the epoch ended): give their slots and buffers back (caller holds the lock)."""
        stale = [
            k for k, (f, tick) in self._ahead.items() if f.done() and self._reads - tick > self.STALE_READS
        ]
        for k in stale:
            f, _ = self._ahead.pop(k)
            if f.exception() is None:
                self.recycle([f.result()])

    STALE_READS = 16

    def _ahead_pool(self) -> ThreadPoolExecutor:
        """Decodes ahead run in a pool of their own: queued behind them in the read's pool, the
        current batch's copies would wait for every unit decoded ahead to start (caller holds the lock)."""
        if self._ahead_executor is None:
            self._ahead_executor = ThreadPoolExecutor(self.threads, thread_name_prefix="dlstore-ahead")
        return self._ahead_executor

    def _forget_other_process(self) -> None:
        """A forked child inherits the parent's futures but not the threads that complete them."""
        if self._ahead_pid != os.getpid():
            self._ahead, self._ahead_pid, self._ahead_executor = OrderedDict(), os.getpid(), None
            self.unit_decoder = None  # the parent's workers answer the parent only

    def recycle(self, evicted: list[np.ndarray]) -> None:
        """Hook for readers that reuse the buffers of evicted units."""

    def close(self) -> None:
        """Cancel the decodes not started, wait for the running ones, then drop every unit and the
        attached ``unit_decoder`` (its owner stops it after this: the units may be views of its memory)."""
        with self._ahead_lock:
            mine = self._ahead_pid == os.getpid()
            ahead = list(self._ahead.values()) if mine else []
            executor = self._ahead_executor if mine else None
            self._ahead, self._ahead_executor, self.unit_decoder = OrderedDict(), None, None
        for f, _ in ahead:
            f.cancel()
        if executor is not None:
            executor.shutdown(wait=True)  # the running decodes finish; their errors are nobody's
        self._units.clear()
        del ahead
        self.shutdown_threads()


class UnitDecoder(Protocol):
    """Decodes units somewhere other than the reader's threads (worker processes of the read side);
    ``ChunkedReader.prefetch`` submits to it when one is attached."""

    def submit(self, k: int) -> Future[np.ndarray] | None:
        """A future of unit k's (unit, H, W, C) array, or None when it cannot take one now."""


# The one bound on what a cache can make a reader allocate: a unit (shard, chunk, payload image) decodes
# to at most twice the bytes the cache holds plus this allowance, and so do the units a reader keeps.
# Every size a unit's file declares must match the manifest, checked against this bound before any
# decode: a hostile cache costs at most twice its size plus ~100 MB, while flat images (1000x
# compressible) still read (dlstore's units decode to at most 32 MB at the default sizes).
DECODE_ALLOWANCE = 64 << 20
UNIT_CACHE_OVER_SIZE = DECODE_ALLOWANCE  # the unit cache's share of the same bound


def held_bytes(root: Path, spec: CacheSpec) -> int:
    """The bytes the cache really holds, as far as its manifest vouches for them: per checksummed
    file its declared extent, but never more than the file here has (a forged extent cannot raise
    the bound); a remote cache's file not fetched yet counts at its extent, which its fetch checks.
    One scan of the folder (as the open's own check), no file opened or stat'ed by name."""
    declared = extents(getattr(spec, "checksums", None) or {})
    if not declared:
        return 0
    present = regular_files(Path(root)) if Path(root).is_dir() else {}
    total = 0
    for name, extent in declared.items():
        size = present.get(name)
        if extent < 0:  # checksummed whole (an empty file; older caches): what is here
            total += size or 0
        else:
            total += extent if size is None else min(size, extent)
    return total


def decode_limit(root: Path, spec: CacheSpec) -> tuple[int, int]:
    """(the most decoded bytes one unit of this cache may allocate, the bytes it holds)."""
    held = held_bytes(root, spec)
    return 2 * held + DECODE_ALLOWANCE, held


def check_decoded_size(where: Path | str, what: str, nbytes: int, limit: int, held: int) -> None:
    """Refuse, before allocating, a unit declared to decode to more than ``decode_limit`` allows."""
    if nbytes > limit:
        raise CacheCorruptError(
            f"{where}: {what} is declared to decode to {nbytes / 1e6:.1f} MB, but the whole cache holds "
            f"{held / 1e6:.2f} MB; a reader allocates at most twice a cache's bytes plus "
            f"{DECODE_ALLOWANCE >> 20} MB for one unit ({limit / 1e6:.1f} MB here). Refusing it (tampered?): "
            "rebuild the cache with `dlstore convert`"
        )


class UnitCache:
    """The most recently decoded units (shards, chunks) of one process, bounded by count."""

    def __init__(self, max_units: int) -> None:
        self.max_units = max(1, max_units)
        self._units: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, k: int) -> np.ndarray | None:
        with self._lock:
            arr = self._units.get(k)
            if arr is not None:
                self._units.move_to_end(k)
            return arr

    def put(self, k: int, arr: np.ndarray) -> list[np.ndarray]:
        """Store unit k; return what was evicted (its buffer may be reused, see BufferPool)."""
        evicted = []
        with self._lock:
            self._units[k] = arr
            while len(self._units) > self.max_units:
                evicted.append(self._units.popitem(last=False)[1])
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._units.clear()


class BufferPool:
    """Decode buffers of evicted units, reused instead of freshly allocated: a fresh multi-MB buffer
    per chunk means an mmap/munmap per chunk, and munmap's TLB shootdowns serialise decoding threads."""

    def __init__(self, shape: tuple[int, ...], keep: int = 32) -> None:
        self.shape, self.keep = shape, keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if sys.getrefcount(buf) <= 2:  # nobody (no copy in flight) still holds it
                    return buf
        return np.empty(self.shape, np.uint8)

    def give(self, bufs: list[np.ndarray]) -> None:
        with self._lock:
            for buf in bufs:
                if buf.shape == self.shape and buf.base is None and len(self._free) < self.keep:
                    self._free.append(buf)


def clamp_units(target_bytes: int, image_bytes: int, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, target_bytes // max(1, image_bytes))))


def group_runs(keys: np.ndarray) -> list[tuple[int, int, int]]:
    """For ascending integer keys: (key, start, stop) of each run of equal keys."""
    if len(keys) == 0:
        return []
    cuts = np.flatnonzero(np.diff(keys)) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(keys)]))
    return [(int(keys[a]), int(a), int(b)) for a, b in zip(starts, stops)]
