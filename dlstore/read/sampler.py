"""``ChunkSampler``: a random order that reads each chunk/shard once per epoch.

A full shuffle over a chunked cache decodes a whole chunk for every image it takes (zarr's random
``oindex`` reads ≈ 300 images/s). This shuffles the order of *units* (chunks, shards) and mixes the
images of ``window`` consecutive units, so each unit is decoded once per epoch and few are live at a
time; ``dlstore convert`` stores images shuffled, so every unit already holds a mix of classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlstore.read.cache import Cache
from dlstore.read.order import EpochSampler, storage_map

__all__ = ["ChunkSampler", "storage_map"]


class ChunkSampler(EpochSampler):
    """``EpochSampler`` with ``order="chunk"``: dataset indices grouped so that each storage unit is
    visited once per epoch, ``num_replicas``/``rank`` as ``DistributedSampler`` (a window per rank, so
    each chunk is decoded by one rank), ``state_dict()`` / ``load_state_dict()`` to resume mid-epoch on
    any number of ranks (``dlstore.read.order``). The first argument is a ``CachedDataset`` (or anything
    with ``.cache``), a ``Cache``, or storage positions (then ``unit``, the images per chunk, too).

    >>> sampler = ChunkSampler(ds, window=16, seed=0, num_replicas=world, rank=rank)  # doctest: +SKIP
    >>> loader = StatefulDataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)  # doctest: +SKIP
    """

    def __init__(
        self,
        source: np.ndarray | Cache | Any,
        unit: int | None = None,
        window: int = 16,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        kw = {"window": window, "seed": seed, "num_replicas": num_replicas, "rank": rank}
        super().__init__(source, unit, order="chunk", drop_last=drop_last, shuffle=shuffle, **kw)
