#!/usr/bin/env python3
"""Reproduce the two seed experiments with ``dlstore bench``, next to the cached kinds, in one call.

FashionMNIST-format IDX files (synthetic pixels, the real format and size: 60,000 train images of 28×28) are
written with ``dlstore.datasets.mnist_idx``; then, with the seeds' protocol (SmallCNN, 105,866 parameters, Adam, FP32 with
TF32 off, batch 256, pin_memory, persistent workers, prefetch 2, 40 warm-up + 100 timed steps, rounds in
rotated order):

1. ``raw`` = torchvision.datasets.FashionMNIST + ToTensor (``light``) and + RandomResizedCrop(28, .75–1) +
   RandomRotation(15) + flip (``augment``), over workers 0,1,2,4,8,12,16: the seeds themselves;
2. the cached kinds (ram, npz, and zarr when installed) with the same transforms on the CPU, and with
   ``gpu-augment`` (the same random transforms per sample on the device), over a shorter worker sweep.

Each part is one ``run_bench`` call; its document goes to ``OUT/<part>.json`` (plus steps.csv and plots under
``OUT/<part>/``), the whole to ``OUT/seeds.json`` (data and caches stay in ``--work``), and a short table is printed last. A time budget skips
parts that would not fit (they are listed as skipped). No internet is needed.

GPU machine, from the repository root (zarr optional: carry .whl and install it first to include zarr)::

    python benchmarks/seeds.py --out "$OUT"

Tiny check on a laptop::

    python benchmarks/seeds.py --out /tmp/seeds --n-train 2048 --workers 0,1 --cached-workers 0,1 \\
        --warmup 2 --steps 4 --batch-size 64 --repeats 1 --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dlstore.bench.protocol import BenchConfig, parse_int_list  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="Folder for the JSON results (e.g. $OUT).")
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/dlstore-seeds"),
        help="Scratch folder for the IDX files and caches (kept out of OUT, which is copied back).",
    )
    p.add_argument("--n-train", type=int, default=60_000)
    p.add_argument("--workers", default="0,1,2,4,8,12,16", help="Worker sweep for raw (the seeds).")
    p.add_argument("--cached-workers", default="0,2,4,8", help="Worker sweep for the cached kinds.")
    p.add_argument(
        "--formats", default=None, help="Cached kinds to run (default: ram, npz, and zarr when installed)."
    )
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument(
        "--max-run-seconds",
        type=float,
        default=6.0,
        help="Cap on one run's timed phase (a slow configuration still gives ≥ 4 timed steps).",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="Start no part after this many seconds (the longest part takes about 2.5 minutes).",
    )
    p.add_argument(
        "--parts",
        default="raw-light,raw-augment,cached-gpu-augment,cached-light,cached-augment",
        help="In order of importance: the seeds first, then the cached kinds.",
    )
    return p.parse_args(argv)


def cached_formats() -> tuple[str, ...]:
    try:
        import zarr  # noqa: F401
    except ImportError:
        return ("ram", "npz")
    return ("ram", "npz", "zarr")


def parts(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    raw_w, cached_w = parse_int_list(args.workers), parse_int_list(args.cached_workers)
    cached = tuple(f for f in args.formats.split(",") if f) if args.formats else cached_formats()
    table = {
        "raw-light": {"formats": ("raw",), "transform": "light", "workers": raw_w},
        "raw-augment": {"formats": ("raw",), "transform": "augment", "workers": raw_w},
        "cached-light": {"formats": cached, "transform": "light", "workers": cached_w},
        "cached-augment": {"formats": cached, "transform": "augment", "workers": cached_w},
        "cached-gpu-augment": {"formats": cached, "transform": "gpu-augment", "workers": cached_w},
    }
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in table]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {list(table)}")
    return {name: table[name] for name in wanted}


def summary_rows(name: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in doc["runs"]:
        if r["pin_memory"] != doc["protocol"]["pin_memory_default"]:
            continue
        rows.append(
            {
                "part": name,
                "loader": r["loader"],
                "transform": doc["protocol"]["transform"],
                "workers": r["workers"],
                "img_per_s": r["img_per_s"],
                "min": r["img_per_s_min"],
                "max": r["img_per_s_max"],
                "predicted": r["predicted_img_per_s"],
                "bottleneck": r["bottleneck"],
                "wait_over_wall": r["wait"]["sum_over_wall"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from dlstore.bench.run import run_bench
    from dlstore.datasets.mnist_idx import write_fashion_mnist_like

    args = parse_args(argv)
    t0 = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = args.work / "data"
    if not (data / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        write_fashion_mnist_like(data, n_train=args.n_train, n_test=max(1, args.n_train // 6))
    log = lambda msg: print(f"[seeds {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa
    results: dict[str, Any] = {}
    skipped: list[str] = []
    rows: list[dict[str, Any]] = []
    for name, part in parts(args).items():
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(name)
            log(f"{name}: skipped, past the {args.budget_s:.0f} s budget")
            continue
        log(f"{name}: {','.join(part['formats'])} × {part['transform']} × workers {part['workers']}")
        config = BenchConfig(
            source="torchvision:FashionMNIST",
            root=data,
            loaders=part["formats"],
            workers=part["workers"],
            batch_size=args.batch_size,
            model="smallcnn",
            precision="fp32",  # the seeds' protocol: FP32, TF32 off, no channels_last
            channels_last=False,
            transform=part["transform"],
            device=args.device,
            repeats=args.repeats,
            steps=args.steps,
            warmup=args.warmup,
            stage_steps=min(args.steps, 20),
            max_run_s=args.max_run_seconds,
            cold=False,
            out=out / name,
            demo_images=1,
            cache=args.work / "caches",
        )
        doc = run_bench(config, log=log)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        results[name] = {
            "verdict": doc["verdict"],
            "recommendations": doc["recommendations"],
            "stages": {
                k: {s: v[s] for s in ("read", "transform", "h2d", "compute")}
                for k, v in doc["stages"].items()
            },
            "elapsed_s": doc["elapsed_s"],
            "file": f"{name}.json",
        }
        rows += summary_rows(name, doc)
        env = doc["environment"]
    summary = {
        "what": "dlstore seeds reproduction (FashionMNIST-format IDX, SmallCNN, batch 256)",
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": env if results else None,
        "parts": results,
        "skipped": skipped,
        "table": rows,
        "elapsed_s": time.perf_counter() - t0,
    }
    (out / "seeds.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(render(rows, summary))
    return 0


def render(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    env = summary.get("environment") or {}
    gpu = (env.get("gpu") or {}).get("name", "no GPU")
    lines = [
        f"seeds reproduction on {gpu}, {env.get('cpu_usable')} cores, torch {env.get('versions', {}).get('torch')}"
        f", {summary['elapsed_s']:.0f} s",
        "",
        f"{'loader':<6} {'transform':<11} {'wk':>3} {'img/s':>9} {'min–max':>19} {'predicted':>9} "
        f"{'bottleneck':<10} {'Σwait/wall':>10}",
    ]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:,.0f}"
        lines.append(
            f"{r['loader']:<6} {r['transform']:<11} {r['workers']:>3} {r['img_per_s']:>9,.0f} "
            f"{r['min']:>9,.0f}–{r['max']:<9,.0f} {pred:>9} {str(r['bottleneck']):<10} "
            f"{'-' if r['wait_over_wall'] is None else format(100 * r['wait_over_wall'], '.0f') + '%':>10}"
        )
    if summary["skipped"]:
        lines.append(f"skipped (time budget): {', '.join(summary['skipped'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
