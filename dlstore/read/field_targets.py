"""Targets as torchvision.transforms.v2 users write against them, from a cache's named fields.

A classification cache's target is its int label. A cache with fields gives each sample a dict: boxes
as ``tv_tensors.BoundingBoxes`` (XYXY, the image's canvas size), masks as ``tv_tensors.Mask``, other
numeric fields as tensors, a JSON field as the decoded object, so a v2 pipeline moves them with the
image unchanged. ``collate_fields`` stacks what has one shape per sample and keeps the rest as lists::

    ds = CachedDataset("coco-cache/", transform=v2.Compose([v2.RandomIoUCrop(), v2.SanitizeBoundingBoxes()]))
    loader = DataLoader(ds, batch_size=8, collate_fn=collate_fields)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dlstore.spec import CacheSpec

__all__ = ["collate_fields", "sample_targets"]


def sample_targets(
    spec: CacheSpec, fields: dict[str, Any], sizes: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """One target dict per sample from ``Cache.read_fields``' batch; ``sizes``: each image's (H, W)."""
    from torchvision import tv_tensors

    def row(value: Any, j: int) -> Any:
        if not isinstance(value, torch.Tensor):
            return value[j]
        own = value[j].as_subclass(torch.Tensor).clone()  # not a view keeping the batch alive
        return tv_tensors.Mask(own) if isinstance(value, tv_tensors.Mask) else own

    batch = batch_target(spec, fields, sizes)
    return [{name: row(value, j) for name, value in batch.items()} for j in range(len(sizes))]


def ragged_names(spec: CacheSpec) -> frozenset[str]:
    """The fields whose rows per sample vary (boxes, their rows, JSON; masks of a ragged cache)."""
    return frozenset(k for k, f in spec.fields.items() if f.ragged or (f.kind == "mask" and spec.ragged))


def collate_fields(batch: Sequence[tuple[Any, Any]], ragged: frozenset[str] | None = None) -> tuple[Any, Any]:
    """DataLoader ``collate_fn`` for (image, target) samples of a cache with fields (``ds.collate_fn``
    fills in ``ragged``). Images: one (B, C, H, W) tensor when they share a size, else a list. Fixed-
    shape target entries are stacked (masks as one ``Mask``); ``ragged`` ones (without it: boxes,
    non-tensors, entries that differ in shape) are lists of B items. An int target becomes a tensor."""
    from torchvision import tv_tensors

    images, targets = zip(*batch)
    same = all(isinstance(i, torch.Tensor) and i.shape == images[0].shape for i in images)
    out_images: Any = torch.stack(list(images)) if same else list(images)
    if not isinstance(targets[0], dict):
        return out_images, torch.as_tensor(targets)
    out: dict[str, Any] = {}
    for name in targets[0]:
        values = [t[name] for t in targets]
        listed = ragged is not None and name in ragged
        if (
            listed
            or isinstance(values[0], tv_tensors.BoundingBoxes)
            or not isinstance(values[0], torch.Tensor)
        ):
            out[name] = values
        elif all(v.shape == values[0].shape for v in values):
            stacked = torch.stack([v.as_subclass(torch.Tensor) for v in values])
            out[name] = tv_tensors.Mask(stacked) if isinstance(values[0], tv_tensors.Mask) else stacked
        else:
            out[name] = values
    return out_images, out


def batch_target(spec: CacheSpec, fields: dict[str, Any], sizes: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """A batch's collated target straight from ``Cache.read_fields`` (what ``collate_fields`` makes of
    the per-sample dicts, without them): the fast loaders' form."""
    from torchvision import tv_tensors

    out: dict[str, Any] = {}
    for name, f in spec.fields.items():
        column = fields[name]
        if f.kind == "json":
            out[name] = [json.loads(np.asarray(v, np.uint8).tobytes()) for v in column]
        elif f.kind == "boxes":
            out[name] = [
                tv_tensors.BoundingBoxes(
                    torch.from_numpy(np.array(v, np.float32)).reshape(-1, 4),
                    format="XYXY",
                    canvas_size=tuple(s),
                )
                for v, s in zip(column, sizes)
            ]
        elif isinstance(column, list):
            wrap = tv_tensors.Mask if f.kind == "mask" else torch.as_tensor
            out[name] = [wrap(torch.from_numpy(np.array(v))) for v in column]
        elif f.kind == "mask":
            out[name] = tv_tensors.Mask(torch.from_numpy(np.ascontiguousarray(column)))
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(column))
    return out


def read_target(cache: Any, index: np.ndarray, into: dict[str, torch.Tensor] | None = None) -> Any:
    """The labels of ``index`` (a cache without fields), or its collated target on the host; ``into``:
    (B, ...) tensors the fixed-shape fields are read straight into (a loader's pinned buffers), which
    the target then holds."""
    if not cache.spec.fields:
        return cache.labels[index]
    spec = dataclasses.replace(cache.spec, fields=cache.fields)
    if cache.spec.ragged:
        sizes = [tuple(s) for s in cache.payload_extents(index).shapes[:, :2].tolist()]
    else:
        sizes = [tuple(cache.spec.shape[:2])] * len(index)
    target = batch_target(
        spec, cache.read_fields(index, {k: t.numpy() for k, t in (into or {}).items()}), sizes
    )
    for name, t in (into or {}).items():  # the very tensors (pinned), not views made by from_numpy
        target[name] = type(target[name])(t) if type(target[name]) is not torch.Tensor else t
    return target


def target_to_device(target: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every tensor of a collated target on ``device``; a list of tensors (boxes, their labels, masks
    of a ragged cache) goes in one copy (concatenated, then split), not one per sample."""
    from torchvision import tv_tensors

    pin = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if pin else t).to(device, non_blocking=pin)

    out: dict[str, Any] = {}
    for name, value in target.items():
        if isinstance(value, torch.Tensor):
            out[name] = (
                type(value)(move(value.as_subclass(torch.Tensor)))
                if isinstance(value, tv_tensors.Mask)
                else move(value)
            )
        elif isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
            flat = move(torch.cat([v.as_subclass(torch.Tensor).reshape(-1) for v in value]))
            parts = flat.split([v.numel() for v in value])
            out[name] = [rewrap(v, p.view(v.shape)) for v, p in zip(value, parts)]
        else:
            out[name] = value
    return out


def rewrap(like: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as the tv_tensor ``like`` is (its box format and canvas size), or plain."""
    from torchvision import tv_tensors

    if isinstance(like, tv_tensors.BoundingBoxes):
        return tv_tensors.BoundingBoxes(data, format=like.format, canvas_size=like.canvas_size)
    if isinstance(like, tv_tensors.Mask):
        return tv_tensors.Mask(data)
    return data


def target_tensors(target: Any) -> list[torch.Tensor]:
    """Every tensor in a target (labels, or a collated dict), for ``record_stream``."""
    if isinstance(target, torch.Tensor):
        return [target]
    if not isinstance(target, dict):
        return []
    out = []
    for value in target.values():
        out.extend(
            [value]
            if isinstance(value, torch.Tensor)
            else [v for v in value if isinstance(v, torch.Tensor)]
            if isinstance(value, list)
            else []
        )
    return out
