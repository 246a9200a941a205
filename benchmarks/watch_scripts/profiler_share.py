"""The data-wait share of a training script by torch.profiler: the script runs unwatched (``runpy``) under
the profiler; the share is the first iterated loader's ``__next__`` spans (renamed: no other loader's count)
over the steps' wall time, a step being a ``__next__`` start to the next on its iterator, over the steps
watch counts as steady (the warm-up and later epochs' first steps left out). Stops after ``--steps``.

    python profiler_share.py --steps 100 --warmup 5 [--cache DEST [--in-memory] [--gpu-augment KW]]
        [--no-profile] -- script.py ARGS

``--cache``: the script's first ImageFolder is that dlstore cache with its transform (``pil=True``), or
read as tensors and augmented on the GPU by ``GpuAugment(**KW)``: the cache advice by hand.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import dataloader

SPAN = "enumerate(DataLoader)#timed.__next__"


class Stop(Exception):
    """Raised from the ``__next__`` after the last step: the script ends there."""


def count_next(total: int, calls: list[list[Any]], batch: list[int], aug: Any) -> None:
    """Wrap ``__next__`` of the first loader iterated: per call [start, end, epoch, index in it, got a
    batch]; one batch's size; the stop; ``aug`` put on the images (the cache advice's GpuAugment)."""
    orig = dataloader._BaseDataLoaderIter.__next__
    seen: list[Any] = []  # the loader's dataset, then its iterators (one an epoch)

    def __next__(self: Any) -> Any:
        if not seen:
            seen.append(self._dataset)
        if self._dataset is not seen[0]:
            return orig(self)
        if self not in seen[1:]:
            seen.append(self)
        self._profile_name = SPAN
        epoch = seen[1:].index(self)
        call = [time.perf_counter(), None, epoch, sum(c[2] == epoch for c in calls), False]
        calls.append(call)
        if sum(c[4] for c in calls) >= total:  # this call ends the last step's period
            with torch.profiler.record_function(SPAN):
                raise Stop
        out = orig(self)  # a StopIteration ends the epoch's last step's period
        if aug is not None:
            out = [aug(out[0].to("cuda", non_blocking=True)), *out[1:]]
        call[1], call[4] = time.perf_counter(), True
        if not batch and isinstance(out, (list, tuple)) and hasattr(out[0], "shape"):
            batch.append(int(out[0].shape[0]))
        return out

    dataloader._BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]


def use_cache(dest: str, in_memory: bool, done: list[Any], gpu: bool) -> None:
    """The first ImageFolder the script makes reads the cache instead."""
    import torchvision.datasets as tvd

    orig = tvd.ImageFolder

    def image_folder(root: Any, transform: Any = None, *args: Any, **kw: Any) -> Any:
        if done:
            return orig(root, transform, *args, **kw)
        from dlstore import CachedDataset

        done.append(root)
        if gpu:
            return CachedDataset(dest, in_memory=in_memory)
        return CachedDataset(dest, transform=transform or kw.get("transform"), pil=True, in_memory=in_memory)

    tvd.ImageFolder = image_folder  # type: ignore[misc, assignment]


def steady(times: list[tuple[float, float]], calls: list[list[Any]], warmup: int) -> tuple[float, float, int]:
    """(Σ wait, Σ period, steps) over the steady steps: those with a next call on their iterator."""
    wait = period = 0.0
    n = 0
    for i in range(min(len(times), len(calls)) - 1):
        _, _, epoch, k, got = calls[i]
        if not got or calls[i + 1][2] != epoch or k < (warmup if epoch == 0 else 1):
            continue
        wait, period, n = wait + times[i][1] - times[i][0], period + times[i + 1][0] - times[i][0], n + 1
    return wait, period, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cache")
    ap.add_argument("--in-memory", action="store_true")
    ap.add_argument("--gpu-augment", help="GpuAugment's arguments as JSON (with --cache)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("script", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    calls: list[list[Any]] = []
    batch: list[int] = []
    aug, used = None, []
    if a.gpu_augment:
        from dlstore.gpu import GpuAugment

        aug = GpuAugment(**json.loads(a.gpu_augment)).to("cuda")
    count_next(a.steps, calls, batch, aug)
    if a.cache:
        use_cache(a.cache, a.in_memory, used, aug is not None)
    sys.argv = list(script)
    sys.path.insert(0, str(Path(script[0]).resolve().parent))
    prof = None if a.no_profile else torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    if prof is not None:
        prof.__enter__()
    try:
        runpy.run_path(script[0], run_name="__main__")
    except Stop:
        pass
    except BaseException as e:  # a framework that wraps the stop, or exits: the steps are what count
        if sum(c[4] for c in calls) < a.steps:
            raise
        print(f"the script ended with {type(e).__name__} after the steps", file=sys.stderr)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    hand = steady([(c[0], c[1] or c[0]) for c in calls], calls, a.warmup)
    out: dict[str, Any] = {"calls": len(calls), "steady_steps": hand[2], "batch": batch[0] if batch else None}
    out["hand_wait_share"] = hand[0] / hand[1] if hand[1] else None
    out["img_per_s"] = batch[0] * hand[2] / hand[1] if batch and hand[1] else None
    if prof is not None:
        spans = sorted(
            (e.time_range.start / 1e6, e.time_range.end / 1e6) for e in prof.events() if e.name == SPAN
        )
        got = steady(spans, calls, a.warmup)
        out.update(spans=len(spans), wait_share=got[0] / got[1] if got[1] else None)
    out["cache"] = a.cache if used else None  # None: no ImageFolder was replaced
    print(json.dumps({"profiler_share": out}), flush=True)


if __name__ == "__main__":
    main()
