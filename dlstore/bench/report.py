"""Outputs of a bench run, rendered from the result document ``run_bench`` returns: result.json, steps.csv,
the PNG plots and the text; and the profiler traces, from their own short runs (never a rate)."""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from dlstore.bench.monitor import load_average, mem_available_bytes, shm_usage
from dlstore.bench.protocol import STAGES
from dlstore.errors import DlstoreError
from dlstore.machine import cpu_model, usable_cores
from dlstore.write.sizes import count

STEP_COLUMNS = tuple(
    "loader workers pin_memory cold repeat position phase epoch index images wait_s step_s device_step_s t_s "
    "device_start_s device_end_s".split()
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


def check_out_dir(out: Path) -> None:
    """Create ``out`` and write a probe there: a folder that cannot take the outputs fails now."""
    probe = out / f".dlstore-write-check-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise DlstoreError(
            f"--out {out}: cannot write there ({e.strerror}); choose a writable folder with free space"
        ) from None


@contextmanager
def removed_if_left_empty(out: str | Path | None) -> Iterator[None]:
    """A failed run leaves no empty ``--out`` folder it created; one that existed or holds files stays."""
    folder = Path(out) if out is not None else None
    existed = folder is None or folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder is not None:
            with suppress(OSError):
                folder.rmdir()  # only succeeds when empty
        raise


def write_outputs(doc: dict[str, Any], out: Path) -> dict[str, str]:
    """result.json, steps.csv and plots.png (when matplotlib is installed) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "result.json"), "csv": str(out / "steps.csv")}
    rows = step_rows(doc)
    with open(out / "steps.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=STEP_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    doc.setdefault("outputs", {}).update(paths, csv_rows=len(rows))
    plot = save_figure(plot_figure, doc, out / "plots.png")
    if plot is None:
        doc.setdefault("notes", []).append(
            "matplotlib is not installed: no plot written (pip install matplotlib)"
        )
    else:
        doc["outputs"]["plot"] = str(plot)
        doc["outputs"]["timeline"] = str(save_figure(timeline_figure, doc, out / "timeline.png"))
    with open(out / "result.json", "w") as f:
        json.dump(doc, f, indent=1, default=str)  # paths as text
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


def step_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per step of every repeat of every run (warm sweep, pin variants, cold runs)."""
    rows: list[dict[str, Any]] = []
    raws = [raw for run in doc["runs"] for raw in run["raw"]]
    raws += [raw for c in doc.get("cold", {}).values() for raw in c["raw"]]
    for raw in raws:
        steps = raw["steps"]
        for i in range(len(steps["index"])):
            row = {k: raw[k] for k in ("loader", "workers", "pin_memory", "cold", "repeat", "position")}
            row.update({k: steps[k][i] for k in STEP_COLUMNS[6:]})
            rows.append(row)
    return rows


def save_figure(figure: Callable[[dict[str, Any]], Any], doc: dict[str, Any], path: Path) -> Path | None:
    """``figure(doc)`` drawn off-screen and saved as ``path``; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = figure(doc)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_figure(doc: dict[str, Any]) -> Any:
    """The sweep (measured and predicted per loader and worker count) beside the parts alone."""
    import matplotlib.pyplot as plt

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
    ax1.set_ylim(bottom=0)  # from zero: a log-free axis that starts high turns 15 vs 22 into a cliff
    proto = doc["protocol"]
    ax1.set_title(
        f"end to end: {proto['model']}, batch {proto['batch_size']}, transform {proto['transform']}, "
        f"{doc['environment']['device']}",
        fontsize=9,
    )
    # Below the axes, never over the data.
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, title="loader")
    names = list(doc["stages"])
    bars = stage_bars(doc)
    width = 0.8 / max(1, len(bars))
    for j, (label, vals) in enumerate(bars.items()):
        xs, hatch = [i + j * width for i in range(len(names))], "//" if label == ONE_OFF_LABEL else None
        ax2.bar(xs, [v or 0 for v in vals], width, label=label, hatch=hatch)
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax2.set_yscale("log")
    ax2.set_ylabel("images/s, stage alone")
    ax2.set_title("parts alone (missing bar: does not apply)", fontsize=9)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    return fig


# The names the text's stage table uses ("parts alone"), so the plot and the table say the same.
STAGE_LABELS = {
    "read": "read (warm)",
    "transform": "loader (decode + transform, best workers)",
    "h2d": "h2d copy",
    "compute": "compute (step alone)",
}
ONE_OFF_LABEL = "read (one-off load into memory)"


def stage_bars(doc: dict[str, Any]) -> dict[str, list[float | None]]:
    """The parts-alone bars, label → img/s per loader (None: no bar); a loader that loads everything once
    shows that one-off read beside the reads."""
    stages = doc["stages"].values()
    bars = {}
    for stage in STAGES:
        vals = [s[stage] for s in stages]
        if any(v is not None for v in vals):
            bars[STAGE_LABELS[stage]] = vals
        once = [s.get("read_warm") if s["read"] is None else None for s in stages]
        if stage == "read" and any(v is not None for v in once):
            bars[ONE_OFF_LABEL] = once
    return bars


def timeline_runs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(title, first repeat's record) for the default configuration and the best one."""
    out = []
    seen = set()
    for role in ("default", "best"):
        pick = doc.get(role)
        key = pick and (pick["loader"], pick["workers"], pick["pin_memory"])
        if not pick or key in seen:
            continue
        seen.add(key)
        run = next((r for r in doc["runs"] if (r["loader"], r["workers"], r["pin_memory"]) == key), None)
        if run is not None and run["raw"]:
            title = (
                f"{role}: {run['loader']}, {count(run['workers'], 'worker')}, pin_memory={run['pin_memory']}: "
                f"{run['img_per_s']:,.0f} img/s, bottleneck {run.get('bottleneck')}"
            )
            out.append((title, run["raw"][0]))
    return out


def timeline_figure(doc: dict[str, Any]) -> Any:
    """Per step, on one time axis: the main thread waiting for data, its own work (copy + step calls), and
    the step on the device; warm-up (worker start, first batches) shaded apart from the timed, warm steps."""
    import matplotlib.pyplot as plt

    picks = timeline_runs(doc)
    # one time scale for every panel: a loader 6x slower must look 6x longer
    fig, axes = plt.subplots(
        max(1, len(picks)), 1, figsize=(13, 2.6 * max(1, len(picks))), squeeze=False, sharex=True
    )
    for ax, (title, raw) in zip(axes[:, 0], picks):
        _timeline_axis(ax, raw["steps"], title)
    axes[-1, 0].set_xlabel("time since the loader was created (ms)")
    fig.tight_layout()
    return fig


def _timeline_axis(ax: Any, steps: dict[str, list[Any]], title: str) -> None:
    colours = {"wait": "#d62728", "host": "#1f77b4", "device": "#2ca02c", "warm-up": "0.9"}
    n = len(steps["index"])
    for i in range(n):
        t, wait, host = 1e3 * steps["t_s"][i], 1e3 * steps["wait_s"][i], 1e3 * steps["step_s"][i]
        ax.broken_barh([(t, wait)], (1.1, 0.8), color=colours["wait"])
        ax.broken_barh([(t + wait, host)], (1.1, 0.8), color=colours["host"])
        start, end = steps["device_start_s"][i], steps["device_end_s"][i]
        if start is not None and end is not None:
            ax.broken_barh([(1e3 * start, 1e3 * (end - start))], (0.1, 0.8), color=colours["device"])
    warmup = [i for i in range(n) if steps["phase"][i] == "warmup"]
    shaded = bool(warmup) and len(warmup) < n
    if shaded:
        ax.axvspan(0, warmup_end_ms(steps, warmup), color=colours["warm-up"], zorder=0)
    on_device = any(s is not None for s in steps["device_start_s"])
    ax.set_yticks([0.5, 1.5], ["device step" if on_device else "device step\n(no device)", "main thread"])
    ax.set_ylim(0, 2.0)
    ax.set_title(title, fontsize=9)
    drawn = {"device": on_device, "warm-up": shaded}
    handles = [matplotlib_patch(c, k) for k, c in colours.items() if drawn.get(k, True)]
    # Outside the axes on the right, the phases named there too: no label over the bars or another label.
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def warmup_end_ms(steps: dict[str, list[Any]], warmup: list[int]) -> float:
    """Where the warm-up's own bars end: its last host work, or its last step on the device."""
    ends = [1e3 * (steps["t_s"][i] + steps["wait_s"][i] + steps["step_s"][i]) for i in warmup]
    ends += [1e3 * steps["device_end_s"][i] for i in warmup if steps["device_end_s"][i] is not None]
    return max(ends)


def matplotlib_patch(colour: str, key: str) -> Any:
    from matplotlib.patches import Patch

    label = {
        "wait": "waiting for data (next())",
        "host": "copy + step calls",
        "device": "step on the device",
        "warm-up": "warm-up (worker start, first batches); after it: timed",
    }
    return Patch(color=colour, label=label[key])


# --- profiler -----------------------------------------------------------------------------------------


PROFILE_SCHEDULE = {"wait": 1, "warmup": 2, "active": 3}  # steps: skipped, warming up, recorded


def profile_configuration(
    run_steps: Callable[[Callable[[], None]], None], device: torch.device, out: Path, name: str
) -> dict[str, str]:
    """A short scheduled torch.profiler run (``run_steps(tick)``): NAME.trace.json and NAME.ops.txt."""
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
        schedule=schedule(**PROFILE_SCHEDULE, repeat=1),
        on_trace_ready=ready,
    ) as prof:
        run_steps(prof.step)
    return {"trace": str(trace), "ops": str(table), "steps": str(sum(PROFILE_SCHEDULE.values()))}


# --- text ---------------------------------------------------------------------------------------------


def _n(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def images_line(source: dict[str, Any]) -> str:
    n, total = source["n_images"], source.get("n_images_total", source["n_images"])
    return f"{n:,} images" if n == total else f"{n:,} of {total:,} images"


def render_text(doc: dict[str, Any]) -> str:
    """The verdict, at most five recommendations, the figures behind it, one line per kind, the notes."""
    proto = doc["protocol"]
    num = proto.get("numerics") or {}
    step = proto.get("model") or (proto.get("step") or {}).get("step")
    lines = [
        doc["verdict"],
        "",
        f"dlstore bench: {doc['source']['description']} ({images_line(doc['source'])}, {proto['size']}px), "
        f"{step}, {num.get('precision') or '-'}{', channels_last' if num.get('channels_last') else ''}"
        f"{', compiled' if num.get('compiled') else ''}, batch {proto['batch_size']}, transform "
        f"{proto['transform']}, device {doc['environment']['device']}, {count(proto['repeats'], 'repeat')}",
        "Recommendations (most valuable first):",
    ]
    lines += [f"{i}. {r}" for i, r in enumerate(doc["recommendations"], 1)] or ["(none)"]
    lines += ["", doc.get("detail") or "", ""]
    lines += kind_lines(doc)
    lines += [f"note: {note}" for note in doc.get("notes", [])]
    return "\n".join(lines)


def kind_lines(doc: dict[str, Any]) -> list[str]:
    head = f"{'kind':<9} {'best':>5} {'img/s':>9} {'bottleneck':<10} {'predicted':>9} {'err':>5}  by workers (img/s)"
    lines = [head, "-" * len(head)]
    for name, k in (doc.get("kinds") or {}).items():
        err = "-" if k["prediction_error"] is None else f"{100 * k['prediction_error']:+.0f}%"
        sweep = " · ".join(
            f"{w}: {_n(r)}" for w, r in sorted(k["by_workers"].items(), key=lambda x: int(x[0]))
        )
        hurt = f" (more than {count(k['best_workers'], 'worker')}: slower)" if k["hurts"] else ""
        lines.append(
            f"{name:<9} {str(k['best_workers']) + 'w':>5} {_n(k['best_img_per_s']):>9} {str(k['bottleneck']):<10} "
            f"{_n(k['predicted_img_per_s']):>9} {err:>5}  {sweep}{hurt}"
        )
    return lines
