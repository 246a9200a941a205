"""zarr's own read path vs dlstore's direct chunk decode, same cache, same batches, one process.

    python benchmarks/zarr_overhead.py --images 1200 --out benchmarks/results/zarr_overhead.json

Reads 256 px demo images from one zarr cache three ways, alternating in rounds: (a) zarr's
``Array.oindex`` with each batch's sorted storage positions (what a user of zarr would write), (b)
zarr slices chunk by chunk, (c) dlstore's ZarrReader (metadata validated once, chunk files decoded
directly, in threads). Random batches and ChunkSampler batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlstore import convert, open_cache  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.read.loaders import make_sampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import zarr

    work = Path(tempfile.mkdtemp(prefix="dlstore-zarr-"))
    demo = ensure_demo(work / "demo", n_images=args.images)
    convert(demo, work / "z", format="zarr", size=256, workers=os.cpu_count())
    cache = open_cache(work / "z", check_source=False)
    arr = zarr.open_array(work / "z" / "images", mode="r")
    pos = cache.positions
    rng = np.random.default_rng(0)
    random_batches = [
        np.sort(pos[rng.choice(len(pos), args.batch, replace=False)]) for _ in range(args.batches)
    ]
    order = np.asarray(list(make_sampler(cache, "chunk", seed=0)))
    chunk_batches = [np.sort(pos[order[i * args.batch : (i + 1) * args.batch]]) for i in range(args.batches)]
    unit = cache.reader.unit
    out = np.empty((args.batch, 256, 256, 3), np.uint8)

    def zarr_oindex(b: np.ndarray) -> None:
        out[:] = arr.oindex[b]

    def zarr_slices(b: np.ndarray) -> None:
        i = 0
        for k in np.unique(b // unit):
            block = arr[k * unit : (k + 1) * unit]
            local = b[(b // unit) == k] - k * unit
            out[i : i + len(local)] = block[local]
            i += len(local)

    def dlstore_reader(b: np.ndarray) -> None:
        cache.reader.read_into(b, out)

    methods = {
        "zarr_oindex": zarr_oindex,
        "zarr_chunk_slices": zarr_slices,
        "dlstore_ZarrReader": dlstore_reader,
    }
    results: dict[str, dict[str, list[float]]] = {m: {"random": [], "chunk_sampler": []} for m in methods}
    for r in range(args.rounds):
        names = list(methods)[r % 3 :] + list(methods)[: r % 3]
        for name in names:
            for label, batches in (("random", random_batches), ("chunk_sampler", chunk_batches)):
                if name == "dlstore_ZarrReader":
                    cache.reader.close()  # no decoded chunks kept from an earlier round
                    cache = open_cache(work / "z", check_source=False)
                t0 = time.perf_counter()
                for b in batches:
                    methods[name](b)
                results[name][label].append(len(batches) * args.batch / (time.perf_counter() - t0))
    summary = {m: {k: float(np.median(v)) for k, v in d.items()} for m, d in results.items()}
    doc = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "zarr": zarr.__version__,
        "numpy": np.__version__,
        "command": " ".join(sys.argv),
        "images": args.images,
        "chunk_images": unit,
        "batch": args.batch,
        "rounds": results,
        "median_img_per_s": summary,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    print(f"{'method':22} {'random':>10} {'chunk sampler':>14}  (img/s, median of {args.rounds})")
    for m, d in summary.items():
        print(f"{m:22} {d['random']:>10,.0f} {d['chunk_sampler']:>14,.0f}")


if __name__ == "__main__":
    main()
