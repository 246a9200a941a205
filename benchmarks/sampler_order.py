"""How random is the one global order (``dlstore.read.order``), per rank, next to the old per-rank slices?

The figures of the removed ``sampler_quality.py`` (RESULTS.md, "Answered questions") came from a demo
cache of 2,500 images, 5 classes, units of 342, batches of 64. This script rebuilds that layout (and a
larger one) without a cache: storage shuffled as ``convert`` stores it (or in source order, classes
sorted), the label of each image, the unit that holds it. For each order it measures the batches each
rank gets: label entropy, distinct classes, KL divergence and total variation from the global class
mix, units per batch, the mean run of equal labels; Spearman of each index's place in epoch e and e+1
(the global sequence); and the unit decodes per rank per epoch with a reader that keeps 2 x window
decoded units (LRU, batches read in storage order, as the loaders do).

Splits of the one global sequence among W ranks: ``old``, the first ChunkSampler's: one contiguous
slice per rank; ``turns``, issue 24's first version: rank r takes positions r, r+W, r+2W, ...;
``rounds``, ``EpochSampler``'s now (``dlstore.read.rounds``): a window per rank, rounds of W windows.

``--caches`` also decodes real zarr and npz caches the way the loaders read them (each rank's batches
in storage order through the cache's reader, its own unit cache, ``read_into``) and counts the units
each rank's reader decodes in an epoch, for the split of the dlstore on the path: run it once with
this checkout and once with the code before (``PYTHONPATH=<old checkout>``) to compare.

    python benchmarks/sampler_order.py --out benchmarks/results/sampler_order.json
    python benchmarks/sampler_order.py --caches --layouts none --out benchmarks/results/rank_units_after.json
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


def shares(sampler: EpochSampler, epoch: int, world: int, split: str) -> list[np.ndarray]:
    seq = sampler.sequence(epoch).astype(np.int64)
    n = len(seq)
    per = -(-n // world)
    padded = np.resize(seq, per * world)
    if split == "old":
        return [padded[r * per : (r + 1) * per] for r in range(world)]
    if split == "turns":
        return [padded[r::world] for r in range(world)]
    out = []
    for r in range(world):
        one = EpochSampler(
            sampler.positions, sampler.unit, order=sampler.order, window=sampler.window, seed=sampler.seed,
            num_replicas=world, rank=r,
        )  # fmt: skip
        one.set_epoch(epoch)
        out.append(np.fromiter(one, np.int64))
    return out


SPLITS = {"old": "contiguous slice (old)", "turns": "turns (issue 24 v1)", "rounds": "rounds (new)"}


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
                for split in ("old", "turns", "rounds") if world > 1 else ("rounds",):
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
                            for share in shares(s, epoch, world, split):
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
                            "split": SPLITS[split],
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


def rank_units(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Units each rank's reader decodes in one epoch of real zarr / npz caches (the split on the path)."""
    import tempfile

    import dlstore
    from dlstore import convert, open_cache
    from dlstore.convert.sources import ArraySource
    from dlstore.formats import FORMATS
    from dlstore.read.loader_core import storage_sorted

    n, unit, bs = args.images, args.unit, args.batch
    rng = np.random.default_rng(0)
    source = ArraySource(
        description="rank units",
        classes=("a", "b"),
        names=[str(i) for i in range(n)],
        labels=np.arange(n) % 2,
        kind="bench",
        data=rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            writer = FORMATS[fmt].writer
            saved = writer.__dict__["choose_unit_size"]
            writer.choose_unit_size = staticmethod(lambda _b: unit)  # type: ignore[method-assign]
            try:
                convert(source, Path(tmp) / fmt, format=fmt, size=8, resize="stretch", workers=1)
            finally:
                writer.choose_unit_size = saved  # type: ignore[method-assign]
            for world, window in [(w, x) for x in args.window for w in args.caches_worlds]:
                decoded, touched = [], []
                for r in range(world):
                    cache = open_cache(Path(tmp) / fmt)
                    reader = cache.reader
                    count = [0]
                    load = reader.load_unit

                    def counted(k: int, load: Any = load, count: list[int] = count) -> np.ndarray:
                        count[0] += 1
                        return load(k)

                    reader.load_unit = counted  # type: ignore[method-assign]
                    sampler = EpochSampler(
                        cache.positions, reader.unit, order="chunk", window=window, seed=0,
                        num_replicas=world, rank=r, drop_last=True,
                    )  # fmt: skip
                    idx = np.fromiter(sampler, np.int64)
                    out = np.empty((bs, 8, 8, 3), np.uint8)  # size=8, RGB
                    units_seen = set()
                    for i in range(0, len(idx) - bs + 1, bs):
                        pos = cache.positions[storage_sorted(cache, idx[i : i + bs].tolist())]
                        reader.read_into(pos, out)
                        units_seen.update((pos // reader.unit).tolist())
                    decoded.append(count[0])
                    touched.append(len(units_seen))
                    reader.close()
                row = {
                    "format": fmt,
                    "ranks": world,
                    "units": -(-n // reader.unit),
                    "unit": reader.unit,
                    "window": window,
                    "decodes_per_rank": decoded,
                    "units_touched_per_rank": touched,
                    "decodes_all_ranks": sum(decoded),
                    "unit_cache_units": reader.max_units,
                    "code": str(Path(dlstore.__file__).parents[1]),
                }
                rows.append(row)
                print(
                    f"{fmt} window {window} W={world}: decodes per rank {decoded} (touched {touched}) of {row['units']} units",
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
    ap.add_argument("--caches", action="store_true", help="also count unit decodes per rank on real caches")
    ap.add_argument("--formats", default="zarr,npz", type=lambda s: s.split(","))
    ap.add_argument("--caches-worlds", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--images", type=int, default=12800)
    ap.add_argument("--unit", type=int, default=64)
    ap.add_argument("--window", default="16,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    names = [x for x in args.layouts.split(",") if x in LAYOUTS]
    rows = [row for name in names for row in measure(name, args)]
    cache_rows = rank_units(args) if args.caches else []
    doc = {
        "command": "python benchmarks/sampler_order.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}, Python {platform.python_version()}",
        "layouts": {
            k: dict(zip(("images", "classes", "unit", "batch", "windows"), v)) for k, v in LAYOUTS.items()
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "rank_units": cache_rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
