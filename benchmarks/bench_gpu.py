#!/usr/bin/env python3
"""``dlstore bench`` on the GPU machine, in one call: the issue-12 table, a batch-size sweep, the default run
and the decode-/compute-heavy verdicts. Writes ``OUT/bench_gpu.json`` (every document, trimmed of per-step
arrays) plus the table run's ``result.json`` and ``timeline.png``, and prints a short table last.

Sections (``--sections``, comma-separated):

- ``table``: 384 JPEGs of 300×240 in 4 classes, ResNet-18 @112, batch 128, gpu-augment, loaders
  raw/ram/zarr/pinned at workers 0,4,8, 2 repeats (the table of issue 12, "after");
- ``batches``: 2,048 JPEGs of 300×240, batch 32 and 512: raw at 8 workers, ram at 0 and 4, pinned, resident;
- ``default``: ``dlstore bench --out …`` as a user runs it (wall time, goal ≤ 60 s);
- ``workloads``: decode-heavy (raw, CPU augment at 224 px, 0 and 4 workers, ResNet-18) must be named
  transform-bound; compute-heavy (ram, ResNet-50 @224, batch 256, 4 workers) compute-bound.

GPU machine, from the repository root::

    python3 benchmarks/bench_gpu.py --out "$OUT" --work /tmp/bg
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dlstore.bench.protocol import BenchConfig  # noqa: E402

SECTIONS = ("table", "batches", "default", "workloads")


def write_one(args: tuple[str, int, int]) -> None:
    from dlstore.datasets.demo import make_demo_image

    root, index, classes = args
    label = index % classes
    img = make_demo_image(index, label % 5).convert("RGB").resize((300, 240))
    path = Path(root) / f"class{label}" / f"{index:05d}.jpg"
    img.save(path, quality=90)


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


def run(name: str, config: BenchConfig, results: dict[str, Any], log: Any) -> dict[str, Any]:
    from dlstore.bench.run import run_bench

    t0 = time.perf_counter()
    log(f"{name}: start")
    doc = run_bench(config, log=lambda m: log(f"{name}: {m}"))
    results[name] = {"wall_s": time.perf_counter() - t0, "doc": trim(doc)}
    log(f"{name}: {time.perf_counter() - t0:.0f} s, phases {doc['phases']}")
    print("\n".join(table_rows(name, doc)), flush=True)  # as it goes: a run cut short still reports
    if results.get("_out"):
        Path(results["_out"]).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return doc


def table_rows(name: str, doc: dict[str, Any]) -> list[str]:
    rows = []
    for r in sorted(doc["runs"], key=lambda r: (list(doc["loaders"]).index(r["loader"]), r["workers"])):
        err = r.get("prediction_error")
        rows.append(
            f"{name:<10} {doc['protocol']['batch_size']:>5} {r['loader']:<8} {r['workers']:>3} "
            f"{'on' if r['pin_memory'] else 'off':>3} {r['img_per_s']:>9,.0f} {r['predicted_img_per_s'] or 0:>9,.0f} "
            f"{'-' if err is None else f'{100 * err:+.0f}%':>6} {str(r['bottleneck']):<10}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/dlstore-bench-gpu"))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "sections": sections,
        "_out": str(args.out / f"bench_gpu_{'-'.join(sections)}.json"),
    }
    common = dict(
        cache=args.work / "caches", cold=False, repeats=args.repeats, transform="gpu-augment", max_run_s=None
    )
    if "table" in sections:
        jpegs = make_jpegs(args.work / "jpegs384", 384)
        log("384 JPEGs ready")
        doc = run(
            "table",
            BenchConfig(
                source=str(jpegs),
                loaders=("raw", "ram", "zarr", "pinned"),
                workers=(0, 4, 8),
                size=112,
                batch_size=128,
                model="resnet18",
                out=args.work / "table",
                **common,  # type: ignore[arg-type]
            ),
            results,
            log,
        )
        (args.out / "table_result.json").write_text(json.dumps(trim(doc), indent=1, default=str) + "\n")
        for f in ("timeline.png", "plots.png"):
            if (args.work / "table" / f).is_file():
                (args.out / f"table_{f}").write_bytes((args.work / "table" / f).read_bytes())
    if "batches" in sections:
        jpegs = make_jpegs(args.work / "jpegs2048", 2048)
        log("2,048 JPEGs ready")
        for batch in (32, 512):
            for loaders, workers in ((("raw",), (8,)), (("ram", "pinned", "resident"), (0, 4))):
                run(
                    f"b{batch}-{loaders[0]}",
                    BenchConfig(
                        source=str(jpegs),
                        loaders=loaders,
                        workers=workers,
                        size=112,
                        batch_size=batch,
                        model="resnet18",
                        steps=8 if batch == 512 else 16,
                        warmup=2 if batch == 512 else 4,
                        **{**common, "repeats": 1},  # type: ignore[arg-type]
                    ),
                    results,
                    log,
                )
    if "default" in sections:
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["dlstore", "bench", "--out", str(args.work / "default")],
            capture_output=True,
            text=True,
            check=False,
            cwd=args.work,  # not the checkout: PYTHONPATH may hold "" (the cwd), whose dlstore/ lacks cli
        )
        wall = time.perf_counter() - t0
        results["default"] = {
            "wall_s": wall,
            "rc": proc.returncode,
            "text": proc.stdout,
            "stderr": proc.stderr[-4000:],
        }
        (args.out / "default.txt").write_text(proc.stdout + f"\nwall {wall:.1f} s rc={proc.returncode}\n")
        log(f"default: {wall:.0f} s rc={proc.returncode}")
    if "workloads" in sections:
        jpegs = make_jpegs(args.work / "jpegs384", 384)
        heavy = run(
            "decode-heavy",
            BenchConfig(
                source=str(jpegs),
                loaders=("raw",),
                workers=(0, 4),
                size=224,
                batch_size=64,
                model="resnet18",
                transform="augment",
                steps=8,
                warmup=2,
                repeats=1,
                cold=False,
                cache=args.work / "caches",
                max_run_s=None,
            ),
            results,
            log,
        )
        compute = run(
            "compute-heavy",
            BenchConfig(
                source=str(jpegs),
                loaders=("ram",),
                workers=(4,),
                size=224,
                batch_size=256,
                model="resnet50",
                steps=8,
                warmup=2,
                **{**common, "repeats": 1},  # type: ignore[arg-type]
            ),
            results,
            log,
        )
        results["verdicts"] = {
            "decode-heavy": [r["bottleneck"] for r in heavy["runs"]],
            "compute-heavy": [r["bottleneck"] for r in compute["runs"]],
        }
    results["elapsed_s"] = time.perf_counter() - t_start
    Path(results["_out"]).write_text(json.dumps(results, indent=1, default=str) + "\n")
    lines = [
        f"{'run':<10} {'batch':>5} {'loader':<8} {'wk':>3} {'pin':>3} {'img/s':>9} {'predicted':>9} {'err':>6} bottleneck"
    ]
    for name, res in results.items():
        if isinstance(res, dict) and "doc" in res:
            lines += table_rows(name, res["doc"])
    if "default" in results:
        lines.append(
            f"default dlstore bench: {results['default']['wall_s']:.1f} s, rc {results['default']['rc']}"
        )
    if "verdicts" in results:
        lines.append(f"verdicts: {results['verdicts']}")
    lines.append(f"total {results['elapsed_s']:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
