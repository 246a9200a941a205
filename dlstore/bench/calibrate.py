"""The bench's calibration, well under a second: the per-batch costs (``plan.Costs``) the plan is estimated
from: a few decodes, the step on synthetic batches, a cache-like collate, one worker pool's start."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dlstore.bench.kinds.context import LoaderContext
from dlstore.bench.plan import PLAN_FIELDS, Costs, Plan
from dlstore.bench.protocol import BenchConfig
from dlstore.machine import synchronize, usable_cores

# Kinds without worker processes, known before they are prepared (jpeg-gpu only without a GPU).
WORKERLESS_KINDS = frozenset({"pinned", "resident", "jpeg-gpu"})
RAW_OVERHEAD = 1.15  # the raw kind's ToTensor and float collate on top of the decode and resize
CACHE_READ_FACTOR = 3.0  # a cache batch: the read (a zstd decode for zarr) on top of the collate
JPEG_CACHE_DECODE = 0.5  # a JPEG cache holds images at the run's size: cheaper to decode than the source's
CONVERT_OVERHEAD = 1.3  # a conversion writes, checksums and verifies on top of decoding
DECODE_SAMPLE = 6  # images decoded to calibrate
STEP_MIN_S = 0.5  # the step is timed for at least this long (and at least 2 steps, at most 10)


def process_age_s() -> float:
    """Seconds since this process started, from /proc; 0 where there is none."""
    import os

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def command_startup_s() -> float:
    """What the ``dlstore`` command spent before the bench started; 0 inside another program."""
    import sys

    return process_age_s() if Path(sys.argv[0]).name in ("dlstore", "dlstore.exe") else 0.0


def decode_s(ctx: LoaderContext, n: int = DECODE_SAMPLE) -> float:
    """Seconds per image to decode, orient and resize to the run's size, as a conversion does."""
    from dlstore.spec import ImagePolicy

    policy = ImagePolicy(size=ctx.size, channels=ctx.channels)
    picks = list(range(0, len(ctx.source), max(1, len(ctx.source) // n)))[:n] or [0]
    t0 = time.perf_counter()
    for i in picks:
        with contextlib.suppress(Exception):  # a broken file costs its attempt too; the conversion skips it
            ctx.source.decode(i, policy)
    return (time.perf_counter() - t0) / len(picks)


def step_s(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> float:
    """Seconds per step alone on a synthetic batch after a warm-up step: the mean, as slow steps count too."""
    step(*batch)
    synchronize(device)
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < 2 or (time.perf_counter() - t0 < STEP_MIN_S and len(times) < 10):
        a = time.perf_counter()
        step(*batch)
        synchronize(device)
        times.append(time.perf_counter() - a)
    return sum(times) / len(times)


def collate_s(
    batch_size: int, shape: Sequence[int], transform: Callable[[torch.Tensor], torch.Tensor] | None
) -> float:
    """Seconds to collate one batch of uint8 samples (each through the cached kinds' CPU transform)."""
    samples = [torch.randint(0, 256, tuple(shape), dtype=torch.uint8) for _ in range(batch_size)]
    t0 = time.perf_counter()
    torch.stack([transform(x) if transform else x for x in samples])
    return time.perf_counter() - t0


def pool_s() -> float:
    """Starting a one-worker DataLoader, its first batch, and its shutdown."""
    from torch.utils.data import DataLoader, TensorDataset

    t0 = time.perf_counter()
    it = iter(DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1, num_workers=1))
    next(it)
    del it  # shuts the worker down
    return time.perf_counter() - t0


def cache_format(kind: str) -> str | None:
    """The cache format a kind builds (pinned and resident share the in-memory one); None: raw or JPEG."""
    from dlstore.formats import FORMATS, in_memory_format

    return kind if kind in FORMATS else in_memory_format() if kind in ("pinned", "resident") else None


def cache_ready(ctx: LoaderContext, kind: str) -> bool:
    """A matching cache of the kind's format is there (``ensure_cache`` reuses it); raw needs none."""
    from dlstore.bench.kinds.cached import cache_dir_for, spec_matches
    from dlstore.spec import read_spec

    fmt = cache_format(kind)
    if fmt is None:
        return kind == "raw"
    dest = cache_dir_for(ctx, fmt)
    if isinstance(dest, str):
        return True  # a remote cache given with --cache: read where it is
    try:
        return spec_matches(ctx, read_spec(dest), fmt)
    except Exception:  # noqa: BLE001 — missing or unreadable: ensure_cache converts
        return False


def batch_cost(kind: str, config: BenchConfig, per_image: float, cache_batch: float) -> float:
    assert config.batch_size is not None
    if kind == "raw":
        return RAW_OVERHEAD * config.batch_size * per_image
    if kind == "jpeg-cpu":
        return JPEG_CACHE_DECODE * config.batch_size * per_image
    return cache_batch


def step_looks(loaders: Sequence[str]) -> int:
    """Distinct batch looks the step is timed alone for: raw's float batches, the caches' uint8, JPEG's."""
    return len({"raw" if k == "raw" else "jpeg" if k.startswith("jpeg") else "cache" for k in loaders})


def measure_costs(
    ctx: LoaderContext,
    step: Callable[[torch.Tensor, torch.Tensor], None],
    batch: tuple[torch.Tensor, torch.Tensor],
    cache_transform: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Costs:
    """The costs of this run's kinds on this machine (``step``: the run's model, fed ``batch``)."""
    config = ctx.config
    assert config.batch_size is not None
    per_image = decode_s(ctx)
    cache_batch = CACHE_READ_FACTOR * collate_s(config.batch_size, tuple(batch[0].shape[1:]), cache_transform)
    cores = usable_cores()
    convert_workers = config.convert_workers or cores
    return Costs(
        step_s=step_s(step, batch, ctx.device),
        batch_s={k: batch_cost(k, config, per_image, cache_batch) for k in config.loaders},
        convert_s=convert_costs(ctx, CONVERT_OVERHEAD * per_image / convert_workers),
        pool_s=pool_s(),
        cores=cores,
        step_on_host=ctx.device.type == "cpu",
    )


def convert_costs(ctx: LoaderContext, per_image: float) -> dict[str, float]:
    """Per kind, seconds per image to build its cache: 0 when one is there or another kind builds the same."""
    out: dict[str, float] = {}
    building: set[str] = set()
    for kind in ctx.config.loaders:
        fmt = cache_format(kind) or kind
        out[kind] = 0.0 if fmt in building or cache_ready(ctx, kind) else per_image
        building.add(fmt)
    return out


def initial_plan(config: BenchConfig, workers: tuple[int, ...], images: int, cuda: bool = False) -> Plan:
    """``cuda``: jpeg-gpu's worker counts are its CPU decoders there (each one a run)."""
    assert config.batch_size is not None
    workerless = WORKERLESS_KINDS - {"jpeg-gpu"} if cuda else WORKERLESS_KINDS
    fields = {f: getattr(config, f) for f in PLAN_FIELDS} | {"loaders": tuple(config.loaders)}
    return Plan(
        **fields | {"workers": workers},
        images=images,
        batch_size=config.batch_size,
        workerless=frozenset(k for k in config.loaders if k in workerless),
        step_looks=step_looks(config.loaders),
    )
