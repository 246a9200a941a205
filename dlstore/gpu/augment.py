"""Batched, on-device augmentation of uint8 ``(B, C, H, W)`` batches: random resized crop, horizontal
flip, rotation, scaling to ``[0, 1]`` and normalisation as a few batched kernels::

    aug = GpuAugment(224, degrees=15, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                     out_dtype=torch.bfloat16, channels_last=True).to("cuda")
    for images, labels in loader:            # images: uint8 (B, 3, H, W) on CPU
        x = aug(images.cuda(non_blocking=True))

Geometry: crop, flip and rotation are one ``affine_grid`` + ``grid_sample`` (bilinear,
``align_corners=False``, the convention of ``interpolate`` and so of torchvision's
``resized_crop(..., antialias=False)``). It equals torchvision's ``RandomResizedCrop ->
RandomHorizontalFlip -> RandomRotation`` except that rotated corners outside the crop but inside the
image show the real pixels (only what lies outside the image is black). ``padding_mode='border'``
makes the half-pixel fringe of an up-scaled crop at the image edge replicate the edge pixel as
``interpolate`` does (``'zeros'`` would darken it); samples outside the image are then zeroed, so the
rotation fill stays black. No antialiasing.

Numerics: resampling is in float32 whatever ``out_dtype`` (bf16 sampling coordinates would be off by
about a pixel at 224 px); ``/255`` and normalisation are one per-channel multiply-add on the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dlstore.gpu.target_geometry import crop_boxes, crop_masks, mask_batch, move_target, rotate_masks

__all__ = ["AugmentParams", "GpuAugment", "normalize"]

# torchvision's RandomResizedCrop.get_params makes exactly this many attempts.
_CROP_ATTEMPTS = 10


@dataclass(frozen=True)
class AugmentParams:
    """Per-sample parameters, each a ``(B,)`` tensor: the crop ``top``/``left``/``height``/``width``
    (int64, torchvision's ``(i, j, h, w)``), ``flip`` (bool, of the output) and ``angle`` (degrees,
    counter-clockwise about the output's centre, as ``torchvision.transforms.functional.rotate``)."""

    top: torch.Tensor
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    flip: torch.Tensor
    angle: torch.Tensor


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        pair = (size, size)
    else:
        pair = tuple(int(s) for s in size)
        if len(pair) != 2:
            raise ValueError(f"size must be an int or (height, width), got {size!r}")
    if pair[0] <= 0 or pair[1] <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return pair  # type: ignore[return-value]


def _channel_affine(
    mean: tuple[float, ...] | list[float] | torch.Tensor | None,
    std: tuple[float, ...] | list[float] | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(mul, add)`` with ``uint8 value * mul + add == (v/255 - mean)/std``."""
    if (mean is None) != (std is None):
        raise ValueError("mean and std must be given together")
    if mean is None or std is None:
        return torch.tensor([1.0 / 255.0]), torch.tensor([0.0])
    m = torch.as_tensor(mean, dtype=torch.float64).flatten()
    s = torch.as_tensor(std, dtype=torch.float64).flatten()
    if m.numel() != s.numel() or m.numel() == 0:
        raise ValueError("mean and std must have the same, non-zero length")
    if bool((s == 0).any()):
        raise ValueError("std must be non-zero")
    # Folding in float64 keeps the one float32 rounding at the end.
    return (1.0 / (255.0 * s)).float(), (-m / s).float()


def affine_buffers(module: torch.nn.Module, mean: Any, std: Any) -> None:
    """``module._mul``/``_add`` (``_channel_affine``) as buffers, so that ``.to(device)`` moves them; not
    persistent: configuration, not state."""
    for name, value in zip(("_mul", "_add"), _channel_affine(mean, std)):
        module.register_buffer(name, value, persistent=False)


def _check_batch(batch: torch.Tensor) -> None:
    if batch.dtype != torch.uint8:
        raise TypeError(f"expected a torch.uint8 batch, got {batch.dtype}")
    if batch.ndim != 4:
        raise ValueError(f"expected a (B, C, H, W) batch, got shape {tuple(batch.shape)}")


def _check_channels(mul: torch.Tensor, channels: int) -> None:
    if mul.numel() not in (1, channels):
        raise ValueError(f"mean/std have {mul.numel()} entries but the batch has {channels} channels")


def normalize(
    batch_uint8: torch.Tensor,
    mean: tuple[float, ...] | list[float] | torch.Tensor,
    std: tuple[float, ...] | list[float] | torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(batch_uint8 / 255 - mean) / std`` as ``out_dtype``, for batches with no geometric
    augmentation (e.g. validation after a CPU-side centre crop)::

        x = normalize(images.cuda(non_blocking=True), IMAGENET_MEAN, IMAGENET_STD)
    """
    _check_batch(batch_uint8)
    if not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
    mul, add = _channel_affine(mean, std)
    _check_channels(mul, batch_uint8.shape[1])
    dev = batch_uint8.device
    mul = mul.to(dev, non_blocking=True).view(1, -1, 1, 1)
    add = add.to(dev, non_blocking=True).view(1, -1, 1, 1)
    # Compute in float32 so bf16 output is rounded once, not twice.
    return torch.addcmul(add, batch_uint8.float(), mul).to(out_dtype)


def sample_crop_boxes(
    heights: torch.Tensor,
    widths: torch.Tensor,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchvision ``RandomResizedCrop.get_params`` for every image at once, each with its own size:
    (top, left, height, width) int64 tensors on the device of ``heights``."""
    dev = heights.device
    b = heights.numel()
    h_img, w_img = heights.to(torch.float64), widths.to(torch.float64)
    area = (h_img * w_img).unsqueeze(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, device=dev, dtype=torch.float64)

    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = area * (scale[0] + (scale[1] - scale[0]) * rand(b, _CROP_ATTEMPTS))
    aspect = _exp(log_lo + (log_hi - log_lo) * rand(b, _CROP_ATTEMPTS))
    w_c = _round(_sqrt(target * aspect)).long()
    h_c = _round(_sqrt(target / aspect)).long()
    valid = (w_c > 0) & (w_c <= widths.unsqueeze(1)) & (h_c > 0) & (h_c <= heights.unsqueeze(1))
    first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first valid attempt
    any_valid = valid.any(dim=1)
    h_acc, w_acc = h_c.gather(1, first).squeeze(1), w_c.gather(1, first).squeeze(1)
    top_acc = torch.minimum((rand(b) * (heights - h_acc + 1)).long(), heights - h_acc)
    left_acc = torch.minimum((rand(b) * (widths - w_acc + 1)).long(), widths - w_acc)
    fb_top, fb_left, fb_h, fb_w = _fallback_boxes(heights, widths, ratio)
    return (
        torch.where(any_valid, top_acc, fb_top),
        torch.where(any_valid, left_acc, fb_left),
        torch.where(any_valid, h_acc, fb_h),
        torch.where(any_valid, w_acc, fb_w),
    )


def _fallback_boxes(
    heights: torch.Tensor, widths: torch.Tensor, ratio: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchvision's central-crop fallback, per image (float64 like Python's floats; round half even)."""
    hf, wf = heights.to(torch.float64), widths.to(torch.float64)
    in_ratio = wf / hf
    lo, hi = min(ratio), max(ratio)
    w = torch.where(in_ratio > hi, _round(hf * hi).long(), widths)
    h = torch.where(in_ratio < lo, _round(wf / lo).long(), heights)
    return (heights - h) // 2, (widths - w) // 2, h, w


def _host_fast(torch_fn: Any, numpy_fn: Any) -> Any:
    """``torch_fn``, computed by ``numpy_fn`` for CPU tensors: torch's float64 exp/sqrt/round on the
    CPU took ~1 µs per element (11 ms for a batch of 512 boxes; numpy: ~0.1 ms). Both are correctly
    rounded for sqrt and round half to even; exp may differ in the last bit."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(numpy_fn(x.numpy())) if x.device.type == "cpu" else torch_fn(x)

    return fn


_exp, _sqrt, _round = (
    _host_fast(t, n) for t, n in ((torch.exp, np.exp), (torch.sqrt, np.sqrt), (torch.round, np.round))
)


class GpuAugment(torch.nn.Module):
    """RandomResizedCrop + horizontal flip + rotation + normalise, batched.

    Args: ``size`` (an int or (height, width)); ``scale``, ``ratio`` as torchvision's (aspect sampled
    log-uniformly); ``hflip_p``, the flip probability; ``degrees``: angles drawn from ``[-degrees,
    degrees]``; ``mean``/``std`` in ``[0, 1]`` units (without them the output is scaled to ``[0, 1]``);
    ``out_dtype``; ``channels_last``; ``generator``: on the batches' device (None: its default one).

    The crops follow ``RandomResizedCrop``'s distribution (10 attempts, central fallback), drawn for the
    whole batch on its device, so ``forward`` never synchronises with the host. The configuration is
    fixed at construction.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        hflip_p: float = 0.5,
        degrees: float = 0.0,
        mean: tuple[float, ...] | list[float] | torch.Tensor | None = None,
        std: tuple[float, ...] | list[float] | torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        if not 0.0 < self.scale[0] <= self.scale[1]:
            raise ValueError(f"scale must satisfy 0 < min <= max, got {scale!r}")
        if not 0.0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio!r}")
        if not 0.0 <= hflip_p <= 1.0:
            raise ValueError(f"hflip_p must be in [0, 1], got {hflip_p!r}")
        if degrees < 0:
            raise ValueError(f"degrees must be >= 0, got {degrees!r}")
        if not out_dtype.is_floating_point:
            raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
        self.size, self.hflip_p, self.degrees = _pair(size), float(hflip_p), float(degrees)
        self.out_dtype, self.channels_last, self.generator = out_dtype, bool(channels_last), generator
        self.normalized = mean is not None
        affine_buffers(self, mean, std)

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"hflip_p={self.hflip_p}, degrees={self.degrees}, normalized={self.normalized}, "
            f"out_dtype={self.out_dtype}, channels_last={self.channels_last}"
        )

    def _rand(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, device=device)

    def sample_params(
        self,
        batch_size: int,
        height: int,
        width: int,
        device: torch.device | str | None = None,
    ) -> AugmentParams:
        """Draw per-sample parameters for ``batch_size`` images of ``height x width``, in batched calls
        on ``device``. ``forward`` makes the same calls in the same order: resetting the generator and
        calling this reproduces what ``forward`` used."""
        if height <= 0 or width <= 0:
            raise ValueError(f"image size must be positive, got {height}x{width}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        ones = torch.ones(batch_size, dtype=torch.int64, device=dev)
        crop = sample_crop_boxes(ones * height, ones * width, self.scale, self.ratio, self.generator)
        flip = self._rand(batch_size, device=dev) < self.hflip_p
        angle = (2.0 * self._rand(batch_size, device=dev) - 1.0) * self.degrees
        return AugmentParams(*crop, flip=flip, angle=angle)

    def theta(self, params: AugmentParams, height: int, width: int) -> torch.Tensor:
        """The ``(B, 2, 3)`` float32 ``affine_grid`` matrices for ``params``: output coordinates to input
        ones, rotated in output *pixel* space (rigid even when the crop is resized anisotropically),
        flipped, scaled onto the crop and moved to its centre."""
        out_h, out_w = self.size
        f32 = torch.float32
        w_frac = params.width.to(f32) / width
        h_frac = params.height.to(f32) / height
        cx = (2.0 * params.left.to(f32) + params.width.to(f32)) / width - 1.0
        cy = (2.0 * params.top.to(f32) + params.height.to(f32)) / height - 1.0
        rad = params.angle.to(f32) * (math.pi / 180.0)
        cos, sin = torch.cos(rad), torch.sin(rad)
        sign = 1.0 - 2.0 * params.flip.to(f32)
        # Inverse of a visually counter-clockwise rotation in y-down pixel
        # coordinates is [[c, -s], [s, c]]; flip negates the x row.
        return torch.stack(
            [
                torch.stack([sign * cos * w_frac, -sign * sin * w_frac * (out_h / out_w), cx], dim=-1),
                torch.stack([sin * h_frac * (out_w / out_h), cos * h_frac, cy], dim=-1),
            ],
            dim=-2,
        )

    def forward(
        self,
        batch_uint8: torch.Tensor,
        params: AugmentParams | None = None,
        target: dict[str, Any] | None = None,
    ) -> Any:
        """Augment a ``(B, C, H, W)`` uint8 batch into ``(B, C, *size)`` of ``out_dtype``. ``params``
        replaces the random draw. With ``target`` (a collated dict of a cache with fields) returns
        ``(images, target)``, its masks and boxes moved by each sample's crop, flip and rotation."""
        if target is None:
            return self._images(batch_uint8, params)
        _check_batch(batch_uint8)
        b, _, h, w = batch_uint8.shape
        drawn = params is None
        p = self.sample_params(b, h, w, batch_uint8.device) if params is None else params
        rotated = self.degrees > 0 or (not drawn and bool((p.angle != 0).any()))

        def masks(value: Any) -> torch.Tensor:
            m = mask_batch(value).to(batch_uint8.device)
            starts = torch.arange(m.shape[0], device=m.device) * (h * w)
            widths = torch.full_like(starts, w)
            cropped = crop_masks(
                m.reshape(-1), starts, widths, p.top, p.left, p.height, p.width, p.flip, self.size
            )
            return rotate_masks(cropped, p.angle) if rotated and m.shape[0] else cropped

        def boxes(value: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            angle = p.angle if rotated else None
            return crop_boxes(value, p.top, p.left, p.height, p.width, p.flip, self.size, angle)

        # The target first: the box crop's one host sync then waits for the small kernels queued
        # so far, and this batch's image resample runs on the device while the host prepares the
        # next batch (after the images, the sync held the host for the whole resample).
        moved = move_target(target, self.size, masks, boxes)
        return self._images(batch_uint8, p, explicit=not drawn), moved

    def _images(
        self, batch_uint8: torch.Tensor, params: AugmentParams | None, explicit: bool | None = None
    ) -> torch.Tensor:
        """The augmented batch; ``explicit``: the parameters were the caller's (default: whether
        ``params`` is given)."""
        _check_batch(batch_uint8)
        b, c, h, w = batch_uint8.shape
        _check_channels(self._mul, c)
        dev = batch_uint8.device
        explicit = params is not None if explicit is None else explicit
        if params is None:
            params = self.sample_params(b, h, w, dev)
        out_h, out_w = self.size
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        if b == 0:
            # affine_grid rejects an empty batch (e.g. a drop_last=False tail).
            return batch_uint8.new_empty((0, c, out_h, out_w), dtype=self.out_dtype)
        theta = self.theta(params, h, w)
        grid = F.affine_grid(theta, [b, c, out_h, out_w], align_corners=False)
        # One uint8 -> float32 conversion; see the module docstring for why float32.
        out = F.grid_sample(
            batch_uint8.float(), grid, mode="bilinear", padding_mode="border", align_corners=False
        )
        if self.degrees > 0 or explicit:  # black outside the image (unrotated crops sample inside it)
            inside = (grid.abs() <= 1.0).all(dim=-1).unsqueeze(1)
            out = out * inside
        out = torch.addcmul(self._add.float().view(1, -1, 1, 1), out, self._mul.float().view(1, -1, 1, 1))
        return out.to(dtype=self.out_dtype, memory_format=memory_format)
