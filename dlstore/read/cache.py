"""Open a finished cache: manifest first, then labels, then the format's reader."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dlstore.errors import (
    CacheCorruptError,
    CacheReplacedError,
    CacheTooLargeError,
    DlstoreError,
    SampleReadError,
)
from dlstore.formats import get_format
from dlstore.spec import LABELS_FILE, POSITIONS_FILE, CacheSpec, read_spec
from dlstore.storage.mirror import RemoteMirror, fetch_manifest
from dlstore.storage.stores import RemoteStore, parse_store_path

if TYPE_CHECKING:
    from dlstore.formats.payload import PayloadExtents

T = TypeVar("T")


class Cache:
    """A complete cache: ``spec``, ``labels`` (one per usable sample) and batched ``read``.

    >>> cache = open_cache("cache/")            # doctest: +SKIP
    >>> images = cache.read([5, 1, 9])          # (3, H, W, C) uint8, in the order asked
    """

    def __init__(
        self,
        root: str | Path,
        in_memory: bool = False,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        location = parse_store_path(root)
        self.location = location  # what errors name: the folder, or the URL of a remote cache
        # A remote cache is read through its local mirror (dlstore.storage.mirror); below this point
        # every format reads local files, on today's code path.
        self.mirror = (
            open_mirror(location, storage_options, cache_dir, cache_bytes)
            if isinstance(location, str)
            else None
        )
        self.root: Path = self.mirror.path if self.mirror is not None else location
        self._root_inode = os.stat(self.root).st_ino if self.root.is_dir() else -1
        self.spec: CacheSpec = read_spec(self.root)
        stored = load_labels(self.root, self.spec)
        # Dataset index → storage position: storage may be shuffled, and skipped images keep a slot.
        self.positions: np.ndarray = load_positions(self.root, self.spec, stored)
        self.labels: np.ndarray = stored[self.positions]
        fmt = get_format(self.spec.format)
        self.traits = fmt.traits
        if in_memory and self.traits.loads_into_ram:
            check_fits_in_memory(self.spec.n_stored * self.spec.image_bytes, self.root)
        self.reader = fmt.reader_for(self.spec)(self.root, self.spec, in_memory=in_memory)

    @property
    def ragged(self) -> bool:
        """Images differ in size: read them with ``read_images`` (a list), not ``read``."""
        return self.spec.ragged

    def __len__(self) -> int:
        return self.spec.n

    def storage_positions(self, indices: np.ndarray) -> np.ndarray:
        if indices.size and (indices.min() < -len(self) or indices.max() >= len(self)):
            raise IndexError(f"index out of range for a cache of {len(self)} images: {indices}")
        return self.positions[indices]

    def read(self, indices: np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray:
        """(B,H,W,C) uint8 images in the order of ``indices``, into ``out`` when given (e.g. a pinned
        buffer's numpy view); chunked formats visit each chunk once per call."""
        if self.ragged:
            raise ValueError(
                f"{self.root}: images in this cache differ in size (resize={self.spec.image.resize}); "
                "read them with read_images() (a list), or use CachedDataset / a GPU-crop loader"
            )
        pos = self.storage_positions(np.asarray(indices, dtype=np.int64).reshape(-1))
        if out is None:
            out = np.empty((len(pos), *self.spec.shape), np.uint8)
        elif out.shape != (len(pos), *self.spec.shape) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be C-contiguous uint8{(len(pos), *self.spec.shape)}, got {out.dtype}{out.shape}"
            )
        try:
            if self.mirror is None:
                self.reader.read_into(pos, out)
            else:
                with self.mirror.reading():  # fetched units stay until read (eviction waits)
                    self.mirror.ensure(self.reader.files_for(pos))
                    self.reader.read_into(pos, out)
        except DlstoreError as e:
            flat = np.asarray(indices, dtype=np.int64).reshape(-1)
            where = self._first_failing(flat, pos) if self.mirror is None else f"indices {_short(flat)}"
            raise SampleReadError(f"reading dataset {where} from {self.location}: {e}") from e
        if self.traits.opens_files_per_read:
            self.check_generation()
        return out

    def prefetch(self, indices: np.ndarray | list[int]) -> None:
        """Start preparing a later ``read`` of these indices in the background: a remote cache
        downloads the units they need, a local chunked one (zarr, npz) decodes them in its reader's
        threads, in the order given. Errors surface in the read that needs the unit, not here."""
        pos = self.storage_positions(np.asarray(indices, dtype=np.int64).reshape(-1))
        if self.mirror is not None:
            self.mirror.prefetch(self.reader.files_for(pos))
        else:
            self.reader.prefetch(pos)

    def read_batches(
        self, batches: list[np.ndarray] | list[list[int]], processes: int = 0
    ) -> Iterator[np.ndarray]:
        """Each batch of indices as ``read`` returns it, in order. With ``processes`` > 0 and a local
        chunked cache (zarr, npz), worker processes decode every chunk once and copy its images
        straight into the batches in shared memory: each array is then valid only until the next one
        is asked for (copy it to keep it). Otherwise each batch is a fresh ``read``."""
        readers_batches = getattr(self.reader, "decode_batches", None)
        if (
            processes <= 0
            or readers_batches is None
            or self.mirror is not None
            or mp.current_process().daemon
        ):
            for idx in batches:
                yield self.read(idx)
            return
        flat = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        stream = readers_batches([self.storage_positions(b) for b in flat], processes)
        taken = 0  # batches handed out: an error names the indices of the next one
        try:
            for images in stream:
                if self.traits.opens_files_per_read:
                    self.check_generation()
                taken += 1
                yield images
        except DlstoreError as e:
            where = f"indices {_short(flat[min(taken, len(flat) - 1)])}"
            raise SampleReadError(f"reading dataset {where} from {self.location}: {e}") from e
        finally:
            stream.close()  # type: ignore[attr-defined]

    def read_images(self, indices: np.ndarray | list[int]) -> list[np.ndarray]:
        """(H, W, C) uint8 images in the order of ``indices``, of any sizes (every format and layout)."""
        if getattr(self.reader, "read_images", None) is None:  # pixel layouts: one batched read
            return list(self.read(indices))
        return self._read_payload_layout(indices, self.reader.read_images)  # type: ignore[attr-defined]

    def read_payloads(self, indices: np.ndarray | list[int]) -> tuple[list[memoryview], np.ndarray]:
        """Encoded payloads (CRC-checked) and (B, 3) shapes, for a decoder elsewhere (the GPU); payload
        layouts only (``reader.gpu_jpeg`` says whether nvJPEG can decode them)."""
        return self._read_payload_layout(indices, self.reader.read_payloads)  # type: ignore[attr-defined]

    def payload_extents(self, indices: np.ndarray | list[int]) -> PayloadExtents:
        """Where the payloads of ``indices`` lie (see ``PayloadExtents``), for a decoder in another process
        that copies and CRC-checks them; payload layouts only. A remote cache's local copies of its units
        may be evicted once read, so its payloads are copied from this process's buffers, never re-read
        from those files by another process."""
        extents = self._read_payload_layout(indices, self.reader.payload_extents)  # type: ignore[attr-defined]
        if self.mirror is not None:
            extents.sources = [None] * len(extents.sources)
        return extents

    def _read_payload_layout(self, indices: np.ndarray | list[int], read: Callable[[np.ndarray], T]) -> T:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        pos = self.storage_positions(index)
        try:
            if self.mirror is None:
                result = read(pos)
            else:
                with self.mirror.reading():  # fetched units stay until read (eviction waits)
                    self.mirror.ensure(self.reader.files_for(pos))
                    result = read(pos)
        except DlstoreError as e:
            raise SampleReadError(
                f"reading dataset {self._name_failing(index, pos, e)} from {self.location}: {e}"
            ) from e
        self.check_generation()
        return result

    def dataset_index(self, position: int) -> int | None:
        hits = np.flatnonzero(self.positions == position)
        return int(hits[0]) if hits.size else None

    def _name_failing(self, indices: np.ndarray, pos: np.ndarray, error: Exception) -> str:
        """Payload readers say which storage position failed; map it back to the dataset index."""
        p = getattr(error, "position", None)
        if p is not None:
            return f"index {self.dataset_index(p)} (storage position {p}; batch {_short(indices)})"
        return f"indices {_short(indices)}"

    def check_generation(self) -> None:
        """Formats that open files as they go: if DEST was rebuilt (swapped) while open, refuse
        rather than mix generations. Checked after a read, so a read that passed got the old files.
        (A memory map taken at open keeps reading its old generation: it outlives the swap.)"""
        try:
            inode = os.stat(self.root).st_ino
        except OSError:
            inode = -2
        if inode != self._root_inode:
            raise CacheReplacedError(
                f"{self.root}: the cache was rebuilt or removed while open; open it "
                "again (a new CachedDataset / open_cache) to read the new generation"
            )

    def _first_failing(self, indices: np.ndarray, pos: np.ndarray) -> str:
        """On the error path only: re-read one by one to name the dataset index that fails."""
        for i, p in zip(indices.tolist(), pos.tolist()):
            try:
                self.reader.read_into(np.asarray([p]), np.empty((1, *self.spec.shape), np.uint8))
            except DlstoreError:
                return f"index {i} (storage position {p}; batch {_short(indices)})"
        return f"indices {_short(indices)}"

    def close(self) -> None:
        self.reader.close()


def load_npy(path: Path) -> np.ndarray:
    """A small index array of the cache (never a pickle)."""
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: missing; rebuild the cache") from None
    except ValueError as e:
        raise CacheCorruptError(f"{path}: unreadable ({e}); rebuild the cache") from None


def load_labels(root: Path, spec: CacheSpec) -> np.ndarray:
    path = root / LABELS_FILE
    labels = load_npy(path)
    if labels.shape != (spec.n_stored,) or labels.dtype.kind != "i" or int((labels >= 0).sum()) != spec.n:
        raise CacheCorruptError(
            f"{path}: {labels.dtype}{labels.shape} does not match the manifest "
            f"({spec.n} usable of {spec.n_stored}); rebuild the cache"
        )
    return labels.astype(np.int64, copy=False)


def load_positions(root: Path, spec: CacheSpec, stored_labels: np.ndarray) -> np.ndarray:
    path = root / POSITIONS_FILE
    pos = load_npy(path)
    if (
        pos.shape != (spec.n,)
        or pos.dtype.kind != "i"
        or (pos.size and (pos.min() < 0 or pos.max() >= spec.n_stored))
        or (stored_labels[pos] < 0).any()
    ):
        raise CacheCorruptError(
            f"{path}: {pos.dtype}{pos.shape} does not map {spec.n} samples into "
            f"{spec.n_stored} stored images; rebuild the cache"
        )
    return pos.astype(np.int64, copy=False)


def open_cache(
    path: str | Path,
    in_memory: bool = False,
    strict: bool = False,
    check_source: bool = False,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    cache_bytes: int | None = None,
) -> Cache:
    """Open a complete cache for batched reads; raises CacheNotFoundError if it is not complete.

    Opening reads the manifest and the index arrays, never the source files: its cost does not grow
    with the number of source files. One ``stat`` of the source root warns (StaleCacheWarning) when a
    class folder was added, removed or renamed since. ``check_source=True`` re-scans the source folder
    (sizes, mtimes): a changed source warns, or with ``strict`` raises StaleCacheError, naming the first
    changed path. ``in_memory`` (formats that load into RAM) is refused up front when the images
    exceed the available memory, and for formats that are read unit by unit.

    ``path`` may be a URL (``s3://bucket/prefix``): credentials from the store's environment or
    ``storage_options``; data units are fetched on first use into a local read-through cache under
    ``cache_dir`` (default ``~/.cache/dlstore/remote``) of at most ``cache_bytes``, each checked
    against the manifest's checksum. The source is not re-scanned for a remote cache.
    """
    cache = Cache(path, in_memory, storage_options, cache_dir, cache_bytes)
    if cache.mirror is None:  # a remote cache's source folder is on the machine that converted it
        check_staleness(cache.root, cache.spec, check_source, strict)
    return cache


def check_staleness(root: Path, spec: CacheSpec, full: bool, strict: bool) -> None:
    """The cheap root check always; the full scan only when asked for."""
    from dlstore import sourcefiles

    if full:
        sourcefiles.check_source(root, strict=strict)
    else:
        sourcefiles.root_warning(spec, root)


def check_fits_in_memory(need: int, root: Path) -> None:
    from dlstore.machine import available_memory

    avail, where = available_memory()
    if avail is not None and need > avail:
        raise CacheTooLargeError(
            f"{root}: loading the ram cache into memory needs {need / 1e9:.2f} GB but only {avail / 1e9:.2f} GB "
            f"is available ({where}); open it without in_memory=True (memory-mapped, the default, pages "
            "it in on demand) or raise the memory limit"
        )


def _short(indices: object) -> str:
    seq = np.asarray(indices).reshape(-1)[:8].tolist()
    return f"{seq}{'...' if np.asarray(indices).size > 8 else ''}"


def open_mirror(
    url: str,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    cache_bytes: int | None = None,
) -> RemoteMirror:
    """The mirror of the cache at ``url``; its format says which files are fetched unit by unit."""
    store = RemoteStore(url, storage_options)
    raw, spec = fetch_manifest(store)
    lazy = get_format(spec.format).reader_for(spec).unit_files(spec)
    return RemoteMirror(store, lazy, cache_dir, cache_bytes, manifest=(raw, spec))
