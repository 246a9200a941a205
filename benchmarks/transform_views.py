"""CachedDataset with a torchvision CPU pipeline: the transform fed a contiguous CHW copy of each image
(what CachedDataset does) against the stored (H,W,C) pixels as a (C,H,W) view (a change tried and
rejected, see benchmarks/RESULTS.md), side by side in one run, interleaved.

    python benchmarks/transform_views.py --out OUTDIR [--images 512] [--workers N] [--repeats 5]

Two caches of the demo photos: a JPEG ``--resize shorter`` 256 cache (variable size, decoded per image
in the workers) with RandomResizedCrop(224) + flip + ToDtype + Normalize, and a raw ``ram`` 256² cache
with RandomCrop(224) + the same tail. Each through ``DataLoader(batch_size=64, num_workers=N)`` (N: the
usable cores), one warm epoch per measurement; the two variants alternate, ``--repeats`` times each.
Also the transform alone on one image, both ways, in this process (one thread). Writes
OUTDIR/transform_views.json (every number, the environment) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore.convert.conversion import convert  # noqa: E402
from dlstore.machine import usable_cores  # noqa: E402
from dlstore.read.dataset import CachedDataset  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ViewFirst(CachedDataset):
    """The variant tried: the transform gets the (C,H,W) view of the stored pixels, no copy first; its
    output is made contiguous."""

    def _sample(self, image: torch.Tensor, label: int) -> tuple[Any, int]:
        assert self.transform is not None
        out = self.transform(image)
        return (out.contiguous() if isinstance(out, torch.Tensor) else out), label


def pipeline(crop: Any) -> Any:
    from torchvision.transforms import v2

    return v2.Compose(
        [crop, v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    )


def epoch_rate(ds: CachedDataset, workers: int) -> float:
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=workers, drop_last=True)
    n, t0 = 0, 0.0
    for i, (x, _y) in enumerate(loader):
        if i == 1:  # from the second batch: the workers are up
            t0, n = time.perf_counter(), 0
        n += len(x)
    return n / (time.perf_counter() - t0)


def transform_alone(ds: CachedDataset, repeats: int = 200) -> dict[str, float]:
    torch.set_num_threads(1)
    image = ds._batch([0])[0][0]  # the (C,H,W) view of the stored pixels
    out = {}
    for name, make in (
        ("copy", lambda: ds.transform(image.contiguous())),
        ("view", lambda: ds.transform(image)),
    ):
        for _ in range(20):
            make()
        t0 = time.perf_counter()
        for _ in range(repeats):
            make()
        out[f"{name}_us"] = (time.perf_counter() - t0) / repeats * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dlstore-transform-views"))
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--workers", type=int, default=usable_cores())
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from torchvision.transforms import v2

    caches = {
        "jpeg_shorter256": (
            dict(format="zarr", codec="jpeg", resize="shorter", size=256),
            v2.RandomResizedCrop(224, antialias=True),
        ),
        "ram256": (dict(format="ram", size=256), v2.RandomCrop(224)),
    }
    doc: dict[str, Any] = {"environment": harness.environment(), "workers": args.workers, "cases": {}}
    for name, (options, crop) in caches.items():
        dest = args.work / name
        if not (dest / "dlstore.json").is_file():
            convert("demo", dest, demo_images=args.images, overwrite=True, **options)  # type: ignore[arg-type]
        copy, view = CachedDataset(dest, transform=pipeline(crop)), ViewFirst(dest, transform=pipeline(crop))
        rates: dict[str, list[float]] = {"copy": [], "view": []}
        for r in range(args.repeats):
            for variant, ds in (
                (("copy", copy), ("view", view)) if r % 2 == 0 else (("view", view), ("copy", copy))
            ):
                rates[variant].append(epoch_rate(ds, args.workers))
        case = {
            "img_per_s": rates,
            "median_copy": statistics.median(rates["copy"]),
            "median_view": statistics.median(rates["view"]),
            "alone": transform_alone(copy),
        }
        case["ratio_view_over_copy"] = case["median_view"] / case["median_copy"]
        doc["cases"][name] = case
        harness.log(f"{name}: {json.dumps(case)}")
    (args.out / "transform_views.json").write_text(json.dumps(doc, indent=1, default=str))
    print(
        "| cache | workers | copy first, as now (img/s) | view, tried (img/s) | view / copy | transform alone copy / view (µs) |"
    )
    print("|---|---|---|---|---|---|")
    for name, c in doc["cases"].items():
        print(
            f"| {name} | {args.workers} | {c['median_copy']:,.0f} | {c['median_view']:,.0f} | "
            f"{c['ratio_view_over_copy']:.2f} | {c['alone']['copy_us']:.0f} / {c['alone']['view_us']:.0f} |"
        )


if __name__ == "__main__":
    main()
