"""The data-wait share of a training script by an independent tool, torch.profiler: the script runs unwatched
(``runpy``) under the profiler, and the share is the DataLoader ``__next__`` spans' time over the wall time
of the steps, a step being one ``__next__`` start to the next (the first loader the script iterates):

    python profiler_share.py --steps 60 --warmup 5 [--cache DEST [--in-memory]] [--no-profile] -- script.py ARGS

The script is stopped after ``--steps`` steps (the ``__next__`` call after them ends it: those steps' periods
are whole). ``--cache DEST``: the script's training ImageFolder (the first one made) is a dlstore cache read
with its own transform (``dlstore.CachedDataset(DEST, transform=…, pil=True)``: the cache advice applied
by hand); ``--no-profile`` times the steps without the profiler (the rate alone). Prints one
``{"profiler_share": …}`` line: the share, the steps' rate, and the same share by this wrapper's own clock.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from typing import Any

import torch
from torch.utils.data import dataloader

SPAN = "enumerate(DataLoader)#"


class Stop(Exception):
    """Raised from the ``__next__`` after the last step: the script ends there."""


def count_next(total: int, calls: list[tuple[float, float]], batch: list[int]) -> None:
    """Wrap ``__next__`` of the first loader iterated: its (start, end) times, one batch's size, a stop."""
    orig, first = dataloader._BaseDataLoaderIter.__next__, []

    def __next__(self: Any) -> Any:
        if not first:
            first.append(self._dataset)
        if self._dataset is not first[0]:
            return orig(self)
        if len(calls) >= total:
            raise Stop
        t = time.perf_counter()
        out = orig(self)
        calls.append((t, time.perf_counter()))
        if not batch and isinstance(out, (list, tuple)) and hasattr(out[0], "shape"):
            batch.append(int(out[0].shape[0]))
        return out

    dataloader._BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]


def use_cache(dest: str, in_memory: bool) -> None:
    """The first ImageFolder the script makes reads the cache instead, with the script's transform."""
    import torchvision.datasets as tvd

    orig, done = tvd.ImageFolder, []

    def image_folder(root: Any, transform: Any = None, *args: Any, **kw: Any) -> Any:
        if done:
            return orig(root, transform, *args, **kw)
        from dlstore import CachedDataset

        done.append(root)
        return CachedDataset(dest, transform=transform or kw.get("transform"), pil=True, in_memory=in_memory)

    tvd.ImageFolder = image_folder  # type: ignore[misc, assignment]


def share(spans: list[tuple[float, float]], warmup: int) -> float | None:
    """Σ span time / wall time from the first timed span's start to the last span's start."""
    timed = spans[warmup:]
    if len(timed) < 2:
        return None
    wall = timed[-1][0] - timed[0][0]
    return sum(b - a for a, b in timed[:-1]) / wall if wall > 0 else None


def profiler_spans(prof: Any) -> list[tuple[float, float]]:
    """(start, end) in seconds of every DataLoader ``__next__`` span, in order (the watched loader's)."""
    evs = [e for e in prof.events() if e.name.startswith(SPAN)]
    return sorted((e.time_range.start / 1e6, e.time_range.end / 1e6) for e in evs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cache")
    ap.add_argument("--in-memory", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("script", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    calls: list[tuple[float, float]] = []
    batch: list[int] = []
    count_next(a.steps + 1, calls, batch)
    if a.cache:
        use_cache(a.cache, a.in_memory)
    sys.argv = list(script)
    sys.path.insert(0, str(__import__("pathlib").Path(script[0]).resolve().parent))
    prof = None
    if not a.no_profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    try:
        runpy.run_path(script[0], run_name="__main__")
    except Stop:
        pass
    except BaseException as e:  # a framework re-raises the stop wrapped, or exits: the steps are what count
        if len(calls) < a.steps:
            raise
        print(f"script ended with {type(e).__name__} after the steps", file=sys.stderr)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    spans = profiler_spans(prof) if prof is not None else []
    timed = calls[a.warmup :]
    wall = timed[-1][0] - timed[0][0] if len(timed) > 1 else 0.0
    out = {
        "steps": len(calls),
        "warmup": a.warmup,
        "batch": batch[0] if batch else None,
        "wait_share": share(spans, a.warmup) if prof is not None else None,
        "spans": len(spans),
        "hand_wait_share": share(calls, a.warmup),
        "img_per_s": batch[0] * (len(timed) - 1) / wall if batch and wall > 0 else None,
        "cache": a.cache,
    }
    print(json.dumps({"profiler_share": out}), flush=True)


if __name__ == "__main__":
    main()
