"""Where images come from. One module per kind of SOURCE, each a ``Source`` class that declares which
arguments it reads (``claims``); ``open_source`` asks the registered kinds in turn
(``registry.py``). ``source.py`` holds the interface every kind implements:

- ``names[i]``, ``labels[i]``, ``classes``, ``stats`` (size, mtime_ns per sample, when files);
- ``decode(i, policy)`` → the pre-resized pixels (``imageops``), or ImageDecodeError naming sample i;
- ``digest(i)`` / ``decode_and_digest`` for ``verify --deep``; ``entries()`` / ``fingerprint()`` for
  make-like re-runs; ``subset(indices)`` for the bench's samples.
"""

from __future__ import annotations

from dlstore.sourcefiles import IMAGE_EXTENSIONS
from dlstore.write.sources import (  # noqa: F401 - each registers its kind
    coco,
    demo_source,
    filelist,
    folder,
    multilabel,
    parquet,
    segmentation,
    torch_dataset,
    torchvision,
    webdataset,
)
from dlstore.write.sources.demo_source import DemoSource
from dlstore.write.sources.folder import FolderSource, scan_folder
from dlstore.write.sources.registry import (
    SourceArgs,
    kind_for,
    local_root,
    open_source,
    register_source,
    source_kinds,
)
from dlstore.write.sources.source import ArraySource, Source
from dlstore.write.sources.torch_dataset import DatasetSource
from dlstore.write.sources.torchvision import TORCHVISION_SETS, TorchvisionSource, load_torchvision

__all__ = [
    "IMAGE_EXTENSIONS",
    "TORCHVISION_SETS",
    "ArraySource",
    "DatasetSource",
    "DemoSource",
    "FolderSource",
    "Source",
    "SourceArgs",
    "TorchvisionSource",
    "kind_for",
    "load_torchvision",
    "local_root",
    "open_source",
    "register_source",
    "scan_folder",
    "source_kinds",
]
