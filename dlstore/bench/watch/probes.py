"""The advised loaders timed alone, in the watched process after the loop, as the bench times each loader
alone before composing it with the step (``dlstore.bench.predict``). A recommendation's predicted rate is
then the loop's own step (its replay) composed with a loader that was measured, not one scaled by hand:

- more workers: the loop's own Dataset, sampler kind and collate in a DataLoader with the advised
  ``num_workers`` (persistent; pinned on a GPU). Workers share the cores with each other and with the
  main thread, so N workers do not reach N times one worker's rate; the period measured at N shows it,
  and the workers' CPU seconds per batch (/proc) feed the cores term;
- a dlstore cache (with GpuAugment when the advice moves the augmentation to the GPU): a RAM cache of
  synthetic images of the advised shape (two batches, made by ``dlstore.convert``) read by the advised
  loader exactly as ``--try-cache`` reads a sample of the user's data. The pixels do not change a raw
  cache's read or the augmentation's cost; the DataLoader's own per-batch cost and GpuAugment's launch
  and device time are what this probe adds to the model.

Each probe's timings land under the loader's ``probes`` in the raw record; ``analyse`` composes them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

PROBE_BATCHES = 2  # synthetic cache images, in batches of the loop's size


def attach_probes(doc: dict[str, Any], session: Any) -> None:
    """In the watched process, once its record is made: time each advised loader the advice names
    (``workers``, ``cache``) and put the timings under the primary loader's ``probes``."""
    from dlstore.bench.watch.analyse import analyse, trial_of

    report = analyse([doc])
    if not report["loaders"] or report.get("primary") is None:
        return
    primary = next(r for r in report["loaders"] if r["index"] == report["primary"])
    ld = next(d for d in doc["loaders"] if d["index"] == primary["index"])
    rec = next(r for r in session.records.values() if r.index == primary["index"])
    budget, cuda = session.config.parts_budget_s, doc["cuda"]
    images = int(primary.get("images_per_batch") or 0)
    probes: dict[str, Any] = {}
    for a in primary["advice"]:
        key = "workers" if a.get("workers") is not None else "cache" if a.get("cache") else None
        if key is None or not images:
            continue
        tried = trial_of(primary)
        if key == "workers" and tried is not None and tried["workers"] == a["workers"]:
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


def probe_workers(loader: Any, workers: int, images: int, cuda: bool, budget_s: float) -> dict[str, Any]:
    """The loop's loader rebuilt with ``workers`` persistent workers, timed alone (``time_batches``)."""
    from torch.utils.data import DataLoader

    from dlstore.bench.watch.try_cache import time_batches

    dl = DataLoader(**workers_kwargs(loader, workers, cuda))
    try:
        return {**time_batches(dl, images, budget_s), "n": workers}
    finally:
        del dl


def workers_kwargs(loader: Any, workers: int, cuda: bool) -> dict[str, Any]:
    """The DataLoader arguments of ``loader`` with ``workers`` workers: its dataset, batching, collate,
    start method and worker init; a fresh random (or sequential) order, any other sampler as it is."""
    from torch.utils.data import RandomSampler, SequentialSampler

    kw: dict[str, Any] = {
        "dataset": loader.dataset,
        "num_workers": workers,
        "persistent_workers": True,
        "pin_memory": cuda,
        "collate_fn": loader.collate_fn,
        "worker_init_fn": getattr(loader, "worker_init_fn", None),
        "multiprocessing_context": getattr(loader, "multiprocessing_context", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None) or 2,
    }
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
    from dlstore.bench.watch.try_cache import convert_and_time

    if plan.get("jpeg"):
        return {"skipped": "the advice is a JPEG cache decoded on the GPU (DecodeLoader): not probed"}
    source = SyntheticImages(PROBE_BATCHES * images, plan["size"], plan["channels"])
    return {**convert_and_time(loader, source, plan, images, cuda, budget_s), "synthetic": True}
