"""Loader kinds: a registry of name → factory. A factory gets a ``LoaderContext`` and returns a
``PreparedLoader`` that knows its dataset, the files an epoch reads, the batch it hands over and what
runs on the device after the copy. Nothing else in the bench depends on how a kind is built, so a new
kind (a pinned double-buffered loader, a GPU-resident one) is one more ``register_loader_kind``::

    from dlstore.bench.loaders import PreparedLoader, register_loader_kind

    @register_loader_kind("resident", "whole cache on the GPU, indexed per batch")
    def resident(ctx):
        ...
        return PreparedLoader(name="resident", ..., on_device=True, make_loader=my_iterable_factory)

Built-in kinds: ``raw`` (torchvision ImageFolder / torchvision dataset: per-file PIL decode + resize +
transform in DataLoader workers) and one cached kind per registered format (``ram``, ``npz``, ``zarr``),
converted once into a cache directory and read through ``CachedDataset`` in batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dlstore.bench.protocol import AUGMENT_DEGREES, AUGMENT_SCALE, BenchConfig
from dlstore.errors import DlstoreError
from dlstore.sources import ArraySource, FolderSource, Source

NATIVE_SIZES = {"MNIST": 28, "FashionMNIST": 28, "CIFAR10": 32, "CIFAR100": 32}
DEFAULT_FOLDER_SIZE = 224  # what image folders are usually trained at
DEFAULT_DEMO_SIZE = 32  # keeps the default run within its time bound on 2 cores
META_FILES = {"dlstore.json", "sources.json", "skipped.json"}

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
        **kwargs,
    )


@dataclass
class PreparedLoader:
    """A loader kind ready to measure.

    ``files``: what an epoch reads from storage (read stage, cold runs). ``reads_per_epoch``: False when
    the dataset loads everything once (then the read stage is a one-off load, not a per-epoch bound).
    ``batch_dtype``/``sample_shape``: what one sample looks like when it reaches the copy.
    ``device_transform``: runs on the device inside the training step (float conversion, GPU augment).
    ``on_device``: batches arrive already on the device (no host→device copy stage).
    """

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
        """Close the shared dataset's storage handles (memmaps hold pages against eviction); the next use
        re-creates it."""
        ds, self._dataset = self._dataset, None
        cache = getattr(ds, "_cache", None)
        if cache is not None and hasattr(cache, "close"):
            cache.close()
        del ds, cache
        import gc

        gc.collect()

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.files)


@dataclass(frozen=True)
class LoaderKind:
    name: str
    description: str
    factory: Callable[[LoaderContext], PreparedLoader]


LOADER_KINDS: dict[str, LoaderKind] = {}


def register_loader_kind(
    name: str, description: str = ""
) -> Callable[[Callable[[LoaderContext], PreparedLoader]], Callable[[LoaderContext], PreparedLoader]]:
    def wrap(factory: Callable[[LoaderContext], PreparedLoader]) -> Callable[[LoaderContext], PreparedLoader]:
        LOADER_KINDS[name] = LoaderKind(name, description, factory)
        return factory

    return wrap


def prepare_loader(name: str, ctx: LoaderContext) -> PreparedLoader:
    try:
        kind = LOADER_KINDS[name]
    except KeyError:
        raise DlstoreError(f"unknown loader kind {name!r}; choose from {', '.join(LOADER_KINDS)}") from None
    return kind.factory(ctx)


# --- transforms (module-level classes: picklable for spawn/forkserver workers) ----------------------


class ToFloat(torch.nn.Module):
    """uint8 → float32 in [0, 1], the ToTensor scaling, done on the device after the copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) / 255.0  # never in place: a float input may be a reused batch


def raw_transform(kind: str, size: int, native: int | None) -> Any:
    """torchvision transforms on PIL images, as users write them."""
    from torchvision import transforms as T

    fit = [] if native == size else [T.Resize(size), T.CenterCrop(size)]
    if kind == "light":
        return T.Compose([*fit, T.ToTensor()])
    if kind == "augment":
        return T.Compose(
            [
                T.RandomResizedCrop(size, scale=AUGMENT_SCALE),
                T.RandomRotation(AUGMENT_DEGREES),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
            ]
        )
    return T.Compose([*fit, T.PILToTensor()])  # gpu-augment: uint8 to the device


def cached_cpu_transform(kind: str, size: int) -> Any:
    """Per-sample CPU augmentation of uint8 CHW tensors (torchvision v2), for cached kinds."""
    if kind != "augment":
        return None
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.RandomResizedCrop(size, scale=AUGMENT_SCALE, antialias=True),
            v2.RandomRotation(AUGMENT_DEGREES),
            v2.RandomHorizontalFlip(),
        ]
    )


def device_transform(kind: str, size: int, device: torch.device) -> torch.nn.Module:
    if kind == "gpu-augment":
        from dlstore.gpu import GpuAugment

        return GpuAugment(size, scale=AUGMENT_SCALE, degrees=AUGMENT_DEGREES).to(device)
    return ToFloat()


# --- raw ----------------------------------------------------------------------------------------------


def source_channels(source: Source) -> int:
    if isinstance(source, ArraySource):
        return 1 if source.data.ndim == 3 else 3
    return 3


def default_size(source: Source) -> int:
    if source.kind == "demo":
        return DEFAULT_DEMO_SIZE
    return NATIVE_SIZES.get(source.kind.removeprefix("torchvision:"), DEFAULT_FOLDER_SIZE)


@register_loader_kind("raw", "torchvision ImageFolder/dataset: per-file PIL decode + resize + transform")
def raw_kind(ctx: LoaderContext) -> PreparedLoader:
    tf_name, size = ctx.config.transform, ctx.size
    dtype = torch.uint8 if tf_name == "gpu-augment" else torch.float32
    dev_tf = device_transform(tf_name, size, ctx.device) if tf_name == "gpu-augment" else None
    if isinstance(ctx.source, FolderSource):
        root = ctx.source.root
        files = [root / n for n in ctx.source.names]

        def new_dataset() -> Dataset:
            from torchvision.datasets import ImageFolder

            return ImageFolder(str(root), transform=raw_transform(tf_name, size, None))

        return PreparedLoader(
            "raw",
            f"torchvision ImageFolder({root}) + {tf_name}",
            len(ctx.source),
            files,
            True,
            dtype,
            (3, size, size),
            new_dataset,
            dev_tf,
            fresh_for_cold=False,
            info={"root": str(root)},
        )
    name = ctx.source.kind.removeprefix("torchvision:")
    root = ctx.config.root
    if root is None:
        raise DlstoreError(f"raw loader for {ctx.source.kind} needs --root")
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and _torchvision_file(name, p))

    def new_tv_dataset() -> Dataset:
        import torchvision.datasets as tvd

        return getattr(tvd, name)(
            str(root),
            train=True,
            download=False,
            transform=raw_transform(tf_name, size, NATIVE_SIZES.get(name)),
        )

    return PreparedLoader(
        "raw",
        f"torchvision.datasets.{name}({root}) + {tf_name}",
        len(ctx.source),
        files,
        False,
        dtype,
        (ctx.channels, size, size),
        new_tv_dataset,
        dev_tf,
        info={"root": str(root), "loads_once": True},
    )


def _torchvision_file(name: str, path: Path) -> bool:
    if name in ("MNIST", "FashionMNIST"):
        return (
            path.parent.name == "raw" and path.parent.parent.name == name and path.name.startswith("train-")
        )
    folder = "cifar-10-batches-py" if name == "CIFAR10" else "cifar-100-python"
    return path.parent.name == folder


# --- cached kinds ---------------------------------------------------------------------------------------


def cache_dir_for(ctx: LoaderContext, fmt: str) -> Path:
    """Reuse a cache given with --cache when it is a cache of this format, else one keyed by the spec."""
    given = ctx.config.cache
    if given is not None and (Path(given) / "dlstore.json").is_file():
        from dlstore.spec import read_spec

        if read_spec(Path(given)).format == fmt:
            return Path(given)
    key = hashlib.sha256(
        f"{ctx.source.fingerprint()}|{fmt}|{ctx.size}|{ctx.channels}|crop".encode()
    ).hexdigest()
    base = (
        Path(given) if given is not None and not (Path(given) / "dlstore.json").is_file() else ctx.cache_root
    )
    return base / f"{fmt}-s{ctx.size}-c{ctx.channels}-{key[:12]}"


def ensure_cache(ctx: LoaderContext, fmt: str) -> tuple[Path, dict[str, Any]]:
    """Convert the source into a cache unless a matching one is there; return its path and what happened."""
    from dlstore.conversion import convert
    from dlstore.errors import CacheNotFoundError, SpecError
    from dlstore.spec import read_spec

    dest = cache_dir_for(ctx, fmt)
    try:
        spec = read_spec(dest)
        matches = (
            spec.format == fmt
            and spec.source.get("fingerprint") == ctx.source.fingerprint()
            and tuple(spec.shape) == (ctx.size, ctx.size, ctx.channels)
        )
        if matches or dest == ctx.config.cache:
            return dest, {"cache": str(dest), "reused": True}
    except (CacheNotFoundError, SpecError, FileNotFoundError, OSError):
        pass
    ctx.log(f"converting {ctx.source.description} → {fmt} cache at {dest} ({ctx.size}px)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    result = convert(
        ctx.source,
        dest,
        format=fmt,
        size=ctx.size,
        channels=ctx.channels,
        overwrite=dest.exists(),
        workers=ctx.config.convert_workers,
    )
    return dest, {
        "cache": str(dest),
        "reused": False,
        "convert_s": result.seconds,
        "convert_img_per_s": result.images_per_s,
        "convert_workers": result.workers,
    }


def cached_kind(fmt: str) -> Callable[[LoaderContext], PreparedLoader]:
    def factory(ctx: LoaderContext) -> PreparedLoader:
        from dlstore.dataset import CachedDataset
        from dlstore.spec import read_spec

        path, info = ensure_cache(ctx, fmt)
        spec = read_spec(path)
        h, w, c = spec.shape
        tf_name = ctx.config.transform
        in_memory = fmt == "ram"
        cpu_tf = cached_cpu_transform(tf_name, ctx.size)

        def new_dataset() -> Dataset:
            return CachedDataset(path, transform=cpu_tf, in_memory=in_memory)

        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in META_FILES)
        side = ctx.size if tf_name != "light" else h
        return PreparedLoader(
            fmt,
            f"CachedDataset({fmt}{', in memory' if in_memory else ''}) + {tf_name}",
            spec.n,
            files,
            not in_memory,
            torch.uint8,
            (c, side, side) if cpu_tf else (c, h, w),
            new_dataset,
            device_transform(tf_name, ctx.size, ctx.device),
            info={**info, "shape": list(spec.shape), "loads_once": in_memory},
        )

    return factory


def _register_cached_kinds() -> None:
    from dlstore.formats import FORMATS

    for fmt in FORMATS:
        register_loader_kind(fmt, f"dlstore {fmt} cache through CachedDataset (batched reads)")(
            cached_kind(fmt)
        )


_register_cached_kinds()

from dlstore.bench import fastkinds  # noqa: E402,F401  (registers the pinned and resident kinds)
