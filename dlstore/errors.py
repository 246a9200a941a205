"""Errors raised by dlstore. Each subclasses the built-in a caller would catch anyway."""

from __future__ import annotations


class DlstoreError(Exception):
    """Base of every error dlstore raises on purpose; the CLI turns these into exit code 1."""


class CacheNotFoundError(DlstoreError, FileNotFoundError):
    """The path holds no complete dlstore cache."""


class CacheExistsError(DlstoreError, FileExistsError):
    """The destination exists and overwriting was not asked for."""


class CacheCorruptError(DlstoreError, OSError):
    """A cache file is missing, truncated or does not match its checksum or the manifest."""


class SpecError(DlstoreError, ValueError):
    """A manifest is malformed, of an unknown version, or disagrees with the data."""


class SourceError(DlstoreError, ValueError):
    """The source dataset cannot be used (missing, empty, unreadable)."""


class ImageDecodeError(DlstoreError, ValueError):
    """One image could not be decoded; names the file."""


class ConvertError(DlstoreError, RuntimeError):
    """A conversion failed as a whole (too many bad files, interrupted, disk full)."""


class ConvertInterrupted(ConvertError):
    """Ctrl-C: the message says how far the conversion got; the command exits with the shell's 130."""

    exit_code = 130


class SampleReadError(DlstoreError, RuntimeError):
    """Reading one sample failed; names the cache file and the dataset index."""


class StaleCacheError(DlstoreError, RuntimeError):
    """The source files changed since the cache was built (raised instead of a warning with ``strict``)."""


class StaleCacheWarning(UserWarning):
    """The source files changed since the cache was built; names the first changed path."""


class CacheTooLargeError(DlstoreError, MemoryError):
    """Loading the cache into memory would exceed the memory available to this process (cgroup included)."""


class SharedMemoryError(DlstoreError, RuntimeError):
    """/dev/shm is too small for the batches DataLoader workers hand to the main process."""


class CacheReplacedError(DlstoreError, RuntimeError):
    """The cache was rebuilt or removed while it was open; reopen it to read the new generation."""


class UnsupportedStoreError(DlstoreError, ValueError):
    """A cache path names a store this dlstore cannot use (a URL such as s3://)."""


class MissingExtraError(DlstoreError, ImportError):
    """A feature needs an optional dependency; names the extra to install (``pip install 'dlstore[X]'``)."""


def require_extra(module: str, extra: str, feature: str) -> None:
    """Raise MissingExtraError naming ``extra`` when ``module`` cannot be imported."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{feature} needs the {module!r} package: pip install 'dlstore[{extra}]'")
