"""Where images come from: one module per kind of SOURCE, each a ``Source`` class (``source.py``)
that declares which arguments it reads (``claims``); ``open_source`` asks the kinds in turn
(``registry.py``)."""

from __future__ import annotations

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
from dlstore.write.sources.folder import FolderSource, scan_folder
from dlstore.write.sources.registry import SourceArgs, local_root, open_source
from dlstore.write.sources.source import ArraySource, Source
from dlstore.write.sources.torch_dataset import DatasetSource
from dlstore.write.sources.torchvision import load_torchvision

__all__ = [
    "ArraySource",
    "DatasetSource",
    "FolderSource",
    "Source",
    "SourceArgs",
    "load_torchvision",
    "local_root",
    "open_source",
    "scan_folder",
]
