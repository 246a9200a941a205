"""Crops of variable-size images to one fixed size, batched on the device.

A ragged cache (``resize="shorter"``) keeps aspect ratios, so a decoded batch is a list of
``(C, H_i, W_i)`` uint8 tensors. ``RaggedRandomResizedCrop`` draws one crop per image over its whole
field of view with ``RandomResizedCrop.get_params``' distribution, flips, and resamples every crop to
``size`` in one batched gather; ``RaggedCenterCrop`` is the evaluation counterpart (``Resize(size /
crop_fraction)`` + ``CenterCrop(size)``)::

    crop = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16).cuda()
    x = crop(images)          # images: list of uint8 (3, H_i, W_i) on the GPU -> (B, 3, 224, 224)

The images are concatenated into one flat buffer (no padding, no per-image launches); every output
pixel gathers its four neighbours there at ``interpolate(..., align_corners=False)``'s positions,
clamped to each crop: the pixels equal ``resized_crop(..., antialias=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlstore.gpu import fused_crop
from dlstore.gpu.augment import _check_channels, _pair, affine_buffers, sample_crop_boxes
from dlstore.gpu.target_geometry import crop_boxes, crop_masks, move_target

__all__ = [
    "PARAM_COLUMNS",
    "FlatImages",
    "RaggedCenterCrop",
    "RaggedRandomResizedCrop",
    "flat_batch",
    "sample_crop_boxes",
    "scattered_flat",
]


@dataclass
class FlatImages:
    """A batch of (C, H_i, W_i) uint8 images already back to back in one flat buffer (as ``flat_batch``
    makes it): a loader that decodes into one buffer hands it over without per-image tensors."""

    flat: torch.Tensor  # uint8, 1-D
    starts: torch.Tensor  # (B,) int64, on the flat buffer's device
    heights: torch.Tensor
    widths: torch.Tensor
    channels: int
    # (starts, heights, widths) on the host, when known there: the crop draws its boxes there
    host: np.ndarray | None = None
    # Images in several allocations (``scattered_flat``): starts are addresses minus ``flat``'s, which
    # only the fused kernel may read; ``gather()`` copies them back to back for the PyTorch path.
    gather: Callable[[], FlatImages] | None = None

    def __len__(self) -> int:
        return len(self.starts)


def scattered_flat(
    base: torch.Tensor,
    addresses: np.ndarray,
    hwc: np.ndarray,
    sources: Callable[[], list[torch.Tensor]],
) -> FlatImages:
    """Planar uint8 images anywhere in device memory (the decode lanes' own buffers), read in place:
    each start is its image's address minus ``base``'s (the caller keeps every buffer alive). ``hwc``:
    (B, 3) shapes; ``sources()`` makes (C, H, W) tensors, for ``gather`` where the kernel cannot run."""
    hwc = np.asarray(hwc, np.int64).reshape(-1, 3)
    host = np.empty((3, len(hwc)), np.int64)
    host[0] = np.asarray(addresses, np.int64) - base.data_ptr()
    host[1], host[2] = hwc[:, 0], hwc[:, 1]
    meta = to_device(torch.from_numpy(host), base.device)

    def gather() -> FlatImages:
        flat, packed = _flat_host(sources())
        meta = to_device(torch.from_numpy(packed), flat.device)
        return FlatImages(flat, meta[0], meta[1], meta[2], int(hwc[0, 2]), host=packed)

    return FlatImages(base, meta[0], meta[1], meta[2], int(hwc[0, 2]), host=host, gather=gather)


# Per-image crop parameters, one int64 row each, as the crop kernels read them.
PARAM_COLUMNS = ("start", "height", "width", "top", "left", "crop_h", "crop_w", "flip")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without making this thread wait: through (cached) pinned
    memory on CUDA, since a copy from pageable memory may wait for the stream's queued work first."""
    if device.type != "cuda" or t.device.type != "cpu":  # nothing to pin (or on the device already)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def flat_batch(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The uint8 (C, H_i, W_i) images back to back in one flat buffer (one ``cat``: no per-image copy
    launches, no padding), with each image's start, height and width as (B,) int64 tensors."""
    flat, host = _flat_host(images)
    meta = to_device(torch.from_numpy(host), flat.device)
    return flat, meta[0], meta[1], meta[2]


def _flat_host(images: list[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """``flat_batch``'s buffer, and (starts, heights, widths) as a (3, B) int64 array on the host."""
    if not images:
        raise ValueError("empty batch")
    c = images[0].shape[0]
    for img in images:
        if img.dtype != torch.uint8 or img.ndim != 3 or img.shape[0] != c:
            raise ValueError(f"expected uint8 (C={c}, H, W) tensors, got {img.dtype}{tuple(img.shape)}")
    flat = torch.cat([img.reshape(-1) for img in images])
    host = np.empty((3, len(images)), np.int64)
    host[1:] = np.asarray([img.shape[1:] for img in images], np.int64).T
    sizes = host[1] * host[2] * c
    host[0, 0], host[0, 1:] = 0, np.cumsum(sizes)[:-1]
    return flat, host


def center_boxes(
    heights: torch.Tensor, widths: torch.Tensor, crop_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A centred square of ``crop_fraction`` × the shorter side (torchvision CenterCrop's rounding)."""
    side = torch.clamp(torch.round(torch.minimum(heights, widths) * crop_fraction).long(), min=1)
    top = torch.round((heights - side).double() / 2).long()
    left = torch.round((widths - side).double() / 2).long()
    return top, left, side, side


class _RaggedCrop(torch.nn.Module):
    def __init__(
        self,
        size: int | tuple[int, int],
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        out_dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if not out_dtype.is_floating_point:
            raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
        self.size = _pair(size)
        self.out_dtype, self.channels_last = out_dtype, channels_last
        # On CUDA with Triton: one fused kernel (dlstore.gpu.fused_crop), ~10x less memory traffic than
        # the PyTorch gather; set False to use the PyTorch path (the same pixels up to float rounding).
        self.fused = True
        affine_buffers(self, mean, std)

    def boxes(
        self, heights: torch.Tensor, widths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top, left, height, width, flip) per image."""
        raise NotImplementedError

    takes_flat = True  # forward accepts FlatImages (the Loader's decode path hands them over when it can)
    # Whether boxes may be drawn on the host (where the image sizes are known): then the whole batch's
    # parameters reach the device in one small copy instead of ~50 tiny kernels launched per batch.
    samples_on_host = True

    def forward(self, images: list[torch.Tensor] | FlatImages, target: dict[str, Any] | None = None) -> Any:
        """A list of uint8 (C, H_i, W_i) tensors (or a (B, C, H, W) batch, or FlatImages) → (B, C, *size).
        With ``target`` (a collated dict of a cache with fields) returns ``(images, target)``, each
        sample's masks and boxes cropped and flipped as its image (``dlstore.gpu.target_geometry``)."""
        if target is None:
            return self._crop(images)[0]
        out, params = self._crop(images)
        _, heights, widths, top, left, h, w, flip = params.unbind(1)

        def masks(value: Any) -> torch.Tensor:
            listed = [
                m.as_subclass(torch.Tensor) for m in (value if isinstance(value, list) else value.unbind(0))
            ]
            shapes = [tuple(m.shape) for m in listed]
            if shapes != [tuple(hw) for hw in params[:, 1:3].tolist()]:
                raise ValueError(f"each mask must have its image's (H, W); masks {shapes[:4]}...")
            sizes = torch.tensor([m.numel() for m in listed], device=out.device)
            flat = torch.cat([m.reshape(-1) for m in listed]).to(out.device)
            starts = torch.cumsum(sizes, 0) - sizes
            return crop_masks(flat, starts, widths, top, left, h, w, flip, self.size)

        def boxes(value: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return crop_boxes(value, top, left, h, w, flip, self.size)

        return out, move_target(target, self.size, masks, boxes)

    def _crop(self, images: list[torch.Tensor] | FlatImages) -> tuple[torch.Tensor, torch.Tensor]:
        """(the crops, the (B, 8) ``PARAM_COLUMNS`` rows they used)."""
        if isinstance(images, torch.Tensor):
            images = list(images.unbind(0))
        if isinstance(images, FlatImages):
            if images.gather is not None and not (self.fused and fused_crop.available(images.flat.device)):
                images = images.gather()
            flat, channels, host = images.flat, images.channels, images.host
            meta = (images.starts, images.heights, images.widths)
        else:
            flat, host = _flat_host(images)
            channels, meta = images[0].shape[0], None
        _check_channels(self._mul, channels)
        params = self.params(flat.device, host, meta)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.fused and fused_crop.available(flat.device):
            out = torch.empty(
                (len(params), channels, *self.size),
                dtype=self.out_dtype,
                device=flat.device,
                memory_format=fmt,
            )
            mul, add = self._mul.expand(channels), self._add.expand(channels)
            done = fused_crop.try_fused_crop(flat, params, channels, mul, add, out)
            if done is not None:
                return done, params
            if isinstance(images, FlatImages) and images.gather is not None:  # the kernel failed
                return self._crop(images.gather())
        starts, heights, widths, top, left, h, w, flip = params.unbind(1)
        sx, sy = crop_coords(top, left, h, w, flip.bool(), self.size)
        out = bilinear_gather(flat, starts, heights, widths, channels, sx, sy)
        out = torch.addcmul(self._add.view(1, -1, 1, 1), out, self._mul.view(1, -1, 1, 1))
        return out.to(dtype=self.out_dtype, memory_format=fmt), params

    def params(
        self,
        device: torch.device,
        host: np.ndarray | None,
        meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """(B, 8) int64 rows of ``PARAM_COLUMNS`` on ``device``: drawn on the host when the sizes are
        known there (``host``) and ``samples_on_host``, else on the device from ``meta``."""
        if host is not None and self.samples_on_host:
            starts, heights, widths = (torch.from_numpy(v) for v in host)
        elif meta is not None:
            starts, heights, widths = meta
        else:
            starts, heights, widths = to_device(torch.from_numpy(host), device)  # type: ignore[arg-type]
        top, left, h, w, flip = self.boxes(heights, widths)
        params = torch.stack([starts, heights, widths, top, left, h, w, flip.to(torch.int64)], dim=1)
        return to_device(params, device)


def crop_coords(
    top: torch.Tensor,
    left: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    flip: torch.Tensor,
    size: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source positions (pixel-centre coordinates) of each crop's output columns (B, out_w) and rows
    (B, out_h): interpolate's ``align_corners=False`` mapping, clamped to the crop as interpolate clamps
    to its input, so the pixels equal torchvision's resized_crop(antialias=False)."""
    out_h, out_w = size
    dev = top.device
    xs = torch.arange(out_w, device=dev, dtype=torch.float32)
    ys = torch.arange(out_h, device=dev, dtype=torch.float32)
    xs = torch.where(flip.unsqueeze(1), out_w - 1 - xs, xs)
    sx = left.unsqueeze(1) + (xs + 0.5) * (w.unsqueeze(1).float() / out_w) - 0.5
    sy = top.unsqueeze(1) + (ys.unsqueeze(0) + 0.5) * (h.unsqueeze(1).float() / out_h) - 0.5
    sx = torch.minimum(torch.maximum(sx, left.unsqueeze(1).float()), (left + w - 1).unsqueeze(1).float())
    sy = torch.minimum(torch.maximum(sy, top.unsqueeze(1).float()), (top + h - 1).unsqueeze(1).float())
    return sx, sy


def bilinear_gather(
    flat: torch.Tensor,
    starts: torch.Tensor,
    heights: torch.Tensor,
    widths: torch.Tensor,
    channels: int,
    sx: torch.Tensor,
    sy: torch.Tensor,
) -> torch.Tensor:
    """float32 (B, C, out_h, out_w): bilinear samples at (sy, sx) of each image in the flat buffer."""
    x0f, y0f = sx.floor(), sy.floor()
    wx, wy = (sx - x0f).unsqueeze(1).unsqueeze(2), (sy - y0f).unsqueeze(1).unsqueeze(3)
    x0, y0 = x0f.long(), y0f.long()
    x1 = torch.minimum(x0 + 1, (widths - 1).unsqueeze(1))
    y1 = torch.minimum(y0 + 1, (heights - 1).unsqueeze(1))
    plane = heights * widths
    chan = starts.unsqueeze(1) + torch.arange(channels, device=flat.device) * plane.unsqueeze(1)  # (B, C)
    w_ = widths.unsqueeze(1)
    row0 = (chan.unsqueeze(2) + (y0 * w_).unsqueeze(1)).unsqueeze(3)  # (B, C, out_h, 1)
    row1 = (chan.unsqueeze(2) + (y1 * w_).unsqueeze(1)).unsqueeze(3)
    col0, col1 = x0.unsqueeze(1).unsqueeze(2), x1.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, out_w)

    def px(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return flat[rows + cols].float()

    top_row = torch.lerp(px(row0, col0), px(row0, col1), wx)
    bottom_row = torch.lerp(px(row1, col0), px(row1, col1), wx)
    return torch.lerp(top_row, bottom_row, wy)


class RaggedRandomResizedCrop(_RaggedCrop):
    """RandomResizedCrop (+ horizontal flip, + normalise) of variable-size images, batched: ``size``,
    ``scale``, ``ratio`` as torchvision's, ``mean``/``std`` in [0, 1] units; ``generator``: None or a
    CPU one draws the boxes on the host (one small copy per batch), one on the device draws there."""

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        hflip_p: float = 0.5,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        out_dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(size, mean, std, out_dtype, channels_last)
        if not (0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"need 0 < min <= max for scale {scale} and ratio {ratio}")
        self.scale, self.ratio, self.hflip_p, self.generator = scale, ratio, hflip_p, generator
        # A device generator draws on the device (its random stream is the caller's); otherwise the
        # host's (default or given CPU) generator draws where the sizes are known.
        self.samples_on_host = generator is None or generator.device.type == "cpu"

    def boxes(
        self, heights: torch.Tensor, widths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        top, left, h, w = sample_crop_boxes(heights, widths, self.scale, self.ratio, self.generator)
        flip = torch.rand(heights.numel(), generator=self.generator, device=heights.device) < self.hflip_p
        return top, left, h, w, flip


class RaggedCenterCrop(_RaggedCrop):
    """Evaluation crop: a centred square of ``crop_fraction`` × the shorter side, resized to ``size``."""

    def __init__(
        self,
        size: int | tuple[int, int],
        crop_fraction: float = 0.875,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        out_dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
    ) -> None:
        super().__init__(size, mean, std, out_dtype, channels_last)
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        self.crop_fraction = crop_fraction

    def boxes(
        self, heights: torch.Tensor, widths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        top, left, h, w = center_boxes(heights, widths, self.crop_fraction)
        return top, left, h, w, torch.zeros_like(top, dtype=torch.bool)
