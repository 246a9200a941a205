"""Kinds for ``dlstore.Loader``'s raw-cache paths over a ram cache: ``pinned`` (a gather thread into pinned
buffers, a side-stream copy) and ``resident`` (the whole cache in device memory). Neither has worker
processes; both run the device transform (an ``augment`` asked for runs as GpuAugment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlstore.bench.kinds.cached import ensure_cache
from dlstore.bench.kinds.context import LoaderContext, PreparedLoader, cache_files, convert_command
from dlstore.bench.protocol import AUGMENT_DEGREES, AUGMENT_SCALE
from dlstore.bench.transforms import device_transform


def loader_kind(ctx: LoaderContext, via: str, description: str) -> PreparedLoader:
    """The kind of ``dlstore.Loader(..., via=via)`` over the run's ram cache."""
    from dlstore.formats import in_memory_format
    from dlstore.read.dataset import CachedDataset
    from dlstore.read.loader import Loader
    from dlstore.spec import read_spec

    path, info = ensure_cache(ctx, in_memory_format())
    spec = read_spec(path)
    h, w, c = spec.shape
    tf = "gpu-augment" if ctx.config.transform == "augment" else ctx.config.transform
    extra: dict[str, Any] = {}
    if tf != ctx.config.transform:  # no worker processes to run a CPU augmentation in: it runs on the device
        extra["substituted"] = (
            f"ran GpuAugment on the device in place of the CPU augmentation asked for "
            f"(--transform {ctx.config.transform}): {via} has no workers to run it"
        )
    order = ", order='random'" if via == "pinned" else ""
    code = (
        f"import dlstore; loader = dlstore.Loader(DEST, {ctx.config.batch_size}, "
        f"device='{ctx.device.type}', via='{via}'{order})"
    )
    if tf == "gpu-augment":
        moved = "x, y = aug(x, target=y)" if ctx.source.fields else "x = aug(x)"  # masks, boxes move too
        code += (
            f"; from dlstore.gpu import GpuAugment; aug = GpuAugment({ctx.size}, scale={AUGMENT_SCALE}, "
            f"degrees={AUGMENT_DEGREES}).to('{ctx.device.type}'); for x, y in loader: {moved}"
        )
    return PreparedLoader(
        via,
        description,
        spec.n,
        cache_files(Path(path)),
        False,
        torch.uint8,
        (c, h, w),
        lambda: CachedDataset(path, in_memory=True),
        device_transform(tf, ctx.size, ctx.device),
        on_device=True,
        # resident_budget: as much of the free memory as the bench's own runs may take
        make_loader=lambda ds, workers, pin, cfg: Loader(
            ds.cache, cfg.batch_size, device=ctx.device, via=via, order="random", resident_budget=0.8
        ),
        info={
            **info,
            "shape": list(spec.shape),
            "loads_once": True,
            "ignores_workers": True,
            "apply": f"{convert_command(ctx, in_memory_format())}, then {code}",
            **extra,
        },
    )


def pinned_kind(ctx: LoaderContext) -> PreparedLoader:
    return loader_kind(ctx, "pinned", "Loader(ram, in memory, via='pinned')")


def resident_kind(ctx: LoaderContext) -> PreparedLoader:
    return loader_kind(ctx, "resident", f"Loader(ram, on {ctx.device}, via='resident')")
