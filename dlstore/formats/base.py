"""The Writer/Reader contract every cache format implements."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.spec import CacheSpec


class CacheWriter(ABC):
    """Writes images in *units* (a shard, a chunk, a slab): unit ``k`` holds images
    ``[k*unit_size, (k+1)*unit_size)``. ``create`` runs once in the main process; ``write_unit`` may run
    in any worker process and must only touch that unit's bytes, so units can be written in parallel
    and a finished unit never needs redoing."""

    name: ClassVar[str]

    def __init__(self, root: Path, n: int, shape: tuple[int, int, int], options: dict[str, Any]) -> None:
        self.root, self.n, self.shape, self.options = Path(root), n, tuple(shape), dict(options)
        self.unit_size = self.choose_unit_size(self.image_bytes)

    @property
    def image_bytes(self) -> int:
        h, w, c = self.shape
        return h * w * c

    @property
    def n_units(self) -> int:
        return -(-self.n // self.unit_size)

    def unit_range(self, k: int) -> range:
        return range(k * self.unit_size, min(self.n, (k + 1) * self.unit_size))

    @staticmethod
    @abstractmethod
    def choose_unit_size(image_bytes: int) -> int: ...

    @abstractmethod
    def create(self) -> None:
        """Lay out empty storage (main process, before any write_unit)."""

    @abstractmethod
    def write_unit(self, k: int, images: np.ndarray) -> None:
        """Store unit k durably (fsync) before returning."""

    def finish(self, labels: np.ndarray) -> None:
        """Main process, after every unit: anything global (labels copies, final flush)."""

    def recorded_options(self) -> dict[str, Any]:
        return {**self.options, "unit_size": self.unit_size}


class CacheReader(ABC):
    """Reads images by sorted storage positions. ``fork_safe`` readers may be used by a forked child
    as they are; others are re-opened per process by the dataset."""

    fork_safe: ClassVar[bool] = False

    def __init__(self, root: Path, spec: CacheSpec, in_memory: bool = False) -> None:
        self.root, self.spec, self.in_memory = Path(root), spec, in_memory

    @abstractmethod
    def read_sorted(self, positions: np.ndarray) -> np.ndarray:
        """(B,H,W,C) uint8 for ascending storage positions (duplicates allowed)."""

    def close(self) -> None:
        """Release handles; the reader may not be used afterwards."""


class UnitCache:
    """The most recently decoded units (shards, chunks) of one process, bounded by count."""

    def __init__(self, max_units: int) -> None:
        self.max_units = max(1, max_units)
        self._units: OrderedDict[int, np.ndarray] = OrderedDict()

    def get(self, k: int, load: Callable[[int], np.ndarray]) -> np.ndarray:
        if k in self._units:
            self._units.move_to_end(k)
            return self._units[k]
        arr = load(k)
        self._units[k] = arr
        while len(self._units) > self.max_units:
            self._units.popitem(last=False)
        return arr

    def clear(self) -> None:
        self._units.clear()


def clamp_units(target_bytes: int, image_bytes: int, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, target_bytes // max(1, image_bytes))))


def write_file_durably(path: Path, data: bytes | memoryview) -> None:
    """Temp name in the same folder, fsync, rename: a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def group_runs(keys: np.ndarray) -> list[tuple[int, int, int]]:
    """For ascending integer keys: (key, start, stop) of each run of equal keys."""
    if len(keys) == 0:
        return []
    cuts = np.flatnonzero(np.diff(keys)) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(keys)]))
    return [(int(keys[a]), int(a), int(b)) for a, b in zip(starts, stops)]
