"""Conversion rate: the built-in process pool vs Dask (``--scheduler``), by number of workers.

    python benchmarks/dask_convert.py --out OUTDIR [--images 1024] [--size 128] [--workers 1,2]
        [--source DIR --copies K]

``--source DIR`` converts an existing image folder (K hard-linked copies of each file with ``--copies``,
so a long run needs no new images) instead of generating ``--images`` demo images.

For each N: the built-in pool (``workers=N``), ``scheduler="local:N"`` (a LocalCluster started and
stopped by the conversion, so its start-up is in the time), and a running LocalCluster of N workers
by address (start-up excluded: the steady rate). Same source, same format, configurations rotated
over ``--repeats`` rounds; writes OUTDIR/dask_convert.json and prints a table of median img/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore.build.conversion import convert  # noqa: E402
from dlstore.build.sources import scan_folder  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--format", default="npz")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--source", type=Path, default=None, help="an existing image folder (else the demo)")
    p.add_argument("--copies", type=int, default=1, help="hard-linked copies of --source's files")
    p.add_argument("--per-class", type=int, default=0, help="only the first K files of each class (0: all)")
    p.add_argument(
        "--configs", default="pool,local,running", help="which of pool / local (incl. start) / running to run"
    )
    p.add_argument("--dest-dir", type=Path, default=None, help="where the caches go (e.g. /dev/shm)")
    return p.parse_args()


def linked_copies(source: Path, dest: Path, copies: int, per_class: int = 0) -> Path:
    """``copies`` hard links of every image (or the first ``per_class`` of each class) under new
    names, same classes."""
    for cls in sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")):
        (dest / cls.name).mkdir(parents=True)
        files = sorted(f for f in cls.iterdir() if f.is_file() and not f.name.startswith("."))
        for f in files[: per_class or None]:
            for c in range(copies):
                os.link(f, dest / cls.name / f"{c:03d}_{f.name}")
    return dest


def rate(src: Any, work: Path, args: argparse.Namespace, details: list[Any], name: str, **kw: Any) -> float:
    dest = (args.dest_dir or work) / f"dask-convert-cache-{os.getpid()}"
    shutil.rmtree(dest, ignore_errors=True)
    res = convert(src, dest, format=args.format, size=args.size, **kw)
    shutil.rmtree(dest, ignore_errors=True)
    details.append({"config": name, "seconds": res.seconds, "stages": res.stages})
    return len(src) / res.seconds


def write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """After every run, so a run cut short by a time limit still leaves what it measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dask_convert.json").write_text(json.dumps(doc, indent=1))


def main() -> None:
    from distributed import LocalCluster

    args = parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dask-convert-"))
    if args.source is None:
        src = scan_folder(ensure_demo(work / "demo", n_images=args.images))
    else:
        src = scan_folder(linked_copies(args.source, work / "src", args.copies, args.per_class))
    runs: dict[str, list[float]] = {}
    details: list[Any] = []
    doc: dict[str, Any] = {
        "what": f"convert {len(src)} images ({args.source or 'demo'}) → {args.format} {args.size}px, img/s",
        "runs": runs,
        "details": details,
        "environment": {
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "distributed": __import__("distributed").__version__,
            "command": "python3 " + " ".join(sys.argv),
        },
    }
    try:
        for n in counts:
            # The running cluster's scheduler and nannies live in this process: only when measured
            # (they share the GIL with pool:1, which converts in this process).
            wanted = "running" in args.configs.split(",")
            running = (
                LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") if wanted else None
            )
            with running or contextlib.nullcontext():
                every = {
                    "pool": (f"pool:{n}", {"workers": n}),
                    "local": (f"dask local:{n} (incl. start)", {"scheduler": f"local:{n}"}),
                    "running": (
                        f"dask running:{n}",
                        {"scheduler": running.scheduler_address if running else ""},
                    ),
                }
                configs = dict(every[c] for c in args.configs.split(","))
                for r in range(args.repeats):
                    names = list(configs)
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        runs.setdefault(name, []).append(
                            rate(src, work, args, details, name, **configs[name])
                        )
                        write(args, doc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: float(np.median(v)) for k, v in runs.items()}
    doc["median"] = medians
    write(args, doc)
    n_img = len(src)
    targets = harness.Targets()
    for n in counts:
        pool = medians.get(f"pool:{n}", 0.0)
        for name, what in (
            (f"dask local:{n} (incl. start)", "--scheduler local"),
            (f"dask running:{n}", "a running cluster"),
        ):
            if name in medians and pool:
                targets.add(
                    f"Dask convert ({what}:{n}, ram {args.size}px, {n_img:,} images) vs the built-in pool at {n} workers",
                    medians[name],
                    pool,
                    0.9,
                    f"{args.repeats} round(s), median img/s; start-up and decode per image in dask_convert.json",
                )
    env = harness.environment(distributed=__import__("distributed").__version__)
    (args.out / "targets.json").write_text(
        json.dumps({"environment": env, "targets": targets}, indent=1, default=str)
    )
    for n in counts:
        pool = medians.get(f"pool:{n}", float("nan"))
        for name in (f"pool:{n}", f"dask local:{n} (incl. start)", f"dask running:{n}"):
            if name in medians:
                st = [d["stages"] for d in details if d["config"] == name]
                decode = np.median([1e3 * s.get("workers_decode_s", 0) / n_img for s in st])
                start = np.median([s.get("startup_s", 0) for s in st])
                idle = np.median(
                    [s.get("workers_other_or_idle_s", 0) / max(1e-9, n * s["run_s"]) for s in st]
                )
                print(
                    f"{name:<32}{medians[name]:>10,.0f} img/s  {medians[name] / pool:.2f}x pool  "
                    f"start-up {start:.2f} s  decode {decode:.2f} ms/img  idle {idle:.0%}"
                )
    print(targets.table())


if __name__ == "__main__":
    main()
