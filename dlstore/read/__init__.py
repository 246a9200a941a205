"""Reading a cache: ``open_cache`` (batched reads), ``CachedDataset``, ``ChunkSampler``, the fast
loaders ``PinnedLoader`` / ``ResidentLoader`` and ``DecodeLoader`` (JPEG / ragged caches, decoded on the GPU).

>>> from dlstore.read import CachedDataset, PinnedLoader, ChunkSampler   # doctest: +SKIP

Names load lazily so that importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Cache": "dlstore.read.cache",
    "open_cache": "dlstore.read.cache",
    "CachedDataset": "dlstore.read.dataset",
    "ChunkSampler": "dlstore.read.sampler",
    "EpochSampler": "dlstore.read.order",
    "PinnedLoader": "dlstore.read.loaders",
    "ResidentLoader": "dlstore.read.loaders",
    "DecodeLoader": "dlstore.read.gpu_decode",
    "LoaderCore": "dlstore.read.loader_core",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore.read' has no attribute {name!r}")
