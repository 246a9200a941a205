"""Where images come from: one module per kind of SOURCE, each a ``Source`` class (``source.py``)
that declares which arguments it reads (``claims``); ``open_source`` asks the kinds in turn
(``registry.py``)."""

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
from dlstore.write.sources.registry import SourceArgs, kind_for, local_root, open_source, register_source
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
]
