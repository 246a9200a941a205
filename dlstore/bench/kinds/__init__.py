"""Loader kinds: a registry of name → factory. A factory gets a ``LoaderContext`` and returns a
``PreparedLoader`` that knows its dataset, the files an epoch reads, the batch it hands over and what
runs on the device after the copy. Nothing else in the bench depends on how a kind is built, so a new
kind is one more entry here::

    from dlstore.bench.kinds import LoaderKind, register_loader_kind

    def resident(ctx: LoaderContext) -> PreparedLoader:
        ...
        return PreparedLoader(name="resident", ..., on_device=True, make_loader=my_iterable_factory)

    register_loader_kind(LoaderKind("resident", "whole cache on the GPU", resident))

Built-in kinds: ``raw`` (torchvision ImageFolder / dataset, per-file decode in DataLoader workers), one
cached kind per registered format (``ram``, ``npz``, ``zarr``) read through ``CachedDataset``, and the
fast paths ``pinned`` and ``resident``, and the JPEG cache's ``jpeg-gpu`` / ``jpeg-cpu``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dlstore.bench.kinds import cached, fast, jpeg, raw
from dlstore.bench.kinds.base import LoaderContext, PreparedLoader
from dlstore.errors import DlstoreError
from dlstore.formats import FORMATS

__all__ = [
    "LOADER_KINDS",
    "LoaderContext",
    "LoaderKind",
    "PreparedLoader",
    "prepare_loader",
    "register_loader_kind",
]


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


register_loader_kind(LoaderKind("raw", raw.DESCRIPTION, raw.raw_kind))
for _fmt in FORMATS:
    register_loader_kind(
        LoaderKind(
            _fmt, f"dlstore {_fmt} cache through CachedDataset (batched reads)", cached.cached_kind(_fmt)
        )
    )
register_loader_kind(LoaderKind("pinned", fast.PINNED, fast.pinned_kind))
register_loader_kind(LoaderKind("resident", fast.RESIDENT, fast.resident_kind))
register_loader_kind(LoaderKind("jpeg-gpu", jpeg.GPU, jpeg.jpeg_gpu_kind))
register_loader_kind(LoaderKind("jpeg-cpu", jpeg.CPU, jpeg.jpeg_cpu_kind))
