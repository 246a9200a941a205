"""``CachedDataset``: the torch Dataset over a dlstore cache."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlstore.errors import CacheReplacedError
from dlstore.machine import check_loader_shared_memory, usable_cores
from dlstore.read.batch import BatchSamples, ImageBatch, in_worker, new_batch
from dlstore.read.cache import Cache, Remote, check_staleness
from dlstore.read.field_targets import collate_fields, ragged_names, sample_targets
from dlstore.spec import CacheSpec
from dlstore.storage.mirror import spec_at
from dlstore.storage.stores import parse_store_path


class CachedDataset(torch.utils.data.Dataset):
    """Images of a dlstore cache as uint8 CHW tensors with int labels (a dict of its named fields as
    the target when the cache has fields: boxes, masks, multi-label vectors; ``dlstore.read.field_targets``).

    Cheap to pickle (a path, never pixels) and opened lazily in each process, so it works with
    DataLoader workers under fork, spawn and forkserver. ``__getitems__`` reads a whole batch in one
    storage pass. Keep float conversion, normalisation and augmentation on the GPU::

        ds = CachedDataset("cache/")                    # or in_memory=True for a ram cache
        loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=2, pin_memory=True)
        augment = GpuAugment(224, degrees=15, mean=MEAN, std=STD).cuda()
        for images, labels in loader:
            x = augment(images.cuda(non_blocking=True))

    A ragged cache (``resize="shorter"``) yields variable-size tensors, as ImageFolder does: give a
    ``transform`` that makes them one size or a ``collate_fn`` of your own. JPEG caches are decoded
    here, in the reader's threads. ``pil=True`` yields PIL images (RGB, or L) as ImageFolder's loader
    does, for transforms written for them (``ToTensor``). ``in_memory=True`` (ram format) loads the
    images once into one array; forked workers share it copy-on-write, spawned ones load their own.
    """

    pil = False  # a dataset pickled before the option existed reads as tensors
    field_names: tuple[str, ...] | None = None  # likewise: every field

    def __init__(
        self,
        path: str | Path,
        transform: Callable[[torch.Tensor], Any] | None = None,
        in_memory: bool = False,
        strict: bool = False,
        check_source: bool = False,
        remote: Remote | None = None,
        pil: bool = False,
        fields: Sequence[str] | None = None,
    ) -> None:
        self.path = parse_store_path(path)
        self.field_names = None if fields is None else tuple(fields)  # None: every field of the cache
        self.transform = transform
        self.pil = pil
        self.in_memory = in_memory
        # A remote cache (URL): what each worker process needs to open its own mirror of it.
        self.remote = remote
        self.spec: CacheSpec = spec_at(self.path, dict(remote.storage_options or {}) if remote else None)
        # One stat of the source root (a full scan with check_source); a remote cache's source is on
        # the machine that converted it.
        if not isinstance(self.path, str):
            check_staleness(self.path, self.spec, check_source, strict)
        self._cache: Cache | None = None
        self._pid = -1
        self._threads_pid = -1
        if in_memory:
            _ = self.cache  # load now, before DataLoader forks, so workers share one copy

    @property
    def classes(self) -> list[str]:
        return list(self.spec.classes)

    @property
    def cache(self) -> Cache:
        if self._cache is None or (self._pid != os.getpid() and not self._cache.reader.fork_safe):
            self._cache = Cache(self.path, self.in_memory, self.remote)
            self._pid = os.getpid()
            if self._cache.spec != self.spec:  # e.g. a spawned worker opening a cache rebuilt since
                raise CacheReplacedError(
                    f"{self.path}: the cache was rebuilt after this dataset was created "
                    "(its manifest changed); create the dataset again to read the new one"
                )
        if self._cache.field_names != self.field_names:
            self._cache.select_fields(self.field_names)
        if self._threads_pid != os.getpid():
            self._threads_pid = os.getpid()
            share_cores_with_workers(self._cache)
        return self._cache

    @property
    def targets(self) -> list[int]:
        return self.cache.labels.tolist()

    def __len__(self) -> int:
        return self.spec.n

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if self.spec.fields:
            return self._field_samples([index])[0]
        image, label = self._batch([index])
        return self._sample(image[0], int(label[0]))

    @property
    def collate_fn(self) -> Callable[[Sequence[tuple[Any, Any]]], Any]:
        """``DataLoader(ds, collate_fn=ds.collate_fn)`` for a cache with fields: images stacked (a list
        for a ragged cache), boxes and other variable-length fields kept as lists (``collate_fields``)."""
        return functools.partial(collate_fields, ragged=ragged_names(self.spec))

    def _field_samples(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """(image, target dict) per index (``dlstore.read.field_targets``); the transform gets both, as a
        torchvision.transforms.v2 pipeline takes them (``transform(image, target)``)."""
        images, _ = self._batch(indices)
        cache = self.cache
        fields = cache.read_fields(np.asarray(indices, dtype=np.int64))
        sizes = [tuple(img.shape[1:]) for img in images]
        spec = dataclasses.replace(self.spec, fields=cache.fields)
        out = []
        for image, target in zip(images, sample_targets(spec, fields, sizes)):
            sample: Any = to_pil(image) if self.pil else image.contiguous()
            out.append((sample, target) if self.transform is None else self.transform(sample, target))
        return out

    def __getitems__(self, indices: Sequence[int]) -> Sequence[tuple[Any, int]]:
        """One storage pass for the batch. Without a transform it is read into one (in a worker:
        shared-memory) block that default_collate hands on (``dlstore.read.batch``): one copy per
        image, where per-sample tensors stacked by collate cost three. A ragged cache's images go out
        one by one."""
        check_loader_shared_memory(len(indices) * self.spec.image_bytes * (2 if self.spec.ragged else 1))
        if self.spec.fields:
            return self._field_samples(indices)
        if self.transform is not None or self.spec.ragged or self.pil:
            images, labels = self._batch(indices)
            return [self._sample(img, int(lab)) for img, lab in zip(images, labels.tolist())]
        images, labels = self._batch(indices, shared=in_worker())
        return BatchSamples(images.as_subclass(ImageBatch), labels)  # type: ignore[union-attr]

    def read_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor]:
        """(B,C,H,W) uint8 (a list of (C,H,W) for a ragged cache) and (B,) int64 tensors, no transform."""
        images, labels = self._batch(indices)
        return images, torch.from_numpy(labels)

    def _batch(
        self, indices: Sequence[int], shared: bool = False
    ) -> tuple[torch.Tensor | list[torch.Tensor], np.ndarray]:
        """(B,C,H,W) with channels-last strides: the (B,H,W,C) block as read, not transposed; for a
        ragged cache a list of (C,H_i,W_i)."""
        cache = self.cache
        idx = np.asarray(indices, dtype=np.int64)
        if cache.ragged:
            images = [torch.from_numpy(img).permute(2, 0, 1) for img in cache.read_images(idx)]
            return images, cache.labels[idx]
        block = new_batch((len(idx), *cache.spec.shape), shared)
        cache.read(idx, out=block.numpy())
        return block.permute(0, 3, 1, 2), cache.labels[idx]

    def _sample(self, image: torch.Tensor, label: int) -> tuple[Any, int]:
        sample: Any = to_pil(image) if self.pil else image.contiguous()
        if self.transform is None:
            return sample, label
        try:
            return self.transform(sample), label
        except TypeError as e:
            if self.pil or "PIL" not in str(e):
                raise
            raise TypeError(
                f"{e} (CachedDataset yields uint8 CHW tensors: for transforms written for ImageFolder's PIL "
                "images, such as ToTensor, pass pil=True; or use v2.ToDtype(torch.float32, scale=True), "
                "or ConvertImageDtype(torch.float32), where ToTensor was)"
            ) from e

    def close(self) -> None:
        """Close the storage handles this process opened (memory maps pin pages, workers hold shared
        memory); the next read opens the cache again."""
        cache, self._cache, self._pid = self._cache, None, -1
        if cache is not None:
            cache.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_pid"], state["_threads_pid"] = None, -1, -1  # no pixels, no handles
        return state

    def __repr__(self) -> str:
        return (
            f"CachedDataset({str(self.path)!r}, format={self.spec.format}, n={len(self)}, "
            f"shape={self.spec.shape}, classes={len(self.spec.classes)})"
        )


def to_pil(image: torch.Tensor) -> Any:
    """A (C,H,W) uint8 tensor as the PIL image ImageFolder's loader gives: RGB, or L for one channel."""
    from PIL import Image

    hwc = image.permute(1, 2, 0).numpy()
    return Image.fromarray(hwc[:, :, 0] if hwc.shape[2] == 1 else hwc, "L" if hwc.shape[2] == 1 else "RGB")


def share_cores_with_workers(cache: Cache) -> None:
    """In a DataLoader worker the workers are the parallelism: give each reader its share of the cores
    (one thread with as many workers as cores) instead of a thread pool per worker, whose hand-offs
    and oversubscription (16 workers x 4 threads on 16 cores) cost more than they gain."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return
    cores = usable_cores()
    cache.reader.threads = max(1, min(cache.reader.threads, cores // max(1, info.num_workers)))
