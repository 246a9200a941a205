"""Conversion rate: the built-in process pool vs Dask (``--scheduler``), by number of workers.

    python benchmarks/dask_convert.py --out OUTDIR [--images 1024] [--size 128] [--workers 1,2]

For each N: the built-in pool (``workers=N``), ``scheduler="local:N"`` (a LocalCluster started and
stopped by the conversion, so its start-up is in the time), and a running LocalCluster of N workers
by address (start-up excluded: the steady rate). Same source, same format, configurations rotated
over ``--repeats`` rounds; writes OUTDIR/dask_convert.json and prints a table of median img/s.
"""

from __future__ import annotations

import argparse
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
    return p.parse_args()


def rate(src: Any, work: Path, args: argparse.Namespace, **kw: Any) -> float:
    dest = work / "cache"
    shutil.rmtree(dest, ignore_errors=True)
    res = convert(src, dest, format=args.format, size=args.size, **kw)
    return args.images / res.seconds


def main() -> None:
    from distributed import LocalCluster

    args = parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dask-convert-"))
    src = scan_folder(ensure_demo(work / "demo", n_images=args.images))
    runs: dict[str, list[float]] = {}
    try:
        for n in counts:
            with LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster:
                configs = {
                    f"pool:{n}": {"workers": n},
                    f"dask local:{n} (incl. start)": {"scheduler": f"local:{n}"},
                    f"dask running:{n}": {"scheduler": cluster.scheduler_address},
                }
                for r in range(args.repeats):
                    names = list(configs)
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        runs.setdefault(name, []).append(rate(src, work, args, **configs[name]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: float(np.median(v)) for k, v in runs.items()}
    doc = {
        "what": f"convert {args.images} demo images → {args.format} {args.size}px, img/s",
        "runs": runs,
        "median": medians,
        "environment": {
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "distributed": __import__("distributed").__version__,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dask_convert.json").write_text(json.dumps(doc, indent=1))
    for n in counts:
        pool = medians[f"pool:{n}"]
        for name in (f"pool:{n}", f"dask local:{n} (incl. start)", f"dask running:{n}"):
            print(f"{name:<32}{medians[name]:>10,.0f} img/s  {medians[name] / pool:.2f}x pool")


if __name__ == "__main__":
    main()
