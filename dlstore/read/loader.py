"""``Loader``: dlstore's one fast loader. It picks its path from the cache and the machine.

- ``"resident"``: a raw cache within ``resident_budget`` of the device's free memory lives there as one
  uint8 tensor; each batch is an ``index_select`` there (``dlstore.read.resident``).
- ``"pinned"``: any other raw cache, gathered by a background thread into a ring of pinned host
  buffers and copied to the device on a side stream (``dlstore.read.pinned``).
- ``"decode"``: a JPEG or ragged cache, decoded by nvJPEG, the GPU's hardware JPEG engines and CPU
  processes, then cropped to one size on the device (``dlstore.read.decode``).

``via=`` forces one. Every path takes the same epoch (``order``, ``seed``, ``drop_last``, ``window``,
``num_replicas``/``rank``) and keeps the same state: ``state_dict()`` / ``load_state_dict()`` resume
mid-epoch on any number of ranks (``dlstore.read.order``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.errors import DlstoreError
from dlstore.read.cache import Cache, Remote, open_cache
from dlstore.read.order import ORDER_KINDS, EpochSampler, Pass
from dlstore.read.sampler import ChunkSampler

ORDERS = ("auto", "chunk", "random", "sequential")
VIAS = ("auto", "pinned", "resident", "decode")


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
    """``chunk`` (chunk-aware, default for npz/zarr), ``random`` (full shuffle) or ``sequential``: one
    global order per epoch, each rank an equal share (``dlstore.read.order``)."""
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


def storage_sorted(cache: Cache, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """A batch's indices in storage order (chunked readers then copy each unit's rows in one slice);
    the order inside a batch does not matter to training."""
    index = np.asarray(indices, dtype=np.int64)
    return index[np.argsort(cache.positions[index], kind="stable")]


def check_ranks(num_replicas: int, rank: int) -> None:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int (the number of ranks), got {num_replicas!r}")
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank!r} not in [0, {num_replicas}) (num_replicas={num_replicas})")


def open_for_loader(cache: str | Path | Cache, remote: Remote | None) -> Cache:
    """The cache a loader reads: ``cache`` itself when it is open already."""
    if isinstance(cache, Cache):
        if remote is not None:
            raise ValueError(
                "remote= applies when the loader opens the cache; pass it to open_cache(...) instead, "
                "or pass the path or URL to the loader"
            )
        return cache
    return open_cache(cache, remote=remote)


def choose_via(cache: Cache, device: torch.device, via: str, budget: float) -> str:
    """The path ``auto`` means for this cache on this device (see the module)."""
    if via not in VIAS:
        raise ValueError(f"via must be one of {', '.join(VIAS)}, got {via!r}")
    if via != "auto":
        return via
    if cache.reader.traits.payloads:
        return "decode"
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    if on_gpu and resident_need(cache) <= budget * free_memory(device):
        return "resident"
    return "pinned"


def resident_need(cache: Cache) -> int:
    return len(cache) * cache.spec.image_bytes


def free_memory(device: torch.device) -> float:
    """Free bytes of ``device`` (host RAM for the CPU; infinite where it is not known)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    from dlstore.machine import available_memory

    free = available_memory()[0]
    return math.inf if free is None else float(free)


def check_fits(cache: Cache, device: torch.device, budget: float) -> None:
    need, free = resident_need(cache), free_memory(device)
    if need > free * budget:
        raise DlstoreError(
            f"{cache.root}: {need / 1e9:.2f} GB of images exceed resident_budget={budget:g} of the "
            f"{free / 1e9:.2f} GB free in {device}; use via='pinned', or raise resident_budget"
        )


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


class Loader:
    """Batches of a dlstore cache on the device, by the fastest path for the cache and the machine.

    >>> loader = Loader("cache/", batch_size=256, device="cuda")          # doctest: +SKIP
    >>> for epoch in range(10):
    ...     for images, labels in loader:                                  # uint8 on the GPU
    ...         step(augment(images), labels)

    - ``cache``: a folder, a URL (``s3://bucket/prefix``, read through ``remote``) or an open ``Cache``;
      ``via``: ``auto``, ``pinned``, ``resident`` or ``decode`` (``dlstore.read.loader``).
    - ``transform``: applied to each batch on the device (``dlstore.gpu.GpuAugment``; for a JPEG or
      ragged cache a crop to one size, e.g. ``RaggedRandomResizedCrop(224)``); called as
      ``transform(images, target=target)`` with ``fields`` (the ones to read, None: all), whose
      batches are ``(images, target dict)``.
    - ``order``: ``auto`` (``chunk`` for chunked formats, ``random`` when resident), ``chunk`` (each
      chunk decoded once per epoch, ``window`` chunks mixed at a time), ``random``, ``sequential``;
      ``seed`` fixes it (``set_epoch`` replays an epoch); ``drop_last`` drops a last short batch.
    - ``num_replicas``, ``rank``: one process per GPU, each reading an equal share of every epoch.
    - ``resident_budget``: the fraction of the device's free memory the images may take resident.
    - ``cpu_decoders``: CPU processes decoding a chunked cache's chunks (pinned) or a JPEG cache's
      CPU share of each batch (decode); ``lanes``, ``split``: the decode lanes to run (``cpu``,
      ``hw``, ``nvjpeg``; default: each that exists here) and fixed fractions of each batch per lane
      (default: measured in place; a lane left out of ``split`` shares the rest equally).
    - ``cuda_graph``: replay the transform (resident: the gather too) from a CUDA graph; the batch it
      yields is overwritten by the next one: ``.clone()`` what you keep.
    """

    def __init__(
        self,
        cache: str | Path | Cache,
        batch_size: int,
        device: str | torch.device = "cuda",
        *,
        via: str = "auto",
        transform: Callable[..., Any] | None = None,
        fields: Sequence[str] | None = None,
        order: str = "auto",
        seed: int = 0,
        drop_last: bool = True,
        window: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        remote: Remote | None = None,
        resident_budget: float = 0.5,
        cpu_decoders: int = 0,
        lanes: Sequence[str] | None = None,
        split: Mapping[str, float] | None = None,
        cuda_graph: bool = False,
    ) -> None:
        self.batch_size = check_batch_size(batch_size)
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        check_ranks(num_replicas, rank)
        self.device = torch.device(device)
        self.cache = open_for_loader(cache, remote)
        self.cache.select_fields(fields)  # a cache with fields: only these are read (None: all)
        self.via = choose_via(self.cache, self.device, via, resident_budget)
        if order == "auto" and self.via == "resident":
            order = "random"  # the images are in device memory: chunks do not matter
        self.order, self.seed, self.drop_last, self.window = order, seed, drop_last, window
        self.num_replicas, self.rank = num_replicas, rank
        self.sampler = make_sampler(self.cache, order, seed, window, num_replicas, rank)
        self._pass: LoaderPass | None = None
        self._path = self._open_path(transform, resident_budget, cpu_decoders, lanes, split, cuda_graph)

    def _open_path(
        self,
        transform: Any,
        budget: float,
        cpu_decoders: int,
        lanes: Sequence[str] | None,
        split: Mapping[str, float] | None,
        cuda_graph: bool,
    ) -> Any:
        if self.via == "decode":
            from dlstore.read.decode.lanes import DecodePath

            if cuda_graph:
                raise ValueError("cuda_graph replays a fixed batch: not with the decode lanes")
            return DecodePath(self.cache, self.batch_size, transform, self.device, cpu_decoders, lanes, split)
        if self.cache.ragged:
            raise ValueError(
                f"{self.cache.root}: images differ in size; via={self.via!r} reads fixed-size images, "
                "via='decode' crops these to one size"
            )
        if self.via == "resident":
            from dlstore.read.resident import ResidentPath

            check_fits(self.cache, self.device, budget)
            return ResidentPath(self.cache, self.batch_size, self.device, transform, cuda_graph)
        from dlstore.read.pinned import PinnedPath

        return PinnedPath(self.cache, self.batch_size, self.device, transform, cuda_graph, cpu_decoders)

    @property
    def stats(self) -> Any:
        """The decode path's ``DecodeStats`` (where the time went, which lane decoded what); else None."""
        return getattr(self._path, "stats", None)

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (the sampler's)."""
        return self.sampler.epoch

    def settings(self) -> dict[str, Any]:
        """What the epoch is made of and the path, for reports (never the credentials nor the path)."""
        keep = ("via", "batch_size", "order", "seed", "drop_last", "window", "num_replicas", "rank")
        return {name: getattr(self, name) for name in keep}

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        p, indices = self.sampler.take_pass()
        b = self.batch_size
        batches = p.count // b if self.drop_last else -(-p.count // b)
        self._pass = LoaderPass(p, batches, b)
        return self._count(self._path.epoch(indices[: batches * b]), self._pass)

    @staticmethod
    def _count(batches: Iterable[Any], counted: LoaderPass) -> Iterator[Any]:
        """The batches the loop receives, counted as it receives them; closed early, it closes ``batches``."""
        it = iter(batches)
        try:
            for batch in it:
                counted.received += 1
                yield batch
        finally:
            getattr(it, "close", lambda: None)()

    def set_epoch(self, epoch: int) -> None:
        """The order of the next epoch is the one of ``epoch`` (resuming at an epoch boundary, or at a
        loaded state's position in it); without calls, each iteration advances the epoch by one."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands (the batches the loop received), a few hundred bytes of JSON, the
        same on every rank: save it with each checkpoint; it resumes on any number of ranks."""
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

    def close(self) -> None:
        """Stop the path's worker processes and threads (if any); iterating again starts new ones."""
        close = getattr(self._path, "close", None)
        if close is not None:
            close()


def split_batches(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """The epoch's indices cut into batches (the last one short when the pass keeps it)."""
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
