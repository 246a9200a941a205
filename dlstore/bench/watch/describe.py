"""What a DataLoader is: its settings, its dataset (type, root, transform pipeline with the sizes and
angles the advice reads off it), and the number of images in a batch. Plain data, taken once per loader."""

from __future__ import annotations

import sys
from typing import Any

# transforms whose output size the cache advice reads (torchvision.transforms and .v2 share these names)
SIZED = ("Resize", "RandomResizedCrop", "CenterCrop", "RandomCrop")
# transforms that draw random parameters per sample: augmentation that GpuAugment can take over
RANDOM = (
    "RandomResizedCrop",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomVerticalFlip",
    "RandomRotation",
    "RandomAffine",
    "ColorJitter",
    "RandomErasing",
)


def keeps_state(loader: Any) -> bool:
    from dlstore.read.order import keeps_state as loader_keeps_state

    return loader_keeps_state(loader)


def loader_settings(loader: Any) -> dict[str, Any]:
    """The DataLoader options that decide its speed, as the user set them."""
    ctx = getattr(loader, "multiprocessing_context", None)
    method = ctx.get_start_method() if ctx is not None and hasattr(ctx, "get_start_method") else None
    if method is None and getattr(loader, "num_workers", 0):
        import multiprocessing

        method = multiprocessing.get_start_method(allow_none=True) or "fork"
    try:
        batches: int | None = len(loader)
    except TypeError:  # an IterableDataset without __len__
        batches = None
    return {
        "type": _type_name(loader),
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "batch_size": getattr(loader, "batch_size", None),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "drop_last": bool(getattr(loader, "drop_last", False)),
        "start_method": method,
        "sampler": _type_name(getattr(loader, "sampler", None)),
        "collate_fn": getattr(getattr(loader, "collate_fn", None), "__name__", None),
        "batches_per_epoch": batches,
        "keeps_state": keeps_state(loader),
    }


def base_dataset(dataset: Any) -> Any:
    """Through torch's Subset wrappers to the dataset that does the work."""
    seen = 0
    while type(dataset).__name__ == "Subset" and hasattr(dataset, "dataset") and seen < 8:
        dataset, seen = dataset.dataset, seen + 1
    return dataset


def dataset_info(dataset: Any) -> dict[str, Any]:
    ds = base_dataset(dataset)
    try:
        n: int | None = len(dataset)
    except TypeError:
        n = None
    info: dict[str, Any] = {"type": _type_name(ds), "len": n, "wrapped": ds is not dataset}
    info["image_folder"] = is_dataset_folder(ds)
    info["torchvision"] = type(ds).__module__.startswith("torchvision.datasets")
    if info["image_folder"] or info["torchvision"]:
        root = getattr(ds, "root", None)
        info["root"] = None if root is None else str(root)
    transform = getattr(ds, "transform", None)
    info["transform"] = None if transform is None else repr(transform)
    info["transforms"] = transform_steps(transform)
    return info


def is_dataset_folder(ds: Any) -> bool:
    # a DatasetFolder exists only once its module is imported: never import torchvision for a script that
    # does not use it (seconds at the first iter(), in its time)
    folder = sys.modules.get("torchvision.datasets.folder")
    return folder is not None and isinstance(ds, folder.DatasetFolder)


def transform_steps(transform: Any) -> list[dict[str, Any]]:
    """A transform pipeline flattened: name, repr, and the size/degrees where it has them."""
    if transform is None:
        return []
    inner = getattr(transform, "transforms", None)
    if isinstance(inner, (list, tuple)):
        return [s for t in inner for s in transform_steps(t)]
    step: dict[str, Any] = {"name": type(transform).__name__, "repr": repr(transform)}
    size = getattr(transform, "size", None)
    if step["name"] in SIZED and size is not None:
        step["size"] = list(size) if isinstance(size, (list, tuple)) else [int(size)]
    degrees = getattr(transform, "degrees", None)
    if isinstance(degrees, (list, tuple)) and len(degrees) == 2:
        step["degrees"] = max(abs(float(degrees[0])), abs(float(degrees[1])))
    step["random"] = step["name"] in RANDOM
    return [step]


def batch_images(batch: Any) -> int | None:
    """Samples in a collated batch: the first dimension of its first tensor (or array)."""
    if hasattr(batch, "shape") and len(getattr(batch, "shape", ())) > 0:
        return int(batch.shape[0])
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_images(item)
            if n is not None:
                return n
    return None


def _type_name(obj: Any) -> str | None:
    if obj is None:
        return None
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"
