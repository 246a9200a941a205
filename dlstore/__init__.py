"""dlstore: find and remove the input bottleneck of PyTorch image training.

``from dlstore import CachedDataset, convert, open_cache, verify``; the loaders and sampler from
``dlstore.read``, GPU augmentation from ``dlstore.gpu``. Names load lazily so that importing
dlstore (and ``dlstore --help``) does not import torch.
"""

from __future__ import annotations

from typing import Any

from dlstore._version import __version__
from dlstore.errors import DlstoreError

__all__ = [
    "CachedDataset",
    "DlstoreError",
    "__version__",
    "convert",
    "open_cache",
    "verify",
]

_LAZY = {
    "CachedDataset": "dlstore.read.dataset",
    "convert": "dlstore.build.conversion",
    "open_cache": "dlstore.read.cache",
    "verify": "dlstore.build.verification",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlstore' has no attribute {name!r}")
