#!/usr/bin/env python3
"""Would scaling a part by the single-core reference loop (``stages.cpu_reference_s``) bring it closer to its
run? A check on recorded ``bench_batches.py`` documents, no new measurement.

For every run, the ratio of the part as the run saw it to the part timed in the parts phase (the main thread's
copy + step calls: run ``host_ms`` / ``beside_serial_s``; a 0-worker loader's ``next()``: run ``wait_ms`` /
loader alone) is compared with the ratio of the reference loop (mean over the run's repeats / parts phase).
If the machine's per-core speed drove the drift, the two would move together and dividing one by the other
would bring the parts closer to their runs.

    python3 benchmarks/ref_correction_check.py benchmarks/results/bench_h200_roundE/bench_batches.json \
        benchmarks/results/roundF_h200/bench/bench_batches.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

TOLERANCE = 0.20


def pairs(doc: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(part, reference ratio run/parts, part ratio run/parts) for every run of every document."""
    out = []
    for v in doc["runs"].values():
        d = v["doc"]
        for r in d["runs"]:
            key = f"w{r['workers']}-{'pin' if r['pin_memory'] else 'nopin'}"
            alone = d["stages"][r["loader"]]["loader_alone"].get(key, {})
            refs = [x for x in r.get("cpu_ref_ms") or [] if x]
            if not refs or not alone.get("cpu_ref_s"):
                continue
            ref = statistics.fmean(refs) / (1e3 * alone["cpu_ref_s"])
            measured = r["measured_ms"]
            if alone.get("beside_serial_s"):
                out.append(("host", ref, measured["host_ms"] / (1e3 * alone["beside_serial_s"])))
            if r["workers"] == 0 and alone.get("in_caller") and alone["main_s"] > 0.01:
                out.append(("next", ref, measured["wait_ms"] / (1e3 * alone["main_s"])))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    rows = [x for f in args.files for x in pairs(json.loads(f.read_text()))]
    for part in ("host", "next"):
        ps = [(ref, ratio) for name, ref, ratio in rows if name == part]
        if len(ps) < 3:
            continue
        corr = statistics.correlation([math.log(a) for a, _ in ps], [math.log(b) for _, b in ps])
        plain = sum(abs(b - 1) <= TOLERANCE for _, b in ps)
        scaled = sum(abs(b / a - 1) <= TOLERANCE for a, b in ps)
        print(
            f"{part}: {len(ps)} runs, correlation of log ratios {corr:+.2f}; part within ±20% of its run: "
            f"{plain} as timed, {scaled} scaled by the reference"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
