"""What a DataLoader is: its settings, its dataset (type, root, transform pipeline with the sizes and
angles the advice reads off it), and the number of images in a batch. Plain data, taken once per loader."""

from __future__ import annotations

import os
import sys
from typing import Any

# transforms that draw random parameters per sample: augmentation that GpuAugment can take over
RANDOM = frozenset(
    "RandomResizedCrop RandomResizedCropAndInterpolation RandomCrop RandomHorizontalFlip RandomVerticalFlip "
    "RandomRotation RandomAffine ColorJitter RandomErasing".split()
)


def loader_settings(loader: Any) -> dict[str, Any]:
    """The DataLoader options that decide its speed, as the user set them."""
    from dlstore.read.order import keeps_state as loader_keeps_state

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
        "keeps_state": loader_keeps_state(loader),
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
    info["image_folder"] = is_dataset_folder(ds) or _timm_folder(ds) is not None
    info["torchvision"] = type(ds).__module__.startswith("torchvision.datasets")
    try:
        info["convert"] = convert_source(ds)
    except Exception as e:  # a Dataset's own attribute that raises: no cache advice, never the script's error
        info["convert"] = {"why": f"reading {type(ds).__name__}'s files failed ({type(e).__name__}: {e})"}
    info["root"] = info["convert"].get("root")
    transform = getattr(ds, "transform", None)
    info["transform"] = None if transform is None else repr(transform)
    info["transforms"] = transform_steps(transform)
    return info


TORCHVISION_SOURCES = ("MNIST", "FashionMNIST", "CIFAR10", "CIFAR100")
PATH_LISTS = ("samples", "imgs", "image_paths", "img_paths", "paths", "files", "filenames")


def convert_source(ds: Any) -> dict[str, Any]:
    """How ``dlstore convert`` reads this dataset's images: ``source`` (the SOURCE argument), ``extra``
    (its options), ``prepare`` (code to run first, writing the file the source names) and ``root`` (a
    folder of class folders); or ``why`` there is none."""
    name = type(ds).__name__
    root = _timm_folder(ds) or (getattr(ds, "root", None) if is_dataset_folder(ds) else None)
    if root is not None:
        return {"source": str(root), "extra": "", "root": str(root)}
    if type(ds).__module__.startswith("torchvision.datasets") and name in TORCHVISION_SOURCES:
        split = "" if getattr(ds, "train", True) else " --split test"
        return {"source": f"torchvision:{name}", "extra": f" --root {ds.root}{split}", "root": str(ds.root)}
    if type(ds).__module__.split(".")[0] == "datasets" and hasattr(ds, "to_parquet"):
        return _hf_source(ds)
    listed = _path_rows(ds)
    if listed is not None:
        rows = f"[('path', 'label'), *{listed}]"
        prepare = f"import csv; csv.writer(open('files.csv', 'w', newline='')).writerows({rows})"
        return {"source": "files.csv", "extra": "", "prepare": prepare}
    if isinstance(ds, sys.modules["torch.utils.data"].IterableDataset):
        return {"why": f"{name} is an IterableDataset: it streams samples and names no files to convert"}
    if type(ds).__module__ == "__main__":
        return {
            "why": f"{name} is defined in the script itself and names no image files: dlstore convert "
            "cannot import it (move it to a module, then dlstore convert MODULE:CALLABLE DEST with a "
            "CALLABLE that returns it with transform=None)"
        }
    return {
        "source": f"{type(ds).__module__}:CALLABLE",
        "extra": "",
        "why_callable": f"{name} names no image files: CALLABLE is a function in {type(ds).__module__} that "
        "returns it with transform=None (its items then hold the images as loaded)",
    }


def _timm_folder(ds: Any) -> str | None:
    """timm's ImageDataset over its folder reader: the reader's root (class folders, as ImageFolder)."""
    timm_reader = getattr(ds, "reader", None)
    root = vars(timm_reader).get("root") if type(timm_reader).__name__ == "ReaderImageFolder" else None
    return str(root) if root else None


def _path_rows(ds: Any) -> str | None:
    """Python for the (path, label) rows of a Dataset over a list of paths or of (path, label) pairs."""
    for attr in ("reader.samples", *PATH_LISTS):
        value = ds
        for part in attr.split("."):
            value = getattr(value, part, None)
        first = value[0] if isinstance(value, (list, tuple)) and value else None
        if isinstance(first, (tuple, list)) and len(first) >= 2 and isinstance(first[0], (str, os.PathLike)):
            return f"[(str(p), y) for p, y, *_ in ds.{attr}]"
        if isinstance(first, (str, os.PathLike)):
            n = len(value)  # type: ignore[arg-type]
            ys = [f"ds.{a}" for a in ("targets", "labels") if len(getattr(ds, a, None) or ()) == n]
            return f"zip(map(str, ds.{attr}), {(ys or ['[0] * len(ds)'])[0]})"
    return None


def _hf_source(ds: Any) -> dict[str, Any]:
    """A Hugging Face ``datasets`` table: written as parquet, read by dlstore's parquet source."""
    kinds = {k: type(v).__name__ for k, v in (getattr(ds, "features", {}) or {}).items()}
    if "Image" not in kinds.values():
        return {"why": "the Hugging Face table has no Image column: nothing to cache as images"}
    label = next((k for k, v in kinds.items() if v == "ClassLabel"), "label")
    return {
        "source": "train.parquet",
        "extra": f" --label {label}",
        "prepare": "ds.to_parquet('train.parquet')",
    }


def is_dataset_folder(ds: Any) -> bool:
    # a DatasetFolder exists only once its module is imported: never import torchvision for a script that
    # does not use it (seconds at the first iter(), in its time)
    folder = sys.modules.get("torchvision.datasets.folder")
    return folder is not None and isinstance(ds, folder.DatasetFolder)


# the parameters the advice reproduces, read off each transform where it has them
PARAMS = ("size", "scale", "ratio", "p", "mean", "std", "degrees", "dtype")


def transform_steps(transform: Any) -> list[dict[str, Any]]:
    """A transform pipeline flattened: name, repr, and the parameters the advice reproduces."""
    if transform is None:
        return []
    inner = getattr(transform, "transforms", None)
    if isinstance(inner, (list, tuple)):
        return [s for t in inner for s in transform_steps(t)]
    step: dict[str, Any] = {"name": type(transform).__name__, "repr": repr(transform)}
    for key in PARAMS:
        value = getattr(transform, key, None)
        if hasattr(value, "tolist"):  # a tensor (timm's Normalize keeps its mean and std as tensors)
            value = value.tolist()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            step[key] = [round(float(v), 6) if key != "size" else int(v) for v in value]
        elif key == "dtype" and str(value).startswith("torch."):
            step[key] = str(value)
    if "degrees" in step:
        step["degrees"] = max(abs(d) for d in step["degrees"])
    if "p" in step:
        step["p"] = step["p"][0]
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
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"
