"""zstd chunk decoding with one reusable decompression context per thread.

numcodecs' ``Zstd.decode`` creates and frees a ~96 KB context per call; with many threads decoding,
glibc's arena trimming (``madvise``) then interrupts every other thread. Here each thread keeps one
``ZSTD_DCtx`` and calls ``ZSTD_decompressDCtx`` through ctypes (GIL released) into the caller's buffer,
with numcodecs' bundled zstd or a system ``libzstd`` (neither: ``direct_zstd_decoder`` returns None).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

import numpy as np


class _Context:
    """A thread's ZSTD_DCtx, freed when the thread (and so its thread-local slot) goes away."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.ptr = lib, lib.ZSTD_createDCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createDCtx failed")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeDCtx(self.ptr)
            self.ptr = None


class DirectZstd:
    """``decode(raw, out=array)``: numcodecs' ``Zstd().decode`` with its ``out``."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._local = threading.local()

    def context(self) -> int:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = _Context(self.lib)
        return int(ctx.ptr)

    def decode(self, raw: Any, out: np.ndarray) -> np.ndarray:
        """Into ``out``, which the frame must fill exactly (its size: what the caller's index allows)."""
        src = np.frombuffer(raw, dtype=np.uint8)
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("DirectZstd.decode needs a writable C-contiguous out array")
        n = self.lib.ZSTD_decompressDCtx(
            self.context(), out.ctypes.data, out.nbytes, src.ctypes.data, src.nbytes
        )
        if n > _ERROR_LIMIT:  # ZSTD_isError without a second foreign call (each one drops the GIL)
            raise RuntimeError(f"zstd: {self.lib.ZSTD_getErrorName(n).decode(errors='replace')}")
        if n != out.nbytes:
            raise ValueError(f"zstd: decoded {n} bytes, expected {out.nbytes}")
        return out


_ERROR_LIMIT = (1 << 64) - 120  # ERROR(maxCode) in zstd's error_private.h: larger return values are errors
_LOCK = threading.Lock()
_CACHED: list[DirectZstd | None] = []


def direct_zstd_decoder() -> DirectZstd | None:
    """The process-wide direct decoder, or None when no zstd library with the needed symbols loads."""
    with _LOCK:
        if not _CACHED:
            _CACHED.append(_load())
        return _CACHED[0]


def _load() -> DirectZstd | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            _declare(lib)
        except (OSError, AttributeError):
            continue
        return DirectZstd(lib)
    return None


def _candidates() -> list[str]:
    paths = []
    try:
        import numcodecs.zstd

        paths.append(numcodecs.zstd.__file__)
    except ImportError:
        pass
    system = ctypes.util.find_library("zstd")
    if system:
        paths.append(system)
    return [p for p in paths if p]


def _declare(lib: Any) -> None:
    lib.ZSTD_createDCtx.restype = ctypes.c_void_p
    lib.ZSTD_createDCtx.argtypes = []
    lib.ZSTD_freeDCtx.restype = ctypes.c_size_t
    lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
    lib.ZSTD_decompressDCtx.restype = ctypes.c_size_t
    lib.ZSTD_decompressDCtx.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    lib.ZSTD_getErrorName.restype = ctypes.c_char_p
    lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
