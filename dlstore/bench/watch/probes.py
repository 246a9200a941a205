"""The advised loaders timed alone after the loop, as the bench times a loader before composing it with the
step: more workers (the loop's own Dataset, sampler kind and collate; N workers share the cores, so they do
not reach N times one's rate), and a dlstore cache (synthetic images of the advised shape, or with
``--try-cache`` a seeded sample of the user's dataset, converted to a temporary cache and read by the
advised loader). Timings land under the loader's ``probes`` and ``try_cache``; ``analyse`` composes them."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.bench.watch.describe_loop import base_dataset
from dlstore.bench.watch.loop_parts import tensors_of

PROBE_BATCHES = 2  # synthetic cache images, in batches of the loop's size
SAMPLE_IMAGES = 2048  # at most: enough for a steady loader, converted in seconds
SAMPLE_BATCHES = 4  # at least this many batches of the user's size
WARM_BATCHES = 2
EPOCH_BATCHES = 64  # batches per epoch of the loader timed on a sample
JPEG = "the advice is a JPEG cache decoded on the GPU (DecodeLoader)"


def primary_of(doc: dict[str, Any], session: Any) -> tuple[dict[str, Any], dict[str, Any], Any] | None:
    """(the training loader's report, its raw record, its LoaderRecord), from ``doc`` analysed now."""
    from dlstore.bench.watch.analyse import analyse

    report = analyse([doc])
    if report.get("primary") is None:
        return None
    rep = next(r for r in report["loaders"] if r["index"] == report["primary"])
    ld = next(d for d in doc["loaders"] if d["index"] == rep["index"])
    return rep, ld, next(r for r in session.records.values() if r.index == rep["index"])


def attach_probes(doc: dict[str, Any], session: Any) -> None:
    """Time each advised loader (``workers``, ``cache``) and put the timings under its loader's ``probes``."""
    from dlstore.bench.watch.analyse import trial_of

    found = primary_of(doc, session)
    if found is None:
        return
    primary, ld, rec = found
    budget, cuda = session.config.parts_budget_s, doc["cuda"]
    images = int(primary.get("images_per_batch") or 0)
    tried = trial_of(primary)
    probes: dict[str, Any] = {}
    for a in primary["advice"] if images else ():
        key = "workers" if a.get("workers") is not None else "cache" if a.get("cache") else None
        if key is None or (key == "workers" and tried is not None and tried["workers"] == a["workers"]):
            continue  # tried in the loop itself: the better measurement (trial.py)
        t = time.perf_counter()
        try:
            if key == "workers":
                probes[key] = probe_workers(rec.loader, int(a["workers"]), images, cuda, budget)
            else:
                probes[key] = probe_cache(rec.loader, a["cache"], images, cuda, budget)
        except Exception as e:  # advice only: a failed probe leaves the modelled prediction
            probes[key] = {"skipped": f"the probe failed: {type(e).__name__}: {e}"}
        probes[key]["probe_s"] = time.perf_counter() - t
    ld["probes"] = probes


def attach_try_cache(doc: dict[str, Any], session: Any) -> None:
    """--try-cache: when the training loader's report advises a cache, try it on a sample and put what was
    measured under that loader's ``try_cache`` (or why not)."""
    found = primary_of(doc, session)
    if found is None:
        return
    primary, ld, rec = found
    plan = next((a["cache"] for a in primary["advice"] if a.get("cache")), None)
    if plan is None:
        ld["try_cache"] = {"skipped": "no dlstore cache was advised for this loop: nothing to try"}
        return
    try:
        ld["try_cache"] = try_cache(
            rec.loader, primary["dataset"], plan, doc["cuda"], session.config.parts_budget_s
        )
    except Exception as e:  # advice only: a failed try must not lose the record of the loop
        ld["try_cache"] = {"skipped": f"the try failed: {type(e).__name__}: {e}"}


def probe_workers(loader: Any, workers: int, images: int, cuda: bool, budget_s: float) -> dict[str, Any]:
    """The loop's loader rebuilt with ``workers`` persistent workers, timed alone (``time_batches``)."""
    from torch.utils.data import DataLoader

    dl = DataLoader(**workers_kwargs(loader, workers, cuda))
    try:
        return {**time_batches(dl, images, budget_s), "n": workers}
    finally:
        del dl


def workers_kwargs(loader: Any, workers: int, cuda: bool) -> dict[str, Any]:
    """The DataLoader arguments of ``loader`` with ``workers`` workers: its dataset, batching, collate,
    start method and worker init; a fresh random (or sequential) order, any other sampler as it is."""
    from torch.utils.data import RandomSampler, SequentialSampler

    kw: dict[str, Any] = {"dataset": loader.dataset, "num_workers": workers, "persistent_workers": True}
    kw.update(pin_memory=cuda, collate_fn=loader.collate_fn, prefetch_factor=loader.prefetch_factor or 2)
    kw.update({k: getattr(loader, k, None) for k in ("worker_init_fn", "multiprocessing_context")})
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        kw["shuffle"] = isinstance(sampler, RandomSampler)
    elif sampler is not None:
        kw["sampler"] = sampler
    if getattr(loader, "batch_size", None) is not None:
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif getattr(loader, "batch_sampler", None) is not None:
        kw = {k: v for k, v in kw.items() if k not in ("shuffle", "sampler")}
        kw["batch_sampler"] = loader.batch_sampler
    else:
        kw["batch_size"] = None
    return kw


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` seeded uint8 (C,S,S) images with labels 0..9: the shape a cache advice stores."""

    def __init__(self, n: int, size: int, channels: int) -> None:
        rng = np.random.default_rng(0)
        self.images = torch.from_numpy(rng.integers(0, 256, (n, channels, size, size), dtype=np.uint8))
        self.targets = [i % 10 for i in range(n)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.targets[i]


def probe_cache(
    loader: Any, plan: dict[str, Any], images: int, cuda: bool, budget_s: float
) -> dict[str, Any]:
    """The advised cache loader timed on synthetic images of the advised shape."""
    if plan.get("jpeg"):
        return {"skipped": f"{JPEG}: not probed"}
    source = SyntheticImages(PROBE_BATCHES * images, plan["size"], plan["channels"])
    return {**convert_and_time(loader, source, plan, images, cuda, budget_s), "synthetic": True}


def try_cache(
    loader: Any, ds_info: dict[str, Any], plan: dict[str, Any], cuda: bool, budget_s: float
) -> dict:
    """--try-cache: a seeded sample of the observed dataset (a folder of class folders, or a torchvision
    set) converted as ``plan`` says and the advised loader timed on it; or ``{"skipped": why}``."""
    from dlstore.write.sources import load_torchvision, scan_folder

    if plan.get("jpeg"):
        return {"skipped": f"{JPEG}: not tried"}
    src, root = ds_info.get("convert") or {}, ds_info.get("root")
    if not root:
        return {"skipped": f"the advice first writes {ds_info['convert']['source']}: not tried on a sample"}
    if src.get("source", "").startswith("torchvision:"):
        train = bool(getattr(base_dataset(getattr(loader, "dataset", None)), "train", True))
        source = load_torchvision(src["source"].split(":", 1)[1], Path(root), train)
    else:
        source = scan_folder(Path(root))
    batch = int(getattr(loader, "batch_size", None) or plan.get("batch") or 32)
    keep = min(len(source), max(SAMPLE_IMAGES, SAMPLE_BATCHES * batch))
    if keep < len(source):
        source = source.subset(np.sort(np.random.default_rng(0).choice(len(source), keep, replace=False)))
    if len(source) < batch + 1:
        return {"skipped": f"the dataset holds {len(source)} images, fewer than two batches of {batch}"}
    return convert_and_time(loader, source, plan, batch, cuda, budget_s)


def convert_and_time(
    loader: Any, source: Any, plan: dict[str, Any], batch: int, cuda: bool, budget_s: float
) -> dict[str, Any]:
    """``source`` converted as ``plan`` says into a temporary folder, and the advised loader timed on it:
    with GpuAugment at 0 workers, else with the loop's transform and workers."""
    from torch.utils.data import DataLoader, RandomSampler

    from dlstore.read.dataset import CachedDataset
    from dlstore.write.conversion import convert
    from dlstore.write.options import ConvertOptions

    dataset = base_dataset(getattr(loader, "dataset", None))
    transform = None if plan["gpu"] else getattr(dataset, "transform", None)
    workers = 0 if plan["gpu"] else int(getattr(loader, "num_workers", 0) or 0)
    tmp = Path(tempfile.mkdtemp(prefix="dlstore-try-cache-"))
    try:
        t0 = time.perf_counter()
        convert(source, tmp / "cache", ConvertOptions(**{k: plan[k] for k in ("size", "channels", "format")}))
        out = {"images": len(source), "convert_s": time.perf_counter() - t0, "batch": batch}
        in_memory = plan.get("in_memory", False)
        ds = CachedDataset(tmp / "cache", transform, in_memory, pil=transform is not None)
        # a sample (or a probe's synthetic images) holds a few batches: drawn with replacement into epochs
        # of EPOCH_BATCHES, or the workers' pipeline would drain and refill every few batches, as the
        # loop's own longer epochs do not
        n, epoch = len(ds), EPOCH_BATCHES * batch
        sampler = RandomSampler(ds, replacement=n < epoch, num_samples=max(n, epoch))
        kw = dict(num_workers=workers, persistent_workers=workers > 0, pin_memory=cuda, drop_last=True)
        dl = DataLoader(ds, batch, sampler=sampler, **kw)
        augment, device = None, None
        if plan["gpu"] and cuda:
            from dlstore.gpu import GpuAugment

            device = torch.device("cuda", torch.cuda.current_device())
            augment = GpuAugment(**augment_kwargs(plan)).to(device)
        return {**out, **time_batches(dl, batch, budget_s, augment, device)}
    finally:
        dl = None  # its workers shut down before their cache's folder goes
        shutil.rmtree(tmp, ignore_errors=True)


def augment_kwargs(plan: dict[str, Any]) -> dict[str, Any]:
    """The advice's GpuAugment arguments (the snippet's), its dtype named as code turned into the dtype."""
    kw = dict(plan.get("augment") or {"size": plan["crop"], "degrees": plan.get("degrees", 0.0)})
    if "out_dtype" in kw:
        kw["out_dtype"] = getattr(torch, str(kw["out_dtype"]).removeprefix("torch."))
    return kw


def time_batches(
    dl: Any, batch: int, budget_s: float, augment: Any = None, device: torch.device | None = None
) -> dict[str, Any]:
    """A loader alone, as the bench times one (``stages.measure_loader``), ``augment`` (on the CUDA
    ``device``) applied in next(): per batch its period, the main thread's share, the workers' CPU."""
    from dlstore.bench.stages import measure_loader

    workers = int(getattr(dl, "num_workers", 0) or 0)
    timed = _Augmented(dl, augment, device) if augment is not None else dl
    queued = max(3, 2 * workers * (getattr(dl, "prefetch_factor", None) or 2))
    got = measure_loader(timed, WARM_BATCHES + queued, 100_000, device or torch.device("cpu"), budget_s)
    out = {"workers": workers, "gpu_augment": augment is not None, "batches_timed": got["batches"]}
    out.update(period_s=got["period_s"], main_s=got["main_s"], loader_img_per_s=batch / got["period_s"])
    out["workers_cpu_s"] = max(0.0, got["cpu_s"] - got["main_s"]) if workers else None
    if augment is not None:
        out["augment_device_s"] = _device_time(augment, next(iter(dl)), device)
    return out


class _Augmented:
    """A loader whose batches come out of ``augment`` on the device: its launch is the main thread's."""

    def __init__(self, dl: Any, augment: Any, device: Any) -> None:
        self.dl, self.augment, self.device, self.num_workers = dl, augment, device, dl.num_workers

    def __len__(self) -> int:
        return len(self.dl)

    def __iter__(self) -> Any:
        for x in self.dl:
            yield self.augment(tensors_of(x)[0].to(self.device, non_blocking=True))


def _device_time(augment: Any, batch: Any, device: Any, n: int = 10) -> float:
    x = tensors_of(batch)[0].to(device)
    augment(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        augment(x)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / n
