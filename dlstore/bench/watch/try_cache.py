"""``--try-cache``: ground the cache recommendation on the user's own data. A seeded sample of the observed
dataset (an ImageFolder/DatasetFolder root, or a torchvision MNIST/CIFAR set) is converted with the
recommended ``dlstore convert ROOT DEST --size S`` options into a temporary folder, the recommended loader
reads it with the user's batch size (and workers), and its per-batch times come back as plain data for
``analyse`` to compose with the loop's step. The temporary cache is removed whatever happens.

Runs in the watched process after the loop (it needs the dataset's transform and, on a GPU, the device),
through the library: ``dlstore.convert`` and ``CachedDataset``, never a shell.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.bench.watch.describe import base_dataset

SAMPLE_IMAGES = 2048  # at most: enough for a steady loader, converted in seconds
SAMPLE_BATCHES = 4  # at least this many batches of the user's size
WARM_BATCHES = 2


def sample_source(ds_info: dict[str, Any], dataset: Any, batch: int, seed: int = 0) -> Any:
    """The observed dataset as a dlstore Source, cut to a seeded random sample."""
    from dlstore.convert.sources import load_torchvision, scan_folder

    root = ds_info.get("root")
    if ds_info.get("image_folder"):
        source = scan_folder(Path(root))
    else:
        name = ds_info["type"].rsplit(".", 1)[-1]
        source = load_torchvision(name, Path(root), bool(getattr(dataset, "train", True)))
    keep = min(len(source), max(SAMPLE_IMAGES, SAMPLE_BATCHES * batch))
    if keep < len(source):
        picked = np.sort(np.random.default_rng(seed).choice(len(source), keep, replace=False))
        source = source.subset(picked)
    return source


def try_cache(
    loader: Any, ds_info: dict[str, Any], plan: dict[str, Any], cuda: bool, budget_s: float
) -> dict:
    """Convert a sample as ``plan`` says (the cache advice's ``cache`` fields) and time the recommended
    loader on it. Returns the timings, or ``{"skipped": why}``."""
    if plan.get("jpeg"):
        return {"skipped": "the advice is a JPEG cache decoded on the GPU (DecodeLoader): not tried"}
    dataset = base_dataset(getattr(loader, "dataset", None))
    batch = int(getattr(loader, "batch_size", None) or plan.get("batch") or 32)
    source = sample_source(ds_info, dataset, batch)
    if len(source) < batch + 1:
        return {"skipped": f"the dataset holds {len(source)} images, fewer than two batches of {batch}"}
    tmp = Path(tempfile.mkdtemp(prefix="dlstore-try-cache-"))
    try:
        t0 = time.perf_counter()
        dest = tmp / "cache"
        convert_sample(source, dest, plan)
        out: dict[str, Any] = {
            "images": len(source),
            "convert_s": time.perf_counter() - t0,
            "batch": batch,
        }
        transform = None if plan["gpu"] else getattr(dataset, "transform", None)
        workers = 0 if plan["gpu"] else int(getattr(loader, "num_workers", 0) or 0)
        out.update(time_loader(dest, plan, batch, workers, transform, cuda, budget_s))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_sample(source: Any, dest: Path, plan: dict[str, Any]) -> None:
    from dlstore.convert.conversion import convert
    from dlstore.convert.options import ConvertOptions

    options = ConvertOptions(size=plan["size"], channels=plan["channels"], format=plan["format"])
    convert(source, dest, options)


def time_loader(
    dest: Path,
    plan: dict[str, Any],
    batch: int,
    workers: int,
    transform: Any,
    cuda: bool,
    budget_s: float,
) -> dict[str, Any]:
    """The recommended loader alone over the sample (epochs repeated until ``budget_s``): per batch its
    period, the main thread's time in next() (plus the GPU augmentation's launch) and, on a GPU, the
    augmentation's device time."""
    from torch.utils.data import DataLoader

    from dlstore.read.dataset import CachedDataset

    ds = CachedDataset(
        dest, transform=transform, pil=transform is not None, in_memory=plan.get("in_memory", False)
    )
    dl = DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=cuda,
    )
    augment, device = None, None
    if plan["gpu"] and cuda:
        from dlstore.gpu import GpuAugment

        device = torch.device("cuda", torch.cuda.current_device())
        augment = GpuAugment(plan["crop"], degrees=plan.get("degrees", 0.0)).to(device)
    main = _Timer()
    events: list[tuple[Any, Any]] = []  # the augmentation's device span per timed batch
    n, t_start, deadline = 0, 0.0, float("inf")
    # past the batches the workers queued ahead (prefetch), or the first timed batches cost nothing
    least = WARM_BATCHES + max(3, 2 * workers * (getattr(dl, "prefetch_factor", None) or 2))
    while True:
        for x, _ in _iterate(dl, main):
            if augment is not None:
                with main:
                    e0 = _event()
                    augment(x.to(device, non_blocking=True))
                    if n >= WARM_BATCHES:
                        events.append((e0, _event()))
            n += 1
            if n == WARM_BATCHES:  # start-up (workers, allocator, kernels) kept out
                if device is not None:
                    torch.cuda.synchronize(device)
                main.reset()
                t_start = time.perf_counter()
                deadline = t_start + budget_s
            if n >= least and time.perf_counter() >= deadline:
                break
        else:
            continue
        break
    if device is not None:
        torch.cuda.synchronize(device)
    timed = n - WARM_BATCHES
    wall = time.perf_counter() - t_start
    del dl
    out = {
        "workers": workers,
        "gpu_augment": augment is not None,
        "batches_timed": timed,
        "period_s": wall / timed,
        "main_s": main.total / timed,
        "loader_img_per_s": batch * timed / wall,
    }
    if events:
        out["augment_device_s"] = sum(a.elapsed_time(b) for a, b in events) / 1e3 / len(events)
    return out


class _Timer:
    """Seconds spent inside ``with timer:`` blocks, summed."""

    def __init__(self) -> None:
        self.total = 0.0
        self._t = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.total += time.perf_counter() - self._t

    def reset(self) -> None:
        self.total = 0.0


def _iterate(dl: Any, main: _Timer) -> Any:
    """The loader's batches, the time in each next() counted in ``main``."""
    it = iter(dl)
    while True:
        with main:
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


def _event() -> Any:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def attach_try_cache(doc: dict[str, Any], session: Any) -> None:
    """In the watched process, once its record is made: when the training loader's report advises a
    cache, try it and put what was measured under that loader's ``try_cache`` (or why not)."""
    from dlstore.bench.watch.analyse import analyse

    report = analyse([doc])
    if not report["loaders"]:
        return
    primary = next(r for r in report["loaders"] if r["index"] == report["primary"])
    ld = next(d for d in doc["loaders"] if d["index"] == primary["index"])
    plan = next((a["cache"] for a in primary["advice"] if a.get("cache")), None)
    if plan is None:
        ld["try_cache"] = {"skipped": "no dlstore cache was advised for this loop: nothing to try"}
        return
    rec = next(r for r in session.records.values() if r.index == primary["index"])
    try:
        ld["try_cache"] = try_cache(
            rec.loader, primary["dataset"], plan, doc["cuda"], session.config.parts_budget_s
        )
    except Exception as e:  # advice only: a failed try must not lose the record of the loop
        ld["try_cache"] = {"skipped": f"the try failed: {type(e).__name__}: {e}"}
