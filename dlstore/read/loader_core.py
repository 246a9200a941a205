"""What every dlstore loader takes, declared once: ``LoaderCore``, and ``CoreLoader``, the base that
opens the cache, builds the sampler and counts the epochs from it.

``PinnedLoader``, ``ResidentLoader`` and ``DecodeLoader`` each declare only their own parameters and
take the core as keywords, so the three say ``order``, ``seed``, ``num_replicas``/``rank`` and the
remote-cache options the same way, with the same defaults and checks::

    loader = PinnedLoader("s3://bucket/cache", batch_size=256, order="chunk", num_replicas=8, rank=r,
                          cache_dir="/scratch/dlstore")
    loader.core                                  # LoaderCore(path='s3://bucket/cache', batch_size=256, ...)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from dlstore.read.cache import Cache, open_cache
from dlstore.read.order import ORDER_KINDS, EpochSampler, Pass
from dlstore.read.sampler import ChunkSampler

ORDERS = ("auto", "chunk", "random", "sequential")


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` when it is a positive int (in torch BatchSampler's words otherwise)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
    return batch_size


def make_sampler(
    cache: Cache,
    order: str,
    seed: int = 0,
    window: int | None = None,
    num_replicas: int = 1,
    rank: int = 0,
) -> EpochSampler:
    """``chunk`` (chunk-aware, default for npz/zarr), ``random`` (full shuffle) or ``sequential``.

    One global order per epoch whatever ``num_replicas`` is; each rank takes an equal-length share of
    it, a window at a time (``chunk``), so every rank runs the same number of steps and DDP never waits
    on a rank that ran out (``dlstore.read.order``)."""
    if order == "auto":
        order = "chunk" if cache.reader.traits.unit_grouped else "random"
    if order not in ORDER_KINDS:
        raise ValueError(f"order must be auto, chunk, random or sequential, got {order!r}")
    if order == "chunk":
        window = window or default_window(cache)
        return ChunkSampler(
            cache.positions, cache.reader.unit, window=window, seed=seed, num_replicas=num_replicas, rank=rank
        )
    return EpochSampler(
        cache.positions, cache.reader.unit, order=order, seed=seed, num_replicas=num_replicas, rank=rank
    )


def default_window(cache: Cache, images: int = 4096) -> int:
    """Mix about `images` images at a time, but never more units than half the reader keeps decoded."""
    reader = cache.reader
    if not reader.traits.unit_grouped:
        return 1
    return max(1, min(reader.max_units // 2, -(-images // reader.unit)))


def storage_sorted(cache: Cache, indices: list[int]) -> np.ndarray:
    """A batch's indices in storage order: chunked readers then copy each unit's rows in one slice.
    The order of samples inside a batch does not matter to training; the labels follow the images."""
    index = np.asarray(indices, dtype=np.int64)
    return index[np.argsort(cache.positions[index], kind="stable")]


@dataclass(frozen=True)
class LoaderCore:
    """The parameters every loader takes, validated once.

    - ``path``: a cache folder, a URL (``s3://bucket/prefix``) or a ``Cache`` already open.
    - ``batch_size``, ``drop_last``: how the epoch is cut (the last short batch dropped or kept).
    - ``order``: ``auto`` (``chunk`` for chunked formats, else ``random``), ``chunk`` (each chunk
      decoded once per epoch, ``window`` chunks mixed at a time), ``random``, ``sequential``;
      ``seed`` fixes it (each epoch differs; ``set_epoch`` replays one).
    - ``num_replicas``, ``rank``: one process per GPU; each rank reads its own equal share of every
      epoch, so all ranks run the same number of steps.
    - ``storage_options``, ``cache_dir``, ``cache_bytes``: for a URL, as ``open_cache`` takes them
      (credentials, where the read-through cache lives, its bound).
    """

    path: str | Path | Cache
    batch_size: int
    order: str = "auto"
    seed: int = 0
    drop_last: bool = True
    window: int | None = None
    num_replicas: int = 1
    rank: int = 0
    storage_options: dict[str, Any] | None = None
    cache_dir: str | Path | None = None
    cache_bytes: int | None = None

    def __post_init__(self) -> None:
        check_batch_size(self.batch_size)
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if (
            isinstance(self.num_replicas, bool)
            or not isinstance(self.num_replicas, int)
            or self.num_replicas < 1
        ):
            raise ValueError(
                f"num_replicas must be a positive int (the number of ranks), got {self.num_replicas!r}"
            )
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"rank {self.rank!r} not in [0, {self.num_replicas}) (num_replicas={self.num_replicas})"
            )
        remote = (self.storage_options, self.cache_dir, self.cache_bytes)
        if isinstance(self.path, Cache) and any(v is not None for v in remote):
            raise ValueError(
                "storage_options, cache_dir and cache_bytes apply when the loader opens the cache; "
                "pass them to open_cache(...) instead, or pass the path or URL to the loader"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_keywords(
        cls,
        path: str | Path | Cache,
        batch_size: int,
        given: dict[str, Any],
        loader: str,
        stacklevel: int = 4,
    ) -> LoaderCore:
        """The core from a loader's keywords; ``shuffle=`` (ResidentLoader's old spelling) still works
        for one round, with a DeprecationWarning naming ``order=`` (``stacklevel``: the user's call;
        from a loader's ``__init__`` through ``CoreLoader._open_core``, 4)."""
        given = dict(given)
        if "shuffle" in given:
            shuffle = given.pop("shuffle")
            order = "random" if shuffle else "sequential"
            warnings.warn(
                f"{loader}(shuffle={shuffle!r}) is deprecated and goes in the next release; "
                f"say order={order!r} (every loader takes order=)",
                DeprecationWarning,
                stacklevel=stacklevel,
            )
            if "order" in given:
                raise TypeError(
                    f"{loader}() got both shuffle= and order=; pass only order={given['order']!r}"
                )
            given["order"] = order
        unknown = sorted(set(given) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"{loader}() got an unexpected keyword argument {unknown[0]!r}; "
                f"see help({loader}) for what it takes"
            )
        return cls(path, batch_size, **given)

    def open(self, in_memory: bool = False) -> Cache:
        """The cache this core names: ``path`` itself when it is open already."""
        if isinstance(self.path, Cache):
            return self.path
        return open_cache(
            self.path,
            in_memory=in_memory,
            storage_options=self.storage_options,
            cache_dir=self.cache_dir,
            cache_bytes=self.cache_bytes,
        )

    def sampler(self, cache: Cache) -> EpochSampler:
        return make_sampler(cache, self.order, self.seed, self.window, self.num_replicas, self.rank)

    def settings(self) -> dict[str, Any]:
        """What the epoch is made of, for reports (never the credentials nor the path)."""
        keep = ("batch_size", "order", "seed", "drop_last", "window", "num_replicas", "rank")
        return {name: getattr(self, name) for name in keep}


@dataclass
class LoaderPass:
    """A loader's pass: the sampler's ``Pass``, its batch count, and the batches handed out so far."""

    sampler_pass: Pass
    batches: int
    batch_size: int
    received: int = 0

    @property
    def done(self) -> bool:
        return self.received >= self.batches

    def consumed(self) -> int:
        p = self.sampler_pass
        return p.consumed(min(self.received * self.batch_size, p.count))


class CoreLoader:
    """The part every dlstore loader shares: ``core``, the ``cache`` it opened, the ``sampler`` of
    this rank's share, ``len`` in batches, ``set_epoch``, and the state: ``state_dict()`` /
    ``load_state_dict()`` (see ``dlstore.read.order``). A subclass's ``__init__`` takes its own
    parameters and ``**core`` (``LoaderCore``'s fields, keyword-only), and calls ``_open_core``; its
    signature (``help``, ``inspect.signature``) then lists both. Its ``__iter__`` takes the epoch's
    batches from ``_next_epoch()`` (or ``_take_pass()``) and yields them; the batches it yields are
    counted here, so a state taken between steps counts what the training loop received, never what
    a gather thread or read-ahead prepared."""

    core: LoaderCore
    cache: Cache
    sampler: EpochSampler
    # What order="auto" means for this loader (None: the format decides, see make_sampler).
    AUTO_ORDER: ClassVar[str | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "__init__" in cls.__dict__:
            cls.__init__.__signature__ = with_core_parameters(cls.__init__)  # type: ignore[attr-defined]
        if "__iter__" in cls.__dict__:  # one place counts, whatever each loader's __iter__ is
            cls.__iter__ = counting(cls.__dict__["__iter__"])  # type: ignore[method-assign]

    def _open_core(
        self, path: str | Path | Cache, batch_size: int, core: dict[str, Any], in_memory: bool = False
    ) -> None:
        self.core = LoaderCore.from_keywords(path, batch_size, core, type(self).__name__)
        if self.core.order == "auto" and self.AUTO_ORDER is not None:
            self.core = dataclasses.replace(self.core, order=self.AUTO_ORDER)
        self.cache = self.core.open(in_memory)
        self.sampler = self.core.sampler(self.cache)
        self._pass: LoaderPass | None = None

    @property
    def batch_size(self) -> int:
        return self.core.batch_size

    @property
    def drop_last(self) -> bool:
        return self.core.drop_last

    @property
    def seed(self) -> int:
        return self.core.seed

    @property
    def order(self) -> str:
        return self.core.order

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (the sampler's)."""
        return self.sampler.epoch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The order of the next epoch is the one of ``epoch`` (resuming at an epoch boundary, or at a
        loaded state's position in it); without calls, each iteration advances the epoch by one."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as plain JSON of a few hundred bytes: save it with each checkpoint.
        Between steps it counts the batches the loop received; it is the same on every rank, and it
        resumes on any number of ranks (``dlstore.read.order``)."""
        lp = self._pass
        if lp is not None and not lp.done:
            state = self.sampler.pass_state(lp.sampler_pass, lp.consumed())
        else:
            state = self.sampler.state_dict()
        return {**state, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues from ``state`` (from ``state_dict()``, on any number of ranks)."""
        self.sampler.load_state_dict(state)
        self._pass = None

    def _take_pass(self) -> np.ndarray:
        """This rank's indices for the rest of the current epoch, and the pass counted from here."""
        p, indices = self.sampler.take_pass()
        b = self.batch_size
        batches = p.count // b if self.drop_last else -(-p.count // b)
        self._pass = LoaderPass(p, batches, b)
        return indices

    def _next_epoch(self) -> list[list[int]]:
        """This rank's batches of the rest of the epoch (dataset indices); the sampler moves on."""
        indices = self._take_pass()
        assert self._pass is not None
        b = self.batch_size
        return [indices[i * b : (i + 1) * b].tolist() for i in range(self._pass.batches)]

    def _count(self, batches: Iterable[Any]) -> Iterator[Any]:
        counted: LoaderPass | None = None
        for batch in batches:
            if counted is None:  # a generator's pass starts with its first batch
                counted = self._pass
            if counted is not None:
                counted.received += 1
            yield batch


def counting(iterate: Callable[[Any], Iterable[Any]]) -> Callable[[Any], Iterator[Any]]:
    """A loader's ``__iter__`` whose batches ``CoreLoader`` counts as the loop receives them."""

    @functools.wraps(iterate)
    def __iter__(self: CoreLoader) -> Iterator[Any]:
        return self._count(iterate(self))

    return __iter__


def with_core_parameters(init: Any) -> inspect.Signature:
    """``init``'s signature with ``**core`` spelled out as LoaderCore's keyword-only fields."""
    sig = inspect.signature(init)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in own}
    core = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(LoaderCore)
        if f.name not in taken and f.default is not dataclasses.MISSING
    ]
    return sig.replace(parameters=[*own, *core])
