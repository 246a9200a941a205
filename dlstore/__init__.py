"""dlstore: find and remove the input bottleneck of PyTorch image training.

``from dlstore import CachedDataset, Loader, convert, open_cache, verify``; the samplers from
``dlstore.read``, GPU augmentation from ``dlstore.gpu``. Names load lazily so that importing
dlstore (and ``dlstore --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from dlstore.errors import DlstoreError

__version__ = "0.1.0"  # pyproject.toml's version

__all__ = [
    "CachedDataset",
    "ConvertOptions",
    "DlstoreError",
    "Loader",
    "Remote",
    "__version__",
    "convert",
    "open_cache",
    "verify",
]

_LAZY = {
    "CachedDataset": "dlstore.read.dataset",
    "ConvertOptions": "dlstore.write.options",
    "Loader": "dlstore.read.loader",
    "Remote": "dlstore.read.cache",
    "convert": "dlstore.write.conversion",
    "open_cache": "dlstore.read.cache",
    "verify": "dlstore.write.verification",
    "watch": "dlstore.bench.watch",  # dlstore.watch(loader) / with dlstore.watch() as w
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore' has no attribute {name!r}")
