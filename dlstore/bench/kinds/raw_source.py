"""The ``raw`` kind, what users start from: torchvision ImageFolder / dataset with per-file PIL decode in
DataLoader workers; sources of encoded samples read as their users read them (``open_image`` per sample)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from dlstore.bench.kinds.context import NATIVE_SIZES, LoaderContext, PreparedLoader
from dlstore.bench.transforms import device_transform, raw_field_transform, raw_transform
from dlstore.errors import DlstoreError
from dlstore.write.sources import FolderSource
from dlstore.write.sources.encoded import EncodedSource


def raw_kind(ctx: LoaderContext) -> PreparedLoader:
    tf_name, size = ctx.config.transform, ctx.size
    dtype = torch.uint8 if tf_name == "gpu-augment" else torch.float32
    dev_tf = device_transform(tf_name, size, ctx.device) if tf_name == "gpu-augment" else None
    if ctx.source.fields:
        return fields_kind(ctx, tf_name, dtype, dev_tf)
    if isinstance(ctx.source, FolderSource):
        root = ctx.source.root
        files = [root / n for n in ctx.source.names]
        listed = frozenset(str(f) for f in files)  # the files convert reads (ImageFolder's, plus GIF)

        def new_dataset() -> Dataset:
            from torchvision.datasets import ImageFolder

            return ImageFolder(
                str(root),
                transform=raw_transform(tf_name, size, None),
                loader=tolerant_loader,
                is_valid_file=listed.__contains__,
                allow_empty=True,  # a sample (--max-images) may miss some classes; their indices stay
            )

        description = f"torchvision ImageFolder({root}) + {tf_name}"
        return per_sample(ctx, description, files, new_dataset, dtype, dev_tf, {"root": str(root)})
    if isinstance(ctx.source, EncodedSource):
        src = ctx.source
        description = f"{src.kind} {src.description} read per sample + {tf_name}"

        def new_images() -> Dataset:
            return SourceImages(src, raw_transform(tf_name, size, None))

        return per_sample(
            ctx, description, src.source_files(), new_images, dtype, dev_tf, {"source": src.description}
        )
    name = ctx.source.kind.removeprefix("torchvision:")
    root = ctx.config.root
    if root is None:
        raise DlstoreError(f"raw loader for {ctx.source.kind} needs --root")
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and _torchvision_file(name, p))

    sample = ctx.source.sample

    def new_tv_dataset() -> Dataset:
        import torchvision.datasets as tvd
        from torch.utils.data import Subset

        ds = getattr(tvd, name)(
            str(root),
            train=True,
            download=False,
            transform=raw_transform(tf_name, size, NATIVE_SIZES.get(name)),
        )
        return ds if sample is None else Subset(ds, sample.tolist())  # the run's sample (--max-images)

    return PreparedLoader(
        "raw",
        f"torchvision.datasets.{name}({root}) + {tf_name}",
        len(ctx.source),
        files,
        False,
        dtype,
        (ctx.channels, size, size),
        new_tv_dataset,
        dev_tf,
        info={"root": str(root), "loads_once": True},
    )


class SourceImages(Dataset):
    """(transformed image, label) of a source's sample i, opened as the source's users open it."""

    def __init__(self, source: EncodedSource, transform: Any) -> None:
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        try:
            img = self.source.open_image(i).convert("RGB")
        except (OSError, ValueError, SyntaxError, DlstoreError, Image.DecompressionBombError):
            img = Image.new("RGB", (1, 1))  # as tolerant_loader: counted in the bench's note, not fatal
        return self.transform(img), int(self.source.labels[i])


def per_sample(
    ctx: LoaderContext,
    description: str,
    files: list[Path],
    new_dataset: Any,
    dtype: torch.dtype,
    dev_tf: Any,
    info: dict[str, Any],
) -> PreparedLoader:
    """A raw kind that decodes each sample from the source's files, every epoch."""
    size = ctx.size
    return PreparedLoader(
        "raw", description, len(ctx.source), files, True, dtype, (3, size, size), new_dataset, dev_tf,
        fresh_for_cold=False, info=info,
    )  # fmt: skip


def fields_kind(ctx: LoaderContext, tf_name: str, dtype: torch.dtype, dev_tf: Any) -> PreparedLoader:
    """A source of fields read per sample, through a v2 pipeline that moves masks and boxes too."""
    source, size = ctx.source, ctx.size
    boxes = any(f.kind == "boxes" for f in source.fields.values())

    def new_dataset() -> Dataset:
        return SourceFieldSamples(source, raw_field_transform(tf_name, size, boxes))

    files = source.source_files() if isinstance(source, EncodedSource) else []
    if isinstance(source, FolderSource):
        files = [source.root / n for n in source.names]
    what = f"{source.kind} {source.description} read per sample (image + {', '.join(source.fields)})"
    info = {"source": source.description, "fields": list(source.fields)}
    return per_sample(ctx, f"{what} + v2 {tf_name}", files, new_dataset, dtype, dev_tf, info)


class SourceFieldSamples(Dataset):
    """(image, target dict) of a source's sample i, its fields as ``tv_tensors``, through ``transform``."""

    def __init__(self, source: Any, transform: Any) -> None:
        self.source, self.transform, self.fields = source, transform, source.fields

    def __len__(self) -> int:
        return len(self.source)

    @property
    def collate_fn(self) -> Any:
        import functools

        from dlstore.read.field_targets import collate_fields

        ragged = frozenset(k for k, f in self.fields.items() if f.ragged)
        return functools.partial(collate_fields, ragged=ragged)

    def __getitem__(self, i: int) -> tuple[Any, dict[str, Any]]:
        from torchvision import tv_tensors

        src = self.source
        opened = src.open_image(i) if hasattr(src, "open_image") else Image.open(src.root / src.names[i])
        img = opened.convert("RGB")
        h, w = img.height, img.width
        target: dict[str, Any] = {}
        for name, value in src.raw_targets(i).items():
            kind = self.fields[name].kind
            if kind == "boxes":
                b = torch.as_tensor(value, dtype=torch.float32).reshape(-1, 4)
                target[name] = tv_tensors.BoundingBoxes(b, format="XYXY", canvas_size=(h, w))
            elif kind == "mask":
                ids = np.zeros((h, w), np.uint8) if value is None else np.asarray(value)
                target[name] = tv_tensors.Mask(
                    torch.from_numpy(ids.astype(np.int64 if ids.itemsize > 1 else np.uint8))
                )
            elif kind == "json":
                target[name] = value
            else:
                target[name] = torch.as_tensor(value)
        return self.transform(img, target)


def tolerant_loader(path: str) -> Image.Image:
    """torchvision's default loader, except that an undecodable file reads as a 1×1 black image (counted
    in the bench's note) where a plain ImageFolder loop stops at the first."""
    from torchvision.datasets.folder import default_loader

    try:
        return default_loader(path)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return Image.new("RGB", (1, 1))


def _torchvision_file(name: str, path: Path) -> bool:
    if name in ("MNIST", "FashionMNIST"):
        return (
            path.parent.name == "raw" and path.parent.parent.name == name and path.name.startswith("train-")
        )
    folder = "cifar-10-batches-py" if name == "CIFAR10" else "cifar-100-python"
    return path.parent.name == folder
