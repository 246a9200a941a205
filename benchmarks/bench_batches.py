#!/usr/bin/env python3
"""``dlstore bench`` on the GPU machine in one call, measured vs predicted per run.

Sections (``--sections``, run in the order given; one is skipped when its estimate would pass ``--budget-s``):

- ``batches``: 2,048 JPEGs of 300×240, ResNet-18 @112, gpu-augment, at each ``--batches`` size: raw at
  8 workers, ram at 0 and 4 workers, pinned and resident (raw, cached-with-workers, pinned, resident);
- ``default``: ``dlstore bench --out …`` as a user runs it (wall time, goal ≤ 60 s);
- ``decode``: the decode-heavy workload (raw, CPU augment at 224, ResNet-18, batch 64, 0 and 4 workers:
  must be named transform-bound).

Writes ``OUT/bench_batches.json`` after every run (a run cut short still leaves what it measured) and prints
one line per run (measured, predicted, error, bottleneck) plus a summary last. The figures of the sections
this script had before (seeds, compute-heavy, parquet, the decode loop taken apart) are in RESULTS.md.

GPU machine, from the repository root::

    python3 benchmarks/bench_batches.py --out "$OUT" --work /tmp/bb
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlstore.bench import BenchConfig  # noqa: E402

SECTIONS = ("batches", "default", "decode")
# Seconds each part took on the H200 (earlier runs), to skip what would not fit in the budget.
ESTIMATE_S = {
    "batch": 15.0,
    "raw": 12.0,
    "default": 60.0,
}
TOLERANCE = 0.20

Log = Callable[[str], None]


def write_one(args: tuple[str, int, int]) -> None:
    from dlstore.datasets.demo import make_demo_image

    root, index, classes = args
    label = index % classes
    img = make_demo_image(index, label % 5).convert("RGB").resize((300, 240))
    img.save(Path(root) / f"class{label}" / f"{index:05d}.jpg", quality=90)


def make_jpegs(root: Path, n: int, classes: int = 4) -> Path:
    """``n`` photo-like JPEGs of 300×240 in ``classes`` class folders (generated once)."""
    done = root / ".done"
    if done.is_file():
        return root
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool() as pool:
        pool.map(write_one, [(str(root), i, classes) for i in range(n)], chunksize=16)
    done.write_text("ok\n")
    return root


def trim(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without per-step arrays (kept in steps.csv), so the JSON stays small."""
    out = dict(doc)
    out["runs"] = [{k: v for k, v in r.items() if k != "raw"} for r in doc["runs"]]
    out["cold"] = {k: {kk: vv for kk, vv in c.items() if kk != "raw"} for k, c in doc.get("cold", {}).items()}
    return out


class Recorder:
    """Keeps every result and rewrites the JSON after each one."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.path = out / "bench_batches.json"
        self.doc: dict[str, Any] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": {},
            "skipped": [],
        }
        self.t0 = time.perf_counter()
        import harness

        self.environment = harness.environment()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def put(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.save()

    def save(self) -> None:
        self.doc["elapsed_s"] = self.elapsed()
        self.path.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        (self.path.parent / "targets.json").write_text(
            json.dumps({"environment": self.environment, "targets": targets(self.doc)}, indent=1, default=str)
            + "\n"
        )


def bench(name: str, config: BenchConfig, rec: Recorder, log: Log) -> dict[str, Any]:
    """One ``run_bench`` call recorded under ``name``."""
    from dlstore.bench import run_bench

    t0 = time.perf_counter()
    doc = run_bench(config, log=lambda m: log(f"{name}: {m}"))
    rec.doc["runs"][name] = {"wall_s": time.perf_counter() - t0, "doc": trim(doc)}
    rec.save()
    log(f"{name}: {time.perf_counter() - t0:.1f} s")
    print("\n".join(rows(name, doc)), flush=True)  # as it goes: a run cut short still reports
    return doc


def rows(name: str, doc: dict[str, Any]) -> list[str]:
    out = []
    order = list(doc["loaders"])
    for r in sorted(doc["runs"], key=lambda r: (order.index(r["loader"]), r["workers"], not r["pin_memory"])):
        err = r.get("prediction_error")
        flag = "" if err is None or abs(err) <= TOLERANCE else "  MISS"
        out.append(
            f"{name:<14} {doc['protocol']['batch_size']:>5} {r['loader']:<9} {r['workers']:>3} "
            f"{'on' if r['pin_memory'] else 'off':>3} {r['img_per_s']:>9,.0f} {r['predicted_img_per_s'] or 0:>9,.0f} "
            f"{'-' if err is None else f'{100 * err:+.0f}%':>6} {str(r['bottleneck']):<10} "
            f"{host_ms(r)}{flag}"
        )
    return out


def host_ms(run: dict[str, Any]) -> str:
    """The main thread's copy + step calls per batch: measured in the loop / used by the model."""
    b = run.get("budget_ms") or {}
    meas, pred = (b.get("measured") or {}).get("host_ms"), (b.get("predicted") or {}).get("host_ms")
    return "" if meas is None or pred is None else f"{meas:5.1f}/{pred:5.1f}"


def batches_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    jpegs = make_jpegs(args.work / f"jpegs{args.images}", args.images)
    log(f"{args.images} JPEGs ready")
    common = dict(
        source=str(jpegs),
        size=32 if args.smoke else 112,
        model="smallcnn" if args.smoke else "resnet18",
        transform="gpu-augment",
        cache=args.work / "caches",
        cold=False,
        repeats=1,
        max_run_s=None,
        fed_s=args.fed_s,
    )
    for batch in args.batches:
        if (
            rec.elapsed()
            + ESTIMATE_S["batch"] * (1.0 if any(args.cached_workers) else 0.65)  # no worker pools: ~10 s
            + ESTIMATE_S["raw"] * (batch in args.raw_batches)
            > args.budget_s
        ):
            rec.doc["skipped"].append(f"batch {batch}")
            continue
        # ≥ 24 steps of a ~13 ms step: windows of 8–12 steps moved ±25% between runs (round B)
        steps, warmup = (24, 4) if batch >= 256 else (32, 4)
        if batch in args.raw_batches:
            bench(
                f"b{batch}-raw",
                BenchConfig(
                    loaders=("raw",),
                    workers=(8,),
                    batch_size=batch,
                    steps=steps,
                    warmup=warmup,
                    pin_memory="on",
                    **common,
                ),  # type: ignore[arg-type]
                rec,
                log,
            )
        bench(
            f"b{batch}-cached",
            BenchConfig(
                loaders=("ram", "pinned", "resident"),
                workers=args.cached_workers,
                batch_size=batch,
                steps=steps,
                warmup=warmup,
                **common,
            ),  # type: ignore[arg-type]
            rec,
            log,
        )


def decode_config(args: argparse.Namespace, jpegs: Path, workers: tuple[int, ...]) -> BenchConfig:
    return BenchConfig(
        source=str(jpegs),
        loaders=("raw",),
        workers=workers,
        size=32 if args.smoke else 224,
        batch_size=16 if args.smoke else 64,
        model="smallcnn" if args.smoke else "resnet18",
        transform="augment",
        steps=args.decode_steps,
        warmup=2,
        repeats=args.decode_repeats,
        cold=False,
        cache=args.work / "caches",
        max_run_s=None,
        stage_steps=args.decode_stage_steps,
        fed_s=args.fed_s,
    )


def decode_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    jpegs = make_jpegs(args.work / "jpegs384", 384)
    doc = bench("decode-heavy", decode_config(args, jpegs, args.decode_workers), rec, log)
    rec.doc.setdefault("verdicts", {})["decode-heavy"] = [r["bottleneck"] for r in doc["runs"]]


def default_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    t0 = time.perf_counter()
    work = args.work / "default-run"
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["dlstore", "bench", "--out", str(work / "out")],
        capture_output=True,
        text=True,
        check=False,
        cwd=work,  # not the checkout: PYTHONPATH may hold "" (the cwd), whose dlstore/ lacks cli
    )
    wall = time.perf_counter() - t0
    rec.put(
        "default", {"wall_s": wall, "rc": proc.returncode, "text": proc.stdout, "stderr": proc.stderr[-3000:]}
    )
    (args.out / "default.txt").write_text(proc.stdout + f"\nwall {wall:.1f} s rc={proc.returncode}\n")
    result = work / "out" / "result.json"
    if result.is_file():
        doc = json.loads(result.read_text())
        rec.doc["runs"]["default"] = {"wall_s": wall, "doc": trim(doc)}
        rec.save()
        print("\n".join(rows("default", doc)), flush=True)
    log(f"default: {wall:.1f} s rc={proc.returncode}")


def prediction_errors(doc: dict[str, Any]) -> dict[str, list[float]]:
    """Every run's (measured − predicted) / predicted, per group: the ResNet runs (sweep, decode-heavy,
    the default run's."""
    groups: dict[str, list[float]] = {"resnet": [], "default": []}
    for name, res in doc["runs"].items():
        errs = [r["prediction_error"] for r in res["doc"]["runs"] if r.get("prediction_error") is not None]
        groups["default" if name == "default" else "resnet"] += errs
    return groups


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's goals as target rows (benchmarks/harness.py): the share of runs predicted within ±20%
    (goal: all) per group, and the default run's wall time (goal ≤ 60 s)."""
    import harness

    t = harness.Targets()
    what = {"resnet": "ResNet runs (batch sweep, decode-heavy)",
            "default": "default `dlstore bench` runs"}  # fmt: skip
    for group, errs in prediction_errors(doc).items():
        if errs:
            within = sum(abs(e) <= TOLERANCE for e in errs)
            t.add(
                f"bench: {what[group]} predicted within ±20% (share of runs)",
                within,
                len(errs),
                1.0,
                f"errors {100 * min(errs):+.0f}% … {100 * max(errs):+.0f}%",
            )
    if "default" in doc:
        t.add("bench: default `dlstore bench` wall time (s; goal ≤ 60 s)", doc["default"]["wall_s"], 60.0, 1.0,
              f"rc {doc['default']['rc']}", higher=False)  # fmt: skip
    return list(t)


def summary(rec: Recorder) -> list[str]:
    lines = [
        f"{'run':<14} {'batch':>5} {'loader':<9} {'wk':>3} {'pin':>3} {'img/s':>9} {'predicted':>9} {'err':>6} bottleneck"
    ]
    errs = []
    for name, res in rec.doc["runs"].items():
        lines += rows(name, res["doc"])
        errs += [r["prediction_error"] for r in res["doc"]["runs"] if r.get("prediction_error") is not None]
    within = sum(abs(e) <= TOLERANCE for e in errs)
    if errs:
        lines.append(
            f"within ±20%: {within}/{len(errs)} (errors {100 * min(errs):+.0f}% … {100 * max(errs):+.0f}%)"
        )
    if "default" in rec.doc:
        lines.append(
            f"default dlstore bench: {rec.doc['default']['wall_s']:.1f} s, rc {rec.doc['default']['rc']}"
        )
    if "verdicts" in rec.doc:
        lines.append(f"verdicts: {rec.doc['verdicts']}")
    if rec.doc["skipped"]:
        lines.append(f"skipped (budget): {rec.doc['skipped']}")
    lines.append(f"total {rec.elapsed():.0f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/dlstore-bench-batches"))
    p.add_argument("--sections", default=",".join(SECTIONS), help="Run in this order.")
    p.add_argument("--batches", default="32,128,512", help="Batch sizes of the sweep.")
    p.add_argument("--budget-s", type=float, default=140.0, help="Start no section that would end past this.")
    p.add_argument("--images", type=int, default=2048, help="JPEGs for the batch sweep.")
    p.add_argument(
        "--raw-batches", default=None, help="Batch sizes with a raw run (default: all of --batches)."
    )
    p.add_argument(
        "--fed-s", type=float, default=0.4, help="Seconds each fed-step loop is timed (BenchConfig.fed_s)."
    )
    p.add_argument("--decode-repeats", type=int, default=1, help="Repeats of the decode-heavy runs.")
    p.add_argument("--decode-steps", type=int, default=8, help="Timed steps of a decode-heavy run (min).")
    p.add_argument("--decode-stage-steps", type=int, default=12, help="Batches of its loader-alone parts.")
    p.add_argument("--decode-workers", default="0,4", help="Worker counts of the decode-heavy runs.")
    p.add_argument(
        "--cached-workers", default="0,4", help="Worker counts of the ram runs of the batch sweep."
    )
    p.add_argument("--smoke", action="store_true", help="Tiny sizes and SmallCNN: a check on a CPU.")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.decode_workers = tuple(int(w) for w in args.decode_workers.split(",") if w)
    args.cached_workers = tuple(int(w) for w in args.cached_workers.split(",") if w)
    args.raw_batches = (
        args.batches if args.raw_batches is None else [int(b) for b in args.raw_batches.split(",") if b]
    )
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out, args)

    def log(msg: str) -> None:
        print(f"[{rec.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)

    run = {"batches": batches_section, "decode": decode_section, "default": default_section}
    for s in sections:  # in the order given: a round's cap cuts the last ones
        # decode-heavy: ~14 s for its runs and ~9 s per extra repeat (H200)
        estimate = 14.0 + 9.0 * (args.decode_repeats - 1) if s == "decode" else ESTIMATE_S.get(s, 0.0)
        if s != "batches" and rec.elapsed() + estimate > args.budget_s:
            rec.doc["skipped"].append(s)
            log(f"{s}: skipped, would pass the {args.budget_s:.0f} s budget")
            continue
        try:
            run[s](args, rec, log)
        except Exception as e:  # keep the other sections' results
            rec.doc.setdefault("errors", {})[s] = repr(e)
            log(f"{s} failed: {e!r}")
    rec.save()
    print("\n".join(summary(rec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
