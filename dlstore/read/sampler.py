"""``ChunkSampler``: random order that reads each chunk/shard once per epoch.

A full shuffle over a chunked cache decodes a whole chunk for every image it takes (zarr's random
``oindex`` reads ≈ 300 images/s). This sampler shuffles the order of *units* (chunks, shards) and
mixes the images of ``window`` consecutive units, so each unit is decoded once per epoch and a
bounded number are live at a time. Because ``dlstore convert`` stores images in a shuffled order by
default, every unit already holds a random mix of classes; the window adds a second level of mixing.

It is ``EpochSampler`` with ``order="chunk"``: one global order per epoch whatever the number of
ranks, and ``state_dict``/``load_state_dict`` to resume anywhere (see ``dlstore.read.order``).
"""

from __future__ import annotations

import numpy as np

from dlstore.read.cache import Cache
from dlstore.read.order import EpochSampler, _HasCache, storage_map

__all__ = ["ChunkSampler", "storage_map"]


class ChunkSampler(EpochSampler):
    """Yields dataset indices, grouped so that each storage unit is visited once per epoch.

    Works like ``DistributedSampler``: pass ``num_replicas``/``rank`` for multi-process training;
    the epoch's one global order is read a window per rank (rounds of W windows, so each chunk is
    decoded by one rank, ``dlstore.read.rounds``), padded (or, with ``drop_last``, cut) to equal shares. Call ``set_epoch`` each epoch (without it, each pass moves to
    the next epoch). ``state_dict()`` / ``load_state_dict()`` resume mid-epoch, on any number of ranks.

    The first argument is a ``CachedDataset`` (or anything with ``.cache``), a ``Cache``, or a
    dataset's storage positions (then ``unit``, the images per chunk, is needed too).

    >>> ds = CachedDataset("cache/")                                        # doctest: +SKIP
    >>> sampler = ChunkSampler(ds, window=16, seed=0, num_replicas=world, rank=rank)  # doctest: +SKIP
    >>> loader = StatefulDataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)  # doctest: +SKIP
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
        super().__init__(
            source,
            unit,
            order="chunk",
            window=window,
            seed=seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
            shuffle=shuffle,
        )
