"""Decode, orient, convert and pre-resize one image (Pillow). ``decode="exact"`` equals torchvision
``Resize`` (+ ``CenterCrop``) pixel for pixel; ``"fast"`` lets libjpeg DCT-scale a large JPEG while it
keeps ``FAST_MARGIN`` times the pixels needed, then resizes from the exact source box."""

from __future__ import annotations

import io
import struct
import warnings
import zlib
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from dlstore.errors import ImageDecodeError
from dlstore.spec import ImagePolicy
from dlstore.write.geometry import Geometry, fit_offset

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
# Decoded side ≥ this many times the resize target for DCT scaling (benchmarks/decode_accuracy.py).
FAST_MARGIN = 3.0
ORIENTATION_TAG = 0x0112
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ALPHA_MODES = {"RGBA", "LA", "PA", "La", "RGBa"}
_SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}


def decode_file(path: Path | str, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
    """One image file → a (size, size, channels) uint8 array, or ImageDecodeError naming ``path``."""
    return decode_with_geometry(path, policy, data, geometry=False)[0]


def decode_with_geometry(
    path: Path | str, policy: ImagePolicy, data: bytes | None = None, geometry: bool = True
) -> tuple[np.ndarray, Geometry | None]:
    """``decode_file``, and (``geometry``) the stored size and EXIF orientation its fields follow."""
    stream = path if data is None else io.BytesIO(data)
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1x and 2x its pixel limit; a cache build treats both as bombs.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(stream, formats=ALLOWED_FORMATS) as img:
                if img.format == "PNG":
                    check_png_chunks(path if data is None else io.BytesIO(data))
                seen = image_geometry(img, policy) if geometry else None
                if policy.decode == "fast" and img.format == "JPEG" and draft_scale(img.size, policy) > 1:
                    return decode_drafted(img, policy), seen
                img.load()
                return prepare(img, policy), seen
    except DECODE_ERRORS as e:
        hint = ""
        if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
            hint = "; if it is a real photograph, raise the limit with --max-megapixels"
        reason = str(e).replace(repr(stream), repr(str(path)))  # Pillow names the stream it was given
        raise ImageDecodeError(f"{path}: cannot decode image ({type(e).__name__}: {reason}){hint}") from e


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png_chunks(path: Path | str | BinaryIO) -> None:
    """Pillow skips IDAT CRCs and needs no IEND, so a damaged PNG decodes silently: walk the chunks."""
    with open(path, "rb") if isinstance(path, (str, Path)) else nullcontext(path) as f:
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


def image_geometry(img: Image.Image, policy: ImagePolicy) -> Geometry:
    """The stored size and the orientation ``prepare`` will apply (1 when none)."""
    orientation = img.getexif().get(ORIENTATION_TAG, 1) if policy.exif_transpose else 1
    return Geometry(img.size, orientation if orientation in _TRANSPOSE else 1)


def prepare(img: Image.Image, policy: ImagePolicy) -> np.ndarray:
    """Orient, convert and resize an opened image according to the policy (the exact path)."""
    if policy.pixels == "torchvision":
        rgb = img.convert("RGB")  # ImageFolder's loader (no EXIF, alpha dropped), then Grayscale
        return as_array(resize(rgb if policy.channels == 3 else rgb.convert("L"), policy))
    if policy.exif_transpose:
        img = ImageOps.exif_transpose(img) or img
    img = to_mode(img, policy)
    return as_array(resize(img, policy))


def as_array(img: Image.Image) -> np.ndarray:
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
    """Resize to ``target_size`` (antialiased bilinear), then crop or pad to ``size``²."""
    target = target_size(img.size, policy)
    if target != img.size:
        img = img.resize(target, Image.BILINEAR)
    return fit(img, policy)


def target_size(size: tuple[int, int], policy: ImagePolicy) -> tuple[int, int]:
    """The size the image is resized to before crop/pad (symmetric in w and h)."""
    w, h = size
    n = policy.size
    if policy.resize == "stretch":
        return n, n
    if policy.resize == "pad":
        scale = n / max(w, h)
        return max(1, round(w * scale)), max(1, round(h * scale))
    return shorter_side_size((w, h), n, policy.max_side if policy.resize == "shorter" else None)


def shorter_side_size(size: tuple[int, int], n: int, max_side: int | None = None) -> tuple[int, int]:
    """(w, h) after torchvision ``Resize(n, max_size=max_side)`` (its _compute_resized_output_size)."""
    w, h = size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = n, int(n * long / short)
    if max_side is not None and new_long > max_side:
        new_short, new_long = int(max_side * new_short / new_long), max_side
    return (new_short, new_long) if w <= h else (new_long, new_short)


def fit(img: Image.Image, policy: ImagePolicy) -> Image.Image:
    """The resized image → ``size``²: centre crop, centred pad, or as is (``geometry.fit_offset``)."""
    if policy.resize not in ("crop", "pad"):
        return img
    (left, top), n = fit_offset(img.size, policy), policy.size
    if policy.resize == "crop":
        return img.crop((-left, -top, n - left, n - top))
    out = Image.new(img.mode, (n, n), 0)
    out.paste(img, (left, top))
    return out


def draft_scale(size: tuple[int, int], policy: ImagePolicy, margin: float | None = None) -> int:
    """The largest DCT scale (8, 4, 2) keeping both sides ≥ ``margin`` × the target, else 1."""
    margin = FAST_MARGIN if margin is None else margin
    w, h = size
    tw, th = target_size(size, policy)
    for s in (8, 4, 2):
        if w / s >= margin * tw and h / s >= margin * th:
            return s
    return 1


def decode_drafted(img: Image.Image, policy: ImagePolicy) -> np.ndarray:
    """decode="fast": a DCT-scaled decode, resized with the exact source box, then oriented."""
    w, h = img.size
    scale = draft_scale((w, h), policy)
    orientation = img.getexif().get(ORIENTATION_TAG, 1) if policy.exif_transpose else 1
    used = img.draft(None, (w // scale, h // scale))
    box = used[1] if used is not None else (0, 0, w, h)
    img.load()
    img = to_mode(img, policy)
    img = img.resize(target_size((w, h), policy), Image.BILINEAR, box=box)
    method = _TRANSPOSE.get(orientation)
    return as_array(fit(img.transpose(method) if method is not None else img, policy))


def array_to_image(arr: np.ndarray) -> Image.Image:
    """An in-memory sample (H,W) or (H,W,C) uint8 from a torchvision dataset → PIL image."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(arr))
