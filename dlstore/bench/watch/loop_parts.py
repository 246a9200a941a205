"""The observed dataset's parts timed alone, in the watched process at the pause (nothing beside the user's
steps): per sample ``__getitem__`` and, where the dataset exposes them, file read vs decode vs transform;
per batch collate and the host→device copy, pinned and pageable. Seconds, plain dicts."""

from __future__ import annotations

import io
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dlstore.bench.watch.describe_loop import base_dataset, is_dataset_folder


def measure_parts(loader: Any, batch: Any, cuda: bool, budget_s: float) -> dict[str, Any]:
    """Per-sample and per-batch costs of this loader's dataset, within about ``budget_s`` seconds."""
    ds = base_dataset(getattr(loader, "dataset", None))
    if ds is None or isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__getitem__"):
        return {"skipped": "the dataset is iterable (no __getitem__): its parts cannot be timed one by one"}
    try:
        n = len(ds)
    except TypeError:
        return {"skipped": "the dataset has no len()"}
    if n == 0:
        return {"skipped": "the dataset is empty"}
    want = max(2, int(getattr(loader, "batch_size", None) or 32))
    indices = random.Random(0).choices(range(n), k=2 * want)
    out: dict[str, Any] = {"dataset_len": n}
    getitem, samples = time_calls(ds.__getitem__, indices, 0.4 * budget_s)
    out["getitem_s"], out["samples_timed"] = getitem, len(samples)
    out.update(_split(ds, indices[: max(2, len(samples))], 0.35 * budget_s))
    out["collate_s"], out["collate_batch"] = _collate(loader, samples, want)
    if cuda and batch is not None:
        out["h2d"] = h2d_times(batch, 0.25 * budget_s)
    return out


def time_calls(fn: Callable[[Any], Any], items: Sequence[Any], budget_s: float) -> tuple[float, list[Any]]:
    """Median seconds of ``fn(item)`` over the items, stopping once ``budget_s`` is spent (at least one):
    the median, since a first call (file cache, lazy imports) or a GC pause would skew a mean of a few."""
    outputs: list[Any] = []
    times: list[float] = []
    for item in items:
        t = time.perf_counter()
        outputs.append(fn(item))
        times.append(time.perf_counter() - t)
        if sum(times) >= budget_s:
            break
    return statistics.median(times), outputs


def _split(ds: Any, indices: Sequence[int], budget_s: float) -> dict[str, Any]:
    """Load vs transform (any dataset with a ``transform``), and read vs decode for DatasetFolder's own
    PIL loader."""
    transform = getattr(ds, "transform", None)
    out: dict[str, Any] = {}
    if is_dataset_folder(ds):
        paths = [ds.samples[i][0] for i in indices]
        out["load_s"], images = time_calls(ds.loader, paths, budget_s / 3)
        if _is_pil_loader(ds.loader):
            out["read_s"], raw = time_calls(lambda p: Path(p).read_bytes(), paths, budget_s / 3)
            out["decode_s"], _ = time_calls(_decode, raw, budget_s / 3)
    elif transform is not None and hasattr(ds, "transform"):
        ds.transform = None  # the same __getitem__ without its transform: the load part alone
        try:
            out["load_s"], loaded = time_calls(ds.__getitem__, indices, budget_s / 2)
        except Exception:  # a Dataset that calls self.transform unconditionally: no split, __getitem__ whole
            return out
        finally:
            ds.transform = transform
        images = [s[0] if isinstance(s, (tuple, list)) else s for s in loaded]
        if all(isinstance(s, (tuple, list)) and len(s) > 1 and isinstance(s[1], dict) for s in loaded):
            # (image, target dict): a v2 transform moves the masks and boxes too; time that work with it
            out["transform_s"], _ = time_calls(lambda s: transform(s[0], s[1]), loaded, budget_s / 3)
            return out
    else:
        return out
    if transform is not None and images:
        out["transform_s"], _ = time_calls(transform, images, budget_s / 3)
    return out


def _is_pil_loader(fn: Any) -> bool:
    """torchvision's default_loader / pil_loader: a file read and a PIL decode to RGB, nothing else."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"
    return name in ("torchvision.datasets.folder.default_loader", "torchvision.datasets.folder.pil_loader")


def _decode(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")  # pil_loader's; convert() forces the lazy decode


def _collate(loader: Any, samples: list[Any], want: int) -> tuple[float | None, int]:
    """The loader's collate_fn on one batch of already-loaded samples."""
    collate = getattr(loader, "collate_fn", None)
    if collate is None or not samples:
        return None, 0
    group = (samples * (want // len(samples) + 1))[:want]
    try:
        t = time.perf_counter()
        collate(group)
        return time.perf_counter() - t, len(group)
    except Exception:  # a collate that needs what the sampler gives it (a custom batch layout): skip it
        return None, 0


def tensors_of(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in tensors_of(item)]
    return []


def h2d_times(batch: Any, budget_s: float) -> dict[str, float | int] | None:
    """Seconds to copy the batch's largest CPU tensor to the current CUDA device, pageable and pinned, timed
    as the bench times its copy (``stages.measure_h2d``, on a batch of that shape and dtype)."""
    from dlstore.bench.stages import measure_h2d

    host = [t for t in tensors_of(batch) if t.device.type == "cpu"]
    if not host:
        return None
    x = max(host, key=lambda t: t.numel())
    steps = max(3, min(50, int(budget_s / max(1e-4, x.numel() * x.element_size() / 4e9))))
    dev = torch.device("cuda", torch.cuda.current_device())
    got = measure_h2d("watch", tuple(x.shape), x.dtype, dev, steps).detail
    n = int(x.shape[0])
    return {
        "bytes": got["batch_bytes"],
        "pageable_s": n / got["pageable_img_per_s"],
        "pinned_s": n / got["pinned_img_per_s"],
    }
