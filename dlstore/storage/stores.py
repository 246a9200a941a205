"""Where a cache lives: a local folder, or a URL on an object store through fsspec (s3fs for ``s3://``,
gcsfs for ``gs://``); ``parse_store_path`` decides. Credentials come from the store's environment
(``AWS_*``, profiles) or ``storage_options``, and are never logged, shown in errors or recorded.

``RemoteStore`` makes every request: transient failures (refused, reset, time-outs, 5xx) are retried
with backoff, then a ``RemoteStoreError`` names the object; a missing object is a
``FileNotFoundError`` at once. It counts its requests and bytes."""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from dlstore.errors import DlstoreError, UnsupportedStoreError, require_extra

T = TypeVar("T")
# scheme → (the fsspec backend module, the dlstore extra that installs it)
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
RETRIES = 5  # attempts per request before giving up
# Every request has a deadline: a store that stops answering (a stopped server, a dropped network)
# ends in RemoteStoreError naming the object within DEADLINE_S + READ_TIMEOUT_S, never a hang.
CONNECT_TIMEOUT_S = 5.0  # per attempt: establishing the connection
READ_TIMEOUT_S = 10.0  # per attempt: the longest wait for the next bytes of an answer
DEADLINE_S = 30.0  # per request, all its attempts: no new attempt starts after this
# Errors that mean "no usable credentials" by their class name (botocore, google-auth): retrying
# cannot help, and their text may be long; they become one line naming the URL and the fix.
NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError", "RefreshError"}
BACKOFF_S = 0.25  # first wait; doubles per attempt, with jitter, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 8.0
# Not worth retrying: the answer will not change.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)
# "s3://b/k", and also "s3:/b/k": what pathlib makes of a URL (it collapses "//"). Two letters at
# least, so a Windows drive ("C:/") is not mistaken for a scheme.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/+(?P<rest>.*)$")

StorePath = Path | str  # a local folder, or the URL of a remote cache


class RemoteStoreError(DlstoreError, OSError):
    """A request to an object store kept failing after its retries; names the object."""


class RemoteAccessError(DlstoreError, PermissionError):
    """The store refused the credentials (or found none); names the URL and how to give them."""


def deadline_options(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """The fsspec options with dlstore's time-outs filled in, the user's own settings winning: for
    S3 botocore's connect/read time-outs with a single attempt each (``RemoteStore.call`` retries,
    within its deadline), so a request never waits botocore's 60 s x 5 attempts x s3fs's 5 retries."""
    out = dict(options)
    if scheme in ("s3", "s3a"):
        config = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": 1, "mode": "standard"},
        }
        out["config_kwargs"] = {**config, **dict(out.get("config_kwargs") or {})}
    if scheme in ("gs", "gcs") and "requests_timeout" not in out:
        # gcsfs passes no time-out to aiohttp by default: a stopped server would be waited on forever
        import aiohttp

        out["requests_timeout"] = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
        )
    return out


# gcsfs methods wrapped in its own retry loop (6 attempts, up to 32 s apart, ~1 min per request
# without a network); its ``retries`` attribute is read when the class is defined, so setting it
# later changes nothing. ``single_attempt`` binds the unwrapped method to the instance instead.
GCSFS_RETRIED = ("_request", "_get_file_request", "_get_file_concurrent")


def single_attempt(fs: Any) -> None:
    """One attempt per backend request, so ``RemoteStore.call``'s bounded loop is the only retry
    loop: s3fs's and gcsfs's own loops would multiply its attempts and outlast its deadline."""
    if hasattr(fs, "retries"):
        fs.retries = 1
    for name in GCSFS_RETRIED if type(fs).__module__.startswith("gcsfs") else ():
        method = getattr(type(fs), name, None)
        inner = getattr(method, "__wrapped__", None)
        if inner is not None:
            setattr(fs, name, types.MethodType(inner, fs))


@contextmanager
def without_gcsfs_cloud_method(scheme: str, options: dict[str, Any]) -> Iterator[None]:
    """Without credentials gcsfs tries, after google-auth's defaults (which already ask a GCE metadata
    server, with short time-outs), its "cloud" method: the metadata server again, 5 attempts over
    ~15 s. gcsfs skips it when ``NO_GCE_CHECK`` is "true" as it connects; google-auth reads the same
    variable once, at import, to skip its own GCE check. So google-auth is imported first (it keeps
    the user's setting: on a GCE machine it still finds the credentials) and the variable is set only
    while gcsfs connects. A user's own setting or token is left alone."""
    if scheme not in ("gs", "gcs") or "token" in options or "NO_GCE_CHECK" in os.environ:
        yield
        return
    import google.auth.compute_engine._metadata  # noqa: F401 - reads NO_GCE_CHECK now, while unset

    os.environ["NO_GCE_CHECK"] = "true"
    try:
        yield
    finally:
        os.environ.pop("NO_GCE_CHECK", None)


def quiet_backend_logs(scheme: str) -> None:
    """gcsfs and google-auth log every retry (hundreds of lines without credentials or network):
    dlstore reports the outcome in one line instead."""
    if scheme in ("gs", "gcs"):
        import logging

        for name in ("gcsfs", "google.auth", "google.auth.compute_engine._metadata", "google.auth.transport"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def parse_store_path(path: str | os.PathLike[str]) -> StorePath:
    """A cache location → a local ``Path``, or the normalised URL (``str``) of a remote cache.
    ``file://`` URLs name a local path; a scheme no fsspec backend of dlstore serves is refused
    instead of becoming a local folder named ``http:``."""
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return Path(text)
    scheme = match["scheme"].lower()
    if scheme == "file" and text.startswith("file://"):
        return Path(text[len("file://") :])
    if scheme not in EXTRAS:
        raise UnsupportedStoreError(
            f"{text}: remote cache locations ({scheme}://) are not supported; use s3:// or gs:// "
            f"({', '.join(sorted(EXTRAS))}), a local folder or a mounted file system path"
        )
    return f"{scheme}://{match['rest'].rstrip('/')}"


def is_url(path: object) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None and not path.startswith("file://")


def scheme_of(url: str) -> str:
    return url.partition("://")[0].lower()


def check_extra(url: str) -> None:
    """A URL whose fsspec backend is not installed: name the extra to install."""
    module, extra = EXTRAS[scheme_of(url)]
    require_extra(module, extra, f"a {scheme_of(url)}:// cache path")


_HINTS = {
    "s3fs": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE",
    "gcsfs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`",
}
CREDENTIALS_HINT = {scheme: _HINTS[module] for scheme, (module, _) in EXTRAS.items()}


def _first_line(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * (0.5 + random.random() / 2)


class RemoteStore:
    """One cache root on an object store: whole-object get/put, listing, server-side copy, delete.

    Opened lazily per process (fsspec's async clients must not cross a fork); pickles as its URL and
    options only.

    >>> store = RemoteStore("s3://bucket/caches/imagenet")          # doctest: +SKIP
    >>> store.get_bytes("dlstore.json")                              # doctest: +SKIP
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        check_extra(url)
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.requests = 0
        self.bytes = 0
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"  # never the options: they may hold credentials

    @property
    def fs(self) -> Any:
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                from fsspec.core import url_to_fs

                scheme = scheme_of(self.url)
                quiet_backend_logs(scheme)
                options = deadline_options(scheme, self.storage_options)
                with without_gcsfs_cloud_method(scheme, options):
                    self._fs, self._root = url_to_fs(self.url, skip_instance_cache=True, **options)
                single_attempt(self._fs)
                self._pid = os.getpid()
            return self._fs

    def key(self, rel: str) -> str:
        _ = self.fs
        return f"{self._root}/{rel}" if rel else self._root

    @property
    def is_bucket_root(self) -> bool:
        """The URL names a whole bucket (``s3://bucket``), not a prefix inside one."""
        return "/" not in self.key("").strip("/")

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn`` with retries on transient errors, within ``DEADLINE_S``; then RemoteStoreError
        naming the object. Refused credentials and a missing bucket fail at once, in one line."""
        last: BaseException | None = None
        start = time.monotonic()
        attempts = 0
        for attempt in range(RETRIES):
            try:
                self.requests += 1
                attempts += 1
                return fn()
            except FileNotFoundError as e:
                raise self.not_found(what, rel, e) from None
            except PermissionError as e:
                raise self.denied(what, rel, e) from None
            except PERMANENT:
                raise
            except Exception as e:  # noqa: BLE001 - network stacks raise many types; all are retried
                if type(e).__name__ in NO_CREDENTIALS:
                    raise self.denied(what, rel, e) from None
                last = e
                wait = backoff(attempt)
                if attempt + 1 < RETRIES and time.monotonic() - start + wait < DEADLINE_S:
                    time.sleep(wait)
                else:
                    break
        took = time.monotonic() - start
        raise RemoteStoreError(
            f"{self.where(rel)}: {what} failed {attempts} times in {took:.0f} s ({type(last).__name__}: "
            f"{_first_line(last)}); check that the object store is reachable and the credentials are "
            "valid, then retry"
        ) from last

    def denied(self, what: str, rel: str, error: BaseException) -> RemoteAccessError:
        """One line naming the object and the fix; never the options (they may hold secrets)."""
        kind = "no credentials were found" if type(error).__name__ in NO_CREDENTIALS else "access denied"
        return RemoteAccessError(
            f"{self.where(rel)}: {what} refused, {kind} ({type(error).__name__}); give credentials that "
            f"may use {self.url}: {CREDENTIALS_HINT.get(scheme_of(self.url), 'the store environment')} "
            "or --storage-options"
        )

    def not_found(self, what: str, rel: str, error: FileNotFoundError) -> OSError:
        """A missing bucket, or an object missing where one was written (lost in an outage), is
        a clear error; a missing object on a read stays a FileNotFoundError its caller words."""
        text = str(error).lower()
        if "specified bucket does not exist" in text or "nosuchbucket" in text:
            bucket = self.key("").split("/")[0]
            return RemoteStoreError(
                f"{self.where(rel)}: the bucket {bucket!r} does not exist (after a server restart its "
                "buckets may be gone); create it or check the URL, then re-run the same command"
            )
        if what in ("COPY", "PUT", "DELETE"):
            return RemoteStoreError(
                f"{self.where(rel)}: {what}: an object this run wrote is missing from the store (lost in "
                "an outage or removed meanwhile); re-run the same command to resume"
            )
        return FileNotFoundError(errno.ENOENT, f"{self.where(rel)}: no such object", self.where(rel))

    def get_bytes(self, rel: str) -> bytes:
        data: bytes = self.call("GET", rel, lambda: self.fs.cat_file(self.key(rel)))
        self.bytes += len(data)
        return data

    def get_file(self, rel: str, dest: Path) -> int:
        """Download one object to ``dest``; returns its size."""
        self.call("GET", rel, lambda: self.fs.get_file(self.key(rel), str(dest)))
        size = dest.stat().st_size
        self.bytes += size
        return size

    def put_file(self, src: Path, rel: str) -> None:
        self.call("PUT", rel, lambda: self.fs.put_file(str(src), self.key(rel)))
        self.bytes += src.stat().st_size

    def put_bytes(self, data: bytes, rel: str) -> None:
        self.call("PUT", rel, lambda: self.fs.pipe_file(self.key(rel), data))
        self.bytes += len(data)

    def copy(self, src_rel: str, dst_rel: str) -> None:
        """Server-side copy: no bytes through this machine."""
        self.call("COPY", dst_rel, lambda: self.fs.cp_file(self.key(src_rel), self.key(dst_rel)))

    def delete(self, rels: list[str]) -> None:
        if rels:
            self.call("DELETE", rels[0], lambda: self.fs.rm([self.key(r) for r in rels]))

    def exists(self, rel: str) -> bool:
        return bool(self.call("HEAD", rel, lambda: self.fs.exists(self.key(rel))))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (names relative to it) and its size; a fresh listing."""

        def listing() -> dict[str, Any]:
            self.fs.invalidate_cache()
            try:
                return self.fs.find(self.key(prefix), detail=True)
            except FileNotFoundError:
                return {}

        found = self.call("LIST", prefix, listing)
        base = self.key(prefix).rstrip("/") + "/"
        # ``find`` of a name that is an object returns that object: not something under the prefix.
        return {
            name[len(base) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if name.startswith(base)
        }
