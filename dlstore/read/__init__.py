"""Reading a cache: ``open_cache`` (batched reads), ``CachedDataset`` (the torch Dataset), the samplers
``ChunkSampler`` / ``EpochSampler``, and ``Loader``, the fast loader. Names load lazily (no torch import).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Cache": "dlstore.read.cache",
    "Remote": "dlstore.read.cache",
    "open_cache": "dlstore.read.cache",
    "CachedDataset": "dlstore.read.dataset",
    "ChunkSampler": "dlstore.read.sampler",
    "EpochSampler": "dlstore.read.order",
    "Loader": "dlstore.read.loader",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore.read' has no attribute {name!r}")
