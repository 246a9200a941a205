"""Loader kinds: a registry of name → factory (``register_loader_kind(LoaderKind(name, description,
factory))``). A factory gets a ``LoaderContext`` and returns a ``PreparedLoader`` that knows its dataset, the
files an epoch reads, the batch it hands over and what runs on the device after the copy; nothing else in
the bench depends on how a kind is built. Built in: ``raw``, one cached kind per registered format, the
paths of ``dlstore.Loader`` (``pinned``, ``resident``, ``jpeg-gpu``) and ``jpeg-cpu``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlstore.errors import DlstoreError
from dlstore.formats import FORMATS

if TYPE_CHECKING:
    from dlstore.bench.kinds.context import LoaderContext, PreparedLoader

__all__ = [
    "LOADER_KINDS",
    "LoaderContext",
    "LoaderKind",
    "PreparedLoader",
    "prepare_loader",
    "register_loader_kind",
]

RAW = "torchvision ImageFolder/dataset: per-file PIL decode + resize + transform"
PINNED = "ram cache, Loader(via='pinned'): gather thread → pinned ring → side-stream copy, no workers"
RESIDENT = "ram cache held in device memory, batches gathered there (Loader(via='resident'))"
JPEG_GPU = (
    "JPEG cache (variable size), Loader(via='decode'): batched nvJPEG decode + GPU crop, no workers"
    " (on a GPU the worker count is its CPU decoders beside nvJPEG)"
)
JPEG_CPU = "JPEG cache (variable size), CachedDataset in DataLoader workers: Pillow decode + v2 crop"


@dataclass(frozen=True)
class LoaderKind:
    name: str
    description: str
    factory: Callable[[LoaderContext], PreparedLoader]


LOADER_KINDS: dict[str, LoaderKind] = {}


def register_loader_kind(kind: LoaderKind) -> LoaderKind:
    LOADER_KINDS[kind.name] = kind
    return kind


def prepare_loader(name: str, ctx: LoaderContext) -> PreparedLoader:
    try:
        kind = LOADER_KINDS[name]
    except KeyError:
        raise DlstoreError(f"unknown loader kind {name!r}; choose from {', '.join(LOADER_KINDS)}") from None
    return kind.factory(ctx)


def imported_on_use(module: str, name: str, *args: str) -> Callable[[LoaderContext], PreparedLoader]:
    """A factory that imports its module only when a kind is built (the CLI's ``--help`` stays instant)."""

    def factory(ctx: LoaderContext) -> PreparedLoader:
        made = getattr(importlib.import_module(f"dlstore.bench.kinds.{module}"), name)
        return (made(*args) if args else made)(ctx)

    return factory


def __getattr__(name: str) -> Any:
    if name in ("LoaderContext", "PreparedLoader"):
        from dlstore.bench.kinds import context

        return getattr(context, name)
    raise AttributeError(f"module 'dlstore.bench.kinds' has no attribute {name!r}")


register_loader_kind(LoaderKind("raw", RAW, imported_on_use("raw_source", "raw_kind")))
for _fmt in FORMATS:
    register_loader_kind(
        LoaderKind(
            _fmt,
            f"dlstore {_fmt} cache through CachedDataset (batched reads)",
            imported_on_use("cached", "cached_kind", _fmt),
        )
    )
register_loader_kind(LoaderKind("pinned", PINNED, imported_on_use("fast", "pinned_kind")))
register_loader_kind(LoaderKind("resident", RESIDENT, imported_on_use("fast", "resident_kind")))
register_loader_kind(LoaderKind("jpeg-gpu", JPEG_GPU, imported_on_use("jpeg", "jpeg_gpu_kind")))
register_loader_kind(LoaderKind("jpeg-cpu", JPEG_CPU, imported_on_use("jpeg", "jpeg_cpu_kind")))
