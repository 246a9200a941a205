"""What every loader kind is built from and returns: ``LoaderContext`` in, ``PreparedLoader`` out, and the
DataLoader all built-in kinds share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from dlstore.bench.protocol import BenchConfig
from dlstore.read.dataset import CachedDataset
from dlstore.read.loader import Loader
from dlstore.read.order import keeps_state
from dlstore.write.sources import ArraySource, Source

NATIVE_SIZES = {"MNIST": 28, "FashionMNIST": 28, "CIFAR10": 32, "CIFAR100": 32}
DEFAULT_FOLDER_SIZE = 224  # what image folders are usually trained at
DEFAULT_DEMO_SIZE = 32  # keeps the default run within its time bound on 2 cores
META_FILES = {"dlstore.json", "sources.npz", "skipped.json"}

Log = Callable[[str], None]


@dataclass
class LoaderContext:
    """What a loader-kind factory may use."""

    config: BenchConfig
    source: Source
    size: int
    channels: int
    device: torch.device
    cache_root: Path
    log: Log = lambda msg: None


LoaderFactory = Callable[[Dataset, int, bool, BenchConfig], Iterable]


def dataloader_factory(dataset: Dataset, workers: int, pin_memory: bool, config: BenchConfig) -> DataLoader:
    """The DataLoader every built-in kind uses: shuffled, drop_last, persistent workers, prefetch."""
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs = {"persistent_workers": True, "prefetch_factor": config.prefetch_factor}
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        collate_fn=fields_collate(dataset),
        **kwargs,
    )


def fields_collate(dataset: Dataset) -> Callable[[Any], Any] | None:
    """A dataset of (image, target dict) samples: its own collate (masks stacked, boxes as lists)."""
    if getattr(getattr(dataset, "spec", None), "fields", None) or getattr(dataset, "fields", None):
        return dataset.collate_fn  # type: ignore[attr-defined, no-any-return]
    return None


@dataclass
class PreparedLoader:
    """A loader kind ready to measure. ``files``: what an epoch reads from storage; ``reads_per_epoch``
    False: the dataset loads everything once; ``device_transform`` runs inside the step; ``on_device``:
    batches arrive on the device (no copy stage)."""

    name: str
    description: str
    n_images: int
    files: list[Path]
    reads_per_epoch: bool
    batch_dtype: torch.dtype
    sample_shape: tuple[int, int, int]
    new_dataset: Callable[[], Dataset]
    device_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    on_device: bool = False
    fresh_for_cold: bool = True  # cold runs build a new dataset (no state left from warm runs)
    make_loader: LoaderFactory = dataloader_factory
    info: dict[str, Any] = field(default_factory=dict)
    _dataset: Dataset | None = None

    @property
    def dataset(self) -> Dataset:
        if self._dataset is None:
            self._dataset = self.new_dataset()
        return self._dataset

    def loader(self, workers: int, pin_memory: bool, config: BenchConfig, fresh: bool = False) -> Iterable:
        dataset = self.new_dataset() if fresh else self.dataset
        return self.make_loader(dataset, workers, pin_memory, config)

    def release(self) -> None:
        """Close the dataset's storage handles (memmaps pin pages against eviction); next use re-opens."""
        ds, self._dataset = self._dataset, None
        if isinstance(ds, CachedDataset):  # other datasets (torchvision's) hold no handles to close
            ds.close()
        del ds
        import gc

        gc.collect()

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def loader_settings(loader: Iterable) -> dict[str, Any]:
    """What the loader object that ran was set to, read back from it (not from what was asked)."""
    out: dict[str, Any] = {"type": type(loader).__name__, "keeps_state": keeps_state(loader)}
    if isinstance(loader, DataLoader):
        out.update(dataloader_settings(loader))
    elif isinstance(loader, Loader):
        out.update(loader.settings())
        out["sampler"] = type(loader.sampler).__name__
        out["shuffle"] = isinstance(loader.sampler, RandomSampler)
    return out


def dataloader_settings(loader: DataLoader) -> dict[str, Any]:
    sampler = loader.sampler
    return {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
        # DataLoader ignores it without workers
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "sampler": type(sampler).__name__,
        "shuffle": isinstance(sampler, RandomSampler),
    }


def describe_transform(transform: Any) -> dict[str, Any] | None:
    """The transform as it ran: its repr (with every parameter) and the horizontal-flip probability."""
    if transform is None:
        return None
    return {"repr": " ".join(repr(transform).split()), "hflip_p": hflip_probability(transform)}


def hflip_probability(transform: Any) -> float | None:
    if hasattr(transform, "hflip_p"):  # GpuAugment
        return float(transform.hflip_p)
    if "HorizontalFlip" in type(transform).__name__:
        return float(getattr(transform, "p", 0.5))
    for t in getattr(transform, "transforms", ()):  # Compose
        p = hflip_probability(t)
        if p is not None:
            return p
    return None


def convert_command(ctx: LoaderContext, fmt: str) -> str:
    """The ``dlstore convert`` a user runs once to get this kind's cache."""
    src = source_arguments(ctx.config.source, ctx.config.root, ctx.config.label)
    mp, pixels = ctx.config.max_megapixels, ctx.config.pixels
    return (
        f"dlstore convert {src} DEST --format {fmt} --size {ctx.size}"
        + "".join(f" --field {f}" for f in ctx.config.fields)
        + (f" --max-megapixels {mp:g}" if mp is not None else "")
        + (f" --pixels {pixels}" if pixels != "dlstore" else "")
    )


def source_arguments(source: str, root: Path | None, label: str | None) -> str:
    """SOURCE as the user gave it, with the --root and --label it came with."""
    return source + (f" --root {root}" if root is not None else "") + (f" --label {label}" if label else "")


def cache_files(path: Path) -> list[Path]:
    """The files of a local cache an epoch reads (its metadata left out)."""
    return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name not in META_FILES)


def source_channels(source: Source) -> int:
    if isinstance(source, ArraySource):
        return 1 if source.data.ndim == 3 else 3
    return 3


def default_size(source: Source) -> int:
    if source.kind == "demo":
        return DEFAULT_DEMO_SIZE
    return NATIVE_SIZES.get(source.kind.removeprefix("torchvision:"), DEFAULT_FOLDER_SIZE)
