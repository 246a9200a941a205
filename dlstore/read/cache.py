"""Open a finished cache: manifest first, then labels, then the format's reader."""

from __future__ import annotations

import io
import os
import stat
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from dlstore.checksums import file_kind, regular_files, size_problems
from dlstore.errors import (
    CacheCorruptError,
    CacheReplacedError,
    CacheTooLargeError,
    DlstoreError,
    SampleReadError,
)
from dlstore.formats import get_format
from dlstore.read.engines.batch_procs import ReaderEngines, may_start_processes
from dlstore.spec import (
    LABELS_FILE,
    MANIFEST,
    POSITIONS_FILE,
    CacheSpec,
    FieldSpec,
    no_manifest,
    parse_manifest,
    read_spec,
)
from dlstore.storage.mirror import RemoteMirror, fetch_manifest
from dlstore.storage.stores import RemoteStore, RemoteStoreError, parse_store_path

if TYPE_CHECKING:
    from dlstore.formats.payload import PayloadExtents, PayloadReader

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
        remote: Remote | None = None,
    ) -> None:
        location = parse_store_path(root)
        self.location = location  # what errors name: the folder, or the URL of a remote cache
        # A remote cache is read through its local mirror: every format reads local files.
        self.mirror = open_mirror(location, remote) if isinstance(location, str) else None
        self.root: Path = self.mirror.path if self.mirror is not None else location
        self._generation = self._open(in_memory)
        self.engines = ReaderEngines(self.reader)  # the reader's decode processes, started on demand

    def _open(self, in_memory: bool) -> Generation:
        """Open one generation whole: a replace during the open (``root`` no longer the folder held)
        opens everything again, a few times at most, never mixing two generations' files."""
        for _ in range(OPEN_ATTEMPTS):
            gen = Generation(self.root)
            try:
                self._open_generation(gen, in_memory)
            except (DlstoreError, OSError, ValueError):  # files read by path: the folder swapped meanwhile
                if gen.is_current():  # a real problem of this cache, not a replace in progress
                    gen.close()
                    raise
            else:
                if gen.is_current():
                    return gen
                self.reader.close()
            gen.close()
        raise CacheReplacedError(
            f"{self.location}: the cache was replaced {OPEN_ATTEMPTS} times while being opened; "
            "open it again once the conversions writing it are done"
        )

    def _open_generation(self, gen: Generation, in_memory: bool) -> None:
        """Manifest, then the inventory of files, the index arrays and the reader, all of ``gen``."""
        self.spec: CacheSpec = parse_manifest(gen.read(MANIFEST), self.root / MANIFEST)
        check_files(self.root, self.spec, lazy=self.mirror is not None)
        stored = load_labels(self.root, self.spec, gen)
        # Dataset index → storage position: storage may be shuffled, and skipped images keep a slot.
        self.positions: np.ndarray = load_positions(self.root, self.spec, stored, gen)
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
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        with self._read_errors(
            lambda e: self._first_failing(flat, pos) if self.mirror is None else f"indices {_short(flat)}"
        ):
            if self.mirror is None:
                self.reader.read_into(pos, out)
            else:
                with self.mirror.reading():  # fetched units stay until read (eviction waits)
                    self.mirror.ensure(self.reader.files_for(pos))
                    self.reader.read_into(pos, out)
        if self.traits.opens_files_per_read:
            self.check_generation()
        return out

    def prefetch(self, indices: np.ndarray | list[int]) -> None:
        """Start preparing a later ``read`` of these indices in the background (a remote cache downloads
        their units, a chunked one decodes them); errors surface in the read that needs the unit."""
        pos = self.storage_positions(np.asarray(indices, dtype=np.int64).reshape(-1))
        if self.mirror is not None:
            self.mirror.prefetch(self.reader.files_for(pos))
        else:
            self.reader.prefetch(pos)

    def read_batches(
        self, batches: list[np.ndarray] | list[list[int]], processes: int = 0
    ) -> Iterator[np.ndarray]:
        """Each batch of indices as ``read`` returns it. With ``processes`` > 0 and a local chunked cache,
        worker processes decode every chunk once straight into the batches in shared memory: each
        array is then valid only until the next one is asked for."""
        if processes <= 0 or self.mirror is not None or not may_start_processes(self.reader):
            for idx in batches:
                yield self.read(idx)
            return
        flat = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        stream = self.engines.decode_batches([self.storage_positions(b) for b in flat], processes)
        taken = 0  # batches handed out: an error names the indices of the next one
        try:
            with self._read_errors(lambda e: f"indices {_short(flat[min(taken, len(flat) - 1)])}"):
                for images in stream:
                    if self.traits.opens_files_per_read:
                        self.check_generation()
                    taken += 1
                    yield images
        finally:
            stream.close()  # type: ignore[attr-defined]

    # Which named fields reads return (``select_fields``); None: every field the manifest declares.
    field_names: tuple[str, ...] | None = None

    def select_fields(self, names: Sequence[str] | None) -> None:
        """Read only these fields from now on (a segmentation run need not read the boxes)."""
        unknown = sorted(set(names or ()) - set(self.spec.fields))
        if unknown:
            raise ValueError(
                f"{self.location}: no field(s) {', '.join(unknown)} in this cache; it has "
                f"{', '.join(self.spec.fields) or 'none'} (see `dlstore info`)"
            )
        self.field_names = None if names is None else tuple(names)

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """The fields reads return: the manifest's, or the ones ``select_fields`` chose."""
        names = self.field_names
        return {k: f for k, f in self.spec.fields.items() if names is None or k in names}

    def read_fields(
        self, indices: np.ndarray | list[int], into: dict[str, np.ndarray] | None = None
    ) -> dict[str, Any]:
        """The ``fields`` of ``indices``: name → a (B, ...) array for a fixed-shape field (a class field is
        the labels), a list of B arrays for a variable-length one; {} without fields. ``into``: (B, ...)
        arrays to fill for fixed-shape fields (a loader's pinned buffers), returned in their place."""
        if not self.spec.fields:
            return {}
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        pos = self.storage_positions(index)
        with self._read_errors(lambda e: f"the fields of indices {_short(index)}", dataset=False):
            out = self.reader.read_fields(pos, self.fields, into)
        for name, f in self.fields.items():
            if f.kind == "class":
                out[name] = self.labels[index]
        return out

    def read_images(self, indices: np.ndarray | list[int]) -> list[np.ndarray]:
        """(H, W, C) uint8 images in the order of ``indices``, of any sizes (every format and layout)."""
        if not self.reader.traits.payloads:  # pixel layouts: one batched read
            return list(self.read(indices))
        return self._read_payload_layout(indices, self.payload_reader.read_images)

    def read_payloads(self, indices: np.ndarray | list[int]) -> tuple[list[memoryview], np.ndarray]:
        """Encoded payloads (CRC-checked) and (B, 3) shapes, for a decoder elsewhere (the GPU); payload
        layouts only (``reader.gpu_jpeg`` says whether nvJPEG can decode them)."""
        return self._read_payload_layout(indices, self.payload_reader.read_payloads)

    def payload_extents(self, indices: np.ndarray | list[int]) -> PayloadExtents:
        """Where the payloads of ``indices`` lie (``PayloadExtents``), for a decoder in another process;
        a remote cache's local copies may be evicted, so its payloads are never re-read from files."""
        extents = self._read_payload_layout(indices, self.payload_reader.payload_extents)
        if self.mirror is not None:
            extents.sources = [None] * len(extents.sources)
        return extents

    @property
    def payload_reader(self) -> PayloadReader:
        """The reader, for the payload layout's own reads (``read_payloads``, ``decode``...)."""
        if not self.reader.traits.payloads:
            raise ValueError(
                f"{self.root}: this cache stores plain pixel arrays, not per-image payloads; payload "
                "reads need a cache converted with --codec jpeg or --resize shorter (or use read())"
            )
        return cast("PayloadReader", self.reader)

    def _read_payload_layout(self, indices: np.ndarray | list[int], read: Callable[[np.ndarray], T]) -> T:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        pos = self.storage_positions(index)
        with self._read_errors(lambda e: self._name_failing(index, pos, e)):
            if self.mirror is None:
                result = read(pos)
            else:
                with self.mirror.reading():  # fetched units stay until read (eviction waits)
                    self.mirror.ensure(self.reader.files_for(pos))
                    result = read(pos)
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
        """Refuse rather than mix generations if the cache was rebuilt or removed while open (checked
        after a read of files opened by path, so a read that passed got the old files)."""
        if not self._generation.is_current():
            raise CacheReplacedError(
                f"{self.location}: the cache was rebuilt or removed while open; open it "
                "again (a new CachedDataset / open_cache) to read the new generation"
            )

    @contextmanager
    def _read_errors(self, where: Callable[[DlstoreError], str], dataset: bool = True) -> Iterator[None]:
        """Around every read: a replaced cache raises CacheReplacedError, not "corrupt"; any other
        dlstore error becomes a SampleReadError naming ``where(error)`` and the cache."""
        try:
            yield
        except CacheReplacedError:
            raise
        except DlstoreError as e:
            self._check_replaced(e)
            what = f"dataset {where(e)}" if dataset else where(e)
            raise SampleReadError(f"reading {what} from {self.location}: {e}") from e
        except (OSError, ValueError):  # a file of a generation swapped away mid-read (a path, a map)
            self.check_generation()
            raise

    def _check_replaced(self, error: Exception) -> None:
        """On a read's error path: a replaced cache raises CacheReplacedError (not damage). Not asked of
        a store that just failed to answer: that would only wait out its deadline again."""
        self.check_generation()
        if self.mirror is not None and not isinstance(error, RemoteStoreError):
            self.mirror.raise_if_replaced()  # one GET of the manifest: only when a read failed

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
        self._generation.close()
        self.engines.close()  # after the reader: its decoded units may be views of their memory


OPEN_ATTEMPTS = 3  # replaces met while opening, before giving up with CacheReplacedError
NPY_HEADER_MAX = 1 << 16  # numpy writes headers of at most a few hundred bytes


class Generation:
    """The folder a local cache was opened from, held open by a directory descriptor: no new folder can
    get its (device, inode) meanwhile, and the manifest and index arrays read relative to it all come
    from the same generation whatever is renamed."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.fd = -1
        try:
            self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            read_spec(self.root)  # raises the usual CacheNotFoundError naming the fix
            raise
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)
        # Not __del__: at interpreter exit a finalizer runs before module globals (os) are torn down.
        self._close = weakref.finalize(self, os.close, self.fd)

    def is_current(self) -> bool:
        """``root`` still names the folder held (it was not swapped, renamed or removed)."""
        try:
            st = os.stat(self.root)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident and self.fd >= 0

    def read(self, name: str, limit: int | None = None) -> bytes:
        """A top-level file of this generation; never follows a symlink, never blocks on a FIFO, and
        reads at most ``limit`` bytes (a larger file is refused before anything is allocated)."""
        path = self.root / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            if name == MANIFEST:
                raise no_manifest(self.root, self.root) from None
            raise CacheCorruptError(f"{path}: missing; rebuild the cache") from None
        except OSError as e:  # ELOOP: a symlink
            raise CacheCorruptError(
                f"{path}: cannot be opened as a regular file ({e.strerror}); refusing it (a symlink is "
                "never followed); rebuild the cache"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CacheCorruptError(
                    f"{path}: a {file_kind(st.st_mode)}, not a regular file; rebuild the cache"
                )
            if limit is not None and st.st_size > limit:
                raise CacheCorruptError(
                    f"{path}: {st.st_size} bytes, more than the {limit} the manifest allows; rebuild the cache"
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read()
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            self._close()
            self.fd = -1


def check_files(root: Path, spec: CacheSpec, lazy: bool = False) -> None:
    """Before anything is allocated: only folders and regular files, and no file holds bytes beyond
    what the manifest's checksums cover. A missing or truncated unit is left to the read that needs
    it and to ``dlstore verify``."""
    present = regular_files(root)
    over = [p for p in size_problems(root, spec.checksums, present, lazy=True) if "appended" in p]
    if over:
        raise CacheCorruptError(f"{over[0]}; run `dlstore verify {root}` and rebuild the cache")


def load_npy(path: Path, data: bytes | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A small index array of the cache (never a pickle). With ``shape`` the header is checked
    first, so a forged header cannot make numpy allocate what it declares."""
    try:
        if data is None:
            data = path.read_bytes()
        f = io.BytesIO(data)
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        declared, fortran, dtype = read_header(f)
        if shape is not None and (
            tuple(declared) != shape or dtype.kind != "i" or dtype.hasobject or fortran
        ):
            raise CacheCorruptError(
                f"{path}: holds {dtype}{tuple(declared)}, the manifest says an integer array of shape "
                f"{shape}; rebuild the cache"
            )
        if len(data) - f.tell() != int(np.prod(declared)) * dtype.itemsize:
            raise ValueError(f"{len(data) - f.tell()} data bytes for {dtype}{tuple(declared)}")
        if dtype.hasobject:
            raise ValueError(f"an object array ({dtype}): dlstore never unpickles")
        count = int(np.prod(declared))
        return np.frombuffer(data, dtype=dtype, count=count, offset=f.tell()).reshape(declared).copy()
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: missing; rebuild the cache") from None
    except (ValueError, SyntaxError, TypeError) as e:
        raise CacheCorruptError(f"{path}: unreadable ({e}); rebuild the cache") from None


def _read_index(root: Path, name: str, gen: Generation | None, shape: tuple[int, ...]) -> np.ndarray:
    limit = NPY_HEADER_MAX + 8 * int(np.prod(shape))
    data = gen.read(name, limit) if gen is not None else None
    return load_npy(root / name, data, shape)


def load_labels(root: Path, spec: CacheSpec, gen: Generation | None = None) -> np.ndarray:
    path = root / LABELS_FILE
    labels = _read_index(root, LABELS_FILE, gen, (spec.n_stored,))
    if labels.shape != (spec.n_stored,) or labels.dtype.kind != "i" or int((labels >= 0).sum()) != spec.n:
        raise CacheCorruptError(
            f"{path}: {labels.dtype}{labels.shape} does not match the manifest "
            f"({spec.n} usable of {spec.n_stored}); rebuild the cache"
        )
    return labels.astype(np.int64, copy=False)


def load_positions(
    root: Path, spec: CacheSpec, stored_labels: np.ndarray, gen: Generation | None = None
) -> np.ndarray:
    path = root / POSITIONS_FILE
    pos = _read_index(root, POSITIONS_FILE, gen, (spec.n,))
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
    remote: Remote | None = None,
) -> Cache:
    """Open a complete cache for batched reads; raises CacheNotFoundError if it is not complete.

    Opening reads the manifest and index arrays, never the source files; one ``stat`` of the source
    root warns (StaleCacheWarning) when a class folder changed. ``check_source=True`` re-scans the
    source (sizes, mtimes): a change warns, or with ``strict`` raises StaleCacheError. ``in_memory``
    is refused up front when the images exceed the available memory. ``path`` may be a URL
    (``s3://bucket/prefix``), read as ``remote`` says: units are fetched on first use into a local
    read-through cache, each checked against the manifest's checksum."""
    cache = Cache(path, in_memory, remote)
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


@dataclass(frozen=True)
class Remote:
    """How a cache at a URL (``s3://bucket/prefix``, ``gs://…``) is read.

    - ``storage_options``: keyword arguments of the fsspec filesystem (credentials, endpoint); never
      recorded, never shown. Without them the store's own environment variables apply.
    - ``cache_dir``: where the local read-through cache of its chunks lives (default
      ``$DLSTORE_REMOTE_CACHE``, ``~/.cache/dlstore/remote``); ``cache_bytes``: its bound.

    >>> loader = dlstore.Loader("s3://bucket/cache", 256, remote=Remote(cache_dir="/scratch"))  # doctest: +SKIP
    """

    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    cache_dir: str | Path | None = None
    cache_bytes: int | None = None


def open_mirror(url: str, remote: Remote | None = None) -> RemoteMirror:
    """The mirror of the cache at ``url``; its format says which files are fetched unit by unit."""
    remote = remote or Remote()
    store = RemoteStore(url, dict(remote.storage_options or {}))
    raw, spec = fetch_manifest(store)
    lazy = get_format(spec.format).reader_for(spec).unit_files(spec)
    return RemoteMirror(store, lazy, remote.cache_dir, remote.cache_bytes, manifest=(raw, spec))
