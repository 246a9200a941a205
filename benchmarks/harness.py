"""What the benchmark scripts share: a log line, the environment record, target rows, the sections loop,
the training step and its synthetic ceiling, and ``make_loader``: the one place the suite builds dlstore's
fast loader.

A script keeps its own sections; this module records them the same way everywhere: every section's
result (or its error, so one failing section does not lose the others) and its seconds in one JSON file,
the targets in a ``targets.json`` next to it, and a short table of the targets printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Section = Callable[[argparse.Namespace, Path], dict[str, Any]]
Step = Callable[[torch.Tensor, torch.Tensor], None]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of a script (the numbers mean nothing)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Targets(list[dict[str, Any]]):
    """Target rows: a ratio to a ceiling measured in the same run (goal < 5) or an absolute rate."""

    def add(
        self, name: str, measured: float, base: float, goal: float, note: str = "", higher: bool = True
    ) -> None:
        """``higher=False``: the goal is an upper bound (bytes, error)."""
        ratio = measured / base if base else float("nan")
        value = ratio if goal < 5 else measured
        met = value >= goal if higher else value <= goal
        self.append(
            {
                "name": name,
                "measured": round(measured, 3),
                "ceiling_or_baseline": round(base, 3),
                "ratio": round(ratio, 4),
                "goal": goal,
                "met": bool(met),
                "note": note,
            }
        )

    def table(self, width: int = 100) -> str:
        lines = [f"{'target':{width}} {'measured':>12} {'base':>12} {'ratio':>7} {'goal':>9} met"]
        for t in self:
            lines.append(
                f"{t['name'][:width]:{width}} {t['measured']:>12,.1f} {t['ceiling_or_baseline']:>12,.1f} "
                f"{t['ratio']:>7.3f} {t['goal']:>9g} {'yes' if t['met'] else 'NO'}"
            )
        return "\n".join(lines)


def environment(**extra: Any) -> dict[str, Any]:
    """Machine, versions and command of this run; the commit from ``DLSTORE_COMMIT`` (device copies have
    no .git) unless given."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "argv": sys.argv,
        "command": "python3 " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": os.environ.get("DLSTORE_COMMIT", "unknown"),
    }
    for module in ("torchvision", "zarr", "PIL", "numcodecs", "simplejpeg", "skimage"):
        try:
            env[module.lower()] = __import__(module).__version__
        except ImportError:
            env[module.lower()] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    env.update({k: v for k, v in extra.items() if v})
    return env


def run_sections(
    sections: dict[str, Section],
    names: list[str],
    args: argparse.Namespace,
    work: Path,
    results: dict[str, Any],
    targets: Targets,
    json_name: str,
) -> None:
    """Run the named sections in order, saving after each one (a later time-out keeps what is done)."""
    for name in names:
        log(f"section {name}")
        t0 = time.perf_counter()
        try:
            results[name] = sections[name](args, work)
        except Exception as e:  # record and go on: the other sections still count
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(traceback.format_exc())
        results.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        (args.out / json_name).write_text(json.dumps(results, indent=1, default=str))
        (args.out / "targets.json").write_text(
            json.dumps({"environment": results.get("environment"), "targets": targets}, indent=1, default=str)
        )


_ALL_CORES: dict[str, Any] = {}


def _all_cores_task(draw: list[int]) -> tuple[float, float, int]:
    work, barrier = _ALL_CORES["work"], _ALL_CORES["barrier"]
    for i in draw[:10]:  # warm: imports, caches, allocator
        work(i)
    barrier.wait(timeout=120)  # every process starts together
    t0 = time.monotonic()
    for i in draw:
        work(i)
    return t0, time.monotonic(), len(draw)


def all_cores_rate(
    work: Callable[[int], Any], n_items: int, procs: int, per_proc: int = 300
) -> dict[str, Any]:
    """``work(i)`` alone in ``procs`` forked processes at once, each over its own random draw of items:
    what the cores deliver together. Against it, the one-core rate x cores assumes perfect scaling (no
    shared caches, memory bandwidth, turbo budget or hyper-threads)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    rng = np.random.default_rng(1)
    draws = [rng.choice(n_items, size=min(per_proc, n_items), replace=False).tolist() for _ in range(procs)]
    _ALL_CORES.update(work=work, barrier=ctx.Barrier(procs))
    try:
        with ctx.Pool(procs) as pool:
            spans = pool.map(_all_cores_task, draws, chunksize=1)
    finally:
        _ALL_CORES.clear()
    wall = max(t1 for _, t1, _ in spans) - min(t0 for t0, _, _ in spans)
    rates = [k / (t1 - t0) for t0, t1, k in spans]
    return {"procs": procs, "img_s": sum(k for *_, k in spans) / wall, "per_process_img_s": rates}


def parser(images: int, warmup: int, steps: int, repeats: int) -> argparse.ArgumentParser:
    """The options every sectioned script takes; a script adds its own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="where data and caches go (default: a temp dir)")
    ap.add_argument("--images", type=int, default=images)
    ap.add_argument("--sections", default="all", help="comma-separated section names, or all")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap


def work_dir(args: argparse.Namespace, prefix: str) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    return args.work or Path(tempfile.mkdtemp(prefix=prefix))


def section_names(spec: str, sections: dict[str, Section]) -> list[str]:
    names = list(sections) if spec == "all" else [s for s in spec.split(",") if s]
    unknown = sorted(set(names) - set(sections))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {', '.join(sections)}")
    return names


def convert_cache(source: Any, dest: str | Path, **options: Any) -> Any:
    """``dlstore.convert`` with the benchmarks' options as keywords (``ConvertOptions``' fields)."""
    import dlstore

    hooks = {k: options.pop(k) for k in ("progress", "log") if k in options}
    return dlstore.convert(source, dest, dlstore.ConvertOptions(**options), **hooks)


def make_loader(
    cache: Any,
    batch_size: int,
    path: str = "pinned",
    *,
    device: str | None = None,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    cuda_graph: bool = False,
    cpu_decoders: int = 0,
    **order: Any,
) -> Any:
    """dlstore's fast loader, the one place the suite constructs it. ``path``: ``pinned`` (a raw cache
    gathered into pinned memory), ``resident`` (the cache on the GPU) or ``decode`` (a JPEG or ragged
    cache through the decode lanes, ``cpu_decoders`` CPU processes beside the GPU). ``order``: the
    sampling (``order``, ``window``, ``seed``, ``num_replicas``, ``rank``, ``drop_last``); a raw cache is
    read in random order unless it says otherwise. ``device``: ``DEV`` unless given."""
    from dlstore import Loader

    device = device or DEV
    if path != "decode":
        order = {"order": "random", **order}
    return Loader(
        cache,
        batch_size,
        device,
        via=path,
        transform=transform,
        cuda_graph=cuda_graph,
        cpu_decoders=cpu_decoders,
        **order,
    )


# --- training: the step, its synthetic ceiling, rotated repeats -----------------------------------------


def small_cnn(channels: int = 1, size: int = 28, classes: int = 10) -> torch.nn.Module:
    """The seeds' SmallCNN: two 3x3 conv + ReLU + 2x2 max-pool blocks (16, 32), Linear to 64, to classes
    (105,866 parameters at 1x28x28 and 10 classes)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, 64), nn.ReLU(), nn.Linear(64, classes),
    )  # fmt: skip


def model_step(name: str, classes: int, bf16: bool = True) -> Step:
    """One SGD step of a torchvision model (``resnet18``, ``resnet50``), bf16 autocast, channels-last."""
    import torchvision

    torch.backends.cudnn.benchmark = True
    model = (
        getattr(torchvision.models, name)(num_classes=classes).to(DEV).to(memory_format=torch.channels_last)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def synthetic(shape: tuple[int, ...], classes: int, dtype: torch.dtype = torch.bfloat16) -> Callable[[], Any]:
    """One device batch again and again: the step's ceiling (channels-last for images in colour)."""
    x = torch.randn(shape, device=DEV).to(dtype)
    if shape[1] == 3:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (shape[0],), device=DEV)

    def gen() -> Any:
        while True:
            yield x, y

    return gen


def timed_steps(batches: Callable[[], Any], step: Step, warmup: int, steps: int, batch: int) -> float:
    """images/s over ``steps`` steps after ``warmup``, synchronised; ``batches()`` gives a fresh iterator
    (called again at an epoch's end)."""
    it = batches()

    def nxt() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = batches()
            return next(it)

    for _ in range(warmup):
        step(*nxt())
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*nxt())
    sync()
    return steps * batch / (time.perf_counter() - t0)


def interleave(configs: dict[str, Callable[[], float]], repeats: int) -> dict[str, dict[str, Any]]:
    """Each configuration ``repeats`` times in rotated order: median, min, max and runs of each (a broken
    one is recorded with its error and a median of 0; the others still run)."""
    runs: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    errors: dict[str, str] = {}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in errors:
                continue
            try:
                runs[name].append(configs[name]())
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
                log(traceback.format_exc())
                continue
            log(f"  {name}: {runs[name][-1]:,.0f} img/s")
    out = {
        k: {"median": float(np.median(v)), "min": min(v), "max": max(v), "runs": v}
        for k, v in runs.items()
        if v
    }
    out.update({k: {"median": 0.0, "error": e} for k, e in errors.items()})
    return out
