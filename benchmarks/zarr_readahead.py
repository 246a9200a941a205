"""zarr zstd-3 256 px batches in ChunkSampler order through dlstore's reader vs numcodecs' decode of the
same chunks, side by side in one run.

    python benchmarks/zarr_readahead.py --out OUTDIR [--images 8192] [--repeats 3] [--work DIR]

Ceiling: numcodecs ``Zstd.decode(raw, out=buf)`` of every chunk (bytes already in memory) in all threads.
Reader runs (rotated over the repeats, every unit decoded again each epoch, 256-image batches):
``batches``: ``Cache.read_batches`` with one decode process per core; ``read``: ``Cache.read`` of each
batch with the reader's threads. Writes OUTDIR/zarr_readahead.json and OUTDIR/targets.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from dlstore import open_cache  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.read import ChunkSampler  # noqa: E402

CORES = len(os.sched_getaffinity(0))
B = 256


def numcodecs_rate(root: Path, threads: int, seconds: float = 1.2) -> float:
    """img/s of numcodecs decoding the cache's chunk files (read before) in ``threads`` threads, each
    into its own reused buffer; at least ``seconds`` of work."""
    from numcodecs.zstd import Zstd

    cache = open_cache(root)
    unit, shape = cache.reader.unit, (cache.reader.unit, *cache.spec.shape)
    cache.close()
    raws = [f.read_bytes() for f in sorted((root / "images" / "c").glob("*/0/0/0"))]
    codec, local = Zstd(), threading.local()

    def one(raw: bytes) -> None:
        if getattr(local, "buf", None) is None:
            local.buf = np.empty(shape, np.uint8)
        codec.decode(raw, out=local.buf)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, raws[: 2 * threads]))  # warm: threads, buffers
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            list(ex.map(one, raws))
            done += len(raws)
        return done * unit / (time.perf_counter() - t0)


def reader_rate(root: Path, batched: bool, epochs: int) -> float:
    """img/s over ``epochs`` epochs after an untimed one (the start-up): ``read_batches`` with a decode
    process per core, or ``read`` of each batch."""
    cache = open_cache(root)
    cache.reader.threads = CORES
    order = list(ChunkSampler(cache, seed=0))
    batches = [order[i : i + B] for i in range(0, len(order) - B + 1, B)]
    buf = np.empty((B, *cache.spec.shape), np.uint8)

    def epoch() -> None:
        cache.reader._units.clear()  # every unit decoded again: the last epoch's are not reused
        if batched:
            for _ in cache.read_batches(batches, processes=CORES):
                pass
        else:
            for idx in batches:
                cache.read(idx, out=buf)

    epoch()
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch()
    rate = epochs * len(batches) * B / (time.perf_counter() - t0)
    cache.close()
    return rate


def main() -> None:
    ap = harness.parser(images=8192, warmup=0, steps=0, repeats=3)
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after an untimed one")
    args = ap.parse_args()
    work = harness.work_dir(args, "dlstore-zra-")
    res: dict[str, Any] = {"environment": harness.environment()}
    save = lambda: (args.out / "zarr_readahead.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    t0 = time.perf_counter()
    demo = ensure_demo(work / "demo", n_images=args.images, workers=CORES)
    root = work / "zarr256"
    harness.convert_cache(demo, root, format="zarr", size=256, workers=CORES, codec="zstd")
    res["data_s"] = time.perf_counter() - t0
    top = numcodecs_rate(root, CORES)
    res["numcodecs_img_s"] = {"1": numcodecs_rate(root, 1), str(CORES): top}
    harness.log(f"numcodecs {res['numcodecs_img_s']}")
    runs: dict[str, list[float]] = {"batches": [], "read": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(reader_rate(root, name == "batches", args.epochs))
            harness.log(f"  {name}: {runs[name][-1]:,.0f} img/s")
    res["reader_img_s"] = {k: {"runs": v, "median": float(np.median(v))} for k, v in runs.items()}
    save()
    targets = harness.Targets()
    targets.add(
        f"zarr zstd-3 256px ChunkSampler batches, Cache.read_batches with {CORES} decode processes "
        f"vs numcodecs decode of the same chunks in {CORES} threads",
        res["reader_img_s"]["batches"]["median"],
        top,
        0.8,
        note=f"Cache.read in {CORES} threads {res['reader_img_s']['read']['median']:,.0f} img/s; "
        f"median of {args.repeats} runs of {args.epochs} epochs",
    )
    (args.out / "targets.json").write_text(
        json.dumps({"environment": res["environment"], "targets": targets}, indent=1)
    )
    print(targets.table(60))


if __name__ == "__main__":
    main()
