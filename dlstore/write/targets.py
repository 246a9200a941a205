"""A sample's named fields from its source's frame (the stored file) to the cache image's frame."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dlstore.errors import SourceError
from dlstore.spec import FieldSpec, ImagePolicy
from dlstore.write.geometry import Geometry, place_boxes, place_mask
from dlstore.write.imageops import target_size


def place_targets(
    raw: dict[str, Any], fields: dict[str, FieldSpec], geometry: Geometry, policy: ImagePolicy, where: str
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(rows by field, boxes dropped per boxes field) of a sample; a field left out of ``raw`` is empty."""
    target = target_size(geometry.oriented_size, policy)
    rows: dict[str, np.ndarray] = {}
    kept: dict[str, np.ndarray] = {}
    dropped: dict[str, int] = {}
    for name, f in fields.items():
        value = raw.get(name)
        try:
            if f.kind == "boxes":
                boxes = np.zeros((0, 4)) if value is None else np.asarray(value, np.float64).reshape(-1, 4)
                rows[name], kept[name] = place_boxes(boxes, geometry, target, policy)
                dropped[name] = len(boxes) - len(kept[name])
            elif f.kind == "mask":
                mask = np.zeros(geometry.size[::-1], f.dtype) if value is None else np.asarray(value)
                rows[name] = place_mask(check_ids(mask, f), geometry, target, policy)
            elif f.kind == "values":
                rows[name] = np.asarray(0 if value is None else value, f.dtype).reshape(f.shape)
            elif f.kind == "json":
                rows[name] = np.frombuffer(json.dumps(value).encode(), np.uint8)
        except (ValueError, TypeError) as e:
            raise SourceError(f"{where}: field {name!r} ({f.kind}): {e}") from None
    for name, f in fields.items():
        if f.kind == "ragged":
            value = np.zeros((0, *f.shape)) if raw.get(name) is None else np.asarray(raw[name])
            rows[name] = np.asarray(value, f.dtype).reshape(-1, *f.shape)[kept[f.follows]]  # type: ignore[index]
    return rows, dropped


def check_ids(mask: np.ndarray, f: FieldSpec) -> np.ndarray:
    """An (H, W) integer mask whose ids fit the field's dtype (never a silent wrap-around)."""
    if mask.ndim != 2 or mask.dtype.kind not in "ui" and mask.dtype != bool:
        raise ValueError(f"a mask is an (H, W) array of integer ids, got {mask.dtype}{mask.shape}")
    if mask.size and (int(mask.min()) < 0 or int(mask.max()) > np.iinfo(f.dtype).max):
        raise ValueError(f"ids {int(mask.min())}..{int(mask.max())} do not fit {f.dtype}; declare uint16")
    return mask.astype(f.dtype, copy=False)


def empty_targets(fields: dict[str, FieldSpec], image_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The rows of a sample skipped as undecodable (no dataset index maps to it): empty, zero."""
    rows: dict[str, np.ndarray] = {}
    for name, f in fields.items():
        if f.kind in ("boxes", "ragged"):
            rows[name] = np.zeros((0, *f.row_shape), f.dtype)
        elif f.kind == "mask":
            rows[name] = np.zeros(image_shape[:2], f.dtype)
        elif f.kind == "values":
            rows[name] = np.zeros(f.shape, f.dtype)
        elif f.kind == "json":
            rows[name] = np.frombuffer(b"null", np.uint8)
    return rows
