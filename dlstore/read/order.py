"""One order per epoch for every loader, rank count and worker count, and where a run is in it.

**One global sequence per epoch.** The epoch's order ``G`` is a pure function of (``seed``, ``epoch``,
``order``, ``window``, the cache's layout: ``n`` and the unit holding each image): never of the rank
count, ``num_workers``, the loader or prefetching. ``epoch_order`` builds it in O(n) into one array
(int32 below 2**31 images); a rank's indices are gathered from it a block at a time.

- ``chunk``: the units (chunks, shards) in a random order, then ``window`` consecutive units at a time
  with their images shuffled together (the two levels of Mosaic Streaming's ``py1e`` and wids'
  ``ChunkedSampler``): each unit is decoded once per epoch by a reader that keeps two windows, and
  ``convert`` stores images shuffled, so every unit is already a random mix.
- ``random``: a permutation of the n indices; ``sequential``: dataset order.

**Rounds.** Rank r of W reads ``G`` a window at a time, in rounds of W windows (``dlstore.read.rounds``),
so each unit is decoded by one rank per epoch. After every rank took k batches of B, exactly the prefix
``c + k*W*B`` of the round's consumption sequence ``C`` is consumed (``c``: where the pass began). Every
rank takes ``ceil((n - c) / W)`` positions, those past ``n`` wrapping to ``G``'s start
(DistributedSampler's padding), or ``floor`` with ``drop_last``: all ranks run the same steps.

**State**: ``{order, seed, window, epoch, consumed, base, width, n, units, num_replicas}`` (and a loader's
``batch_size``), about 230 bytes of JSON at any n. ``base``/``width`` name the segment of ``C`` that
``consumed`` counts in. Resumed on W' ranks, a run finishes the round it stopped in, then reads the
untouched windows in rounds of W': nothing repeated or skipped, whatever chain of world sizes. Loading
adopts the state's order, seed and window; a state of another layout (``n``, ``units``) is refused; a
version-1 state (ranks taking turns in ``G``) is a segment of width 1.

**Who counts.** A sampler counts what its iterator yielded (what torchdata's ``StatefulDataLoader``
snapshots); a dlstore loader counts the batches its iterator handed to the loop, not what it read ahead.

**Epochs.** A pass that yields its last sample moves to the next epoch (a state then reads
``{epoch: e+1, consumed: 0}``). ``set_epoch(e)`` starts epoch e from its beginning, except that a loaded
state of epoch e keeps its position, so the usual ``set_epoch(epoch)`` works after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlstore.read.cache import Cache
from dlstore.read.rounds import Route, Segment

ORDER_KINDS = ("chunk", "random", "sequential")
STATE_VERSION = 2  # 2: the segment (base, width) of rounds; 1 (ranks taking turns in G) reads as width 1
BLOCK = 8192  # indices turned into Python ints at a time


def storage_map(source: np.ndarray | Cache | Any, unit: int | None) -> tuple[np.ndarray, int]:
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


class Layout:
    """Which unit holds each image: dataset indices in storage order, cut at unit boundaries (only
    for the chunk order; the others need just n)."""

    def __init__(self, positions: np.ndarray, unit: int, grouped: bool = True) -> None:
        self.n = len(positions)
        self.dtype = np.dtype(np.int32 if self.n < 2**31 else np.int64)
        self.by_storage = np.zeros(0, self.dtype)
        self.starts = np.array([0, self.n], np.int64)
        self.units = -(-self.n // max(1, unit))
        if grouped and self.n:
            self.by_storage = np.argsort(positions, kind="stable").astype(self.dtype, copy=False)
            keys = positions[self.by_storage] // max(1, unit)
            cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
            self.starts = np.concatenate(([0], cuts, [self.n])).astype(np.int64)
            self.units = len(self.starts) - 1


def epoch_order(
    layout: Layout, order: str, seed: int, epoch: int, window: int, shuffle: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """G, and where each of its windows starts (then n); None for the orders without units."""
    n, dtype = layout.n, layout.dtype
    rng = np.random.default_rng((seed, epoch))
    if order == "sequential":
        return np.arange(n, dtype=dtype), None
    if order == "random":
        seq = np.arange(n, dtype=dtype)
        rng.shuffle(seq)
        return seq, None
    sizes = np.diff(layout.starts)
    if not shuffle:
        return layout.by_storage, window_starts(sizes, window)
    seq = np.empty(n, dtype=dtype)
    picks = rng.permutation(len(layout.starts) - 1)
    at = 0
    for w in range(0, len(picks), window):
        begin = at
        for u in picks[w : w + window].tolist():
            a, b = layout.starts[u], layout.starts[u + 1]
            seq[at : at + b - a] = layout.by_storage[a:b]
            at += b - a
        rng.shuffle(seq[begin:at])
    return seq, window_starts(sizes[picks], window)


def window_starts(unit_sizes: np.ndarray, window: int) -> np.ndarray:
    """Where each window of ``window`` units (of these sizes, in G's order) starts in G, then n."""
    ends = np.cumsum(unit_sizes, dtype=np.int64)
    last = ends[-1:] if len(ends) % window else ends[:0]
    return np.concatenate((np.zeros(1, np.int64), ends[window - 1 :: window], last))


@dataclass
class Pass:
    """One rank's walk through (the rest of) one epoch: ``count`` positions of the consumption
    sequence (``route``) from ``start``."""

    epoch: int
    start: int
    count: int
    num_replicas: int
    rank: int
    route: Route
    yielded: int = 0

    def consumed(self, taken: int) -> int:
        """Global positions consumed once every rank has taken ``taken`` of its own."""
        return self.start + taken * self.num_replicas


class EpochSampler(torch.utils.data.Sampler[int]):
    """This rank's share of one global order per epoch (``order``: ``chunk``, ``random`` or
    ``sequential``; ``num_replicas``/``rank`` as ``DistributedSampler``), with a state of a few hundred
    bytes that resumes on any number of ranks. The first argument is a ``CachedDataset`` (anything
    with ``.cache``), a ``Cache``, or storage positions (then ``unit``, the images per chunk, too)::

        sampler = EpochSampler(ds, order="random", seed=0, num_replicas=world, rank=rank)
        loader = StatefulDataLoader(ds, batch_size=256, sampler=sampler, num_workers=8)
    """

    def __init__(
        self,
        source: np.ndarray | Cache | Any,
        unit: int | None = None,
        *,
        order: str = "chunk",
        window: int = 16,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        if order not in ORDER_KINDS:
            raise ValueError(f"order must be one of {', '.join(ORDER_KINDS)}, got {order!r}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        if order != "chunk":
            unit = 1 if unit is None and isinstance(source, np.ndarray | list | tuple) else unit
        positions, unit = storage_map(source, unit)
        self.positions = np.asarray(positions, dtype=np.int64)
        self.unit, self.window, self.seed, self.order = max(1, unit), max(1, window), seed, order
        self.num_replicas, self.rank, self.drop_last, self.shuffle = num_replicas, rank, drop_last, shuffle
        self.layout = Layout(self.positions, self.unit, grouped=order == "chunk")
        n = self.layout.n
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.epoch = 0
        self._resume = 0  # positions of `epoch` consumed before the next pass (a loaded state's)
        self._segment = Segment(0, num_replicas)  # the rounds `_resume` counts in
        self._pass: Pass | None = None  # the pass in progress, until it yields its last index

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch``: from its start, or from a loaded state's position in it."""
        if epoch != self.epoch:
            self._resume, self._segment = 0, Segment(0, self.num_replicas)
        self.epoch = epoch
        self._pass = None

    def sequence(self, epoch: int) -> np.ndarray:
        """The global order of ``epoch`` (all ranks'), dataset indices."""
        return epoch_order(self.layout, self.order, self.seed, epoch, self.window, self.shuffle)[0]

    def begin_pass(self) -> tuple[Pass, np.ndarray]:
        """Start this rank's pass through the rest of the current epoch: (the pass, the global order)."""
        n, w = self.layout.n, self.num_replicas
        start = min(self._resume, n)
        left = n - start
        count = left // w if self.drop_last else -(-left // w)
        seq, starts = epoch_order(self.layout, self.order, self.seed, self.epoch, self.window, self.shuffle)
        route = Route(starts, n, self._segment, start, w)
        self._resume, self._segment = 0, Segment(0, w)
        p = self._pass = Pass(self.epoch, start, count, w, self.rank, route)
        if count == 0:
            self._finish(p)
        return p, seq

    def indices(self, p: Pass, seq: np.ndarray, a: int, b: int) -> np.ndarray:
        """This rank's indices a..b of pass ``p`` (positions past n wrap: the padding)."""
        pos = p.start + p.rank + np.arange(a, min(b, p.count), dtype=np.int64) * p.num_replicas
        return seq.take(p.route.positions(pos)) if len(seq) else pos

    def take_pass(self) -> tuple[Pass, np.ndarray]:
        """The whole of this rank's pass at once (a loader that reads ahead counts what it hands out
        itself); the sampler moves on to the next epoch."""
        p, seq = self.begin_pass()
        idx = np.empty(p.count, seq.dtype if len(seq) else np.int64)
        for a in range(0, p.count, 128 * BLOCK):  # in blocks: the route's temporaries stay small
            idx[a : a + 128 * BLOCK] = self.indices(p, seq, a, a + 128 * BLOCK)
        if self._pass is p:
            self._finish(p)
        return p, idx

    def _finish(self, p: Pass) -> None:
        if self._pass is p:
            self._pass = None
            self.epoch = p.epoch + 1
            self._resume, self._segment = 0, Segment(0, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        p, seq = self.begin_pass()
        for a in range(0, p.count, BLOCK):
            for i in self.indices(p, seq, a, a + BLOCK).tolist():
                p.yielded += 1
                if p.yielded == p.count:  # the state after the last index reads: next epoch
                    self._finish(p)
                yield i

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler's order stands, as plain JSON (the same on every rank)."""
        p = self._pass
        if p is not None:
            return self.pass_state(p, p.consumed(p.yielded))
        return self.state_at(self.epoch, self._resume, self._segment)

    def pass_state(self, p: Pass, consumed: int) -> dict[str, Any]:
        """The state once every rank has consumed up to ``consumed`` in pass ``p``."""
        return self.state_at(p.epoch, consumed, p.route.segment(consumed))

    def state_at(self, epoch: int, consumed: int, segment: Segment) -> dict[str, Any]:
        return {
            "dlstore_order": STATE_VERSION,
            "order": self.order,
            "seed": self.seed,
            "window": self.window,
            "shuffle": self.shuffle,
            "epoch": int(epoch),
            "consumed": int(min(consumed, self.layout.n)),
            "base": int(segment.base),
            "width": int(segment.width),
            "n": self.layout.n,
            "units": self.layout.units,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved by this sampler or a loader, on any number of ranks)."""
        if state.get("order") != self.order and state.get("order") in ORDER_KINDS:
            self.layout = Layout(self.positions, self.unit, grouped=state["order"] == "chunk")
        check_state(state, self.layout)
        self.order, self.seed, self.window = state["order"], int(state["seed"]), int(state["window"])
        self.shuffle = bool(state.get("shuffle", True))
        self.epoch, self._resume, self._pass = int(state["epoch"]), int(state["consumed"]), None
        self._segment = Segment(int(state.get("base", 0)), int(state.get("width", 1)))


def check_state(state: dict[str, Any], layout: Layout) -> None:
    """A state this layout can continue, or a ValueError naming what differs."""
    if not isinstance(state, dict) or state.get("dlstore_order") not in (1, STATE_VERSION):
        raise ValueError(
            f"not a dlstore order state (expected a dict with dlstore_order={STATE_VERSION}, got "
            f"{str(state)[:120]!r}); pass what state_dict() of a dlstore sampler or loader returned"
        )
    if state["order"] not in ORDER_KINDS:
        raise ValueError(
            f"order state names order {state['order']!r}; expected one of {', '.join(ORDER_KINDS)}"
        )
    grouped = state["order"] == "chunk" and len(layout.by_storage) == layout.n
    if state["n"] != layout.n or (grouped and state["units"] != layout.units):
        raise ValueError(
            f"the order state was saved for a cache of {state['n']} images in {state['units']} units; "
            f"this one has {layout.n} in {layout.units}: resume with the cache the state was saved with"
        )
    if not 0 <= int(state["consumed"]) <= layout.n:
        raise ValueError(f"order state: consumed={state['consumed']} is outside [0, {layout.n}]")
    if int(state.get("width", 1)) < 1 or int(state.get("base", 0)) < 0:
        raise ValueError(
            f"order state: width={state.get('width')} base={state.get('base')}; expected width >= 1 and "
            "base >= 0 (pass a state saved by a dlstore sampler or loader)"
        )


def keeps_state(loader: Any) -> bool:
    """Whether a training loop can checkpoint this loader's position (dlstore loaders, torchdata's
    StatefulDataLoader); a plain DataLoader cannot, whatever its sampler."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


STATELESS_NOTE = (
    "This loader keeps no state: a run stopped mid-epoch restarts the epoch (or skips the rest of it). "
    "Use torchdata's StatefulDataLoader with dlstore's EpochSampler/ChunkSampler, or a dlstore loader, "
    "and save loader.state_dict() with each checkpoint."
)
