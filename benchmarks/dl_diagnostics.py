"""Where each DataLoader configuration of a slowpaths.py run spent its time, one row per run.

    python benchmarks/dl_diagnostics.py OUTDIR/slowpaths.json

Reads the ``diagnostics`` that ``slowpaths.drain`` records: batches that came in a worker slot, slots
first mapped inside the timed window, page faults per batch in the main process and in the workers,
the main thread's CPU inside next() and its time touching the batch, the spread of the rate over
five windows, the warm-up's length. Prints a table (the slots A/B of issue 13's DataLoader rows).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = (
    ("config", 22),
    ("img/s", 9),
    ("main ms", 7),
    ("main s/GB", 9),
    ("wrk s/GB", 8),
    ("in slot", 7),
    ("new slots", 9),
    ("flt main", 8),
    ("flt wrk", 8),
    ("next cpu p50/mean", 17),
    ("touch p50/mean", 14),
    ("windows min-max k", 17),
    ("warmup s", 8),
)


def rows(result: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, entry in result.get("dataloader", {}).items():
        if not isinstance(entry, dict) or "runs" not in entry:
            continue
        for run in entry["runs"]:
            out.append(row(name, run))
    return out


def row(name: str, run: dict[str, Any]) -> list[str]:
    d = run.get("diagnostics", {})
    if not d:
        return [name, f"{run.get('img_s', 0):,.0f}"] + ["-"] * (len(COLUMNS) - 2)
    win = d["window_img_s"]
    return [
        name,
        f"{run['img_s']:,.0f}",
        f"{run['main_thread_cpu_ms_per_batch']:.2f}",
        f"{run['main_cpu_s_per_gb']:.3f}",
        f"{run['worker_cpu_s_per_gb']:.3f}",
        f"{d['batches_in_slot']}/{d['batches']}",
        f"{d['slots_mapped_in_window']}",
        f"{d['main_minflt_per_batch']:.0f}",
        f"{d['worker_minflt_per_batch']:.0f}",
        f"{d['next_cpu_ms']['p50']:.2f}/{d['next_cpu_ms']['mean']:.2f}",
        f"{d['touch_ms']['p50']:.2f}/{d['touch_ms']['mean']:.2f}",
        f"{min(win) / 1e3:.0f}-{max(win) / 1e3:.0f}",
        f"{d['warmup_s']:.2f}",
    ]


def summary(result: dict[str, Any]) -> list[str]:
    """Per configuration: the runs, their median and the median against the all-core memcpy."""
    dl = result.get("dataloader", {})
    copies = dl.get("memcpy_bytes_s", {"0": 0})
    threads = max(copies, key=int)  # the all-core memcpy, as the targets use
    memcpy = copies[threads]
    title = f"vs {threads}-thread memcpy ({memcpy / 1e9:.1f} GB/s)"
    lines = [f"{'config':>22}  {'runs img/s':>30}  {'median':>9}  {'GB/s':>5}  {title}"]
    for name, entry in dl.items():
        if isinstance(entry, dict) and "runs" in entry:
            runs = " / ".join(f"{r.get('img_s', 0) / 1e3:.0f}k" for r in entry["runs"])
            gb = entry["median_bytes_s"] / 1e9
            ratio = f"{gb * 1e9 / memcpy:.3f}" if memcpy and "w0" not in name else "-"
            lines.append(f"{name:>22}  {runs:>30}  {entry['median_img_s']:>9,.0f}  {gb:>5.1f}  {ratio}")
    return lines


def main(path: Path) -> None:
    result = json.loads(path.read_text())
    print(path)
    print("  ".join(title.rjust(width) for title, width in COLUMNS))
    for r in rows(result):
        print("  ".join(cell.rjust(width) for cell, (_, width) in zip(r, COLUMNS)))
    vm = [
        run["diagnostics"].get("vmstat", {})
        for e in result.get("dataloader", {}).values()
        if isinstance(e, dict)
        for run in e.get("runs", [])
        if "diagnostics" in run
    ]
    keys = (
        "numa_hint_faults",
        "numa_pages_migrated",
        "pgmigrate_success",
        "thp_fault_alloc",
        "compact_stall",
    )
    print("vmstat over all timed windows:", {k: sum(v.get(k, 0) for v in vm) for k in keys})
    print("\n".join(summary(result)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
