"""Conversion rate: the built-in process pool vs Dask (``--scheduler``), by number of workers.

    python benchmarks/dask_convert.py --out OUTDIR [--images 1024] [--size 128] [--workers 1,2]
        [--source DIR --copies K]

``--source DIR`` converts an existing image folder (K hard-linked copies of each file with ``--copies``,
so a long run needs no new images) instead of generating ``--images`` demo images.

For each N: the built-in pool (``workers=N``), ``scheduler="local:N"`` (the conversion starts and
stops its cluster, so the cluster's start is in the time), and the same cluster (``start_local_cluster``)
started beforehand and used by address (its start timed apart: the rate on a running cluster). Same
source, same format, configurations rotated over ``--repeats`` rounds; writes OUTDIR/dask_convert.json
(every run's stages: the Dask start steps, units per worker, the tail) and prints a table of median
img/s. ``--budget-s`` skips a run that would not finish in time (estimated from the pool's run);
``--start-sweep 16x1,4x4`` then times cluster starts alone (worker processes x threads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore.convert.conversion import convert  # noqa: E402
from dlstore.convert.dask_engine import start_local_cluster  # noqa: E402
from dlstore.convert.sources import scan_folder  # noqa: E402
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
    p.add_argument("--copies", type=int, default=1, help="hard-linked copies of the source's files")
    p.add_argument("--per-class", type=int, default=0, help="only the first K files of each class (0: all)")
    p.add_argument(
        "--configs", default="pool,local,running", help="which of pool / local (incl. start) / running to run"
    )
    p.add_argument("--dest-dir", type=Path, default=None, help="where the caches go (e.g. /dev/shm)")
    p.add_argument("--budget-s", type=float, default=0.0, help="skip runs that would end past this (0: none)")
    p.add_argument(
        "--start-sweep", default="", help="after the runs: cluster starts alone, e.g. 16x1,4x4,1x16"
    )
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


T_START = time.monotonic()


def rate(src: Any, work: Path, args: argparse.Namespace, details: list[Any], name: str, **kw: Any) -> float:
    dest = (args.dest_dir or work) / f"dask-convert-cache-{os.getpid()}"
    shutil.rmtree(dest, ignore_errors=True)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    res = convert(src, dest, format=args.format, size=args.size, **kw)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(dest, ignore_errors=True)
    driver_cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    details.append(
        {
            "config": name,
            "seconds": res.seconds,
            "workers": res.workers,
            "driver_cpu_s": driver_cpu,
            "stages": res.stages,
        }
    )
    harness.log(f"{name}: {res.n} images in {res.seconds:.2f} s = {res.n / res.seconds:,.0f} img/s")
    return len(src) / res.seconds


def write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """After every run, so a run cut short by a time limit still leaves what it measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dask_convert.json").write_text(json.dumps(doc, indent=1))


def start_running(n: int, doc: dict[str, Any]) -> Any:
    """``local:N``'s own cluster, started before the conversion that uses it by address; its start (up
    to every worker able to fork a decode process) is timed apart."""
    from distributed import Client

    t0 = time.monotonic()
    cluster = start_local_cluster(n)
    with Client(cluster) as client:
        client.wait_for_workers(len(cluster.workers), timeout=120)
        t_workers = time.monotonic() - t0
        client.run(decode_process_ready)
    doc.setdefault("running_cluster_start", []).append(
        {"n": n, "workers_registered_s": t_workers, "decode_process_ready_s": time.monotonic() - t0}
    )
    return cluster


def decode_process_ready() -> float:
    """On a worker: start (and end) one process from the decode fork server, as a first unit would."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from dlstore.convert.dask_engine import warm_decode_forkserver

    warm_decode_forkserver()
    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]  # as _child_pool does
    t0 = time.monotonic()
    with ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
        pool.submit(os.getpid).result()
    return time.monotonic() - t0


def start_sweep(layouts: str, doc: dict[str, Any], args: argparse.Namespace) -> None:
    """Cluster starts alone (no conversion): WxT = W worker processes of T threads, up to every worker
    registered and able to fork a decode process; lcWxT: the same with ``LocalCluster`` (nannies,
    workers spawned by multiprocessing: they and their decode processes re-import this script)."""
    from distributed import Client

    for layout in filter(None, layouts.split(",")):
        reserve = 25 if layout.startswith("lc") else 10  # the old LocalCluster takes several seconds
        if args.budget_s and time.monotonic() - T_START > args.budget_s - reserve:
            doc.setdefault("start_sweep", []).append({"layout": layout, "skipped": "budget"})
            continue
        old = layout.startswith("lc")  # the LocalCluster (nanny, spawn) that local:N started before
        w, t = (int(x) for x in layout.removeprefix("lc").split("x"))
        t0 = time.monotonic()
        if old:
            from distributed import LocalCluster

            cluster = LocalCluster(n_workers=w, threads_per_worker=t, processes=True, dashboard_address=":0")
        else:
            cluster = start_local_cluster(w * t, most_threads=t)
        t_up = time.monotonic() - t0
        with Client(cluster) as client:
            client.wait_for_workers(w, timeout=120)
            t_reg = time.monotonic() - t0
            fork = client.run(decode_process_ready)
            t_ready = time.monotonic() - t0
        t1 = time.monotonic()
        cluster.close()
        row = {
            "layout": layout,
            "cluster_up_s": t_up,
            "workers_registered_s": t_reg,
            "decode_process_ready_s": t_ready,
            "first_decode_fork_s_max": max(fork.values()),
            "close_s": time.monotonic() - t1,
        }
        doc.setdefault("start_sweep", []).append(row)
        harness.log(f"start {layout}: {row}")
        write(args, doc)


def fits(args: argparse.Namespace, runs: dict[str, list[float]], n_img: int, extra: float = 0.0) -> bool:
    """Whether another run fits in --budget-s: the pool's time x 1.4 (+ ``extra``), or 60 s unknown."""
    if not args.budget_s:
        return True
    pools = [v for k, vs in runs.items() if k.startswith("pool") for v in vs]
    need = 1.4 * n_img / max(pools) + extra if pools else 60.0
    return time.monotonic() - T_START + need < args.budget_s


def main() -> None:
    args = parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dask-convert-"))
    t0 = time.monotonic()
    base = args.source or ensure_demo(work / "demo", n_images=args.images)
    t_demo = time.monotonic() - t0
    if args.source is None and args.copies <= 1 and not args.per_class:
        src = scan_folder(base)
    else:
        src = scan_folder(linked_copies(base, work / "src", args.copies, args.per_class))
    harness.log(
        f"source: {len(src)} images (demo {t_demo:.1f} s, links {time.monotonic() - t0 - t_demo:.1f} s)"
    )
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
            "commit": os.environ.get("DLSTORE_COMMIT", ""),
            "command": "python3 " + " ".join(sys.argv),
        },
    }
    try:
        for n in counts:
            every = {
                "pool": f"pool:{n}",
                "local": f"dask local:{n} (incl. start)",
                "running": f"dask running:{n}",
            }
            names = [every[c] for c in args.configs.split(",")]
            for r in range(args.repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    if not fits(args, runs, len(src), extra=5.0 if "running" in name else 0.0):
                        harness.log(f"{name}: skipped, it would not end within --budget-s {args.budget_s:g}")
                        doc.setdefault("skipped", []).append(name)
                        continue
                    if "running" in name:
                        # The cluster the conversion would start, started beforehand (timed apart).
                        cluster = start_running(n, doc)
                        try:
                            runs.setdefault(name, []).append(
                                rate(src, work, args, details, name, scheduler=cluster.scheduler_address)
                            )
                        finally:
                            cluster.close()
                    else:
                        kw = {"workers": n} if name.startswith("pool") else {"scheduler": f"local:{n}"}
                        runs.setdefault(name, []).append(rate(src, work, args, details, name, **kw))
                    write(args, doc)
        start_sweep(args.start_sweep, doc, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {k: float(np.median(v)) for k, v in runs.items()}
    doc["median"] = medians
    write(args, doc)
    report(args, doc, counts, medians, details, len(src))


def report(
    args: argparse.Namespace,
    doc: dict[str, Any],
    counts: list[int],
    medians: dict[str, float],
    details: list[Any],
    n_img: int,
) -> None:
    targets = harness.Targets()
    starts = {row["n"]: row["decode_process_ready_s"] for row in doc.get("running_cluster_start", [])}
    for n in counts:
        pool = medians.get(f"pool:{n}", 0.0)
        for name, what in (
            (f"dask local:{n} (incl. start)", "--scheduler local, cluster start included"),
            (f"dask running:{n}", "on a running cluster"),
        ):
            if name in medians and pool:
                note = f"{args.repeats} round(s), median img/s; stages in dask_convert.json"
                if n in starts and "running" in name:
                    note += f"; that cluster's start, not included: {starts[n]:.2f} s"
                targets.add(
                    f"Dask convert ({what}:{n}, {args.format} {args.size}px, {n_img:,} images) vs the pool",
                    medians[name],
                    pool,
                    0.9,
                    note,
                )
    env = harness.environment(distributed=__import__("distributed").__version__)
    (args.out / "targets.json").write_text(
        json.dumps({"environment": env, "targets": targets}, indent=1, default=str)
    )
    for d in details:
        st = d["stages"]
        keys = [k for k in st if k.startswith("dask_") or k.startswith("slot") or k.startswith("units_per")]
        print(
            f"{d['config']}: "
            + ", ".join(f"{k}={st[k]:.2f}" for k in ["setup_s", "run_s", "startup_s", *keys])
        )
    for row in doc.get("running_cluster_start", []) + doc.get("start_sweep", []):
        print("cluster start:", {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    print(
        f"{'config':<28}{'img/s':>8}{'x pool':>7}{'total s':>8}{'setup':>6}{'wait':>6}{'1st':>6}"
        f"{'tail':>6}{'close':>6}{'idle':>6}{'dec ms':>7}{'wr ms':>6}{'drv cpu':>8}"
    )
    for d in details:
        st, n = d["stages"], d["workers"]
        asked = d["config"].split(":")[1].split(" ")[0]  # the N of "pool:N", "dask local:N (incl. start)"
        pool = medians.get(f"pool:{asked}", float("nan"))
        print(
            f"{d['config']:<28}{n_img / d['seconds']:>8,.0f}{n_img / d['seconds'] / pool:>7.3f}{d['seconds']:>8.2f}"
            f"{st.get('setup_s', 0):>6.2f}{st.get('dask_start_wait_s', 0):>6.2f}{st.get('startup_s', 0):>6.2f}"
            f"{st.get('slot_last_end_max_s', 0) - st.get('slot_last_end_min_s', 0):>6.2f}"
            f"{st.get('dask_close_s', 0):>6.2f}"
            f"{st.get('workers_other_or_idle_s', 0) / max(1e-9, n * st['run_s']):>6.1%}"
            f"{1e3 * st.get('workers_decode_s', 0) / n_img:>7.2f}{1e3 * st.get('workers_write_s', 0) / n_img:>6.2f}"
            f"{d['driver_cpu_s']:>8.1f}"
        )
    print(targets.table())


if __name__ == "__main__":
    main()
