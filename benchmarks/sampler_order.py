"""How random is the one global order (``dlstore.read.order``), per rank, next to the old per-rank slices?

The figures of the removed ``sampler_quality.py`` (RESULTS.md, "Answered questions") came from a demo
cache of 2,500 images, 5 classes, units of 342, batches of 64. This script rebuilds that layout (and a
larger one) without a cache: storage shuffled as ``convert`` stores it (or in source order, classes
sorted), the label of each image, the unit that holds it. For each order it measures the batches each
rank gets: label entropy, distinct classes, KL divergence and total variation from the global class
mix, units per batch, the mean run of equal labels; Spearman of each index's place in epoch e and e+1
(the global sequence); and the unit decodes per rank per epoch with a reader that keeps 2 x window
decoded units (LRU, batches read in storage order, as the loaders do).

``old`` is the previous ChunkSampler's split: the same global sequence cut into one contiguous slice
per rank. ``new`` is ``EpochSampler``'s: rank r takes positions r, r+W, r+2W, ...

    python benchmarks/sampler_order.py --out benchmarks/results/sampler_order.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dlstore.read.order import EpochSampler  # noqa: E402

LAYOUTS = {  # name: (images, classes, images per unit, batch, windows)
    "sampler_quality": (2500, 5, 342, 64, (1, 2, 12)),
    "larger": (51200, 100, 256, 64, (1, 4, 16)),
}


def layout(n: int, classes: int, storage: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(labels by dataset index, storage position of each dataset index); the dataset is class-sorted
    as ImageFolder lists it, storage is shuffled (convert's default) or in that source order."""
    labels = np.repeat(np.arange(classes), -(-n // classes))[:n]
    positions = np.random.default_rng(seed).permutation(n) if storage == "shuffled" else np.arange(n)
    return labels, positions


def shares(seq: np.ndarray, world: int, split: str) -> list[np.ndarray]:
    n = len(seq)
    per = -(-n // world)
    padded = np.resize(seq, per * world)
    if split == "old":
        return [padded[r * per : (r + 1) * per] for r in range(world)]
    return [padded[r::world] for r in range(world)]


def batch_stats(stream: np.ndarray, labels: np.ndarray, units: np.ndarray, bs: int, q: np.ndarray) -> dict:
    nb = len(stream) // bs
    lab = labels[stream[: nb * bs]].reshape(nb, bs)
    counts = np.stack([np.bincount(row, minlength=len(q)) for row in lab]).astype(np.float64)
    p = counts / bs
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
        kl = np.where(p > 0, p * np.log2(p / q), 0.0).sum(1)
    u = units[stream[: nb * bs]].reshape(nb, bs)
    return {
        "entropy_bits": ent,
        "distinct_classes": (counts > 0).sum(1).astype(np.float64),
        "kl_bits": kl,
        "tv": 0.5 * np.abs(p - q).sum(1),
        "units_per_batch": np.array([len(np.unique(r)) for r in u], np.float64),
    }


def decodes(stream: np.ndarray, units: np.ndarray, bs: int, keep: int) -> int:
    lru: OrderedDict[int, None] = OrderedDict()
    count = 0
    for i in range(0, len(stream) - bs + 1, bs):
        for k in np.unique(units[stream[i : i + bs]]).tolist():
            if k in lru:
                lru.move_to_end(k)
                continue
            count += 1
            lru[k] = None
            if len(lru) > keep:
                lru.popitem(last=False)
    return count


def run_length(seq: np.ndarray) -> float:
    return len(seq) / (np.count_nonzero(np.diff(seq)) + 1)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.empty(len(a)), np.empty(len(b))
    ra[a], rb[b] = np.arange(len(a)), np.arange(len(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def mean(v: list[float] | np.ndarray) -> float:
    return round(float(np.mean(v)), 4)


def measure(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    n, classes, unit, bs, windows = LAYOUTS[name]
    rows = []
    for storage in ("shuffled", "source"):
        labels, positions = layout(n, classes, storage)
        units = positions // unit
        q = np.bincount(labels) / n
        configs = [("random", 1)] + [("chunk", w) for w in windows]
        for order, window in configs:
            if storage == "source" and order == "random":
                continue
            for world in args.worlds:
                for split in ("old", "new") if world > 1 else ("new",):
                    t0 = time.perf_counter()
                    acc: dict[str, list[float]] = {}
                    spear, dec, runs = [], [], []
                    for seed in range(args.seeds):
                        s = EpochSampler(positions, unit, order=order, window=window, seed=seed)
                        prev = None
                        for epoch in range(args.epochs):
                            seq = s.sequence(epoch).astype(np.int64)
                            if prev is not None:
                                spear.append(spearman(prev, seq))
                            prev = seq
                            for share in shares(seq, world, split):
                                for k, v in batch_stats(share, labels, units, bs, q).items():
                                    acc.setdefault(k, []).extend(v.tolist())
                                runs.append(run_length(labels[share]))
                                dec.append(decodes(share, units, bs, 2 * window))
                    rows.append(
                        {
                            "layout": name,
                            "storage": storage,
                            "order": order,
                            "window": window if order == "chunk" else None,
                            "ranks": world,
                            "split": "contiguous slice (old)" if split == "old" else "turns (new)",
                            **{k: mean(v) for k, v in acc.items()},
                            "run_length": mean(runs),
                            "spearman_next_epoch": mean(spear),
                            "units": -(-n // unit),
                            "decodes_per_rank_epoch": mean(dec),
                            "seconds": round(time.perf_counter() - t0, 2),
                        }
                    )
                    r = rows[-1]
                    print(
                        f"{name} {storage} {order} w={window} W={world} {split}: entropy {r['entropy_bits']}"
                        f" distinct {r['distinct_classes']} units/batch {r['units_per_batch']}"
                        f" decodes/rank {r['decodes_per_rank_epoch']} of {r['units']}",
                        file=sys.stderr,
                    )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--worlds", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [row for name in args.layouts.split(",") for row in measure(name, args)]
    doc = {
        "command": "python benchmarks/sampler_order.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}, Python {platform.python_version()}",
        "layouts": {
            k: dict(zip(("images", "classes", "unit", "batch", "windows"), v)) for k, v in LAYOUTS.items()
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
