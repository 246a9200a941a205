"""Kinds for dlstore's fast paths, so users see them next to raw files and DataLoader caches.

``pinned``: ``PinnedLoader`` over a ram cache: no worker processes, a gather thread into pinned buffers
and a side-stream copy; batches arrive on the device. ``resident``: the whole cache in device memory
(``ResidentLoader``). Both ignore the worker count (they use none) and apply the run's device transform
(``light`` → float, ``gpu-augment``/``augment`` → GpuAugment on the device).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlstore.bench.kinds.base import META_FILES, LoaderContext, PreparedLoader, convert_command
from dlstore.bench.kinds.cached import ensure_cache
from dlstore.bench.protocol import AUGMENT_DEGREES, AUGMENT_SCALE
from dlstore.bench.transforms import device_transform


def _fast_kind(ctx: LoaderContext, name: str, description: str, make: Any, code: str) -> PreparedLoader:
    from dlstore.formats import in_memory_format
    from dlstore.read.dataset import CachedDataset
    from dlstore.spec import read_spec

    path, info = ensure_cache(ctx, in_memory_format())
    spec = read_spec(path)
    h, w, c = spec.shape
    tf = "gpu-augment" if ctx.config.transform == "augment" else ctx.config.transform
    extra: dict[str, Any] = {}
    if tf != ctx.config.transform:  # no worker processes to run a CPU augmentation in: it runs on the device
        extra["substituted"] = (
            f"ran GpuAugment on the device in place of the CPU augmentation asked for "
            f"(--transform {ctx.config.transform}): {name} has no workers to run it"
        )
    if tf == "gpu-augment":
        moved = "x, y = aug(x, target=y)" if ctx.source.fields else "x = aug(x)"  # masks, boxes move too
        code += (
            f"; from dlstore.gpu import GpuAugment; aug = GpuAugment({ctx.size}, scale={AUGMENT_SCALE}, "
            f"degrees={AUGMENT_DEGREES}).to('{ctx.device.type}'); for x, y in loader: {moved}"
        )
    files = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name not in META_FILES)
    return PreparedLoader(
        name,
        description,
        spec.n,
        files,
        False,
        torch.uint8,
        (c, h, w),
        lambda: CachedDataset(path, in_memory=True),
        device_transform(tf, ctx.size, ctx.device),
        on_device=True,
        make_loader=lambda ds, workers, pin, cfg: make(ds.cache, cfg),
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
    from dlstore.read.loaders import PinnedLoader

    return _fast_kind(
        ctx,
        "pinned",
        "PinnedLoader(ram, in memory)",
        lambda cache, cfg: PinnedLoader(cache, cfg.batch_size, device=ctx.device, order="random"),
        f"from dlstore.read import PinnedLoader; loader = PinnedLoader(DEST, {ctx.config.batch_size}, "
        f"device='{ctx.device.type}', order='random')",
    )


def resident_kind(ctx: LoaderContext) -> PreparedLoader:
    from dlstore.read.loaders import ResidentLoader

    return _fast_kind(
        ctx,
        "resident",
        f"ResidentLoader(ram, on {ctx.device})",
        lambda cache, cfg: ResidentLoader(cache, cfg.batch_size, device=ctx.device),
        f"from dlstore.read import ResidentLoader; loader = ResidentLoader(DEST, {ctx.config.batch_size}, "
        f"device='{ctx.device.type}')",
    )
