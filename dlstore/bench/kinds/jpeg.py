"""Kinds for the JPEG cache (``--codec jpeg --resize shorter``: per-image JPEGs of variable size).

``jpeg-gpu``: ``dlstore.Loader``'s decode path (batched nvJPEG, a ragged crop on the device); on a GPU the
run's worker count is its CPU decode processes beside nvJPEG (``cpu_decoders``), without one it decodes on
the CPU in threads. ``jpeg-cpu``: ``CachedDataset`` in DataLoader workers, Pillow decode + v2 crop.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from dlstore.bench.kinds import JPEG_CPU, JPEG_GPU
from dlstore.bench.kinds.cached import convert_into, megapixels_key
from dlstore.bench.kinds.context import LoaderContext, PreparedLoader, cache_files
from dlstore.bench.protocol import AUGMENT_SCALE
from dlstore.bench.transforms import augment_steps, device_transform

QUALITY = 90


def ensure_jpeg_cache(ctx: LoaderContext) -> tuple[Path, dict[str, Any]]:
    """Convert the source once into a JPEG cache (shorter side = the run's size), keyed by the spec."""
    from dlstore.errors import CacheNotFoundError, DlstoreError, SpecError
    from dlstore.formats import compressed_gpu_format
    from dlstore.spec import read_spec

    found = compressed_gpu_format()
    if found is None:
        raise DlstoreError("no registered cache format takes the jpeg codec")
    fmt, codec = found
    key = hashlib.sha256(
        f"{ctx.source.fingerprint()}|{fmt}|{ctx.size}|{ctx.channels}|shorter|{codec}{QUALITY}"
        f"{megapixels_key(ctx)}".encode()
    ).hexdigest()
    dest = ctx.cache_root / f"jpeg-{fmt}-s{ctx.size}-c{ctx.channels}-{key[:12]}"
    try:
        read_spec(dest)
        return dest, {"cache": str(dest), "reused": True}
    except (CacheNotFoundError, SpecError, FileNotFoundError, OSError):
        pass
    ctx.log(
        f"converting {ctx.source.description} → JPEG q{QUALITY} {fmt} cache at {dest} (shorter {ctx.size}px)"
    )
    info = convert_into(
        ctx, dest, format=fmt, resize="shorter", codec=codec, writer_options={"quality": QUALITY}
    )
    return dest, info


def gpu_crop(transform: str, size: int, device: torch.device) -> torch.nn.Module:
    from dlstore.gpu.ragged import RaggedCenterCrop, RaggedRandomResizedCrop

    if transform == "light":
        return RaggedCenterCrop(size, crop_fraction=1.0).to(device)
    return RaggedRandomResizedCrop(size, scale=AUGMENT_SCALE).to(device)


def jpeg_gpu_kind(ctx: LoaderContext) -> PreparedLoader:
    from dlstore.read.dataset import CachedDataset
    from dlstore.read.loader import Loader

    path, info = ensure_jpeg_cache(ctx)
    crop = gpu_crop(ctx.config.transform, ctx.size, ctx.device)
    c = ctx.channels
    # On a GPU the worker count is the CPU decode processes beside nvJPEG (``cpu_decoders``), so the sweep
    # measures the lanes for this model; without one the loader decodes on the CPU in threads.
    decoders = ctx.device.type == "cuda"

    def make(ds: Any, workers: int, pin: bool, cfg: Any) -> Loader:
        from dlstore.bench.advice import decode_lanes

        n = workers if decoders else 0
        return Loader(
            ds.cache,
            cfg.batch_size,
            device=ctx.device,
            via="decode",
            transform=crop,
            cpu_decoders=n,
            lanes=decode_lanes(n),
        )

    return PreparedLoader(
        "jpeg-gpu",
        JPEG_GPU,
        CachedDataset(path, check_source=False).spec.n,
        cache_files(path),
        True,
        torch.float32,
        (c, ctx.size, ctx.size),
        lambda: CachedDataset(path, check_source=False),
        None,  # the loader's crop already made float batches on the device
        on_device=True,
        make_loader=make,
        info={**info, "quality": QUALITY, "resize": "shorter"}
        | ({"workers_are": "cpu_decoders"} if decoders else {"ignores_workers": True}),
    )


def cpu_transform(transform: str, size: int) -> Any:
    """Per-sample v2 transforms that make variable-size uint8 CHW tensors one size (what users write)."""
    from torchvision.transforms import v2

    if transform == "augment":
        return v2.Compose(augment_steps(v2, size, antialias=True))
    return v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])


def jpeg_cpu_kind(ctx: LoaderContext) -> PreparedLoader:
    from dlstore.read.dataset import CachedDataset

    path, info = ensure_jpeg_cache(ctx)
    tf_name = ctx.config.transform
    cpu_tf = cpu_transform(tf_name, ctx.size)

    def new_dataset() -> Dataset:
        return CachedDataset(path, transform=cpu_tf, check_source=False)

    return PreparedLoader(
        "jpeg-cpu",
        JPEG_CPU,
        CachedDataset(path, check_source=False).spec.n,
        cache_files(path),
        True,
        torch.uint8,
        (ctx.channels, ctx.size, ctx.size),
        new_dataset,
        device_transform("light" if tf_name == "augment" else tf_name, ctx.size, ctx.device),
        info={**info, "quality": QUALITY, "resize": "shorter"},
    )
