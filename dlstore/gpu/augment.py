"""Batched, on-device image augmentation for uint8 batches.

Decoding workers hand over ``(B, C, H, W)`` ``torch.uint8`` batches; everything
after that (random resized crop, horizontal flip, rotation, scaling to ``[0, 1]``
and normalisation) runs here, on whatever device the batch lives on, as a few
large batched kernels instead of per-image CPU work.

Usage in a training loop::

    import torch
    from dlstore.gpu import GpuAugment

    aug = GpuAugment(
        224, degrees=15,
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
        out_dtype=torch.bfloat16, channels_last=True,
    ).to("cuda")
    for images, labels in loader:            # images: uint8 (B, 3, H, W) on CPU
        x = aug(images.cuda(non_blocking=True))
        loss = criterion(model(x), labels.cuda(non_blocking=True))

Geometry, in one place:

* The crop/flip/rotation are fused into one ``affine_grid`` + ``grid_sample``
  (bilinear, ``align_corners=False``). ``align_corners=False`` is the convention
  of ``torch.nn.functional.interpolate`` and therefore of torchvision's
  ``resized_crop(..., antialias=False)``: pixel ``i`` covers ``[i, i + 1)`` and the
  crop ``[left, left + w)`` maps exactly onto the output's extent.
* The composite equals torchvision's ``RandomResizedCrop -> RandomHorizontalFlip
  -> RandomRotation`` with one difference: when rotating, output corners that
  fall outside the *crop* but inside the *image* show the real surrounding
  pixels rather than black fill (only the parts outside the image are black).
* ``padding_mode='border'`` is used, and samples whose location lies outside the
  image's extent are then zeroed. ``border`` makes the half-pixel fringe of an
  up-scaled crop touching the image edge replicate the edge pixel, exactly like
  ``interpolate`` does (``'zeros'`` would blend it with black and darken the
  outermost output row/column). The explicit mask keeps the rotation fill black
  (``fill=0`` in torchvision terms) instead of smearing edge pixels into the
  corners. Without rotation the mask is all ones.
* No antialiasing: down-scaling a large crop aliases exactly like
  ``antialias=False`` in torchvision.

Numerics: the uint8 input is converted once to float32 (not to ``out_dtype``)
and resampled in float32 because ``grid_sample`` interpolates in the grid's
dtype; bf16 sampling coordinates have ~8 significant bits, i.e. errors of
around a pixel at 224 px. ``/255`` and normalisation are folded into a single
per-channel multiply-add on the (usually smaller) output, which is then cast to
``out_dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dlstore.gpu.target_geometry import crop_boxes, crop_masks, mask_batch, move_target, rotate_masks

__all__ = ["AugmentParams", "GpuAugment", "normalize"]

# torchvision's RandomResizedCrop.get_params makes exactly this many attempts.
_CROP_ATTEMPTS = 10


@dataclass(frozen=True)
class AugmentParams:
    """Per-sample augmentation parameters; every field is a ``(B,)`` tensor.

    ``top``/``left``/``height``/``width`` (int64) describe the crop in input
    pixels with torchvision's ``(i, j, h, w)`` meaning. ``flip`` (bool) selects a
    horizontal flip of the output, ``angle`` (float32, degrees) a
    counter-clockwise rotation of the output about its centre, as in
    ``torchvision.transforms.functional.rotate``.
    """

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
    """Return ``(batch_uint8 / 255 - mean) / std`` as ``out_dtype``.

    For batches that need no geometric augmentation (e.g. validation after a
    CPU-side centre crop)::

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


class GpuAugment(torch.nn.Module):
    """RandomResizedCrop + horizontal flip + rotation + normalise, batched.

    Args:
        size: output ``(height, width)``, or one int for a square output.
        scale: range of the crop area as a fraction of the image area.
        ratio: range of the crop aspect ratio (width / height), sampled
            log-uniformly.
        hflip_p: probability of a horizontal flip per sample.
        degrees: rotation angle drawn uniformly from ``[-degrees, degrees]``.
        mean, std: per-channel statistics in ``[0, 1]`` units, as for
            ``torchvision.transforms.Normalize``; without them the output is
            just scaled to ``[0, 1]``.
        out_dtype: ``torch.float32``, ``torch.bfloat16`` or another float dtype.
        channels_last: return the output in ``torch.channels_last`` layout.
        generator: RNG for all random draws; it must live on the device of the
            batches (a CUDA generator for CUDA batches). ``None`` uses the
            device's default generator.

    The crop distribution is that of ``torchvision.transforms.RandomResizedCrop``
    (same 10 attempts and same central-crop fallback), drawn for the whole
    batch at once on the batch's device, so ``forward`` never synchronises
    with the host.

    Example::

        aug = GpuAugment(224, degrees=15, mean=(0.485, 0.456, 0.406),
                         std=(0.229, 0.224, 0.225)).to("cuda")
        x = aug(images.cuda(non_blocking=True))   # float32 (B, 3, 224, 224)

    The configuration is fixed at construction; build a new module to change it.
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
        scale_t = (float(scale[0]), float(scale[1]))
        ratio_t = (float(ratio[0]), float(ratio[1]))
        if not 0.0 < scale_t[0] <= scale_t[1]:
            raise ValueError(f"scale must satisfy 0 < min <= max, got {scale!r}")
        if not 0.0 < ratio_t[0] <= ratio_t[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio!r}")
        if not 0.0 <= hflip_p <= 1.0:
            raise ValueError(f"hflip_p must be in [0, 1], got {hflip_p!r}")
        if degrees < 0:
            raise ValueError(f"degrees must be >= 0, got {degrees!r}")
        if not out_dtype.is_floating_point:
            raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
        self.size: tuple[int, int] = _pair(size)
        self.scale: tuple[float, float] = scale_t
        self.ratio: tuple[float, float] = ratio_t
        self.hflip_p: float = float(hflip_p)
        self.degrees: float = float(degrees)
        self.out_dtype: torch.dtype = out_dtype
        self.channels_last: bool = bool(channels_last)
        self.generator: torch.Generator | None = generator
        self.normalized: bool = mean is not None
        mul, add = _channel_affine(mean, std)
        # Buffers so that .to(device) moves them; non-persistent because they
        # are configuration, not state to checkpoint.
        self._mul: torch.Tensor
        self._add: torch.Tensor
        self.register_buffer("_mul", mul, persistent=False)
        self.register_buffer("_add", add, persistent=False)

    def extra_repr(self) -> str:
        return (
            f"size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"hflip_p={self.hflip_p}, degrees={self.degrees}, normalized={self.normalized}, "
            f"out_dtype={self.out_dtype}, channels_last={self.channels_last}"
        )

    def _rand(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, device=device)

    def _fallback_crop(self, height: int, width: int) -> tuple[int, int, int, int]:
        # Verbatim torchvision fallback; pure host arithmetic on Python ints.
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def sample_params(
        self,
        batch_size: int,
        height: int,
        width: int,
        device: torch.device | str | None = None,
    ) -> AugmentParams:
        """Draw per-sample parameters for ``batch_size`` images of ``height x width``.

        All draws are single batched calls on ``device``; ``forward`` makes the
        same calls in the same order, so resetting the generator and calling
        this reproduces what ``forward`` used.
        """
        if height <= 0 or width <= 0:
            raise ValueError(f"image size must be positive, got {height}x{width}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        b = batch_size
        area = float(height * width)
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        s_lo, s_hi = self.scale

        # All 10 attempts for every sample at once; rows are samples.
        target_area = area * (s_lo + (s_hi - s_lo) * self._rand(b, _CROP_ATTEMPTS, device=dev))
        aspect = torch.exp(log_lo + (log_hi - log_lo) * self._rand(b, _CROP_ATTEMPTS, device=dev))
        # torch.round rounds half to even, like Python's round() in torchvision.
        w_c = torch.round(torch.sqrt(target_area * aspect)).long()
        h_c = torch.round(torch.sqrt(target_area / aspect)).long()
        valid = (w_c > 0) & (w_c <= width) & (h_c > 0) & (h_c <= height)
        # argmax returns the first maximal index, i.e. the first valid attempt.
        first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)
        any_valid = valid.any(dim=1)
        h_acc = h_c.gather(1, first).squeeze(1)
        w_acc = w_c.gather(1, first).squeeze(1)

        # randint(0, n + 1) as floor(U * (n + 1)); the clamp guards against
        # U * (n + 1) rounding up to n + 1 in float32.
        u_top = self._rand(b, device=dev)
        u_left = self._rand(b, device=dev)
        top_acc = torch.minimum((u_top * (height - h_acc + 1)).long(), height - h_acc)
        left_acc = torch.minimum((u_left * (width - w_acc + 1)).long(), width - w_acc)

        fb_top, fb_left, fb_h, fb_w = self._fallback_crop(height, width)

        def pick(acc: torch.Tensor, fallback: int) -> torch.Tensor:
            return torch.where(any_valid, acc, torch.full_like(acc, fallback))

        flip = self._rand(b, device=dev) < self.hflip_p
        angle = (2.0 * self._rand(b, device=dev) - 1.0) * self.degrees
        return AugmentParams(
            top=pick(top_acc, fb_top),
            left=pick(left_acc, fb_left),
            height=pick(h_acc, fb_h),
            width=pick(w_acc, fb_w),
            flip=flip,
            angle=angle,
        )

    def theta(self, params: AugmentParams, height: int, width: int) -> torch.Tensor:
        """Return the ``(B, 2, 3)`` float32 ``affine_grid`` matrices for ``params``.

        Maps output coordinates (normalised, ``align_corners=False``) to input
        coordinates: rotate in output *pixel* space (so the rotation is rigid
        even when the crop is resized anisotropically), flip, scale onto the
        crop, translate to the crop centre.
        """
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
        theta = torch.stack(
            [
                torch.stack([sign * cos * w_frac, -sign * sin * w_frac * (out_h / out_w), cx], dim=-1),
                torch.stack([sin * h_frac * (out_w / out_h), cos * h_frac, cy], dim=-1),
            ],
            dim=-2,
        )
        return theta

    def forward(
        self,
        batch_uint8: torch.Tensor,
        params: AugmentParams | None = None,
        target: dict[str, Any] | None = None,
    ) -> Any:
        """Augment a ``(B, C, H, W)`` uint8 batch; returns ``(B, C, *size)`` in ``out_dtype``.

        ``params`` overrides the random draw (for tests or replaying an
        augmentation); otherwise ``sample_params`` is called on the batch's
        device. With ``target`` (a collated dict of a cache with fields,
        ``dlstore.read.collate_fields``) returns ``(images, target)`` with its
        masks and boxes moved by each sample's own crop, flip and rotation
        (``dlstore.gpu.target_geometry``).
        """
        if target is None:
            return self._images(batch_uint8, params)[0]
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
        return self._images(batch_uint8, p, explicit=not drawn)[0], moved

    def _images(
        self, batch_uint8: torch.Tensor, params: AugmentParams | None, explicit: bool | None = None
    ) -> tuple[torch.Tensor, AugmentParams, bool]:
        """(the augmented batch, the parameters used, whether any sample is rotated); ``explicit``:
        the parameters were given by the caller (default: whether ``params`` is given)."""
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
            return batch_uint8.new_empty((0, c, out_h, out_w), dtype=self.out_dtype), params, False
        theta = self.theta(params, h, w)
        grid = F.affine_grid(theta, [b, c, out_h, out_w], align_corners=False)
        # One uint8 -> float32 conversion; see the module docstring for why float32.
        out = F.grid_sample(
            batch_uint8.float(), grid, mode="bilinear", padding_mode="border", align_corners=False
        )
        # Black outside the image (rotation fill); 'border' only serves the
        # half-pixel fringe inside it. All ones when nothing is rotated.
        if self.degrees > 0 or explicit:  # unrotated crops sample only inside the image
            inside = (grid.abs() <= 1.0).all(dim=-1).unsqueeze(1)
            out = out * inside
        mul = self._mul.float().view(1, -1, 1, 1)
        add = self._add.float().view(1, -1, 1, 1)
        out = torch.addcmul(add, out, mul)
        rotated = self.degrees > 0 or (explicit and bool((params.angle != 0).any()))
        return out.to(dtype=self.out_dtype, memory_format=memory_format), params, rotated
