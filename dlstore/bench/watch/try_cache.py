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
EPOCH_BATCHES = 64  # batches per epoch of the loader timed on a sample
HARD_LIMIT = 3  # × the budget: a loader slower than that is timed on fewer batches


def sample_source(ds_info: dict[str, Any], dataset: Any, batch: int, seed: int = 0) -> Any:
    """The observed dataset as a dlstore Source, cut to a seeded random sample."""
    from dlstore.write.sources import load_torchvision, scan_folder

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
    return convert_and_time(loader, source, plan, batch, cuda, budget_s)


def convert_and_time(
    loader: Any, source: Any, plan: dict[str, Any], batch: int, cuda: bool, budget_s: float
) -> dict[str, Any]:
    """``source`` converted as ``plan`` says into a temporary folder (removed after), and the advised
    loader timed on it: with GpuAugment at 0 workers, else with the loop's transform and workers."""
    dataset = base_dataset(getattr(loader, "dataset", None))
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
    from dlstore.write.conversion import convert
    from dlstore.write.options import ConvertOptions

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
    """The recommended loader alone over the cache at ``dest`` (epochs repeated until ``budget_s``): per
    batch its period, the main thread's time in next() (plus the GPU augmentation's launch) and, on a
    GPU, the augmentation's device time (``time_batches``)."""
    from torch.utils.data import DataLoader, RandomSampler

    from dlstore.read.dataset import CachedDataset

    ds = CachedDataset(
        dest, transform=transform, pil=transform is not None, in_memory=plan.get("in_memory", False)
    )
    # a sample (or a probe's synthetic images) holds a few batches: drawn with replacement into epochs of
    # EPOCH_BATCHES, or the workers' pipeline would drain and refill at every few batches, as the loop's
    # own longer epochs do not
    n = len(ds)
    sampler = RandomSampler(
        ds, replacement=n < EPOCH_BATCHES * batch, num_samples=max(n, EPOCH_BATCHES * batch)
    )
    dl = DataLoader(
        ds,
        batch_size=batch,
        sampler=sampler,
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
    try:
        return time_batches(dl, batch, budget_s, augment, device)
    finally:
        del dl


def time_batches(
    dl: Any, batch: int, budget_s: float, augment: Any = None, device: torch.device | None = None
) -> dict[str, Any]:
    """A loader alone (epochs repeated until ``budget_s``, past the batches its workers queued ahead),
    as the bench times a loader alone: per batch its period, the main thread's share (the wall time in
    next() and the augmentation's launch with 0 workers, where the loader works in the caller; the main
    thread's CPU time there with workers, whose wait is not work), its workers' CPU seconds (/proc) and,
    with ``augment`` (a module on the CUDA ``device``), the augmentation's device time."""
    workers = int(getattr(dl, "num_workers", 0) or 0)
    main = _Timer()
    events: list[tuple[Any, Any]] = []  # the augmentation's device span per timed batch
    n, t_start, deadline, cpu0 = 0, 0.0, float("inf"), 0.0
    # past the batches the workers queued ahead (prefetch), or the first timed batches cost nothing
    least = WARM_BATCHES + max(3, 2 * workers * (getattr(dl, "prefetch_factor", None) or 2))
    hard = time.perf_counter() + HARD_LIMIT * budget_s + 60.0  # a very slow loader: stop short of ``least``
    its: list[Any] = []
    while True:
        for x in _iterate(dl, main, its):
            if augment is not None:
                with main:
                    e0 = _event()
                    augment(_first_tensor(x).to(device, non_blocking=True))
                    if n >= WARM_BATCHES:
                        events.append((e0, _event()))
            n += 1
            if n == WARM_BATCHES:  # start-up (workers, allocator, kernels) kept out
                if device is not None:
                    torch.cuda.synchronize(device)
                main.reset()
                cpu0 = workers_cpu_s(its[-1])
                t_start = time.perf_counter()
                deadline = t_start + budget_s
            now = time.perf_counter()
            if (n >= least and now >= deadline) or (n > WARM_BATCHES and now >= hard):
                break
        else:
            continue
        break
    if device is not None:
        torch.cuda.synchronize(device)
    timed = n - WARM_BATCHES
    wall = time.perf_counter() - t_start
    cpu = workers_cpu_s(its[-1]) - cpu0
    main_s = (main.cpu if workers else main.total) / timed
    out = {
        "workers": workers,
        "gpu_augment": augment is not None,
        "batches_timed": timed,
        "period_s": wall / timed,
        "main_s": main_s,
        "workers_cpu_s": cpu / timed if workers else None,
        "loader_img_per_s": batch * timed / wall,
    }
    if events:
        out["augment_device_s"] = sum(a.elapsed_time(b) for a, b in events) / 1e3 / len(events)
    return out


def workers_cpu_s(it: Any) -> float:
    """The CPU seconds (user + system) of a DataLoader iterator's live worker processes."""
    from dlstore.bench.monitor import process_cpu_s

    total = 0.0
    for w in getattr(it, "_workers", None) or ():
        got = process_cpu_s(w.pid) if getattr(w, "pid", None) else None
        total += got or 0.0
    return total


def _first_tensor(batch: Any) -> torch.Tensor:
    from dlstore.bench.watch.parts import tensors_of

    return tensors_of(batch)[0]


class _Timer:
    """Seconds spent inside ``with timer:`` blocks, summed: wall (``total``) and this thread's CPU (``cpu``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.cpu = 0.0
        self._t = 0.0
        self._c = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()
        self._c = time.thread_time()

    def __exit__(self, *exc: Any) -> None:
        self.total += time.perf_counter() - self._t
        self.cpu += time.thread_time() - self._c

    def reset(self) -> None:
        self.total = 0.0
        self.cpu = 0.0


def _iterate(dl: Any, main: _Timer, its: list[Any]) -> Any:
    """The loader's batches, the time in each next() counted in ``main``; the iterator goes in ``its``."""
    it = iter(dl)
    its.append(it)
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
