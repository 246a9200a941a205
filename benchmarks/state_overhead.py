"""Do ``PinnedLoader`` and ``DecodeLoader`` run as fast keeping their state as without it? Side by side.

``without``: the loader's own ``__iter__`` with CoreLoader's counting bypassed (its ``__wrapped__``), so
nothing is counted and no state is taken: the iteration as it was before state keeping, over the same
order. ``with``: the iteration as shipped, plus ``loader.state_dict()`` taken and JSON-encoded after
every step (a checkpoint every step: the worst case). Each round times both, in alternating order, on
the same loader object, each over ``--steps`` batches after ``--warmup``; every batch is consumed on
the device (a float mean) and the device is synchronised at the end of each window. Windows that cross
an epoch end start a new pass, as a training loop would.

    python benchmarks/state_overhead.py --out "$OUT"

Writes ``OUT/state_overhead.json``: per loader the rates of every round, the median ratio with/without
and its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.gpu import RaggedRandomResizedCrop  # noqa: E402
from dlstore.machine import usable_cores  # noqa: E402
from dlstore.read.gpu_decode import DecodeLoader  # noqa: E402
from dlstore.read.loaders import PinnedLoader  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def endless(loader: Any, keep_state: bool) -> Iterator[Any]:
    """Batches across epochs; without state keeping, through the loader's uncounted __iter__."""
    raw = type(loader).__dict__["__iter__"].__wrapped__
    while True:
        yield from (loader if keep_state else raw(loader))


def window(loader: Any, keep_state: bool, warmup: int, steps: int) -> float:
    """Images per second over ``steps`` batches (after ``warmup``), consumed on the device."""
    batches = endless(loader, keep_state)
    sink = torch.zeros((), device=DEV)
    for _ in range(warmup):
        x, _y = next(batches)
        sink += x.float().mean() if isinstance(x, torch.Tensor) else x[0].float().mean()
    harness.sync()
    images, t0 = 0, time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        sink += x.float().mean() if isinstance(x, torch.Tensor) else x[0].float().mean()
        images += len(y)
        if keep_state:
            json.dumps(loader.state_dict())
    harness.sync()
    seconds = time.perf_counter() - t0
    batches.close()
    return images / seconds


def compare(loader: Any, args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for r in range(args.repeats):
        first = r % 2 == 0  # alternate which goes first
        rates = {}
        for keep in (first, not first):
            rates["with" if keep else "without"] = window(loader, keep, args.warmup, args.steps)
        rounds.append(rates)
        harness.log(f"  round {r}: with {rates['with']:,.0f} img/s, without {rates['without']:,.0f} img/s")
    ratios = [x["with"] / x["without"] for x in rounds]
    return {
        "rounds": rounds,
        "with_median_img_s": statistics.median(x["with"] for x in rounds),
        "without_median_img_s": statistics.median(x["without"] for x in rounds),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "state_bytes": len(json.dumps(loader.state_dict())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--images", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args(argv)
    work = harness.work_dir(args, "state_overhead_")
    photos = work / "photos"
    ensure_demo(photos, n_images=args.images, workers=usable_cores())
    caches = {
        "zarr224": {"format": "zarr", "size": 224},
        "jpeg_short256": {"format": "npz", "size": 256, "codec": "jpeg", "resize": "shorter"},
    }
    for name, kw in caches.items():
        harness.convert_cache(photos, work / name, workers=usable_cores(), overwrite=True, **kw)
    crop = RaggedRandomResizedCrop(224).to(DEV)
    loaders = {
        "PinnedLoader zarr 224": PinnedLoader(work / "zarr224", args.batch, device=DEV),
        "DecodeLoader jpeg shorter 256": DecodeLoader(
            work / "jpeg_short256", args.batch, transform=crop, device=DEV
        ),
    }
    doc: dict[str, Any] = {"environment": harness.environment(), "args": vars(args) | {"out": str(args.out)}}
    for name, loader in loaders.items():
        harness.log(name)
        doc[name] = compare(loader, args)
        (args.out / "state_overhead.json").write_text(json.dumps(doc, indent=1, default=str))
    for name in loaders:
        r = doc[name]
        print(
            f"{name}: with {r['with_median_img_s']:,.0f} img/s, without {r['without_median_img_s']:,.0f}; "
            f"ratio {r['ratio_median']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
