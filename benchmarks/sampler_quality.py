#!/usr/bin/env python3
"""How random is ``ChunkSampler``, and does a small model trained with it match a full shuffle?

Part 1 (label-sequence statistics): a demo ImageFolder (5 classes, ImageFolder order is class-sorted)
is converted twice to a zarr cache, once with ``storage_order="shuffled"`` (the default) and once with
``"source"``. For a full shuffle (``RandomSampler``) and for ``ChunkSampler`` with small and default
windows on both caches, over several seeds and epochs, the script measures per batch: label entropy,
distinct classes, KL divergence and total variation of the batch's class histogram from the global
one, and the storage units touched; per epoch: the mean run length of equal consecutive labels, the
Spearman correlation of each index's position in epoch e and e+1, and the unit decodes (a counting
spy on ``reader.load_unit``, the reader's own LRU of decoded units cleared at the start of each epoch
and bounded to a given number of units).

Part 2 (accuracy): a small CNN (2 conv layers, Adam) is trained on an 80 % split of the images (by
index) with the same seeds, steps and initialisation under each sampler, and evaluated on the other
20 %. The chunk samplers are built from ``cache.positions[train_idx]`` so they only yield training
indices (mapped back through ``train_idx``).

    python benchmarks/sampler_quality.py --out benchmarks/results/sampler_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import dlstore  # noqa: E402
from dlstore.bench.report import package_version  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.formats.base import UnitCache  # noqa: E402
from dlstore.machine import cpu_model  # noqa: E402
from dlstore.read.loaders import default_window, storage_sorted  # noqa: E402
from dlstore.read.sampler import ChunkSampler  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sampler_quality.json"))
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/dlstore-sampler-quality"),
        help="Scratch folder for the demo images and the two caches (kept between runs).",
    )
    p.add_argument("--images", type=int, default=2500)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--windows", default="1,2", help="Small windows (units) to compare with the default one.")
    p.add_argument("--stat-seeds", type=int, default=5)
    p.add_argument(
        "--stat-epochs", type=int, default=5, help="Epochs per seed for part 1 (≥ 2 for Spearman)."
    )
    p.add_argument("--train-seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=10, help="Training epochs (same number of steps for all).")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--holdout", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--skip-train", action="store_true")
    return p.parse_args(argv)


# --- environment --------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "versions": {
            d: package_version(d) for d in ("dlstore", "torch", "torchvision", "numpy", "zarr", "pillow")
        },
    }


# --- samplers -----------------------------------------------------------------------------------------


class Order:
    """One sampling configuration: yields each epoch's index stream (positions into `index_map`)."""

    def __init__(
        self,
        name: str,
        cache: Any,
        kind: str,
        window: int | None,
        seed: int,
        index_map: np.ndarray | None = None,
    ) -> None:
        self.name, self.kind, self.window = name, kind, window
        self.index_map = np.arange(len(cache)) if index_map is None else index_map
        n = len(self.index_map)
        if kind == "random":
            self.sampler: Any = torch.utils.data.RandomSampler(
                range(n), generator=torch.Generator().manual_seed(seed)
            )
        else:
            self.sampler = ChunkSampler(
                cache.positions[self.index_map], cache.reader.unit, window=window, seed=seed
            )
        self.epoch = 0

    def next_epoch(self) -> np.ndarray:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return self.index_map[np.fromiter(iter(self.sampler), dtype=np.int64)]


def configs(caches: dict[str, Any], windows: list[int]) -> list[tuple[str, str, str, int | None]]:
    """(name, storage, kind, window)."""
    out: list[tuple[str, str, str, int | None]] = [
        ("full shuffle (RandomSampler)", "shuffled", "random", None)
    ]
    for storage in ("shuffled", "source"):
        dw = default_window(caches[storage])
        for w in [*windows, dw]:
            tag = f"default={w}" if w == dw else str(w)
            out.append((f"chunk, {storage} storage, window {tag}", storage, "chunk", w))
    return out


# --- part 1: statistics -------------------------------------------------------------------------------


def batch_stats(
    stream: np.ndarray, labels: np.ndarray, positions: np.ndarray, unit: int, bs: int, q: np.ndarray
) -> dict[str, np.ndarray]:
    k = len(q)
    nb = len(stream) // bs
    lab = labels[stream[: nb * bs]].reshape(nb, bs)
    counts = np.stack([np.bincount(row, minlength=k) for row in lab]).astype(np.float64)
    p = counts / bs
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log2(p), 0.0)
        kl = np.where(p > 0, p * np.log2(p / q), 0.0).sum(1)
    units = positions[stream[: nb * bs]].reshape(nb, bs) // unit
    return {
        "entropy": np.abs(plogp.sum(1)),
        "distinct": (counts > 0).sum(1).astype(np.float64),
        "kl": kl,
        "tv": 0.5 * np.abs(p - q).sum(1),
        "units": np.array([len(np.unique(u)) for u in units], np.float64),
    }


def mean_run_length(seq: np.ndarray) -> float:
    if len(seq) == 0:
        return float("nan")
    changes = np.count_nonzero(np.diff(seq)) + 1
    return len(seq) / changes


def batch_pair_persistence(a: np.ndarray, b: np.ndarray, n: int, bs: int) -> float:
    """Of the pairs of indices that share a batch in stream a, the fraction that share one again in b."""
    ba, bb = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    ka, kb = len(a) // bs * bs, len(b) // bs * bs
    ba[a[:ka]] = np.arange(ka) // bs
    bb[b[:kb]] = np.arange(kb) // bs
    keep = (ba >= 0) & (bb >= 0)

    def pairs(keys: np.ndarray) -> float:
        c = np.unique(keys, return_counts=True)[1].astype(np.float64)
        return float((c * (c - 1) / 2).sum())

    nb = int(bb.max()) + 1
    return pairs(ba[keep] * nb + bb[keep]) / max(1.0, pairs(ba[keep]))


def spearman_between(a: np.ndarray, b: np.ndarray, n: int) -> float:
    """Spearman of each index's position in stream a and stream b (both permutations of 0..n-1)."""
    ra, rb = np.empty(n), np.empty(n)
    ra[a] = np.arange(n)
    rb[b] = np.arange(n)
    return float(np.corrcoef(ra, rb)[0, 1])


class DecodeSpy:
    """Counts reader.load_unit calls; the reader's LRU of decoded units is reset to `max_units`."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.count, self.lock = cache, 0, threading.Lock()
        reader = cache.reader
        self.orig = reader.load_unit

        def counting(k: int) -> np.ndarray:
            with self.lock:
                self.count += 1
            return self.orig(k)

        reader.load_unit = counting  # instance attribute shadows the method; unit_array calls self.load_unit
        self.default_units = reader._units.max_units

    def epoch(self, stream: np.ndarray, bs: int, max_units: int) -> int:
        self.cache.reader._units = UnitCache(max_units)
        self.count = 0
        for i in range(0, len(stream) - bs + 1, bs):
            self.cache.read(storage_sorted(self.cache, stream[i : i + bs].tolist()))
        return self.count


def summarise(vals: list[float] | np.ndarray) -> dict[str, float]:
    a = np.asarray(vals, dtype=np.float64)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}


def part1(caches: dict[str, Any], args: argparse.Namespace, windows: list[int]) -> list[dict[str, Any]]:
    rows = []
    bs = args.batch_size
    for name, storage, kind, w in configs(caches, windows):
        cache = caches[storage]
        labels, positions, unit = cache.labels, cache.positions, cache.reader.unit
        n_units = -(-cache.spec.n_stored // unit)
        q = np.bincount(labels)
        q = q / q.sum()
        spy = DecodeSpy(cache)
        loader_units = 2 * (w if w is not None else default_window(cache))  # default_window = max_units // 2
        per: dict[str, list[float]] = {k: [] for k in ("entropy", "distinct", "kl", "tv", "units")}
        runs, spear, persist, dec_small, dec_loader = [], [], [], [], []
        t0 = time.perf_counter()
        for seed in range(args.stat_seeds):
            order = Order(name, cache, kind, w, seed)
            prev = None
            for _ in range(args.stat_epochs):
                s = order.next_epoch()
                for key, v in batch_stats(s, labels, positions, unit, bs, q).items():
                    per[key].extend(v.tolist())
                runs.append(mean_run_length(labels[s]))
                if prev is not None:
                    spear.append(spearman_between(prev, s, len(cache)))
                    persist.append(batch_pair_persistence(prev, s, len(cache), bs))
                prev = s
                dec_small.append(spy.epoch(s, bs, 2))
                dec_loader.append(spy.epoch(s, bs, loader_units))
        cache.reader.load_unit = spy.orig
        cache.reader._units = UnitCache(spy.default_units)
        row = {
            "name": name,
            "storage": storage,
            "sampler": kind,
            "window": w,
            "window_images": None if w is None else w * unit,
            "n_units": n_units,
            "unit": unit,
            "batch_size": bs,
            "batches": len(per["entropy"]),
            "entropy_bits": summarise(per["entropy"]),
            "distinct_classes": summarise(per["distinct"]),
            "kl_bits": summarise(per["kl"]),
            "tv": summarise(per["tv"]),
            "units_per_batch": summarise(per["units"]),
            "run_length": summarise(runs),
            "spearman_next_epoch": summarise(spear),
            "batch_pairs_again_next_epoch": summarise(persist),
            "decodes_per_epoch_2unit_cache": summarise(dec_small),
            "loader_cache_units": loader_units,
            "decodes_per_epoch_loader_cache": summarise(dec_loader),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(
            f"  [stats] {name}: entropy {row['entropy_bits']['mean']:.3f} bits, "
            f"distinct {row['distinct_classes']['mean']:.2f} (min {row['distinct_classes']['min']:.0f}), "
            f"run {row['run_length']['mean']:.2f}, {row['seconds']:.1f} s, decodes {row['decodes_per_epoch_2unit_cache']['mean']:.0f}",
            flush=True,
        )
    return rows


# --- part 2: training ---------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B,H,W,C) → float (B,C,H,W) in about [-1, 1]."""
    return images.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)


def train_one(
    order: Order,
    images: torch.Tensor,
    labels: torch.Tensor,
    test_idx: np.ndarray,
    args: argparse.Namespace,
    seed: int,
    classes: int,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = SmallCNN(classes)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    bs = args.batch_size
    x_test, y_test = to_input(images[test_idx]), labels[test_idx]
    steps, curve, t0 = 0, [], time.perf_counter()
    for _ in range(args.epochs):
        model.train()
        stream = order.next_epoch()
        total = 0.0
        for i in range(0, len(stream) - bs + 1, bs):  # drop_last: the same steps for every sampler
            b = torch.from_numpy(stream[i : i + bs])
            loss = loss_fn(model(to_input(images[b])), labels[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        model.eval()
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).float().mean())
        curve.append({"train_loss": total / max(1, len(stream) // bs), "test_acc": acc})
    return {
        "seed": seed,
        "steps": steps,
        "test_acc": curve[-1]["test_acc"],
        "curve": curve,
        "seconds": time.perf_counter() - t0,
    }


def part2(caches: dict[str, Any], args: argparse.Namespace, windows: list[int]) -> dict[str, Any]:
    ref = caches["shuffled"]
    n = len(ref)
    assert np.array_equal(ref.labels, caches["source"].labels)  # dataset index i = source sample i in both
    perm = np.random.default_rng(12345).permutation(n)
    n_test = int(round(args.holdout * n))
    test_idx, train_idx = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    # Pixels are identical in both caches (dataset index = source sample); read once, train from memory.
    images = torch.from_numpy(ref.read(np.arange(n)))
    labels = torch.from_numpy(ref.labels.copy())
    classes = int(labels.max()) + 1
    small = min(windows)
    plan = [
        ("full shuffle (RandomSampler)", "shuffled", "random", None),
        (
            f"chunk, shuffled storage, window default={default_window(ref)}",
            "shuffled",
            "chunk",
            default_window(ref),
        ),
        (f"chunk, shuffled storage, window {small}", "shuffled", "chunk", small),
        (f"chunk, source storage, window {small}", "source", "chunk", small),
        (
            f"chunk, source storage, window default={default_window(caches['source'])}",
            "source",
            "chunk",
            default_window(caches["source"]),
        ),
    ]
    results = []
    for name, storage, kind, w in plan:
        runs = []
        for seed in range(args.train_seeds):
            order = Order(name, caches[storage], kind, w, seed, index_map=train_idx)
            r = train_one(order, images, labels, test_idx, args, seed, classes)
            runs.append(r)
            print(
                f"  [train] {name} seed {seed}: acc {r['test_acc']:.4f} ({r['steps']} steps, {r['seconds']:.1f} s)",
                flush=True,
            )
        accs = [r["test_acc"] for r in runs]
        base = [r["test_acc"] for r in results[0]["runs"]] if results else accs  # full shuffle, same seeds
        results.append(
            {
                "name": name,
                "storage": storage,
                "sampler": kind,
                "window": w,
                "test_acc": summarise(accs),
                "paired_diff_vs_full_shuffle": summarise(np.subtract(accs, base)),
                "runs": runs,
            }
        )
    return {
        "n_train": len(train_idx),
        "n_test": len(test_idx),
        "classes": classes,
        "model": "2 conv (16, 32 ch, 3x3, ReLU, maxpool) + global average pool + linear",
        "params": sum(p.numel() for p in SmallCNN(classes).parameters()),
        "optimizer": f"Adam lr={args.lr}",
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "holdout_split": "seeded permutation (rng 12345) of dataset indices",
        "results": results,
    }


# --- main ---------------------------------------------------------------------------------------------


def table(stats: list[dict[str, Any]], train: dict[str, Any] | None) -> str:
    lines = [
        "| order | window (images) | entropy, bits (mean / min) | classes per batch (mean / min) | "
        "KL, bits (mean) | TV (mean) | run length | Spearman e→e+1 (mean ± std) | batch pairs together again in e+1 | "
        "units per batch | "
        "decodes/epoch, reader keeps 2 units | decodes/epoch, reader keeps 2×window units |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in stats:
        win = "–" if r["window"] is None else f"{r['window']} ({r['window_images']:,})"
        lines.append(
            f"| {r['name']} | {win} | {r['entropy_bits']['mean']:.3f} / {r['entropy_bits']['min']:.3f} | "
            f"{r['distinct_classes']['mean']:.2f} / {r['distinct_classes']['min']:.0f} | {r['kl_bits']['mean']:.3f} | "
            f"{r['tv']['mean']:.3f} | {r['run_length']['mean']:.2f} | {r['spearman_next_epoch']['mean']:+.3f} ± {r['spearman_next_epoch']['std']:.3f} | "
            f"{r['batch_pairs_again_next_epoch']['mean']:.3f} | "
            f"{r['units_per_batch']['mean']:.2f} | {r['decodes_per_epoch_2unit_cache']['mean']:.0f} | "
            f"{r['decodes_per_epoch_loader_cache']['mean']:.0f} ({r['loader_cache_units']} units) |"
        )
    if train:
        lines += [
            "",
            "| training order | held-out accuracy, mean ± std (min–max) | minus full shuffle, same seed: "
            "mean ± std | per seed |",
            "|---|---|---|---|",
        ]
        for r in train["results"]:
            per = ", ".join(f"{x['test_acc']:.3f}" for x in r["runs"])
            a, d = r["test_acc"], r["paired_diff_vs_full_shuffle"]
            lines.append(
                f"| {r['name']} | {a['mean']:.4f} ± {a['std']:.4f} ({a['min']:.3f}–{a['max']:.3f}) | "
                f"{d['mean']:+.4f} ± {d['std']:.4f} | {per} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    windows = [int(w) for w in args.windows.split(",") if w.strip()]
    t0 = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    src = ensure_demo(args.work / f"demo-{args.images}", args.images)
    caches = {}
    for storage in ("shuffled", "source"):
        dest = args.work / f"zarr-{args.size}-{storage}"
        dlstore.convert(
            src, dest, format="zarr", size=args.size, storage_order=storage, overwrite=True, seed=0
        )
        caches[storage] = dlstore.open_cache(dest)
    t_setup = time.perf_counter() - t0
    print(
        f"setup {t_setup:.1f} s: {len(caches['shuffled'])} images, unit {caches['shuffled'].reader.unit} images, "
        f"default window {default_window(caches['shuffled'])} units",
        flush=True,
    )
    stats = part1(caches, args, windows)
    train = None if args.skip_train else part2(caches, args, windows)
    doc = {
        "benchmark": "sampler_quality",
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment(),
        "seconds_total": time.perf_counter() - t0,
        "seconds_setup": t_setup,
        "cache": {
            "format": "zarr",
            "size": args.size,
            "n": len(caches["shuffled"]),
            "unit": caches["shuffled"].reader.unit,
            "reader_max_units": caches["shuffled"].reader.max_units,
            "default_window": default_window(caches["shuffled"]),
            "class_counts": np.bincount(caches["shuffled"].labels).tolist(),
        },
        "statistics": stats,
        "training": train,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    print()
    print(table(stats, train))
    print(f"\n{time.perf_counter() - t0:.0f} s in total; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
