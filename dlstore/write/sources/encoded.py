"""Sources whose samples are encoded image bytes: a file, a parquet row, a tar member, a Dataset's
item. Each kind fetches sample i's bytes (``read_bytes``); decoding is ``imageops.decode_file`` (EXIF,
every mode, the bomb limit) and the digest is of the very bytes decoded. ``labels_from_values``: the
class rule for kinds without a declaration of their own."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from dlstore.errors import ImageDecodeError, SourceError
from dlstore.spec import ImagePolicy
from dlstore.write.geometry import Geometry
from dlstore.write.imageops import decode_file, decode_with_geometry
from dlstore.write.sources.source import Source
from dlstore.write.targets import place_targets

if TYPE_CHECKING:
    from dlstore.write.sources.registry import SourceArgs


@dataclass
class EncodedSource(Source):
    """``read_bytes(i)``: sample i's encoded image, or ImageDecodeError naming ``where(i)``."""

    def read_bytes(self, i: int) -> bytes:
        raise NotImplementedError

    def where(self, i: int) -> Path | str:
        """What errors name for sample i."""
        return self.names[i]

    def decode(self, i: int, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        return decode_file(self.where(i), policy, self.read_bytes(i) if data is None else data)

    def decode_and_digest(self, i: int, policy: ImagePolicy) -> tuple[np.ndarray, str, float]:
        data = self.read_bytes(i)
        t0 = time.perf_counter()
        digest = hashlib.sha256(data).hexdigest()
        hashed = time.perf_counter() - t0
        return self.decode(i, policy, data), digest, hashed

    def decode_geometry(
        self, i: int, policy: ImagePolicy, data: bytes | None = None
    ) -> tuple[np.ndarray, Geometry]:
        image, geometry = decode_with_geometry(
            self.where(i), policy, self.read_bytes(i) if data is None else data
        )
        return image, geometry  # type: ignore[return-value]

    def decode_targets_and_digest(
        self, i: int, policy: ImagePolicy
    ) -> tuple[np.ndarray, str, float, dict[str, np.ndarray], dict[str, int]]:
        """``Source.decode_targets_and_digest`` with the bytes read once."""
        data = self.read_bytes(i)
        t0 = time.perf_counter()
        digest = hashlib.sha256(data).hexdigest()
        hashed = time.perf_counter() - t0
        image, geometry = self.decode_geometry(i, policy, data)
        rows, dropped = place_targets(self.raw_targets(i), self.fields, geometry, policy, self.names[i])
        return image, digest, hashed, rows, dropped

    def reopen(self) -> dict[str, Any] | None:
        """How ``verify --deep`` opens this source again (``open_source`` arguments), or None."""
        return None

    def info(self) -> dict[str, Any]:
        again = self.reopen()
        return {**super().info(), **({"reopen": again} if again else {})}

    def reopen_with(self, source: str, label: str) -> dict[str, Any]:
        """``reopen`` of a kind with a label column or key, and --field requests."""
        again = {"source": source, "label": label if self.classes or not self.field_requests else None}
        return {**again, "fields": [r.text for r in self.field_requests]} if self.field_requests else again

    def fingerprint_of(self, *parts: Any) -> str:
        """sha256 of ``parts`` (JSON, arrays' bytes) and of the --field requests, when any."""
        h = hashlib.sha256()
        for part in parts:
            h.update(
                part.tobytes() if isinstance(part, np.ndarray) else json.dumps(part, default=str).encode()
            )
        if self.field_requests:
            h.update(json.dumps([r.text for r in self.field_requests]).encode())
        return h.hexdigest()

    def source_files(self) -> list[Path]:
        """The local files an epoch of per-sample reads reads (the bench's read stage); [] if none."""
        return []

    def open_image(self, i: int) -> Any:
        """Sample i as its users open it: a PIL image (the bench's ``raw`` kind)."""
        import io

        from PIL import Image

        return Image.open(io.BytesIO(self.read_bytes(i)))

    def digest(self, i: int, missing_ok: bool = False) -> str:
        try:
            return hashlib.sha256(self.read_bytes(i)).hexdigest()
        except (ImageDecodeError, OSError):
            if missing_ok:
                return ""
            raise


def stop_if_strict(errors: list[tuple[str, str]], args: SourceArgs) -> None:
    """``--strict``: a sample the listing cannot take stops the open, named."""
    if errors and args.strict:
        raise SourceError(f"{errors[0][0]}: {errors[0][1]}; stopped (--strict)")


def unreadable(name: str, e: BaseException) -> ImageDecodeError:
    return ImageDecodeError(f"{name}: cannot read image bytes ({type(e).__name__}: {e})")


class IndexedNames(Sequence[str]):
    """``prefix[k]#row`` names computed on demand from arrays: no Python string per sample."""

    def __init__(self, prefixes: Sequence[str], owner: np.ndarray, local: np.ndarray, sep: str = "#") -> None:
        self.prefixes, self.owner, self.local, self.sep = list(prefixes), owner, local, sep

    def __len__(self) -> int:
        return len(self.owner)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return f"{self.prefixes[int(self.owner[i])]}{self.sep}{self.local[i]}"

    def take(self, idx: np.ndarray) -> IndexedNames:
        return IndexedNames(self.prefixes, self.owner[idx], self.local[idx], self.sep)

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


def labels_from_values(values: Any, where: str) -> tuple[tuple[str, ...], np.ndarray]:
    """Classes and labels from raw values: ints ≥ 0 as they are, else the sorted distinct values."""
    arr = np.asarray(values)
    if arr.size == 0:
        return (), np.zeros(0, np.int64)
    if arr.dtype.kind in "iu":
        if arr.min() < 0:
            raise SourceError(f"{where}: label {int(arr.min())} is negative; class labels are indices 0..K-1")
        return tuple(str(k) for k in range(int(arr.max()) + 1)), arr.astype(np.int64).reshape(-1)
    if arr.dtype.kind not in "USO":
        raise SourceError(
            f"{where}: labels must be ints or strings, found {arr.dtype} values; "
            "point --label at a class column (multi-value targets are not read as classes)"
        )
    uniq, inverse = np.unique(arr.astype(str) if arr.dtype.kind == "O" else arr, return_inverse=True)
    return tuple(str(u) for u in uniq.tolist()), inverse.astype(np.int64).reshape(-1)
