"""The Source interface every kind implements, and ``ArraySource`` (samples already in memory).
A Source lists its samples up front and decodes sample ``i`` on demand, so a conversion splits by index."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dlstore.spec import FieldSpec, ImagePolicy
from dlstore.write.geometry import Geometry
from dlstore.write.imageops import array_to_image, prepare
from dlstore.write.sources.fieldmap import FieldRequest, raw_value
from dlstore.write.targets import place_targets

if TYPE_CHECKING:
    from dlstore.write.sources.registry import SourceArgs


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
    # Per-sample fields beside the images (boxes, masks, ...); ``raw_targets(i)`` gives sample i's.
    fields: dict[str, FieldSpec] = field(default_factory=dict)
    field_requests: tuple[FieldRequest, ...] = ()

    # The kind's declaration: when it is asked (lower first), the SOURCE form it reads (messages, --help).
    claim_order: ClassVar[int] = 500
    form: ClassVar[str] = ""
    field_form: ClassVar[str] = ""

    @classmethod
    def claims(cls, text: str) -> bool:
        """True when this kind reads the SOURCE argument ``text``."""
        return False

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> Source:
        raise NotImplementedError

    @classmethod
    def local_root(cls, text: str) -> Path | None:
        """The local folder SOURCE ``text`` reads images from (no cache goes inside it), or None."""
        return None

    def __len__(self) -> int:
        return len(self.names)

    def decode(self, i: int, policy: ImagePolicy) -> np.ndarray:
        raise NotImplementedError

    def stage(self, order: np.ndarray, unit_size: int, folder: Path, units: list[int]) -> None:
        """In the driver, before the units: a kind read in blocks may regroup samples by unit."""

    def prefetch(self, indices: np.ndarray) -> None:
        """A unit is about to decode samples ``indices``: a kind read in blocks reads each block once."""

    def digest(self, i: int, missing_ok: bool = False) -> str:
        """sha256 of sample i's file, for ``verify --deep``; "" for in-memory samples."""
        return ""

    def raw_targets(self, i: int) -> dict[str, Any]:
        """Sample i's fields as ``place_targets`` takes them; default: the ``--field`` values."""
        return {
            r.name: raw_value(self.fields[r.name], self.field_value(i, r.key)) for r in self.field_requests
        }

    def field_value(self, i: int, key: str) -> Any:
        """Sample i's raw value of ``--field`` KEY (None when it has none): kinds with a ``field_form``."""
        raise NotImplementedError(f"{type(self).__name__} takes no --field")

    def decode_geometry(
        self, i: int, policy: ImagePolicy, data: bytes | None = None
    ) -> tuple[np.ndarray, Geometry]:
        """``decode``, and the stored size and EXIF orientation its fields follow."""
        raise NotImplementedError(f"{type(self).__name__} brings no fields")

    def decode_targets_and_digest(
        self, i: int, policy: ImagePolicy
    ) -> tuple[np.ndarray, str, float, dict[str, np.ndarray], dict[str, int]]:
        """``decode_and_digest``, with the fields placed and the boxes dropped per boxes field."""
        image, geometry = self.decode_geometry(i, policy)
        t0 = time.perf_counter()
        digest = self.digest(i)
        hashed = time.perf_counter() - t0
        rows, dropped = place_targets(self.raw_targets(i), self.fields, geometry, policy, self.names[i])
        return image, digest, hashed, rows, dropped

    def targets_fingerprint(self) -> str:
        """What the fields' source data hash to (an annotation file's sha256); "" when unknown."""
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
        """``entries()`` as JSON text, made once (0.3 s per 100k files)."""
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
        if self.fields:  # a classification source's fingerprint stays what it was
            h.update(json.dumps({k: dataclasses.asdict(f) for k, f in self.fields.items()}).encode())
            h.update(self.targets_fingerprint().encode())
        return h.hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        # Workers (forked, spawned or on Dask) need the rows, not the JSON text made from them.
        return {k: v for k, v in self.__dict__.items() if k != "_entries_json"}

    def subset(self, indices: np.ndarray) -> Source:
        """The samples at ``indices`` (ascending) as a source of their own (``sample`` records which)."""
        idx = np.asarray(indices, dtype=np.int64)
        return dataclasses.replace(
            self,  # type: ignore[arg-type]
            names=self.names.take(idx) if hasattr(self.names, "take") else [self.names[i] for i in idx],
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
class ArraySource(Source):
    """Samples already in memory as uint8 arrays (torchvision MNIST/CIFAR files)."""

    data: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 1), np.uint8))

    def decode(self, i: int, policy: ImagePolicy) -> np.ndarray:
        return prepare(array_to_image(self.data[i]), policy)

    def decode_geometry(
        self, i: int, policy: ImagePolicy, data: bytes | None = None
    ) -> tuple[np.ndarray, Geometry]:
        h, w = self.data[i].shape[:2]
        return self.decode(i, policy), Geometry((w, h))

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"data": self.data[idx]}
