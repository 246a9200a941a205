"""One kind per registered format: the source converted once into a cache, read through ``CachedDataset``
in batches by a torch DataLoader."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from dlstore.bench.kinds.context import LoaderContext, PreparedLoader, cache_files, convert_command
from dlstore.bench.transforms import cached_cpu_transform, device_transform
from dlstore.spec import SKIPPED_FILE


def cache_dir_for(ctx: LoaderContext, fmt: str) -> Path | str:
    """Reuse a cache given with --cache when it is a cache of this format, else one keyed by the spec.
    A URL (a remote cache) is read where it is, through its local read-through cache."""
    given = ctx.config.cache
    if isinstance(given, str):
        from dlstore.storage.mirror import spec_at

        if spec_at(given).format == fmt:
            return given
        given = None
    if given is not None and (Path(given) / "dlstore.json").is_file():
        from dlstore.spec import read_spec

        if read_spec(Path(given)).format == fmt:
            return Path(given)
    key = hashlib.sha256(
        f"{ctx.source.fingerprint()}|{fmt}|{ctx.size}|{ctx.channels}|crop{megapixels_key(ctx)}".encode()
    ).hexdigest()
    base = (
        Path(given) if given is not None and not (Path(given) / "dlstore.json").is_file() else ctx.cache_root
    )
    return base / f"{fmt}-s{ctx.size}-c{ctx.channels}-{key[:12]}"


def ensure_cache(ctx: LoaderContext, fmt: str) -> tuple[Path | str, dict[str, Any]]:
    """Convert the source into a cache unless a matching one is there; return its path and what happened."""
    from dlstore.errors import CacheNotFoundError, SpecError
    from dlstore.spec import read_spec

    dest = cache_dir_for(ctx, fmt)
    if isinstance(dest, str):
        return dest, {"cache": dest, "reused": True, "remote": True}
    try:
        if spec_matches(ctx, read_spec(dest), fmt) or dest == ctx.config.cache:
            return dest, {"cache": str(dest), "reused": True, **skipped_info(dest)}
    except (CacheNotFoundError, SpecError, FileNotFoundError, OSError):
        pass
    ctx.log(f"converting {ctx.source.description} → {fmt} cache at {dest} ({ctx.size}px)")
    return dest, convert_into(ctx, dest, format=fmt)


def spec_matches(ctx: LoaderContext, spec: Any, fmt: str) -> bool:
    """A cache of this format, source, shape and pixel policy: the one this run would build."""
    return (
        spec.format == fmt
        and spec.source.get("fingerprint") == ctx.source.fingerprint()
        and tuple(spec.shape) == (ctx.size, ctx.size, ctx.channels)
        and spec.image.pixels == ctx.config.pixels
    )


def megapixels_key(ctx: LoaderContext) -> str:
    """Another decompression-bomb limit or pixel policy may give other images: a key of its own (empty for
    the defaults, so caches built before stay found)."""
    mp, pixels = ctx.config.max_megapixels, ctx.config.pixels
    return ("" if mp is None else f"|mp{mp:g}") + ("" if pixels == "dlstore" else f"|px{pixels}")


def convert_into(ctx: LoaderContext, dest: Path, **choices: Any) -> dict[str, Any]:
    """Convert the run's source into ``dest`` with ``choices`` (ConvertOptions fields); what happened."""
    from dlstore.write.conversion import convert
    from dlstore.write.options import ConvertOptions

    dest.parent.mkdir(parents=True, exist_ok=True)
    options = ConvertOptions(
        size=ctx.size,
        channels=ctx.channels,
        overwrite=dest.exists(),
        workers=ctx.config.convert_workers,
        max_megapixels=ctx.config.max_megapixels,
        pixels=ctx.config.pixels,
        **choices,
    )
    result = convert(ctx.source, dest, options)
    return {
        "cache": str(dest),
        "reused": False,
        "convert_s": result.seconds,
        "convert_img_per_s": result.images_per_s,
        "convert_workers": result.workers,
        "convert_workers_reason": result.workers_reason,
        **skipped_info(dest),
    }


def skipped_info(dest: Path) -> dict[str, Any]:
    """How many source files the conversion skipped (unreadable or undecodable) and where they are named."""
    try:
        n = len(json.loads((dest / SKIPPED_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return {}
    return {"skipped": n, "skipped_list": str(dest / SKIPPED_FILE)} if n else {}


def cached_kind(fmt: str) -> Callable[[LoaderContext], PreparedLoader]:
    def factory(ctx: LoaderContext) -> PreparedLoader:
        from dlstore.formats import get_format
        from dlstore.read.dataset import CachedDataset
        from dlstore.storage.mirror import spec_at

        path, info = ensure_cache(ctx, fmt)
        spec = spec_at(path)
        h, w, c = spec.shape
        tf_name = ctx.config.transform
        in_memory = get_format(fmt).traits.loads_into_ram
        cpu_tf = cached_cpu_transform(tf_name, ctx.size, any(f.kind == "boxes" for f in spec.fields.values()))

        def new_dataset() -> Dataset:
            return CachedDataset(path, transform=cpu_tf, in_memory=in_memory)

        # A remote cache's files are fetched into its local mirror as read: no page-cache eviction.
        files = cache_files(path) if isinstance(path, Path) else []
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
            info={
                **info,
                "shape": list(spec.shape),
                "loads_once": in_memory,
                **({"fields": list(spec.fields)} if spec.fields else {}),
                "apply": f"{convert_command(ctx, fmt)}, then CachedDataset(DEST"
                + (", in_memory=True)" if in_memory else ")"),
            },
        )

    return factory
