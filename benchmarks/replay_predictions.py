#!/usr/bin/env python3
"""Replay recorded ``dlstore bench`` documents through the current prediction model (no measurement).

Each document keeps the parts measured alone (``stages.<kind>.loader_alone``, ``fed_step``, rates) and every
run's measured rate, so a model change can be checked against runs already made on the GPU machine. The
measured rates are the recorded ones; only the predictions are recomputed. Reads ``bench_batches.json`` /
``bench_gpu_*.json`` (documents under ``runs.<name>.doc`` or ``<name>.doc``) or a single ``result.json``.

    python3 benchmarks/replay_predictions.py benchmarks/results/bench_batches_h200_roundA.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dlstore.bench.endtoend import pool_probe_dicts  # noqa: E402
from dlstore.bench.parts import loader_timing_of  # noqa: E402
from dlstore.bench.predict import FedTiming, compose, fed_timing, prediction_error  # noqa: E402
from dlstore.bench.verdict import Facts, KindStages, parts_of, run_stage  # noqa: E402

TOLERANCE = 0.20


def documents(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if "runs" in data and isinstance(data["runs"], list):
        return {"result": data}
    holder = data["runs"] if isinstance(data.get("runs"), dict) else data
    return {k: v["doc"] for k, v in holder.items() if isinstance(v, dict) and "doc" in v}


def kind_stages(entry: dict[str, Any]) -> KindStages:
    loader = {}
    for key, v in entry["loader_alone"].items():
        w, pin = key.split("-")
        loader[(int(w[1:]), pin == "pin")] = loader_timing_of(v)
    fed = {
        name == "pinned": t for name, v in entry.get("fed_step", {}).items() if (t := fed_of(v)) is not None
    }
    cold = entry.get("read_basis", "").startswith("cold")
    return KindStages(
        read=entry.get("read"),
        transform_by_workers={int(k): v for k, v in entry.get("transform_by_workers", {}).items()},
        h2d_pinned=entry.get("h2d"),
        h2d_pageable=entry.get("h2d_pageable"),
        compute=entry.get("compute"),
        loader=loader,
        fed=fed,
        read_limit=entry.get("read") if cold else None,
    )


def fed_of(fed: dict[str, Any]) -> FedTiming | None:
    """The fed step as the current model takes it: pooled from the recorded samples when there are some
    (``predict.fed_timing``), else the recorded summary (documents older than the samples)."""
    if fed.get("samples") and all("free" in s for s in fed["samples"]):
        return fed_timing(fed["samples"])
    if "period_s" not in fed:
        return None
    return FedTiming(fed["period_s"], fed["serial_s"], fed.get("device_s"), fed.get("idle_serial_s"))


IN_CALLER = ("probe", "parts", "beside", "before", "before-beside", "interleaved")


def with_in_caller(run: dict[str, Any], doc: dict[str, Any], basis: str) -> dict[str, Any]:
    """The run as the model would see it with a 0-worker loader's cost taken from ``basis``: ``probe`` (timed
    alone right before each repeat, the model's choice: as recorded), ``parts`` (the parts phase, the model
    before it), ``beside`` (``next()`` between fed steps in the parts phase: the cost under interleaving)."""
    if basis == "probe" or run["workers"] != 0:
        return run
    if basis == "parts":
        return {**run, "loader_probe": None}
    if basis in ("before", "before-beside"):
        return {**run, "loader_probe": probes_before(run, keep_beside=basis == "before-beside")}
    if basis == "interleaved":
        return {**run, "loader_probe": probes_interleaved(run)}
    key = f"w0-{'pin' if run['pin_memory'] else 'nopin'}"
    alone = doc["stages"][run["loader"]]["loader_alone"].get(key, {})
    nxt = alone.get("beside_next_s")
    if nxt is None:
        return {**run, "loader_probe": None}
    return {**run, "loader_probe": {"period_s": nxt, "main_s": nxt, "cpu_s": alone["cpu_s"], "batches": 1}}


def probes_before(run: dict[str, Any], keep_beside: bool) -> dict[str, Any] | None:
    """The run's probes taken before each repeat only, pooled: ``keep_beside`` False is round F's model (the
    loader alone before the run; the step's cost beside the loader from the parts phase)."""
    samples = (run.get("loader_probe") or {}).get("samples", [])
    probes = [p for p in samples if p.get("when", "before") == "before"]  # older documents: before only
    if not keep_beside:
        probes = [{k: v for k, v in p.items() if not k.startswith("beside")} for p in probes]
    return pool_probe_dicts(probes)


def probes_interleaved(run: dict[str, Any]) -> dict[str, Any] | None:
    """The probes around the run with the producer taken from ``next()`` between the fixed-batch steps
    (``beside_next_s``: the loader interleaved with the step, as the loop interleaves it) instead of alone;
    a diagnostic basis, not the model's."""
    pooled = (run.get("loader_probe") or {}).copy()
    beside = [p for p in pooled.get("samples", []) if p.get("beside_batches") and "beside_next_s" in p]
    if "main_s" not in pooled or not beside:
        return pooled or None
    n = sum(p["beside_batches"] for p in beside)
    nxt = sum(p["beside_next_s"] * p["beside_batches"] for p in beside) / n
    return {**pooled, "period_s": nxt, "main_s": nxt}


VARIANTS = {
    "parts": "every part from the parts phase (round D's model)",
    "before": "0-worker loader alone right before each repeat, the step's cost from the parts phase (round F)",
    "before-beside": "both parts right before each repeat (no probe after)",
    "probe": "both parts before and after each repeat, pooled (the model as recorded)",
    "interleaved": "as probe, the 0-worker producer from next() between the probes' fixed-batch steps",
}


def variant_errors(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run's prediction error under each ``VARIANTS`` basis, from the same document (the same run)."""
    by_basis = {basis: replay(doc, basis) for basis in VARIANTS}
    rows = []
    for i, base in enumerate(by_basis["probe"]):
        errors = {basis: rows_[i]["error"] for basis, rows_ in by_basis.items()}
        keep = ("loader", "workers", "pin_memory", "batch", "measured")
        rows.append({**{k: base[k] for k in keep}, "errors": errors})
    return rows


def replay(doc: dict[str, Any], in_caller: str = "probe") -> list[dict[str, Any]]:
    env = doc.get("environment", {})
    facts = Facts(
        device="cuda" if env.get("gpu") else "cpu",
        device_label="",
        batch_size=doc["protocol"]["batch_size"],
        cores=env.get("cpu_usable") or 1,
    )
    stages = {k: kind_stages(v) for k, v in doc["stages"].items()}
    out = []
    for recorded in doc["runs"]:
        run = with_in_caller(recorded, doc, in_caller)
        parts = parts_of(run, stages[run["loader"]], facts)
        pred = compose(parts) if parts else None
        out.append(
            {
                "loader": run["loader"],
                "workers": run["workers"],
                "pin_memory": run["pin_memory"],
                "batch": facts.batch_size,
                "measured": run["img_per_s"],
                "recorded_predicted": run.get("predicted_img_per_s"),
                "recorded_error": run.get("prediction_error"),
                "predicted": pred.img_per_s if pred else None,
                "error": prediction_error(run["img_per_s"], pred.img_per_s) if pred else None,
                "bottleneck": run_stage(pred.bottleneck, run, stages[run["loader"]], facts) if pred else None,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--json", type=Path, help="Write the replayed rows here.")
    p.add_argument(
        "--in-caller",
        choices=IN_CALLER,
        default="probe",
        help="A 0-worker loader's cost: see with_in_caller.",
    )
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for f in args.files:
        for name, doc in documents(json.loads(f.read_text())).items():
            rows += [{"file": f.name, "run": name, **r} for r in replay(doc, args.in_caller)]
    print(
        f"{'run':<16} {'batch':>5} {'loader':<9} {'wk':>3} {'pin':>3} {'img/s':>9} {'recorded':>9} {'err':>6} {'replayed':>9} {'err':>6} bottleneck"
    )
    for r in rows:
        e0, e1 = r["recorded_error"], r["error"]
        print(
            f"{r['run']:<16} {r['batch']:>5} {r['loader']:<9} {r['workers']:>3} {'on' if r['pin_memory'] else 'off':>3} "
            f"{r['measured']:>9,.0f} {r['recorded_predicted'] or 0:>9,.0f} {'-' if e0 is None else f'{100 * e0:+.0f}%':>6} "
            f"{r['predicted'] or 0:>9,.0f} {'-' if e1 is None else f'{100 * e1:+.0f}%':>6} {r['bottleneck']}"
        )
    errs = [r["error"] for r in rows if r["error"] is not None]
    if errs:
        within = sum(abs(e) <= TOLERANCE for e in errs)
        print(
            f"replayed within ±20%: {within}/{len(errs)} ({100 * min(errs):+.0f}% … {100 * max(errs):+.0f}%)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
