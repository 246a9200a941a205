"""Where images come from: an ImageFolder-style tree, a torchvision dataset on local disk, or the demo.

A Source lists its samples up front (name, label, size, mtime) and decodes sample ``i`` on demand,
so a conversion can be split across processes by index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.checksums import file_sha256
from dlstore.convert.imageops import array_to_image, decode_file, prepare
from dlstore.errors import ImageDecodeError, SourceError
from dlstore.sourcefiles import IMAGE_EXTENSIONS, scan_tree
from dlstore.spec import ImagePolicy

__all__ = ["IMAGE_EXTENSIONS", "ArraySource", "FolderSource", "Source", "open_source", "scan_folder"]

TORCHVISION_SETS = ("MNIST", "FashionMNIST", "CIFAR10", "CIFAR100")


@dataclass
class Source:
    """Base: ``names[i]``, ``labels[i]``, ``classes``; subclasses implement ``decode``."""

    description: str
    classes: tuple[str, ...]
    names: list[str]
    labels: np.ndarray
    stats: list[tuple[int, int]] = field(default_factory=list)  # (size, mtime_ns) per sample, when files
    kind: str = ""
    sample: np.ndarray | None = None  # a subset's indices in the whole source (``subset``); None: all of it

    def __len__(self) -> int:
        return len(self.names)

    def decode(self, i: int, policy: ImagePolicy) -> np.ndarray:
        raise NotImplementedError

    def digest(self, i: int, missing_ok: bool = False) -> str:
        """sha256 of sample i's file, for ``verify --deep``; "" for in-memory samples."""
        return ""

    def decode_and_digest(self, i: int, policy: ImagePolicy) -> tuple[np.ndarray, str, float]:
        """``decode`` and ``digest`` of sample i, and the seconds the digest took."""
        image = self.decode(i, policy)
        t0 = time.perf_counter()
        return image, self.digest(i), time.perf_counter() - t0

    def entries(self) -> list[list[Any]]:
        """(relative name, size, mtime_ns, label) rows: what staleness checks compare."""
        stats = self.stats or [(0, 0)] * len(self.names)
        return [[n, s, m, int(lab)] for n, (s, m), lab in zip(self.names, stats, self.labels)]

    def entries_json(self) -> str:
        """``entries()`` as JSON text, made once: the fingerprint hashes it and the journal stores it
        (each a JSON dump of every row otherwise, about 0.3 s per 100k files)."""
        key = (len(self.names), len(self.stats))
        cached = self.__dict__.get("_entries_json")
        if cached is None or cached[0] != key:
            cached = (key, json.dumps(self.entries()))
            self.__dict__["_entries_json"] = cached
        return cached[1]

    def fingerprint(self) -> str:
        # Relative names only, so a moved dataset root keeps its fingerprint.
        h = hashlib.sha256(json.dumps(self.classes).encode())
        h.update(self.entries_json().encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        # Workers (forked, spawned or on Dask) need the rows, not the JSON text made from them.
        return {k: v for k, v in self.__dict__.items() if k != "_entries_json"}

    def subset(self, indices: np.ndarray) -> Source:
        """The samples at ``indices`` (ascending) as a source of their own: ``sample`` records which."""
        idx = np.asarray(indices, dtype=np.int64)
        return dataclasses.replace(
            self,  # type: ignore[arg-type]
            names=[self.names[i] for i in idx],
            labels=self.labels[idx],
            stats=[self.stats[i] for i in idx] if self.stats else [],
            sample=idx if self.sample is None else self.sample[idx],
            **self._subset_fields(idx),
        )

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "description": self.description,
            "count": len(self),
            "fingerprint": self.fingerprint(),
        }


@dataclass
class FolderSource(Source):
    """A folder of class subfolders, scanned exactly like ``torchvision.datasets.ImageFolder``.

    Differences, on purpose: hidden folders and files (``.name``, so ``.DS_Store``) are skipped,
    symlinked folders and files are followed, also when they point outside the root (a link loop, or a
    folder reached twice, ends that descent), non-regular files (FIFOs, devices) and entries that
    cannot be listed or stat'ed are reported in ``scan_errors`` rather than read, GIFs are accepted.
    """

    root: Path = Path(".")
    root_mtime_ns: int = 0
    scan_errors: list[tuple[str, str]] = field(default_factory=list)

    def decode(self, i: int, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        """Sample i's pixels; ``data``: its file's bytes, when already read (``decode_and_digest``)."""
        return decode_file(self.root / self.names[i], policy, data)

    def decode_and_digest(self, i: int, policy: ImagePolicy) -> tuple[np.ndarray, str, float]:
        # One read for both: the converter hashed each file in a second open and read (2.9 % of
        # the workers' time at 256 px on the H200), and the digest is now of the very bytes decoded.
        path = self.root / self.names[i]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ImageDecodeError(f"{path}: cannot decode image ({type(e).__name__}: {e})") from e
        t0 = time.perf_counter()
        digest = hashlib.sha256(data).hexdigest()
        hashed = time.perf_counter() - t0
        return self.decode(i, policy, data), digest, hashed

    def digest(self, i: int, missing_ok: bool = False) -> str:
        try:
            return file_sha256(self.root / self.names[i])
        except OSError:
            if missing_ok:
                return ""
            raise


@dataclass
class ArraySource(Source):
    """Samples already in memory as uint8 arrays (torchvision MNIST/CIFAR files)."""

    data: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 1), np.uint8))

    def decode(self, i: int, policy: ImagePolicy) -> np.ndarray:
        return prepare(array_to_image(self.data[i]), policy)

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"data": self.data[idx]}


def scan_folder(root: Path, kind: str = "folder") -> FolderSource:
    scan = scan_tree(Path(root))
    return FolderSource(
        description=str(scan.root),
        classes=scan.classes,
        names=scan.names,
        labels=scan.labels,
        stats=scan.stats,
        kind=kind,
        root=scan.root,
        scan_errors=scan.errors,
        root_mtime_ns=scan.root_mtime_ns,
    )


def load_torchvision(name: str, root: Path | None, train: bool = True) -> ArraySource:
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
    return ArraySource(
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


def open_source(
    source: str | Path, root: Path | None = None, train: bool = True, demo_images: int = 512
) -> Source:
    """Resolve a SOURCE argument: a folder path, ``torchvision:NAME`` or ``demo``."""
    text = str(source)
    if text == "demo":
        from dlstore.datasets.demo import ensure_demo

        return scan_folder(ensure_demo(n_images=demo_images), kind="demo")
    if text.startswith("torchvision:"):
        return load_torchvision(text.split(":", 1)[1], root, train)
    return scan_folder(Path(text))
