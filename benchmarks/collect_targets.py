"""Write ``results/targets.json`` from one complete run: the ``targets.json`` each benchmark script left
under the run's output folder (``RUN/NAME/targets.json``), all from one commit on one machine.

    python3 benchmarks/collect_targets.py RUN_DIR --commit C --machine "..." [--out benchmarks/results/targets.json]

The file is replaced, not merged: it holds the latest complete run only (older runs stay in RESULTS.md and
their raw JSON files). Each target keeps the name of the script run that measured it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def collect(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    runs: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("*/targets.json")):
        doc = json.loads(path.read_text())
        env = doc.get("environment") or {}
        name = path.parent.name
        runs[name] = {"command": env.get("command"), "date": env.get("date"), "environment": env}
        targets += [{**t, "run": name} for t in doc.get("targets", [])]
    return runs, targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--request", default="", help="the request script that ran them all (recorded)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "targets.json")
    args = ap.parse_args()
    runs, targets = collect(args.run_dir)
    if not targets:
        raise SystemExit(f"{args.run_dir}: no */targets.json with targets; nothing written")
    doc = {
        "machine": args.machine,
        "commit": args.commit,
        "request": args.request,
        "note": (
            "One complete run of the benchmark scripts below, one after another on one machine from one "
            "commit; every ratio is measured side by side inside its script's run."
        ),
        "runs": runs,
        "targets": targets,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    met = sum(t["met"] for t in targets)
    print(f"{args.out}: {len(targets)} targets from {len(runs)} runs, {met} met")


if __name__ == "__main__":
    main()
