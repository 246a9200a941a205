"""Decode, orient, convert and pre-resize one image. Pure functions over Pillow; no torch.

The pixel contract: for ``resize="crop"`` the result equals torchvision ``Resize(size)`` followed by
``CenterCrop(size)`` on the PIL image (antialiased bilinear), except that a JPEG at least twice the
target is decoded with ``Image.draft`` (DCT scaling), which stays within a mean of 2 levels of it.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from dlstore.errors import ImageDecodeError
from dlstore.spec import ImagePolicy

# Decoders Pillow may use. Anything else (EPS → Ghostscript, PDF, ...) is never opened.
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "TGA", "ICO", "DIB")
# What Pillow's own fuzzers treat as the normal outcome of bad input.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    MemoryError,
    NotImplementedError,
    OverflowError,
    EOFError,
    IndexError,
    struct.error,
    zlib.error,
    Image.DecompressionBombError,
    Image.DecompressionBombWarning,
)
_ALPHA_MODES = {"RGBA", "LA", "PA", "La", "RGBa"}
_SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}


def decode_file(path: Path | str, policy: ImagePolicy) -> np.ndarray:
    """Decode one image file into a (size, size, channels) uint8 array, or raise ImageDecodeError."""
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1x and 2x its pixel limit; a cache build treats both as bombs.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=ALLOWED_FORMATS) as img:
                if img.format == "PNG":
                    check_png_chunks(path)
                if policy.draft and img.format == "JPEG":
                    _draft(img, policy)
                img.load()
                return prepare(img, policy)
    except DECODE_ERRORS as e:
        raise ImageDecodeError(f"{path}: cannot decode image ({type(e).__name__}: {e})") from e


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png_chunks(path: Path | str) -> None:
    """Pillow skips the CRC of IDAT chunks and does not need IEND, so a corrupted or cut-off PNG can
    decode to damaged pixels silently; walk the chunks (streamed, bounded memory) and refuse it."""
    with open(path, "rb") as f:
        if f.read(8) != _PNG_SIGNATURE:
            raise SyntaxError("not a PNG signature")
        while True:
            head = f.read(8)
            if len(head) < 8:
                raise EOFError("PNG ends without an IEND chunk (truncated)")
            length, kind = struct.unpack(">I4s", head)
            crc = zlib.crc32(kind)
            left = length
            while left:
                block = f.read(min(left, 1 << 20))
                if not block:
                    raise EOFError(f"PNG chunk {kind!r} is cut off (truncated)")
                crc, left = zlib.crc32(block, crc), left - len(block)
            stored = f.read(4)
            if len(stored) < 4 or struct.unpack(">I", stored)[0] != crc:
                raise SyntaxError(f"PNG chunk {kind!r} fails its CRC check (corrupted)")
            if kind == b"IEND":
                return


def prepare(img: Image.Image, policy: ImagePolicy) -> np.ndarray:
    """Orient, convert and resize an opened image according to the policy."""
    if policy.exif_transpose:
        img = ImageOps.exif_transpose(img) or img
    img = to_mode(img, policy)
    img = resize(img, policy)
    arr = np.asarray(img, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


def to_mode(img: Image.Image, policy: ImagePolicy) -> Image.Image:
    """Any Pillow mode → "RGB" (channels=3) or "L" (channels=1), with alpha composited."""
    if img.mode in _SIXTEEN_BIT_MODES:
        img = sixteen_to_eight(img)
    elif img.mode in ("1", "F"):
        img = img.convert("L")  # 1-bit → 0/255; float clips to 0..255 as Pillow does
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        img = composite(img, policy.background)
    target = "RGB" if policy.channels == 3 else "L"
    return img if img.mode == target else img.convert(target)


def sixteen_to_eight(img: Image.Image) -> Image.Image:
    """Scale 16-bit samples to 8 bits (Pillow's own convert would clip a 0..65535 ramp to 2 levels)."""
    a = np.asarray(img).astype(np.int64)
    a = np.clip(a, 0, 65535)
    return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), mode="L")


def composite(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Alpha-composite over an opaque background colour, keeping grey images grey."""
    rgba = img.convert("RGBA")
    bg = Image.new("RGBA", rgba.size, (*background, 255))
    out = Image.alpha_composite(bg, rgba).convert("RGB")
    return out.convert("L") if img.mode in ("LA", "La") else out


def resize(img: Image.Image, policy: ImagePolicy) -> Image.Image:
    n = policy.size
    if policy.resize == "stretch":
        return img if img.size == (n, n) else img.resize((n, n), Image.BILINEAR)
    if policy.resize == "pad":
        return _pad(img, n)
    return _center_crop(_resize_short(img, n), n)


def _resize_short(img: Image.Image, n: int) -> Image.Image:
    # torchvision's _compute_resized_output_size, so the pixels match Resize(n) exactly.
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = n, int(n * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return img if (new_w, new_h) == (w, h) else img.resize((new_w, new_h), Image.BILINEAR)


def _center_crop(img: Image.Image, n: int) -> Image.Image:
    w, h = img.size
    top, left = int(round((h - n) / 2.0)), int(round((w - n) / 2.0))
    return img.crop((left, top, left + n, top + n))


def _pad(img: Image.Image, n: int) -> Image.Image:
    w, h = img.size
    scale = n / max(w, h)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BILINEAR)
    out = Image.new(img.mode, (n, n), 0)
    out.paste(img, ((n - new_w) // 2, (n - new_h) // 2))
    return out


def _draft(img: Image.Image, policy: ImagePolicy) -> None:
    """DCT-scale a large JPEG while decoding, keeping every side the resize needs at ≥ 2× target."""
    w, h = img.size
    n2 = 2 * policy.size
    if policy.resize == "pad":
        scale = n2 / max(w, h)
        request = (max(1, int(np.ceil(w * scale))), max(1, int(np.ceil(h * scale))))
    else:
        request = (n2, n2)
    if w >= 2 * request[0] and h >= 2 * request[1]:
        img.draft(None, request)


def array_to_image(arr: np.ndarray) -> Image.Image:
    """An in-memory sample (H,W) or (H,W,C) uint8 from a torchvision dataset → PIL image."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(arr))
