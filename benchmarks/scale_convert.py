"""Conversion and opening at 10k / 100k / 300k tiny images: is the cost linear in N and memory flat?

    python benchmarks/scale_convert.py --counts 10000,100000,300000 --out benchmarks/results/scale_convert.json
    python benchmarks/scale_convert.py --source parquet --counts 100000,1000000 \
        --out benchmarks/results/scale_convert_parquet.json

``--source parquet``: one parquet file per N in Hugging Face's layout (``struct<bytes, path>`` images,
a ``ClassLabel`` label, 1000-row row groups), the same tiny JPEGs cycled from a pool of 10k, converted
with the default shuffled storage order.

Generates N tiny JPEGs (16x16, 100 class folders; one pool, hard-linked into one tree per N so the
trees cost no extra disk), then per N runs ``dlstore convert SRC DEST --format F --size 8`` in a
subprocess and records: wall time, peak RSS and PSS of the whole process tree (summed over the
converter and its workers, sampled every 50 ms from /proc), the bytes of the cache's metadata files
(everything but the pixel data) per image, and the time to open the cache (``open_cache`` and
``CachedDataset``, each in a fresh interpreter after the imports, best of 5).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CLASSES = 100
META_FILES = ("dlstore.json", "labels.npy", "positions.npy", "sources.npz", "skipped.json")


def make_pool(pool: Path, n: int, procs: int = 2) -> list[Path]:
    """n tiny JPEGs under pool/<class>/; files already there are kept."""
    names = [pool / f"c{i % CLASSES:03d}" / f"img{i:07d}.jpg" for i in range(n)]
    for c in range(CLASSES):
        (pool / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    todo = [str(p) for p in names if not p.exists()]
    if todo:
        with ProcessPoolExecutor(procs) as ex:
            list(ex.map(_write_batch, [todo[i : i + 5000] for i in range(0, len(todo), 5000)]))
    return names


def _write_batch(paths: list[str]) -> None:
    rng = np.random.default_rng(len(paths) + hash(paths[0]) % 1000)
    for p in paths:
        base = rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((16, 16), Image.BILINEAR)
        img.save(p, quality=90)


def link_tree(files: list[Path], pool: Path, tree: Path) -> None:
    if tree.exists():
        return
    for f in files:
        dest = tree / f.relative_to(pool)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, dest)


def tree_pids(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack += children.get(pid, [])
    return out


def rss_pss(pids: list[int]) -> tuple[int, int, int]:
    """(RSS, PSS, PSS of anonymous memory) bytes summed over ``pids``. The last leaves out file pages
    mapped in, such as the ram format's memory-mapped output, which the kernel writes back and drops as
    needed: it is the memory the conversion holds."""
    rss = pss = anon = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                elif line.startswith("Pss_Anon:"):
                    anon += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss, anon


def make_parquet(pool: list[Path], n: int, out: Path, rows_per_group: int = 1000) -> Path:
    """n rows of HF-layout parquet, written one row group at a time (bounded memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if out.exists():
        return out
    blobs = [p.read_bytes() for p in pool]
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    names = [f"c{c:03d}" for c in range(CLASSES)]
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())]).with_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )
    tmp = out.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, n, rows_per_group):
            idx = range(start, min(n, start + rows_per_group))
            images = [{"bytes": blobs[i % len(blobs)], "path": f"{i:07d}.jpg"} for i in idx]
            labels = [(i % len(blobs)) % CLASSES for i in idx]
            writer.write_table(
                pa.table({"image": pa.array(images, image_type), "label": labels}, schema=schema),
                row_group_size=rows_per_group,
            )
    tmp.rename(out)
    return out


def run_convert(src: Path, dest: Path, fmt: str, workers: int) -> dict[str, Any]:
    exe = Path(sys.executable).with_name("dlstore")
    cmd = [str(exe), "convert", str(src), str(dest), "--format", fmt, "--size", "8"]
    cmd += ["--workers", str(workers), "--overwrite", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak_rss = peak_pss = peak_anon = 0
    while proc.poll() is None:
        rss, pss, anon = rss_pss(tree_pids(proc.pid))
        peak_rss, peak_pss, peak_anon = max(peak_rss, rss), max(peak_pss, pss), max(peak_anon, anon)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"convert failed ({proc.returncode}): {out[-2000:]}")
    result = json.loads(out)
    return {
        "wall_s": wall,
        "peak_rss": peak_rss,
        "peak_pss": peak_pss,
        "peak_anon": peak_anon,
        "n": result["n"],
    }


OPEN_PROBE = """
import sys, time, warnings
from dlstore import CachedDataset, open_cache
import torch
dest = sys.argv[1]
best = {}
for name, fn in (("open_cache", open_cache), ("CachedDataset", CachedDataset)):
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); fn(dest); times.append(time.perf_counter() - t0)
    best[name] = min(times)
print(best["open_cache"], best["CachedDataset"])
"""


def open_times(dest: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", OPEN_PROBE, str(dest)], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"open_cache_s": float(out[0]), "CachedDataset_s": float(out[1])}


def metadata_bytes(dest: Path) -> int:
    return sum((dest / name).stat().st_size for name in META_FILES if (dest / name).exists())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="10000,100000,300000")
    ap.add_argument("--source", choices=["folder", "parquet"], default="folder")
    ap.add_argument("--format", default="ram")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dlstore-scale"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scale_convert.json"))
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    t0 = time.perf_counter()
    pool_n = max(counts) if args.source == "folder" else min(max(counts), 10_000)
    files = make_pool(args.work / "pool", pool_n)
    print(f"generated {pool_n} images in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for n in counts:
        dest = args.work / f"cache-{args.source}-{n}"
        if args.source == "parquet":
            src = make_parquet(files, n, args.work / f"src-{n}.parquet")
        else:
            src = args.work / f"src-{n}"
            link_tree(files[:n], args.work / "pool", src)
        row = {"n": n, **run_convert(src, dest, args.format, args.workers)}
        row["metadata_bytes"] = metadata_bytes(dest)
        row["metadata_bytes_per_image"] = row["metadata_bytes"] / n
        row.update(open_times(dest))
        rows.append(row)
        print(json.dumps(row), flush=True)
        doc = {
            "rows": rows,
            "source": args.source,
            "format": args.format,
            "workers": args.workers,
            "command": " ".join(["python", *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # Written after each N: a long run stopped early keeps its rows.
        args.out.write_text(json.dumps(doc, indent=1))
    print(
        f"\n{'N':>8} {'wall s':>8} {'peak RSS MB':>12} {'peak PSS MB':>12} {'anon PSS MB':>12} {'meta B/img':>11} "
        f"{'open ms':>8}"
    )
    for r in rows:
        print(
            f"{r['n']:>8} {r['wall_s']:>8.1f} {r['peak_rss'] / 1e6:>12.0f} {r['peak_pss'] / 1e6:>12.0f} "
            f"{r['peak_anon'] / 1e6:>12.0f} "
            f"{r['metadata_bytes_per_image']:>11.1f} {r['open_cache_s'] * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()
