"""The resident path of ``dlstore.Loader``: the whole cache as one uint8 tensor on the device, batches
gathered there with no host work per batch. ``device="cpu"`` keeps it in host RAM, the same way.

With ``cuda_graph=True`` the gather and the transform of a full batch are captured once and replayed,
which removes their per-kernel launch cost (it matters for small images and small models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dlstore.read.cache import Cache
from dlstore.read.field_targets import batch_target, target_to_device

Batch = tuple[torch.Tensor, torch.Tensor]
BLOCK_BYTES = 256 << 20  # the upload's pinned staging buffer


class ResidentPath:
    """The images (and a cache's fixed-shape fields) in device memory; see the module."""

    def __init__(
        self,
        cache: Cache,
        batch_size: int,
        device: torch.device,
        transform: Callable[..., Any] | None,
        cuda_graph: bool,
    ) -> None:
        if cuda_graph and (device.type != "cuda" or getattr(transform, "generator", None) is not None):
            raise ValueError("cuda_graph needs a CUDA device and a transform on the default generator")
        if cache.spec.fields and cuda_graph:
            raise ValueError("cuda_graph replays a fixed batch: not with a cache with fields (boxes vary)")
        self.cache, self.batch_size, self.device, self.transform = cache, batch_size, device, transform
        self.images = upload(cache, device, BLOCK_BYTES)
        self.labels = torch.from_numpy(cache.labels.copy()).to(device)
        # A cache with fields: the fixed-shape ones (masks, values) in device memory like the images;
        # the variable-length ones (boxes) read per batch on the host, one copy each.
        self.fields = upload_fields(cache, device) if cache.spec.fields else {}
        # A target per batch whenever the cache has fields, resident or not (boxes alone are read
        # per batch: ``self.fields`` is then empty, and a batch still carries its boxes).
        self.targets = bool(cache.spec.fields)
        self._graph: Any = None
        if cuda_graph:  # the gather and the transform of a full batch, replayed from one CUDA graph
            from dlstore.gpu.graphs import CudaGraphed

            self._graph = CudaGraphed(self.batch)

    def epoch(self, indices: np.ndarray) -> Iterator[Batch]:
        host = indices.astype(np.int64, copy=False)
        # This rank's dataset indices for the rest of the epoch, moved to the device once: the same
        # global order as every other path's (``dlstore.read.order``), built on the host in O(n).
        order = torch.from_numpy(host).to(self.device)
        for start in range(0, len(host), self.batch_size):
            part = slice(start, start + self.batch_size)
            idx = order[part]
            if self._graph is not None and len(idx) == self.batch_size:
                yield self._graph(idx)
            else:
                yield self.batch(idx, host[part]) if self.targets else self.batch(idx)

    def batch(self, idx: torch.Tensor, host: np.ndarray | None = None) -> Batch:
        """The batch of dataset indices ``idx`` (on the device); ``host``: the same on the host, so
        the variable-length fields are read without waiting for the device."""
        x = self.images.index_select(0, idx).permute(0, 3, 1, 2)
        if self.targets:
            target = self.field_target(idx, host)
            return self.transform(x, target=target) if self.transform else (x, target)
        return (self.transform(x) if self.transform else x), self.labels.index_select(0, idx)

    def read_variable(self, host: np.ndarray, names: dict[str, Any]) -> dict[str, Any]:
        """The variable-length fields of ``host`` indices (the resident ones are not read again)."""
        cache, chosen = self.cache, self.cache.field_names
        cache.field_names = tuple(names)
        try:
            return cache.read_fields(host)
        finally:
            cache.field_names = chosen

    def field_target(self, idx: torch.Tensor, host: np.ndarray | None = None) -> dict[str, Any]:
        """The batch's collated target: resident fields gathered on the device, the rest read."""
        spec = self.cache.spec
        chosen = self.cache.fields
        variable = {k: f for k, f in chosen.items() if k not in self.fields}
        target = {}
        if variable:  # read on the host
            host = idx.cpu().numpy() if host is None else host
            partial = dataclasses.replace(spec, fields=variable)
            sizes = [tuple(spec.shape[:2])] * len(host)
            target = target_to_device(
                batch_target(partial, self.read_variable(host, variable), sizes), self.device
            )
        for name, values in self.fields.items():
            picked = values.index_select(0, idx)
            target[name] = type(values)(picked) if type(values) is not torch.Tensor else picked
        return {k: target[k] for k in chosen}


def upload_fields(cache: Cache, device: torch.device) -> dict[str, torch.Tensor]:
    """A fixed-size cache's fixed-shape fields (masks, values, class labels) for every dataset index,
    on the device."""
    from torchvision import tv_tensors

    if cache.spec.ragged:
        return {}
    fixed = {k: f for k, f in cache.fields.items() if not f.ragged}
    if not fixed:
        return {}
    columns = cache.read_fields(np.arange(len(cache)))
    out = {}
    for name, f in fixed.items():
        t = torch.from_numpy(np.ascontiguousarray(columns[name])).to(device)
        out[name] = tv_tensors.Mask(t) if f.kind == "mask" else t
    return out


def upload(cache: Cache, device: torch.device, block_bytes: int) -> torch.Tensor:
    """Read the cache in dataset order, block by block through one pinned buffer."""
    n, shape = len(cache), cache.spec.shape
    out = torch.empty((n, *shape), dtype=torch.uint8, device=device)
    block = max(1, block_bytes // cache.spec.image_bytes)
    staging = torch.empty(
        (min(block, max(n, 1)), *shape), dtype=torch.uint8, pin_memory=device.type == "cuda"
    )
    for start in range(0, n, block):
        stop = min(n, start + block)
        host = staging[: stop - start]
        cache.read(np.arange(start, stop), out=host.numpy())
        out[start:stop].copy_(host, non_blocking=False)
    return out
