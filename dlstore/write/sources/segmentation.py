"""``seg:IMAGES:MASKS``: images and masks in two folders matched by relative path without the
extension (VOC, Cityscapes-style). Each image gets the field ``mask`` (its ids as stored; uint16 for
16-bit masks), moved with the image (nearest); an image without a mask goes to ``skipped.json``.

    dlstore convert seg:VOC2012/JPEGImages:VOC2012/SegmentationClass cache/ --size 512"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dlstore.errors import ImageDecodeError, SourceError
from dlstore.sourcefiles import IMAGE_EXTENSIONS
from dlstore.spec import FieldSpec
from dlstore.write.sources.folder import ListedSource, split_spec
from dlstore.write.sources.registry import SourceArgs, register_source

PREFIX = "seg:"


@register_source
@dataclass
class SegmentationSource(ListedSource):
    claim_order = 22
    form = "seg:IMAGES_DIR:MASKS_DIR (images and masks matched by name)"

    mask_root: Path = Path(".")
    mask_names: list[str] | None = None

    @classmethod
    def claims(cls, text: str) -> bool:
        return text.startswith(PREFIX)

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> SegmentationSource:
        parts = split_spec(text, PREFIX).split(":")
        if len(parts) != 2 or not all(parts):
            raise SourceError(f"{text}: give seg:IMAGES_DIR:MASKS_DIR (two folders)")
        images, masks = Path(parts[0]), Path(parts[1])
        for d in (images, masks):
            if not d.is_dir():
                raise SourceError(f"{d}: not a directory (from {text}); give seg:IMAGES_DIR:MASKS_DIR")
        by_stem = {strip(p, masks): p for p in files(masks)}
        pairs = [(p, by_stem.get(strip(p, images))) for p in files(images)]
        names = [p.relative_to(images).as_posix() for p, m in pairs if m is not None]
        mask_names = [m.relative_to(masks).as_posix() for _, m in pairs if m is not None]
        unmatched = [
            (str(p), f"no mask named {strip(p, images)}.* under {masks}") for p, m in pairs if m is None
        ]
        if not names:
            raise SourceError(f"{text}: no image under {images} has a mask of the same name under {masks}")
        with Image.open(masks / mask_names[0]) as first:
            deep = first.mode in ("I;16", "I;16B", "I;16L", "I")  # 16-bit masks
        fields = {"mask": FieldSpec("mask", "uint16" if deep else "uint8")}
        return cls.listed(
            images,
            names,
            fields,
            "seg",
            text,
            mask_root=masks.resolve(),
            mask_names=mask_names,
            scan_errors=unmatched,
        )

    def raw_targets(self, i: int) -> dict[str, Any]:
        path = self.mask_root / self.mask_names[i]  # type: ignore[index]
        try:
            with Image.open(path) as m:
                arr = np.asarray(m)
        except (OSError, ValueError) as e:
            raise ImageDecodeError(f"{path}: cannot read mask ({type(e).__name__}: {e})") from e
        if arr.ndim == 3:  # an RGB(A) "mask": only its first channel is taken as ids
            arr = arr[:, :, 0]
        return {"mask": arr}

    def targets_fingerprint(self) -> str:
        h = hashlib.sha256()
        for name in self.mask_names or []:
            st = os.stat(self.mask_root / name)
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"mask_names": [self.mask_names[i] for i in idx]}  # type: ignore[index]


def files(root: Path) -> list[Path]:
    """Image files under ``root`` (any depth), sorted, hidden ones skipped."""
    out = []
    for dirpath, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if not n.startswith(".") and n.lower().endswith(IMAGE_EXTENSIONS):
                out.append(Path(dirpath) / n)
    return out


def strip(path: Path, root: Path) -> str:
    """The relative path without its extension: what an image and its mask share."""
    return path.relative_to(root).with_suffix("").as_posix()
