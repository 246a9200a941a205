"""Rendering a watch report: text, steps.csv, timeline.png (matplotlib optional), the JSON document."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from dlstore.bench.advice import plural

CSV_FIELDS = (
    "loader",
    "step",
    "epoch",
    "phase",
    "epoch_first",
    "wait_ms",
    "host_ms",
    "period_ms",
    "device_ms",
    "device_wait_ms",
)


def text_report(report: dict[str, Any]) -> str:
    """The one sentence first, then what to do, then the figures behind it."""
    lines = [
        report["verdict"],
        "",
        f"dlstore watch — {report['device']}, {plural(report['cores'], 'usable core')}; script {_ending(report)}",
    ]
    if report["recommendations"]:
        lines.append("Recommendations (largest predicted gain first):")
        lines += [f"  {i}. {r}" for i, r in enumerate(report["recommendations"], 1)]
    if report.get("detail"):
        lines += ["", report["detail"]]
    for rep in report["loaders"]:
        lines += ["", *_loader_lines(rep, primary=rep["index"] == report.get("primary"))]
    if report.get("ranks"):
        lines.append(
            "Per rank: "
            + ", ".join(f"rank {r['rank']} wait {_pct(r['wait_share'])}" for r in report["ranks"]["per_rank"])
        )
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
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for rep in report["loaders"]:
            for r in rep["rows"]:
                w.writerow(
                    {
                        "loader": rep["index"],
                        "step": r["step"],
                        "epoch": r["epoch"],
                        "phase": r["phase"],
                        "epoch_first": int(r["epoch_first"]),
                        **{
                            f"{k}_ms": _csv_ms(r[f"{k}_s"])
                            for k in ("wait", "host", "period", "device", "device_wait")
                        },
                    }
                )


def write_timeline(report: dict[str, Any], path: Path) -> str | None:
    """Data wait / host work / device span per step of the training loader, replayed steps shaded.
    Returns why not, when it could not draw (matplotlib missing, no steps)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dlstore[plot]')"
    rep = next((r for r in report["loaders"] if r["index"] == report.get("primary")), None)
    if rep is None or not rep["rows"]:
        return "no steps to draw"
    rows = rep["rows"]
    x = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(x, [1e3 * r["wait_s"] for r in rows], label="data wait (next())", lw=0.8)
    ax.plot(x, [1e3 * (r["host_s"] or 0.0) for r in rows], label="host work", lw=0.8)
    if any(r["device_s"] is not None for r in rows):
        ax.plot(
            x,
            [1e3 * r["device_s"] if r["device_s"] is not None else float("nan") for r in rows],
            label="device span",
            lw=0.8,
        )
    replay = [r["step"] for r in rows if r["phase"] == "replay"]
    if replay:
        ax.axvspan(min(replay), max(replay), color="grey", alpha=0.2, label="replayed batches (data free)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("dlstore watch: per-step time")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def json_document(report: dict[str, Any], rows: bool = False) -> dict[str, Any]:
    """The report as one JSON document; per-step rows only on request (they are in steps.csv)."""
    doc = dict(report)
    doc["loaders"] = [{k: v for k, v in r.items() if rows or k != "rows"} for r in report["loaders"]]
    return doc


def _csv_ms(v: float | None) -> str:
    return "" if v is None else f"{1e3 * v:.4f}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1e3 * v:.2f} ms"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def write_outputs(report: dict[str, Any], out: Path) -> dict[str, str]:
    """--out DIR: watch.json (with per-step rows), steps.csv, timeline.png. Returns what was written
    (name → path, or why not)."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    written = {"json": str(out / "watch.json"), "csv": str(out / "steps.csv")}
    (out / "watch.json").write_text(json.dumps(json_document(report, rows=True), indent=1, default=str))
    write_csv(report, out / "steps.csv")
    why = write_timeline(report, out / "timeline.png")
    written["png"] = why or str(out / "timeline.png")
    return written
