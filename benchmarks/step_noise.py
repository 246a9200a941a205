#!/usr/bin/env python3
"""How much a launch-bound training step's time moves between timing windows, and why (issue 12).

The bench predicts a loop's rate from parts measured alone in windows of ~10–30 batches. On the H200 the same
fed ResNet-18 @112 step measured 11.97 and 18.75 ms per batch in two such windows a second apart (round B),
which bounds how close any prediction can be. This feeds the built-in step one device-resident batch (data
free, device kept busy: the fed probe's ``free`` loop) for ``--steps`` steps and records every step's host
time (the step call), device time (CUDA events) and the Python garbage collector's pauses (``gc.callbacks``),
with the collector on (as users run), frozen + disabled, and with a fresh batch gathered on the device each
step (the resident loader's allocation per batch), then the first variant again. Printed per variant: the per-step spread, the
spread of the means of consecutive windows of 8/16/32/64 steps (what a part measured in such a window can
be off by), the drift between the run's quarters, and the collector's share.

    python3 benchmarks/step_noise.py --out OUT --batches 128,512 --steps 300
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from dlstore.bench.models import TrainStep, build_model, resolve_step_options  # noqa: E402
from dlstore.bench.stages import synthetic_batch  # noqa: E402
from dlstore.bench.transforms import device_transform  # noqa: E402
from dlstore.machine import synchronize  # noqa: E402

WINDOWS = (8, 16, 32, 64)


class GcClock:
    """Seconds the collector ran, per step (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.total = 0.0
        self.count = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self.start
            self.count += 1


def run(
    step: TrainStep, batch: tuple[torch.Tensor, torch.Tensor], steps: int, frozen: bool, gather: bool = False
) -> dict[str, Any]:
    """``gather``: each step takes a fresh batch gathered on the device from a pool twice its size (as the
    resident loader does: a new allocation per batch) instead of the same tensors."""
    device = batch[0].device
    pool = (torch.cat([batch[0], batch[0]]), torch.cat([batch[1], batch[1]])) if gather else batch
    n = batch[0].shape[0]

    def take() -> tuple[torch.Tensor, torch.Tensor]:
        if not gather:
            return batch
        idx = torch.randperm(2 * n, device=device)[:n]
        return pool[0][idx], pool[1][idx]

    cuda = device.type == "cuda"
    for _ in range(5):
        step(*batch)
    synchronize(device)
    clock = GcClock()
    if frozen:
        gc.collect()
        gc.freeze()
        gc.disable()
    gc.callbacks.append(clock)
    starts, host, gcs, events = [], [], [], []
    try:
        for _ in range(steps):
            g0 = clock.total
            a = time.perf_counter()
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
                step(*take())
                ev[1].record()
                events.append(ev)
            else:
                step(*take())
            b = time.perf_counter()
            starts.append(a)
            host.append(b - a)
            gcs.append(clock.total - g0)
        synchronize(device)
        end = time.perf_counter()
    finally:
        gc.callbacks.remove(clock)
        if frozen:
            gc.enable()
            gc.unfreeze()
    device_s = [x.elapsed_time(y) / 1e3 for x, y in events] if cuda else host
    periods = [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]
    return summarise(periods, host, device_s, gcs, clock.count)


def window_means(values: list[float], w: int) -> list[float]:
    return [statistics.fmean(values[i : i + w]) for i in range(0, len(values) - w + 1, w)]


def spread(values: list[float]) -> dict[str, float]:
    m = statistics.fmean(values)
    return {
        "mean_ms": 1e3 * m,
        "min_ms": 1e3 * min(values),
        "max_ms": 1e3 * max(values),
        "range_of_mean": (max(values) - min(values)) / m,
        "cv": statistics.pstdev(values) / m,
    }


def summarise(
    periods: list[float], host: list[float], device: list[float], gcs: list[float], collections: int
) -> dict[str, Any]:
    med = statistics.median(periods)
    q = len(periods) // 4
    return {
        "steps": len(periods),
        "period": {
            **spread(periods),
            "median_ms": 1e3 * med,
            "p90_ms": 1e3 * sorted(periods)[int(0.9 * len(periods))],
        },
        "host": spread(host),
        "device": spread(device),
        "slow_steps_over_1.5x_median": sum(p > 1.5 * med for p in periods),
        "windows": {str(w): spread(window_means(periods, w)) for w in WINDOWS if len(periods) >= 2 * w},
        "quarters_ms": [1e3 * statistics.fmean(periods[i * q : (i + 1) * q]) for i in range(4)] if q else [],
        "gc": {
            "collections": collections,
            "ms_per_step": 1e3 * sum(gcs) / len(gcs),
            "max_ms": 1e3 * max(gcs),
            "share_of_period": sum(gcs) / sum(periods),
        },
        "periods_ms": [round(1e3 * p, 3) for p in periods],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="128,512")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--precision", default=None, help="Default: bf16 on CUDA, fp32 on a CPU (as the bench).")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "args": vars(args) | {"out": str(args.out)},
        "device": str(device),
        "torch": torch.__version__,
        "runs": {},
    }
    lines = [
        f"{'batch':>5} {'variant':<9} {'mean ms':>8} {'median':>7} {'p90':>6} {'max':>6} {'>1.5x':>5} "
        + " ".join(f"{'w' + str(w) + ' range':>9}" for w in WINDOWS)
        + f" {'quarters ms':<24} {'gc ms/step':>10} {'gc max':>6}"
    ]
    for batch in [int(b) for b in args.batches.split(",") if b]:
        model = build_model(args.model, 3, args.size, 4)
        options = resolve_step_options(precision, None, False, device, model)
        step = TrainStep(model, device, device_transform("gpu-augment", args.size, device), options)
        data = synthetic_batch((batch, 3, args.size, args.size), torch.uint8, 4, device)
        for variant in ("gc", "gc-frozen", "gather", "gc-again"):
            r = run(step, data, args.steps, frozen=variant == "gc-frozen", gather=variant == "gather")
            doc["runs"][f"b{batch}-{variant}"] = r
            (args.out / "step_noise.json").write_text(json.dumps(doc, indent=1) + "\n")
            pr = r["period"]
            lines.append(
                f"{batch:>5} {variant:<9} {pr['mean_ms']:>8.2f} {pr['median_ms']:>7.2f} {pr['p90_ms']:>6.2f} "
                f"{pr['max_ms']:>6.1f} {r['slow_steps_over_1.5x_median']:>5} "
                + " ".join(
                    f"{100 * r['windows'][str(w)]['range_of_mean']:>8.0f}%"
                    if str(w) in r["windows"]
                    else f"{'-':>9}"
                    for w in WINDOWS
                )
                + f" {' '.join(f'{x:.1f}' for x in r['quarters_ms']):<24} {r['gc']['ms_per_step']:>10.3f} "
                f"{r['gc']['max_ms']:>6.1f}"
            )
            print(lines[-1], flush=True)
        del step, model, data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
