"""Rendering a watch report: text, steps.csv, timeline.png (matplotlib optional), the JSON document; and
``--compare A B``, two runs' reports side by side."""

from __future__ import annotations

import csv
import json
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

from dlstore.bench.advice import plural
from dlstore.bench.watch import WatchError
from dlstore.bench.watch.analyse import loop_rate

TIMES = ("wait", "host", "period", "device", "device_wait")  # steps.csv's timings, in ms
CSV_FIELDS = ("loader", "step", "epoch", "phase", "epoch_first", *(f"{k}_ms" for k in TIMES))


def text_report(report: dict[str, Any]) -> str:
    """The one sentence first, then what to do, then the figures behind it."""
    head = f"dlstore watch — {report['device']}, {plural(report['cores'], 'usable core')}; script {_ending(report)}"
    lines = [report["verdict"], "", head]
    if report["recommendations"]:
        lines.append("Recommendations (largest predicted gain first):")
        lines += [f"  {i}. {r}" for i, r in enumerate(report["recommendations"], 1)]
    if report.get("detail"):
        lines += ["", report["detail"]]
    for rep in report["loaders"]:
        lines += ["", *_loader_lines(rep, primary=rep["index"] == report.get("primary"))]
    if report.get("ranks"):
        per = ", ".join(f"rank {r['rank']} wait {_pct(r['wait_share'])}" for r in report["ranks"]["per_rank"])
        lines.append("Per rank: " + per)
    shown = {n for rep in report["loaders"] for n in rep["notes"]}
    lines += ["Note: " + note for note in report["notes"] if note not in shown]
    if report.get("profile_trace"):
        lines.append(f"Profiler trace: {report['profile_trace']}")
    return "\n".join(lines)


def _ending(report: dict[str, Any]) -> str:
    status, code = report["status"], report["exit_code"]
    words = {
        "completed": "ran to its end",
        "stopped": "stopped at --steps",
        "interrupted": "was interrupted (Ctrl-C)",
        "error": f"raised {report.get('error')}",
        "exited": "exited",
    }.get(status, status)
    return f"{words} (exit code {code})"


def _loader_lines(rep: dict[str, Any], primary: bool) -> list[str]:
    s, d = rep["settings"], rep["dataset"]
    head = (
        f"DataLoader #{rep['index']}{' (the training loop)' if primary else ''}: {d['type']} "
        f"({plural(d.get('len') or 0, 'sample')}{', root ' + d['root'] if d.get('root') else ''}), batch {rep['images_per_batch']}, "
        f"workers {s['num_workers']}, pin_memory {s['pin_memory']}, prefetch_factor {s['prefetch_factor']}, "
        f"persistent_workers {s['persistent_workers']}"
    )
    out = [head]
    if d.get("transform"):
        out.append("  transform: " + " ".join(d["transform"].split()))
    out.append(
        f"  steps: {rep['steps_observed']} observed over {plural(rep['epochs'], 'epoch')}, {rep['steps_replayed']} replayed"
        + (f", {rep['steps_trial']} in the workers trial" if rep.get("steps_trial") else "")
    )
    for phase, s_ in rep["phases"].items():
        out.append(
            f"  {phase:8s} {s_['steps']:5d} steps  {_rate(s_['img_per_s'])} img/s  step {_ms(s_['period_s'])}  "
            f"wait {_ms(s_['wait_mean_s'])} (p95 {_ms(s_['wait_p95_s'])}, {_pct(s_['wait_share'])})  "
            f"host {_ms(s_['host_mean_s'])}  device {_ms(s_['device_mean_s'])}"
        )
    r = rep.get("resources") or {}
    if r:
        out.append(
            f"  cores busy: main {_num(r.get('main_cpu_cores'))}, workers {_num(r.get('workers_cpu_cores'))}; "
            f"workers RSS {_num(r.get('workers_rss_mb_max'))} MB (shared {_num(r.get('workers_shared_mb_max'))} MB, "
            f"PSS {_num(r.get('workers_pss_mb_max'))} MB); GPU util "
            + (f"{_num(r.get('gpu_util_percent'))}%" if r.get("nvml") else "n/a (no pynvml)")
        )
    b = rep.get("binding")
    if b:
        m = rep["model"]
        limits = ", ".join(f"{k} {v:.2f}" for k, v in m["limits_ms"].items())
        out.append(
            f"  predicted from the parts timed alone (ms per batch): {limits} → {_rate(m['predicted_img_per_s'])} img/s"
        )
        out.append(f"  binds: {b['text']}")
    out += [f"  note: {n}" for n in rep["notes"]]
    return out


def write_csv(report: dict[str, Any], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for rep in report["loaders"]:
            for r in rep["rows"]:
                ms = ["" if r[f"{k}_s"] is None else f"{1e3 * r[f'{k}_s']:.4f}" for k in TIMES]
                w.writerow([rep["index"], r["step"], r["epoch"], r["phase"], int(r["epoch_first"]), *ms])


# phase → (legend label, shading); stand-in phases (batches watch fed the loop) are drawn compacted
PHASES = {
    "warmup": ("warm-up", "0.85"),
    "profiled": ("profiled (torch.profiler on)", "#e4d4f4"),
    "real": ("real steps", None),
    "replay": ("stand-in replay (data free)", "#ffe0a8"),
    "trial": ("trial (advised workers)", "#c4e8c4"),
    "refill": ("refill (queue refilling after the pause)", "#cfe3f5"),
}
STAND_IN = ("replay", "trial")
STAND_IN_COLUMNS = 8  # the fewest columns a stand-in phase keeps, however few real steps there are
MAX_COLUMNS = 400
RATE_COLOURS = {"now": "#7f7f7f", "data free": "#bcbd22", "predicted": "#1f77b4", "measured": "#2ca02c"}


def timeline_series(report: dict[str, Any]) -> dict[str, Any] | None:
    """What timeline.png draws of the training loader: ``columns``, one per step or the mean of several (a
    stand-in phase in a quarter of the real steps' width at most); ``spans``, each phase's columns."""
    rep = next((r for r in report["loaders"] if r["index"] == report.get("primary")), None)
    if rep is None or not rep["rows"]:
        return None
    runs = [list(run) for _, run in groupby(rep["rows"], key=lambda r: r["phase"])]
    real = sum(len(run) for run in runs if run[0]["phase"] not in STAND_IN)
    widths = [
        min(len(run), max(STAND_IN_COLUMNS, real // 4)) if run[0]["phase"] in STAND_IN else len(run)
        for run in runs
    ]
    scale = min(1.0, MAX_COLUMNS / sum(widths))
    columns: list[dict[str, Any]] = []
    spans = []
    for run, width in zip(runs, widths):
        x0, n = len(columns), max(1, int(width * scale))
        cuts = [round(i * len(run) / n) for i in range(n + 1)]
        columns += [_column(run[lo:hi]) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
        spans.append({"phase": run[0]["phase"], "x0": x0, "x1": len(columns), "steps": len(run)})
    return {"columns": columns, "spans": spans, "rates": rate_bars(report, rep)}


def _column(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def ms(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return 1e3 * sum(vals) / len(vals) if vals else None

    out = {"first_step": rows[0]["step"], "steps": len(rows), "phase": rows[0]["phase"]}
    # the last step has no host time (no next() after it)
    return {**out, "wait_ms": ms("wait_s"), "host_ms": ms("host_s") or 0.0, "device_ms": ms("device_s")}


def rate_bars(report: dict[str, Any], rep: dict[str, Any]) -> list[dict[str, Any]]:
    """(label, img/s, kind) per bar: now, with data free, each fix as predicted, and after --apply."""
    free = (rep.get("model") or {}).get("data_free_img_per_s")
    bars = [("now", loop_rate(rep), "now"), ("with data free", free, "data free")]
    bars += [
        (f"{_fix_label(a)}\n(predicted)", a.get("expected_img_per_s"), "predicted")
        for a in rep.get("advice") or []
    ]
    bars.append(
        ("after --apply\n(measured)", (report.get("applied") or {}).get("measured_img_per_s"), "measured")
    )
    return [{"label": label, "img_per_s": v, "kind": kind} for label, v, kind in bars if v]


def _fix_label(advice: dict[str, Any]) -> str:
    if advice.get("workers"):
        return f"{advice['workers']} workers"
    if advice.get("cache"):
        return "dlstore cache"
    head = advice["text"].split(":")[0]
    return head if len(head) <= 32 else head[:31] + "…"


def write_timeline(report: dict[str, Any], path: Path) -> str | None:
    """timeline.png: per step the data wait and host work stacked, the device span over them, the phases
    shaded; beside it a bar per rate. Returns why not when it could not draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dlstore[plot]')"
    series = timeline_series(report)
    if series is None:
        return "no steps to draw"
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    _draw_steps(ax, series)
    _draw_rates(bars, series["rates"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _draw_steps(ax: Any, series: dict[str, Any]) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    cols = series["columns"]
    x = range(len(cols))
    wait = [c["wait_ms"] or 0.0 for c in cols]
    ax.bar(x, wait, 1.0, color="#d62728", label="data wait (next())")
    ax.bar(x, [c["host_ms"] for c in cols], 1.0, bottom=wait, color="#1f77b4", label="host work")
    if any(c["device_ms"] is not None for c in cols):
        dev = [c["device_ms"] if c["device_ms"] is not None else float("nan") for c in cols]
        ax.plot(x, dev, ".", color="#2ca02c", ms=3, label="device span (overlaps host work)")
    handles = ax.get_legend_handles_labels()[0]
    for phase in dict.fromkeys(s["phase"] for s in series["spans"]):
        label, colour = PHASES.get(phase, (phase, "0.9"))
        runs = [s for s in series["spans"] if s["phase"] == phase]
        for s in runs if colour else ():
            ax.axvspan(s["x0"] - 0.5, s["x1"] - 0.5, color=colour, zorder=0)
        steps = sum(s["steps"] for s in runs)
        squeezed = sum(s["x1"] - s["x0"] for s in runs) < steps
        label += f": {steps} step{'s' if steps != 1 else ''}" + (" (drawn compacted)" if squeezed else "")
        handles.append(Patch(facecolor=colour or "white", edgecolor="0.6", label=label))
    labels = {i: str(c["first_step"]) for i, c in enumerate(cols)}
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: labels.get(round(v), "")))
    ax.set(xlim=(-0.5, len(cols) - 0.5), xlabel="step", ylabel="ms per step")
    ax.set_title("dlstore watch: per-step time of the training loader", fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)


def rates_top(rates: list[dict[str, Any]]) -> float:
    """The rates axis' end: room for the largest bar's number, or the rest's when the rate with data free
    is over three times theirs (it then runs off the axis, so the bars that compare fixes stay readable)."""
    values = [b["img_per_s"] for b in rates]
    others = [b["img_per_s"] for b in rates if b["kind"] != "data free"]
    return 1.3 * (max(others) if others and max(values) > 3 * max(others) else max(values))


def _draw_rates(ax: Any, rates: list[dict[str, Any]]) -> None:
    values = [b["img_per_s"] for b in rates]
    top = rates_top(rates)
    y = range(len(rates))
    ax.barh(y, values, color=[RATE_COLOURS[b["kind"]] for b in rates])
    for i, v in zip(y, values):
        beyond = v > top
        x, where = (0.98 * top, "right") if beyond else (v + 0.01 * top, "left")
        ax.text(x, i, f"{v:,.0f}{' →' if beyond else ''}", ha=where, va="center", fontsize=8)
    ax.set_yticks(y, [b["label"] for b in rates], fontsize=8)
    ax.set(xlim=(0, top), xlabel="img/s")
    ax.invert_yaxis()
    ax.set_title("rates", fontsize=9)


def json_document(report: dict[str, Any], rows: bool = False) -> dict[str, Any]:
    """The report as one JSON document; per-step rows only on request (they are in steps.csv)."""
    doc = dict(report)
    doc["loaders"] = [{k: v for k, v in r.items() if rows or k != "rows"} for r in report["loaders"]]
    return doc


def _figure(v: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if v is None else f"{scale * v:{spec}}{unit}"


_ms = partial(_figure, spec=".2f", scale=1e3, unit=" ms")
_pct = partial(_figure, spec=".1f", scale=100.0, unit="%")
_rate = partial(_figure, spec=",.0f")
_num = partial(_figure, spec=".1f")


def write_outputs(report: dict[str, Any], out: Path) -> dict[str, str]:
    """--out DIR: watch.json (with per-step rows), steps.csv, timeline.png: name → path, or why not."""
    out.mkdir(parents=True, exist_ok=True)
    written = {"json": str(out / "watch.json"), "csv": str(out / "steps.csv")}
    (out / "watch.json").write_text(json.dumps(json_document(report, rows=True), indent=1, default=str))
    write_csv(report, out / "steps.csv")
    why = write_timeline(report, out / "timeline.png")
    written["png"] = why or str(out / "timeline.png")
    return written


SETTINGS = ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor", "batch_size")
ROWS = {
    **{k: k for k in SETTINGS},
    "img_per_s": "img/s (steady)",
    "loop_img_per_s": "img/s with epoch starts",
    "data_free_img_per_s": "img/s with data free",
    "wait_share": "data wait share",
    "binds": "binds",
    "steps": "steps observed",
}


def load_report(path: Path) -> dict[str, Any]:
    """A watch report from ``watch.json`` or from the ``--out`` folder that holds it."""
    file = path / "watch.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise WatchError(f"{file}: not a watch.json ({e}); give one written by watch --out") from e
    if not isinstance(doc, dict) or "loaders" not in doc or "verdict" not in doc:
        raise WatchError(f"{file}: not a watch.json (no loaders or verdict); give one written by watch --out")
    return doc


def summary(report: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """A loader's figures (the training loader's unless ``index``): its settings, steady rate, rate with
    epoch starts (``loop_img_per_s``), data-free rate, wait share, binding."""
    index = report.get("primary") if index is None else index
    rep = next((r for r in report["loaders"] if r["index"] == index), None)
    if rep is None:
        return {"img_per_s": None}
    steady = rep.get("steady") or {}
    return {
        **{k: rep["settings"].get(k) for k in SETTINGS},
        "img_per_s": steady.get("img_per_s"),
        "loop_img_per_s": loop_rate(rep),
        "wait_share": steady.get("wait_share"),
        "data_free_img_per_s": (rep.get("model") or {}).get("data_free_img_per_s"),
        "binds": (rep.get("binding") or {}).get("stage"),
        "steps": rep["steps_observed"],
    }


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Both summaries and the verdict: B's rate against A's, each over the real steps with epoch starts
    (the rate the script sees, and the basis of the predictions and of ``--apply``)."""
    sa, sb = summary(a), summary(b)
    ra, rb = sa["loop_img_per_s"], sb["loop_img_per_s"]
    change = rb / ra - 1 if ra and rb else None
    if change is None:
        verdict = "No rate to compare: a run observed no steady step."
    else:
        word = "faster" if change >= 0 else "slower"
        verdict = f"{names[1]} vs {names[0]}: {abs(100 * change):.0f}% {word} ({rb:,.0f} vs {ra:,.0f} img/s)."
    return {"names": list(names), "a": sa, "b": sb, "change": change, "verdict": verdict}


def compare_text(result: dict[str, Any]) -> str:
    """A short table, one row per figure, then the verdict."""
    a, b = result["a"], result["b"]
    rows = [
        ("", *result["names"]),
        *((label, cell(k, a.get(k)), cell(k, b.get(k))) for k, label in ROWS.items()),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}" for r in rows]
    return "\n".join([*lines, result["verdict"]])


def cell(key: str, value: Any) -> str:
    if key == "wait_share" or key.endswith("img_per_s"):
        return (_pct if key == "wait_share" else _rate)(value)
    return "n/a" if value is None else str(value)


def apply_text(first: dict[str, Any], second: dict[str, Any] | None) -> str:
    """What was applied, measured beside predicted, then the two runs side by side (``compare``)."""
    a = first["applied"]
    if second is None:
        return f"--apply: {a['skipped']}."
    what = ", ".join(f"{k}={v}" for k, v in a["settings"].items())
    if not a["reached"]:
        line = (
            f"--apply: {what} did not reach DataLoader #{a['loader']} in the second run (the script "
            "iterated its loaders in another order, or made a new one): no measurement."
        )
    else:
        line = (
            f"--apply: the script re-ran with {what} in DataLoader #{a['loader']}: measured "
            f"{cell('img_per_s', a['measured_img_per_s'])} img/s, predicted "
            f"{cell('img_per_s', a['predicted_img_per_s'])}"
            + (f" ({100 * a['error']:+.0f}%)" if a["error"] is not None else "")
            + "".join(f"; not applied (a change to your code): {c}" for c in a["not_applied"])
        )
    return line + "\n" + compare_text(compare(first, second, ("as written", "applied")))
