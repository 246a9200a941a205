"""The read-through local chunk cache of a remote cache: a mirror folder of the same layout. On open
the manifest (always fresh) and the small files are fetched; a data unit when a batch first needs it,
checked against the manifest's sha256 before it is renamed into place, so the format's local reader
never reads a truncated or tampered object.

Bounded by ``cache_bytes`` (least recently used units evicted) and safe to share between processes:
downloads go to a temp name and are renamed, and eviction takes an exclusive ``flock`` on the mirror
while every read holds a shared one. Another manifest (a new generation) gets another mirror folder."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dlstore import settings
from dlstore.checksums import extents, file_kind, file_sha256, split_key
from dlstore.errors import CacheCorruptError, CacheReplacedError, DlstoreError
from dlstore.spec import MANIFEST, CacheSpec, no_manifest, parse_relpath, parse_spec, read_spec
from dlstore.storage.stores import RemoteStore

DEFAULT_CACHE_BYTES = 20 << 30
LOCK = ".lock"


def default_cache_dir() -> Path:
    base = settings.folder("DLSTORE_REMOTE_CACHE", "remote")
    return Path(base)


def fetch_manifest(store: RemoteStore) -> tuple[bytes, CacheSpec]:
    """The remote manifest, validated; a cache without one is not complete (never half-visible)."""
    try:
        raw = store.get_bytes(MANIFEST)
    except FileNotFoundError:
        raise no_manifest(store.url) from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CacheCorruptError(f"{store.where(MANIFEST)}: not valid JSON ({e}); rebuild the cache") from None
    return raw, parse_spec(doc, Path(MANIFEST))


class RemoteMirror:
    """Local files of one remote cache generation, fetched on demand and checked by checksum.

    >>> mirror = RemoteMirror(RemoteStore("s3://b/cache"), lazy={"shards/shard_000001.npz"})  # doctest: +SKIP
    >>> with mirror.reading(): mirror.ensure(["shards/shard_000001.npz"])                      # doctest: +SKIP
    """

    def __init__(
        self,
        store: RemoteStore,
        lazy: Iterable[str] = (),
        cache_dir: str | Path | None = None,
        cache_bytes: int | None = None,
        manifest: tuple[bytes, CacheSpec] | None = None,
    ) -> None:
        self.store = store
        raw, self.spec = manifest or fetch_manifest(store)
        for key in self.spec.checksums:
            parse_relpath(split_key(key)[0], Path(store.where(MANIFEST)))  # no .., no absolute paths
        self.keys = files_to_keys(self.spec.checksums)
        self.lazy = set(lazy) & set(self.keys)
        base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        url_id = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        self.path = base / url_id / hashlib.sha256(raw).hexdigest()[:16]
        self.cache_bytes = DEFAULT_CACHE_BYTES if cache_bytes is None else int(cache_bytes)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = -1
        self._lock_pid = -1
        self._grown = True  # a download since the last size check: only then can eviction be due
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetcher_pid = -1
        if not (self.path / MANIFEST).is_file():
            install(self.path / MANIFEST, raw)
        with self.reading():
            self.ensure(sorted(set(self.keys) - self.lazy))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock_fd"], state["_lock_pid"] = -1, -1
        state["_prefetcher"], state["_prefetcher_pid"] = None, -1
        return state

    # --- locking: shared while reading, exclusive while evicting -------------------------------------

    def _fd(self) -> int:
        if self._lock_pid != os.getpid():
            self._lock_fd = os.open(self.path.parent / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            self._lock_pid = os.getpid()
        return self._lock_fd

    @contextmanager
    def reading(self) -> Iterator[None]:
        fd = self._fd()
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self.evict_if_over()

    def ensure(self, files: Iterable[str]) -> None:
        """Make each listed file present and verified locally; downloads run in parallel threads."""
        missing = []
        for rel in files:
            path = self.path / rel
            if self.present(path):
                os.utime(path)  # recency for LRU eviction
            else:
                missing.append(rel)
        if len(missing) == 1:
            self.fetch(missing[0])
        elif missing:
            with ThreadPoolExecutor(min(16, len(missing))) as ex:
                list(ex.map(self.fetch, missing))

    def present(self, path: Path) -> bool:
        """A fetched file is a regular file here; anything else put in its place (a symlink, a
        FIFO) is refused, never followed or opened."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise CacheCorruptError(
                f"{path}: a {file_kind(st.st_mode)} in the local chunk cache of {self.store.url}, where dlstore "
                f"puts only the regular files it fetched; remove {self.path} and open the cache again"
            )
        return True

    def fetch(self, rel: str) -> None:
        final = self.path / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.part{os.getpid()}-{os.urandom(4).hex()}")
        try:
            try:
                self.store.get_file(rel, tmp)
            except FileNotFoundError:
                self.raise_if_replaced()  # deleted by a replace: say so, not "missing"
                raise CacheCorruptError(
                    f"{self.store.where(rel)}: listed in the manifest but missing from the store; "
                    "rebuild the cache (`dlstore convert ... --overwrite`)"
                ) from None
            try:
                self.check(rel, tmp)
            except CacheCorruptError:
                self.raise_if_replaced()  # a rebuilt cache says so; a damaged object keeps its error
                raise
            os.replace(tmp, final)
            self._grown = True
        finally:
            tmp.unlink(missing_ok=True)

    def raise_if_replaced(self) -> None:
        """On an error path: CacheReplacedError if the remote manifest changed; if the store cannot
        even be asked, nothing (the error being handled says more than this check could)."""
        try:
            self.check_generation()
        except CacheReplacedError:
            raise
        except (DlstoreError, OSError):
            pass

    def check_generation(self) -> None:
        """Refuse to mix generations: the remote manifest is not the one this mirror was opened with."""
        try:
            now = self.store.get_bytes(MANIFEST)
        except FileNotFoundError:
            now = b""
        if hashlib.sha256(now).hexdigest()[:16] != self.path.name:
            raise CacheReplacedError(
                f"{self.store.url}: the cache was rebuilt or removed while open; open it again "
                "(a new CachedDataset / open_cache) to read the new generation"
            )

    def check(self, rel: str, path: Path) -> None:
        """Every checksummed range of the file; a truncated or altered object is refused."""
        size = path.stat().st_size
        extent = extents({k: self.spec.checksums[k] for k in self.keys[rel]})[rel]
        if extent >= 0 and size > extent:  # bytes no checksum covers: a forged index appended
            raise CacheCorruptError(
                f"{self.store.where(rel)}: {size} bytes, but the manifest's checksums cover only {extent}; "
                "rebuild the cache (`dlstore convert ... --overwrite`)"
            )
        for key in self.keys[rel]:
            _, offset, length = split_key(key)
            if length is not None and size < offset + length:
                raise CacheCorruptError(
                    f"{self.store.where(rel)}: truncated ({size} bytes, the manifest lists bytes up to "
                    f"{offset + length}); rebuild the cache"
                )
            if file_sha256(path, offset, length) != self.spec.checksums[key]:
                raise CacheCorruptError(
                    f"{self.store.where(rel)}: checksum mismatch (truncated or modified object); "
                    "rebuild the cache (`dlstore convert ... --overwrite`)"
                )

    def prefetch(self, files: list[str]) -> None:
        """``ensure`` in one background thread per process (the next batches in sampler order)."""
        missing = [rel for rel in files if not os.path.lexists(self.path / rel)]
        if not missing:
            return
        if self._prefetcher is None or self._prefetcher_pid != os.getpid():
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="dlstore-prefetch")
            self._prefetcher_pid = os.getpid()
        self._prefetcher.submit(self._prefetch, missing)

    def _prefetch(self, files: list[str]) -> None:
        try:
            with self.reading():
                self.ensure(files)
        except Exception:  # noqa: BLE001 - the read that needs the unit fetches it again and reports
            pass

    def evict_if_over(self) -> None:
        """Remove least recently used data units until the mirror folder is within ``cache_bytes``.
        Only after a download: a warm epoch pays no directory scan per batch."""
        if not self._grown:
            return
        self._grown = False
        units = [(p.stat(), p) for rel in self.lazy if (p := self.path / rel).is_file()]
        total = sum(st.st_size for st, _ in units)
        if total <= self.cache_bytes:
            return
        fd = self._fd()
        fcntl.flock(fd, fcntl.LOCK_EX)  # no process is between a fetch and its read now
        try:
            for st, p in sorted(units, key=lambda u: u[0].st_mtime_ns):
                if total <= self.cache_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= st.st_size
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def clear(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def files_to_keys(checksums: dict[str, str]) -> dict[str, list[str]]:
    """File name → its checksum keys (a large file has one per byte range)."""
    out: dict[str, list[str]] = {}
    for key in checksums:
        out.setdefault(split_key(key)[0], []).append(key)
    return out


def install(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def bytes_at(location: Path | str, storage_options: dict[str, Any] | None = None) -> int:
    """Bytes of a cache: its folder's files, or its objects (a staging prefix left by an unfinished
    publish not included)."""
    if isinstance(location, str):
        sizes = RemoteStore(location, storage_options).sizes()
        return sum(v for k, v in sizes.items() if not k.startswith(".dlstore-staging/"))
    return sum(p.stat().st_size for p in Path(location).rglob("*") if p.is_file())


def spec_at(location: Path | str, storage_options: dict[str, Any] | None = None) -> CacheSpec:
    """The manifest of a local cache folder or of a remote cache (a URL)."""
    if isinstance(location, str):
        return fetch_manifest(RemoteStore(location, storage_options))[1]
    return read_spec(location)
