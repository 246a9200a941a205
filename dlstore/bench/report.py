"""Outputs of a bench run: result.json, steps.csv, a PNG plot, profiler traces, and the text table.

All of them are rendered from the result document ``run_bench`` returns, except the profiler traces,
which come from their own short scheduled runs (throughput never comes from a profiled run).
"""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dlstore.bench.monitor import load_average, mem_available_bytes, shm_usage
from dlstore.bench.protocol import STAGES
from dlstore.machine import cpu_model, usable_cores

STEP_COLUMNS = (
    "loader",
    "workers",
    "pin_memory",
    "cold",
    "repeat",
    "position",
    "phase",
    "epoch",
    "index",
    "images",
    "wait_s",
    "step_s",
    "device_step_s",
)


def default_out_dir() -> Path:
    return Path(f"dlstore-bench-{time.strftime('%Y%m%d-%H%M%S')}")


def package_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "memory_gb": props.total_memory / 1e9,
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            name: package_version(name)
            for name in ("dlstore", "torch", "torchvision", "numpy", "pillow", "zarr")
        },
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "device": str(device),
        "start_method": multiprocessing.get_context().get_start_method(),
        "free_ram_bytes": mem_available_bytes(),
        "shm": shm_usage(),
        "load_average": load_average(),
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
    }


# --- files --------------------------------------------------------------------------------------------


def write_outputs(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """result.json, steps.csv and plots.png (when matplotlib is installed) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "result.json"), "csv": str(out / "steps.csv")}
    n = write_steps_csv(doc, out / "steps.csv")
    doc.setdefault("outputs", {}).update(paths)
    doc["outputs"]["csv_rows"] = n
    plot = write_plot(doc, out / "plots.png")
    if plot is None:
        doc.setdefault("notes", []).append(
            "matplotlib is not installed: no plot written (pip install matplotlib)"
        )
    else:
        doc["outputs"]["plot"] = str(plot)
    with open(out / "result.json", "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
        f.write("\n")
    return doc["outputs"]


def finite(obj: Any) -> Any:
    """NaN and infinities → None, recursively: result.json stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def step_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per step of every repeat of every run (warm sweep, pin variants, cold runs)."""
    rows: list[dict[str, Any]] = []
    raws = [raw for run in doc["runs"] for raw in run["raw"]]
    raws += [raw for c in doc.get("cold", {}).values() for raw in c["raw"]]
    for raw in raws:
        steps = raw["steps"]
        for i in range(len(steps["index"])):
            row = {k: raw[k] for k in ("loader", "workers", "pin_memory", "cold", "repeat", "position")}
            row.update(
                {
                    k: steps[k][i]
                    for k in ("phase", "epoch", "index", "images", "wait_s", "step_s", "device_step_s")
                }
            )
            rows.append(row)
    return rows


def write_steps_csv(doc: dict[str, Any], path: Path) -> int:
    rows = step_rows(doc)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=STEP_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return len(rows)


def write_plot(doc: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    pin_default = doc["protocol"]["pin_memory_default"]
    for name in doc["loaders"]:
        sweep = sorted(
            (r for r in doc["runs"] if r["loader"] == name and r["pin_memory"] == pin_default),
            key=lambda r: r["workers"],
        )
        if not sweep:
            continue
        xs = [r["workers"] for r in sweep]
        ys = [r["img_per_s"] for r in sweep]
        err = [
            [y - r["img_per_s_min"] for y, r in zip(ys, sweep)],
            [r["img_per_s_max"] - y for y, r in zip(ys, sweep)],
        ]
        line = ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"{name} measured")
        pred = [r["predicted_img_per_s"] or math.nan for r in sweep]
        ax1.plot(xs, pred, linestyle="--", color=line[0].get_color(), alpha=0.6, label=f"{name} predicted")
    ax1.set_xticks(doc["protocol"]["workers"])
    ax1.set_xlabel("DataLoader workers")
    ax1.set_ylabel("images/s (median of repeats, min–max)")
    proto = doc["protocol"]
    ax1.set_title(
        f"end to end: {proto['model']}, batch {proto['batch_size']}, {doc['environment']['device']}"
    )
    ax1.legend(fontsize=7)
    names = list(doc["stages"])
    width = 0.8 / len(STAGES)
    for j, stage in enumerate(STAGES):
        vals = [doc["stages"][n][stage] or 0 for n in names]
        ax2.bar([i + j * width for i in range(len(names))], vals, width, label=stage)
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax2.set_yscale("log")
    ax2.set_ylabel("images/s (stage alone; transform at its best worker count)")
    ax2.set_title("stage rates (missing bar: does not apply)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- profiler -----------------------------------------------------------------------------------------


def profile_configuration(
    run_steps: Callable[[Callable[[], None]], None],
    device: torch.device,
    out: Path,
    name: str,
    wait: int = 1,
    warmup: int = 2,
    active: int = 3,
) -> dict[str, str]:
    """A short scheduled torch.profiler run; ``run_steps(tick)`` runs the loop and calls ``tick`` per step.

    Writes ``NAME.trace.json`` (Chrome trace) and ``NAME.ops.txt`` (operator table)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace = out / f"{name}.trace.json"
    table = out / f"{name}.ops.txt"

    def ready(prof: Any) -> None:
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table.write_text(prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")

    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=ready,
    ) as prof:
        run_steps(prof.step)
    return {"trace": str(trace), "ops": str(table), "steps": str(wait + warmup + active)}


# --- text ---------------------------------------------------------------------------------------------


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render_text(doc: dict[str, Any]) -> str:
    """The table of runs, the stage table, the verdict and the recommendations."""
    lines = [
        f"dlstore bench: {doc['source']['description']} ({doc['source']['n_images']} images, "
        f"{doc['protocol']['size']}px), model {doc['protocol']['model']}, batch {doc['protocol']['batch_size']}, "
        f"transform {doc['protocol']['transform']}, device {doc['environment']['device']}, "
        f"{doc['protocol']['repeats']} repeats × {doc['protocol']['steps']} timed steps",
        "",
    ]
    head = (
        f"{'loader':<7} {'wk':>3} {'pin':>3} {'img/s':>9} {'min–max':>17} {'predicted':>9} {'err':>5} "
        f"{'bottleneck':<10} {'Σwait/wall':>10} {'p95 ms':>7} {'1st epoch':>9}"
    )
    lines += [head, "-" * len(head)]
    kinds = list(doc["loaders"])
    for r in sorted(doc["runs"], key=lambda r: (kinds.index(r["loader"]), r["workers"], not r["pin_memory"])):
        pin = "on" if r["pin_memory"] else "off"
        err = "-" if r["prediction_error"] is None else f"{100 * r['prediction_error']:+.0f}%"
        lines.append(
            f"{r['loader']:<7} {r['workers']:>3} {pin:>3} {_n(r['img_per_s']):>9} "
            f"{_n(r['img_per_s_min']) + '–' + _n(r['img_per_s_max']):>17} "
            f"{_n(r['predicted_img_per_s']):>9} "
            f"{err:>5} {str(r['bottleneck']):<10} {_pct(r['wait']['sum_over_wall']):>10} "
            f"{_n(r['wait']['p95_ms'], '.1f'):>7} {_n(r['first_epoch_img_per_s']):>9}"
        )
    lines += [
        "",
        f"{'stage rates (img/s)':<20} {'read warm':>10} {'read cold':>10} {'transform':>16} {'h2d':>10} "
        f"{'compute':>10}  eviction",
    ]
    for name, s in doc["stages"].items():
        d = s["detail"]
        ev = d["read"]["detail"].get("eviction") or {}
        ev_text = {True: "worked", False: "did not take", None: "unknown"}[ev.get("worked")] if ev else "-"
        tf = f"{_n(s['transform'])} @{d['transform']['detail'].get('best_workers', '-')}w"
        warm = _n(s["read_warm"]) + ("" if s["read"] is not None else "*")
        lines.append(
            f"{name:<20} {warm:>10} {_n(s['read_cold']):>10} {tf:>16} {_n(s['h2d']):>10} "
            f"{_n(s['compute']):>10}  {ev_text}"
        )
    if any(s["read"] is None for s in doc["stages"].values()):
        lines.append("* loaded once into memory: the read is a one-off at start, not a per-epoch bound")
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    lines += ["", "Verdict: " + doc["verdict"], ""]
    lines += [f"- {r}" for r in doc["recommendations"]]
    return "\n".join(lines)
