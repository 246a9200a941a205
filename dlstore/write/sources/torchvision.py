"""``torchvision:NAME``: MNIST, FashionMNIST, CIFAR10 or CIFAR100 read by torchvision from files under
``--root`` (never downloaded), held in memory as arrays."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlstore.errors import SourceError
from dlstore.write.sources.registry import SourceArgs, register_source
from dlstore.write.sources.source import ArraySource

TORCHVISION_SETS = ("MNIST", "FashionMNIST", "CIFAR10", "CIFAR100")
PREFIX = "torchvision:"


@register_source
@dataclass
class TorchvisionSource(ArraySource):
    claim_order = 20
    form = "torchvision:NAME --root DIR (" + ", ".join(TORCHVISION_SETS) + ")"

    @classmethod
    def claims(cls, text: str) -> bool:
        return text.startswith(PREFIX)

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> ArraySource:
        return load_torchvision(text.removeprefix(PREFIX), args.root, args.train)


def load_torchvision(name: str, root: Path | None, train: bool = True) -> TorchvisionSource:
    """MNIST/FashionMNIST/CIFAR10/CIFAR100 read by torchvision from local files; never downloads."""
    if name not in TORCHVISION_SETS:
        raise SourceError(f"torchvision:{name}: unsupported; choose one of {', '.join(TORCHVISION_SETS)}")
    if root is None:
        raise SourceError(f"torchvision:{name} needs --root DIR, the folder torchvision would download into")
    _check_torchvision_files(name, Path(root), train)
    import torchvision.datasets as tvd

    try:
        ds = getattr(tvd, name)(str(root), train=train, download=False)
    except Exception as e:  # noqa: BLE001 - torchvision's readers raise RuntimeError, pickle, OSError, …
        raise SourceError(
            f"torchvision:{name}: torchvision cannot read the files under {root} ({type(e).__name__}: {e}); "
            "extract the dataset's archive there again (dlstore never downloads)"
        ) from e
    data = ds.data.numpy() if hasattr(ds.data, "numpy") else np.asarray(ds.data)
    targets = np.asarray(ds.targets, dtype=np.int64)
    split = "train" if train else "test"
    names = [f"{name}/{split}/{i}" for i in range(len(data))]
    return TorchvisionSource(
        description=f"torchvision:{name} ({split}) from {root}",
        classes=tuple(ds.classes),
        names=names,
        labels=targets,
        kind=f"torchvision:{name}",
        data=data,
    )


def _check_torchvision_files(name: str, root: Path, train: bool) -> None:
    if name in ("MNIST", "FashionMNIST"):
        prefix = "train" if train else "t10k"
        needed = [root / name / "raw" / f"{prefix}-{k}-ubyte" for k in ("images-idx3", "labels-idx1")]
    elif name == "CIFAR10":
        needed = [
            root / "cifar-10-batches-py" / (f"data_batch_{i}" if train else "test_batch")
            for i in (range(1, 6) if train else [0])
        ]
    else:
        needed = [
            root / "cifar-100-python" / ("train" if train else "test"),
            root / "cifar-100-python" / "meta",
        ]
    for path in needed:
        if not path.is_file():
            raise SourceError(
                f"torchvision:{name}: missing {path}; put the extracted dataset files there "
                "(dlstore never downloads)"
            )
