"""Where a sample's masks and boxes go when its image is oriented and pre-resized, as
torchvision.transforms.v2 moves ``Mask`` (nearest) and ``BoundingBoxes`` (scaled, shifted, clipped,
dropped with no area left) under ``Resize`` + ``CenterCrop``. Pure numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlstore.spec import ImagePolicy


@dataclass(frozen=True)
class Geometry:
    """What the decode saw: the file's stored size (w, h) and its EXIF orientation (1 = as stored)."""

    size: tuple[int, int]
    orientation: int = 1

    @property
    def oriented_size(self) -> tuple[int, int]:
        """(w, h) after the orientation: 5-8 swap the sides."""
        w, h = self.size
        return (h, w) if self.orientation in (5, 6, 7, 8) else (w, h)


def orient_mask(mask: np.ndarray, orientation: int) -> np.ndarray:
    """(H, W) ids as ``ImageOps.exif_transpose`` turns the image of that orientation."""
    ops = {
        1: lambda m: m,
        2: lambda m: m[:, ::-1],  # FLIP_LEFT_RIGHT
        3: lambda m: m[::-1, ::-1],  # ROTATE_180
        4: lambda m: m[::-1, :],  # FLIP_TOP_BOTTOM
        5: lambda m: m.T,  # TRANSPOSE
        6: lambda m: np.rot90(m, -1),  # ROTATE_270 (clockwise)
        7: lambda m: np.rot90(m, 2).T,  # TRANSVERSE
        8: lambda m: np.rot90(m, 1),  # ROTATE_90 (counter-clockwise)
    }
    return np.ascontiguousarray(ops.get(orientation, ops[1])(mask))


def orient_boxes(boxes: np.ndarray, geometry: Geometry) -> np.ndarray:
    """XYXY boxes in the stored frame → the oriented frame (corners mapped, then min/max)."""
    if geometry.orientation in (1, 0) or len(boxes) == 0:
        return boxes.astype(np.float64)
    w, h = geometry.size
    x0, y0, x1, y1 = (boxes[:, i].astype(np.float64) for i in range(4))
    maps = {
        2: lambda x, y: (w - x, y),
        3: lambda x, y: (w - x, h - y),
        4: lambda x, y: (x, h - y),
        5: lambda x, y: (y, x),
        6: lambda x, y: (h - y, x),
        7: lambda x, y: (h - y, w - x),
        8: lambda x, y: (y, w - x),
    }
    ax, ay = maps[geometry.orientation](x0, y0)
    bx, by = maps[geometry.orientation](x1, y1)
    return np.stack([np.minimum(ax, bx), np.minimum(ay, by), np.maximum(ax, bx), np.maximum(ay, by)], 1)


def nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """Source index of each output index under ``interpolate(mode="nearest")`` (ATen's nearest_idx)."""
    if n_in == n_out:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    scale = np.float32(n_in) / np.float32(n_out)
    idx = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(idx, n_in - 1)


def resize_mask(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(H, W) → (h, w) for ``size`` = (w, h), nearest (ids stay ids)."""
    w, h = size
    if mask.shape == (h, w):
        return mask
    return mask[nearest_index(mask.shape[0], h)[:, None], nearest_index(mask.shape[1], w)[None, :]]


def fit_offset(size: tuple[int, int], policy: ImagePolicy) -> tuple[int, int]:
    """(left, top) of the resized image in the cache image (``imageops.fit``'s rule)."""
    w, h = size
    n = policy.size
    if policy.resize == "crop":
        return -int(round((w - n) / 2.0)), -int(round((h - n) / 2.0))
    if policy.resize == "pad":
        return (n - w) // 2, (n - h) // 2
    return 0, 0


def canvas(size: tuple[int, int], policy: ImagePolicy) -> tuple[int, int]:
    """(w, h) of the cache image made from a resized image of ``size``."""
    return (policy.size, policy.size) if policy.resize in ("crop", "pad") else size


def fit_mask(mask: np.ndarray, policy: ImagePolicy) -> np.ndarray:
    """A resized mask → the cache image's frame: crop, or pad with 0 (background)."""
    h, w = mask.shape
    cw, ch = canvas((w, h), policy)
    left, top = fit_offset((w, h), policy)
    out = np.zeros((ch, cw), mask.dtype)
    ys, yd = max(0, -top), max(0, top)
    xs, xd = max(0, -left), max(0, left)
    rows, cols = min(h - ys, ch - yd), min(w - xs, cw - xd)
    out[yd : yd + rows, xd : xd + cols] = mask[ys : ys + rows, xs : xs + cols]
    return out


def place_mask(
    mask: np.ndarray, geometry: Geometry, target: tuple[int, int], policy: ImagePolicy
) -> np.ndarray:
    """A mask in the file's stored frame → the cache image's frame (orient, resize, fit)."""
    if mask.shape != geometry.size[::-1]:
        raise ValueError(
            f"mask is {mask.shape[1]}x{mask.shape[0]}, its image {geometry.size[0]}x{geometry.size[1]}"
        )
    return fit_mask(resize_mask(orient_mask(mask, geometry.orientation), target), policy)


def place_boxes(
    boxes: np.ndarray, geometry: Geometry, target: tuple[int, int], policy: ImagePolicy
) -> tuple[np.ndarray, np.ndarray]:
    """XYXY boxes in the stored frame → (float32 boxes in the cache image's frame, indices kept)."""
    b = orient_boxes(np.asarray(boxes, np.float64).reshape(-1, 4), geometry)
    ow, oh = geometry.oriented_size
    tw, th = target
    b = b * np.array([tw / ow, th / oh, tw / ow, th / oh])
    left, top = fit_offset(target, policy)
    b = b + np.array([left, top, left, top])
    cw, ch = canvas(target, policy)
    b = np.clip(b, 0, np.array([cw, ch, cw, ch]))
    keep = np.flatnonzero((b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]))
    return b[keep].astype(np.float32), keep
