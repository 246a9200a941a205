"""``ChunkSampler``: random order that reads each chunk/shard once per epoch.

A full shuffle over a chunked cache decodes a whole chunk for every image it takes (zarr's random
``oindex`` reads ≈ 300 images/s). This sampler shuffles the order of *units* (chunks, shards) and
mixes the images of ``window`` consecutive units, so each unit is decoded once per epoch and a
bounded number are live at a time. Because ``dlstore convert`` stores images in a shuffled order by
default, every unit already holds a random mix of classes; the window adds a second level of mixing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from dlstore.formats.base import group_runs
from dlstore.read.cache import Cache


class ChunkSampler(torch.utils.data.Sampler[int]):
    """Yields dataset indices, grouped so that each storage unit is visited once per epoch.

    Works like ``DistributedSampler``: pass ``num_replicas``/``rank`` for multi-process training;
    the epoch's order is padded (or, with ``drop_last``, cut) to a multiple of the replicas and each
    rank takes one contiguous slice of it. Call ``set_epoch`` each epoch for a new order.

    The first argument is a ``CachedDataset`` (or anything with ``.cache``), a ``Cache``, or a
    dataset's storage positions (then ``unit``, the images per chunk, is needed too).

    >>> ds = CachedDataset("cache/")                                        # doctest: +SKIP
    >>> sampler = ChunkSampler(ds, window=16, seed=0, num_replicas=world, rank=rank)  # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=256, sampler=sampler)             # doctest: +SKIP
    """

    def __init__(
        self,
        source: np.ndarray | Cache | _HasCache,
        unit: int | None = None,
        window: int = 16,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        positions, unit = storage_map(source, unit)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.unit, self.window, self.seed = max(1, unit), max(1, window), seed
        self.num_replicas, self.rank, self.drop_last, self.shuffle = num_replicas, rank, drop_last, shuffle
        self.epoch = 0
        n = len(self.positions)
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        # Dataset indices grouped by the storage unit that holds them.
        order = np.argsort(self.positions, kind="stable")
        self._groups = [order[a:b] for _, a, b in group_runs(self.positions[order] // self.unit)]

    @classmethod
    def for_dataset(cls, dataset: _HasCache, **kw: Any) -> ChunkSampler:
        """From a CachedDataset (or anything with ``.cache``); the same as ``ChunkSampler(dataset, ...)``."""
        return cls(dataset, **kw)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng((self.seed, self.epoch))
        picks = rng.permutation(len(self._groups)) if self.shuffle else range(len(self._groups))
        groups = [self._groups[i] for i in picks]
        stream = []
        for w in range(0, len(groups), self.window):
            block = np.concatenate(groups[w : w + self.window])
            stream.append(rng.permutation(block) if self.shuffle else block)
        flat = np.concatenate(stream) if stream else np.zeros(0, np.int64)
        total = self.num_samples * self.num_replicas
        if len(flat) < total:  # pad like DistributedSampler, from the start of this epoch's order
            flat = np.concatenate([flat, np.resize(flat, total - len(flat))])
        # A contiguous slice per rank: each rank reads whole units, only boundary units are shared.
        mine = flat[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]
        return iter(mine.tolist())


class _HasCache(Protocol):
    @property
    def cache(self) -> Cache: ...


def storage_map(source: np.ndarray | Cache | _HasCache, unit: int | None) -> tuple[np.ndarray, int]:
    """(storage positions, images per unit) of a dataset, a cache, or positions given with their unit."""
    if isinstance(source, np.ndarray | list | tuple):
        if unit is None:
            raise TypeError(
                "ChunkSampler(positions, unit): with storage positions, pass the images per chunk too, "
                "or pass the CachedDataset / Cache itself"
            )
        return np.asarray(source), unit
    cache = source if isinstance(source, Cache) else source.cache
    return cache.positions, cache.reader.unit if unit is None else unit
