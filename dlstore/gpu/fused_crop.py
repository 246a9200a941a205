"""One Triton kernel for the ragged crop: bilinear gather + normalise + cast, written straight into the
output batch (any memory format). The PyTorch path (``ragged.bilinear_gather``) moves ~3 GB per
256×224² batch (~3 ms beside the training step); this reads each output pixel's four neighbours and
writes it once, at the same positions in the same lerp order. Used on CUDA when Triton imports.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Triton ships with torch's CUDA wheels; absent (or broken) elsewhere
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

BLOCK = 256
PARAMS = 8  # columns of the per-image parameter rows (ragged.PARAM_COLUMNS)
# Set when the kernel failed to build or launch once (e.g. no C compiler for Triton's launcher): the
# PyTorch path is used from then on, with one warning.
_BROKEN: list[str] = []


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run on ``device``."""
    return triton is not None and device.type == "cuda" and not _BROKEN


def try_fused_crop(*args: Any) -> torch.Tensor | None:
    """``fused_crop(*args)``, or None (and never again in this process) when Triton cannot run it."""
    try:
        return fused_crop(*args)
    except Exception as e:  # compiler/driver problems surface here, at the first launch
        import warnings

        _BROKEN.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"dlstore: the fused crop kernel failed ({_BROKEN[0]}); using the PyTorch path", stacklevel=2
        )
        return None


if triton is not None:

    @triton.jit
    def _crop_kernel(
        flat,
        rows,  # not "params": Triton's generated argument binder has a dict of that name (3.6/3.7)
        mul,
        add,
        out,
        out_h,
        out_w,
        s_b,
        s_c,
        s_h,
        s_w,
        C: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ) -> None:
        b = tl.program_id(0)
        p = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = p < out_h * out_w
        y = p // out_w
        x = p % out_w
        row = rows + b * 8  # len(ragged.PARAM_COLUMNS): a literal, Triton kernels read no Python globals
        start = tl.load(row)
        h = tl.load(row + 1)
        w = tl.load(row + 2)
        top = tl.load(row + 3)
        left = tl.load(row + 4)
        crop_h = tl.load(row + 5)
        crop_w = tl.load(row + 6)
        flip = tl.load(row + 7)
        # ragged.crop_coords, per pixel: the same float32 operations in the same order (up to fused
        # multiply-adds: positions may differ in the last bit, pixels by ~1e-3 levels)
        xs = tl.where(flip != 0, out_w - 1 - x, x).to(tl.float32)
        fx = left.to(tl.float32) + (xs + 0.5) * (crop_w.to(tl.float32) / out_w) - 0.5
        fy = top.to(tl.float32) + (y.to(tl.float32) + 0.5) * (crop_h.to(tl.float32) / out_h) - 0.5
        fx = tl.minimum(tl.maximum(fx, left.to(tl.float32)), (left + crop_w - 1).to(tl.float32))
        fy = tl.minimum(tl.maximum(fy, top.to(tl.float32)), (top + crop_h - 1).to(tl.float32))
        x0f = tl.floor(fx)
        y0f = tl.floor(fy)
        wx = fx - x0f
        wy = fy - y0f
        x0 = x0f.to(tl.int64)
        y0 = y0f.to(tl.int64)
        x1 = tl.minimum(x0 + 1, w - 1)
        y1 = tl.minimum(y0 + 1, h - 1)
        for c in tl.static_range(C):
            base = start + c * h * w
            v00 = tl.load(flat + base + y0 * w + x0, mask=inside, other=0).to(tl.float32)
            v01 = tl.load(flat + base + y0 * w + x1, mask=inside, other=0).to(tl.float32)
            v10 = tl.load(flat + base + y1 * w + x0, mask=inside, other=0).to(tl.float32)
            v11 = tl.load(flat + base + y1 * w + x1, mask=inside, other=0).to(tl.float32)
            top_row = v00 + wx * (v01 - v00)
            bottom_row = v10 + wx * (v11 - v10)
            v = top_row + wy * (bottom_row - top_row)
            v = v * tl.load(mul + c) + tl.load(add + c)
            dst = out + b * s_b + c * s_c + y * s_h + x * s_w
            tl.store(dst, v.to(out.dtype.element_ty), mask=inside)


def fused_crop(
    flat: torch.Tensor,
    params: torch.Tensor,
    channels: int,
    mul: torch.Tensor,
    add: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill ``out`` (B, C, out_h, out_w), any strides and floating dtype, with each image's crop as
    its row of ``params`` ((B, 8) ``ragged.PARAM_COLUMNS``) says, as ``bilinear_gather`` samples it,
    times ``mul`` plus ``add`` per channel. One launch."""
    b, c, out_h, out_w = out.shape
    grid: Any = (b, triton.cdiv(out_h * out_w, BLOCK))
    _crop_kernel[grid](
        flat,
        params.contiguous(),
        mul.float().reshape(-1).contiguous(),
        add.float().reshape(-1).contiguous(),
        out,
        out_h,
        out_w,
        *out.stride(),
        C=channels,
        BLOCK_SIZE=BLOCK,
    )
    return out
