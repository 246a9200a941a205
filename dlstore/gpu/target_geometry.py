"""Masks and boxes through the batched GPU crops (``GpuAugment``, ``RaggedRandomResizedCrop``), with each
sample's own crop, flip and rotation, as torchvision.transforms.v2 moves ``tv_tensors.Mask`` and
``BoundingBoxes`` under ``RandomResizedCrop`` → ``RandomHorizontalFlip`` → ``RandomRotation``.

* Masks: one gather for the batch at the indices v2's nearest resize reads (``floor(i * crop / out)``
  in float32: the ids equal v2's); a rotation is one batched nearest ``grid_sample`` (0 outside, v2's
  fill; equal but for rounding ties at id boundaries).
* Boxes (XYXY): shifted into the crop and clipped, scaled, flipped, their corners rotated (min/max),
  clipped again; a box with no area is dropped, and ``keep`` says which survived so the rows that
  follow the boxes (their labels) are dropped too. All boxes of the batch are one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["crop_boxes", "crop_masks", "mask_source_index", "move_target"]


def mask_source_index(
    start: torch.Tensor, length: torch.Tensor, out: int, flip: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, out) int64 source indices along one axis: v2's nearest resize of ``[start, start+length)``
    to ``out`` (ATen's nearest_idx), then reversed where ``flip``."""
    i = torch.arange(out, device=start.device, dtype=torch.float32)
    scale = length.to(torch.float32).unsqueeze(1) / float(out)
    idx = torch.minimum(torch.floor(i * scale).long(), (length - 1).unsqueeze(1))
    same = (length == out).unsqueeze(1)
    idx = torch.where(same, i.long().expand_as(idx), idx)
    if flip is not None:
        idx = torch.where(flip.unsqueeze(1), idx.flip(1), idx)
    return start.unsqueeze(1) + idx


def crop_masks(
    flat: torch.Tensor,
    starts: torch.Tensor,
    widths: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    flip: torch.Tensor,
    size: tuple[int, int],
) -> torch.Tensor:
    """(B, out_h, out_w) masks: each sample's crop of its (H_i, W_i) mask, stored back to back in
    ``flat`` from ``starts``, resized nearest as v2 does and flipped; one gather for the batch."""
    rows = mask_source_index(top, h, size[0])  # (B, out_h)
    cols = mask_source_index(left, w, size[1], flip.bool())  # (B, out_w)
    index = starts.view(-1, 1, 1) + rows.unsqueeze(2) * widths.view(-1, 1, 1) + cols.unsqueeze(1)
    return flat[index]


def rotate_masks(masks: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """(B, h, w) masks each rotated counter-clockwise by its ``angle`` (degrees) about its centre,
    nearest, 0 outside: v2's ``rotate`` of a Mask (its grid: pixel centres, square pixels), batched."""
    import torch.nn.functional as F

    b, h, w = masks.shape
    rad = angle.to(device=masks.device, dtype=torch.float32) * (math.pi / 180.0)
    cos, sin = torch.cos(rad), torch.sin(rad)
    zero = torch.zeros_like(cos)
    theta = torch.stack(
        [torch.stack([cos, -sin * (h / w), zero], -1), torch.stack([sin * (w / h), cos, zero], -1)], -2
    )
    grid = F.affine_grid(theta, [b, 1, h, w], align_corners=False)
    moved = F.grid_sample(masks.unsqueeze(1).float(), grid, mode="nearest", align_corners=False)
    return moved.squeeze(1).round().to(masks.dtype)


def crop_boxes(
    boxes: Sequence[torch.Tensor],
    top: torch.Tensor,
    left: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    flip: torch.Tensor,
    size: tuple[int, int],
    angle: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's (N_i, 4) XYXY boxes through its crop → (boxes in the output, kept indices)."""
    counts = [len(b) for b in boxes]
    dev = top.device
    if sum(counts) == 0:
        empty = torch.zeros((0, 4), dtype=torch.float32, device=dev)
        return [empty for _ in counts], [torch.zeros(0, dtype=torch.long, device=dev) for _ in counts]
    owner = torch.repeat_interleave(
        torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev), output_size=sum(counts)
    )
    b = torch.cat([x.reshape(-1, 4).to(device=dev, dtype=torch.float32) for x in boxes])
    out_h, out_w = size

    def per_box(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32)[owner]

    x0, y0, bh, bw = per_box(left), per_box(top), per_box(h), per_box(w)
    x = (b[:, 0::2] - x0.unsqueeze(1)).clamp(min=torch.zeros_like(bw).unsqueeze(1), max=bw.unsqueeze(1))
    y = (b[:, 1::2] - y0.unsqueeze(1)).clamp(min=torch.zeros_like(bh).unsqueeze(1), max=bh.unsqueeze(1))
    x = x * (out_w / bw).unsqueeze(1)
    y = y * (out_h / bh).unsqueeze(1)
    flipped = flip.bool()[owner].unsqueeze(1)
    x = torch.where(flipped, out_w - x.flip(1), x)
    if angle is not None:
        x, y = rotate_boxes(x, y, per_box(angle), size)
    x, y = x.clamp(0, out_w), y.clamp(0, out_h)
    moved = torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], 1)
    alive = ((moved[:, 2] > moved[:, 0]) & (moved[:, 3] > moved[:, 1])).cpu().numpy()  # the one sync
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    kept = np.flatnonzero(alive)
    per_sample = np.bincount(np.repeat(np.arange(len(counts)), counts)[kept], minlength=len(counts))
    local = kept - np.repeat(starts, per_sample)
    both = torch.from_numpy(np.stack([kept, local])).to(dev)
    sizes = per_sample.tolist()
    return list(moved[both[0]].split(sizes)), list(both[1].split(sizes))


def rotate_boxes(
    x: torch.Tensor, y: torch.Tensor, angle: torch.Tensor, size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four corners of each box rotated counter-clockwise by ``angle`` degrees about the output's
    centre (v2's rotate of bounding boxes, ``expand=False``): their min/max."""
    cy, cx = size[0] * 0.5, size[1] * 0.5
    rad = angle * (math.pi / 180.0)
    cos, sin = torch.cos(rad).unsqueeze(1), torch.sin(rad).unsqueeze(1)
    px = torch.stack([x[:, 0], x[:, 1], x[:, 1], x[:, 0]], 1) - cx
    py = torch.stack([y[:, 0], y[:, 0], y[:, 1], y[:, 1]], 1) - cy
    rx = cx + px * cos + py * sin
    ry = cy - px * sin + py * cos
    return (
        torch.stack([rx.min(1).values, rx.max(1).values], 1),
        torch.stack([ry.min(1).values, ry.max(1).values], 1),
    )


def move_target(
    target: dict[str, Any],
    size: tuple[int, int],
    move_masks: Callable[[Any], torch.Tensor],
    move_boxes: Callable[[list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]],
) -> dict[str, Any]:
    """A collated target dict with its masks (``move_masks -> (B, *size)``, one ``Mask``) and boxes
    (``move_boxes(list) -> (boxes, keep)``, ``BoundingBoxes`` of ``size``) moved; every other list with
    one row per box (their labels) loses the rows of the boxes dropped."""
    from torchvision import tv_tensors

    out = dict(target)
    keep: list[torch.Tensor] | None = None
    counts: list[int] = []
    for name, value in target.items():
        if is_masks(value):
            out[name] = tv_tensors.Mask(move_masks(value))
        elif isinstance(value, list) and value and isinstance(value[0], tv_tensors.BoundingBoxes):
            counts = [len(b) for b in value]
            moved, keep = move_boxes([b.as_subclass(torch.Tensor) for b in value])
            out[name] = [tv_tensors.BoundingBoxes(m, format="XYXY", canvas_size=size) for m in moved]
    if keep is None:
        return out
    for name, value in target.items():
        rows = (
            [len(v) if isinstance(v, torch.Tensor) and v.ndim else -1 for v in value]
            if isinstance(value, list)
            else []
        )
        if out[name] is value and rows == counts:
            out[name] = [v[k.to(v.device)] for v, k in zip(value, keep)]
    return out


def is_masks(value: Any) -> bool:
    from torchvision import tv_tensors

    if isinstance(value, tv_tensors.Mask):
        return True
    return isinstance(value, list) and bool(value) and isinstance(value[0], tv_tensors.Mask)


def mask_batch(value: Any) -> torch.Tensor:
    """(B, H, W) from a stacked Mask or a list of equal-size ones."""
    if isinstance(value, list):
        return torch.stack([v.as_subclass(torch.Tensor) for v in value])
    return value.as_subclass(torch.Tensor)
