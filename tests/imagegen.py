"""Synthetic test images covering the modes, sizes and orientations users meet (importable by tests)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

ORIENT_TAG = 0x0112


def smooth_rgb(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Photo-like: smooth colour field plus a little noise, so JPEG and resize behave realistically."""
    low = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.int16)
    img = img + rng.normal(0, 6, img.shape).astype(np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image(kind: str, rng: np.random.Generator) -> tuple[Image.Image, str]:
    """One image of a given kind and the file suffix to save it with."""
    h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
    rgb = smooth_rgb(rng, h, w)
    if kind == "rgb_jpg":
        return Image.fromarray(rgb), ".jpg"
    if kind == "rgb_png":
        return Image.fromarray(rgb), ".png"
    if kind == "big_jpg":  # ≥ 4x the target: exercises draft()
        return Image.fromarray(smooth_rgb(rng, 300, 410)), ".jpg"
    if kind == "grey_png":
        return Image.fromarray(rgb).convert("L"), ".png"
    if kind == "rgba_png":
        alpha = rng.integers(0, 256, (h, w), dtype=np.uint8)
        return Image.fromarray(np.dstack([rgb, alpha]), "RGBA"), ".png"
    if kind == "la_png":
        return Image.fromarray(rgb).convert("LA"), ".png"
    if kind == "p_trns_png":
        p = Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=16)
        p.info["transparency"] = 3
        return p, ".png"
    if kind == "cmyk_jpg":
        return Image.fromarray(rgb).convert("CMYK"), ".jpg"
    if kind == "bilevel_png":
        return Image.fromarray(rgb).convert("1"), ".png"
    if kind == "i16_png":
        return Image.fromarray(rgb[..., 0].astype(np.uint16) * 257), ".png"
    if kind == "bmp":
        return Image.fromarray(rgb), ".bmp"
    if kind == "webp":
        return Image.fromarray(rgb), ".webp"
    raise ValueError(kind)


KINDS = (
    "rgb_jpg",
    "rgb_png",
    "big_jpg",
    "grey_png",
    "rgba_png",
    "la_png",
    "p_trns_png",
    "cmyk_jpg",
    "bilevel_png",
    "i16_png",
    "bmp",
    "webp",
)


def save(img: Image.Image, path: Path, **kw: object) -> None:
    if path.suffix == ".png" and "transparency" in img.info:
        kw.setdefault("transparency", img.info["transparency"])
    img.save(path, quality=92, **kw) if path.suffix == ".jpg" else img.save(path, **kw)


def jpeg_bytes(arr: np.ndarray, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=92, **kw)
    return buf.getvalue()
