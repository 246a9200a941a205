"""What the benchmark scripts share: a log line, the environment record, target rows, the sections loop.

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

from dlstore.machine import cpu_model, usable_cores

Section = Callable[[argparse.Namespace, Path], dict[str, Any]]


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
        "cpu_model": cpu_model(),
        "cores": usable_cores(),
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


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (gone ones count 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


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
    """``dlstore.convert`` with the benchmarks' options as keywords: the one place here that knows its
    signature. It takes keywords today and ``convert(source, dest, ConvertOptions(...), progress=, log=)``
    once issue 21's options object lands; both are served, so the scripts need no edit when it does."""
    import dlstore

    options_type = getattr(dlstore, "ConvertOptions", None) or getattr(
        dlstore.convert, "ConvertOptions", None
    )
    if options_type is None:
        return dlstore.convert(source, dest, **options)
    hooks = {k: options.pop(k) for k in ("progress", "log") if k in options}
    return dlstore.convert(source, dest, options_type(**options), **hooks)
