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

import numpy as np
import torch

from dlstore.formats.base import group_runs


class ChunkSampler(torch.utils.data.Sampler[int]):
    """Yields dataset indices, grouped so that each storage unit is visited once per epoch.

    Works like ``DistributedSampler``: pass ``num_replicas``/``rank`` for multi-process training;
    the epoch's order is padded (or, with ``drop_last``, cut) to a multiple of the replicas and each
    rank takes one contiguous slice of it. Call ``set_epoch`` each epoch for a new order.

    >>> ds = CachedDataset("cache/")                                        # doctest: +SKIP
    >>> sampler = ChunkSampler.for_dataset(ds, window=16, seed=0)            # doctest: +SKIP
    >>> loader = DataLoader(ds, batch_size=256, sampler=sampler)             # doctest: +SKIP
    """

    def __init__(
        self,
        positions: np.ndarray,
        unit: int,
        window: int = 16,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
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
    def for_dataset(cls, dataset: object, **kw: object) -> ChunkSampler:
        """From a CachedDataset (or anything with ``.cache``): its storage map and unit size."""
        cache = dataset.cache  # type: ignore[attr-defined]
        unit = getattr(cache.reader, "unit", 1)
        return cls(cache.positions, unit, **kw)  # type: ignore[arg-type]

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
