"""``--field NAME=KEY[:KIND[:DTYPE]]``: a sample's extra columns or keys as named cache fields; each
kind says what KEY means (``field_form``) and gives sample i's value (``field_value``). KIND: values,
boxes (XYXY pixels), ragged (a row per box), mask (ids, the image's size), json; left out, read from
the first value, as the DTYPE (int64 / float32 / uint8; masks uint16 when ids exceed 255).

    dlstore convert data.parquet cache/ --size 256 --field tags=tags:values --field boxes=objects"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlstore.errors import SourceError
from dlstore.spec import FIELD_DTYPES, FIELD_KINDS, FieldSpec

__all__ = ["FieldRequest", "declare", "field_texts", "parse_field", "raw_value"]

KINDS = tuple(k for k in FIELD_KINDS if k != "class")
FORM = "NAME=KEY[:KIND[:DTYPE]]"


@dataclass(frozen=True)
class FieldRequest:
    """One ``--field``: field ``name`` from ``key``, its kind and dtype (None: read from a value)."""

    name: str
    key: str
    kind: str | None = None
    dtype: str | None = None

    @property
    def text(self) -> str:
        tail = "".join(f":{p}" for p in (self.kind, self.dtype) if p)
        return f"{self.name}={self.key}{tail}"


def parse_field(text: str) -> FieldRequest:
    """``NAME=KEY[:KIND[:DTYPE]]`` (``NAME`` alone: that key) → a request, or SourceError."""
    name, eq, rest = str(text).partition("=")
    name = name.strip()
    parts = (rest if eq else name).split(":")
    key = parts[0].strip()
    kind = parts[1].strip() if len(parts) > 1 and parts[1].strip() else None
    dtype = parts[2].strip() if len(parts) > 2 and parts[2].strip() else None
    if not name.isidentifier() or not key or len(parts) > 3:
        raise SourceError(f"--field {text!r}: expected {FORM}, e.g. tags=labels:values or mask=seg.png:mask")
    if kind is not None and kind not in KINDS:
        raise SourceError(f"--field {text!r}: KIND {kind!r} is not one of {', '.join(KINDS)}")
    if dtype is not None and dtype not in FIELD_DTYPES:
        raise SourceError(f"--field {text!r}: DTYPE {dtype!r} is not one of {', '.join(FIELD_DTYPES)}")
    return FieldRequest(name, key, kind, dtype)


def field_texts(given: Iterable[str] | Mapping[str, str] | None) -> tuple[str, ...]:
    """``ConvertOptions.fields``' one form, ``("NAME=KEY[:KIND[:DTYPE]]", ...)``, each parsed."""
    if not given:
        return ()
    if isinstance(given, str):
        given = [given]
    items = [f"{k}={v}" for k, v in given.items()] if isinstance(given, Mapping) else list(given)
    requests = [parse_field(t) for t in items]
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise SourceError(f"--field: a name is given twice ({', '.join(names)}); each field needs its own")
    return tuple(r.text for r in requests)


def requests_of(texts: Iterable[str]) -> tuple[FieldRequest, ...]:
    return tuple(parse_field(t) for t in texts)


def plain(value: Any) -> Any:
    """A tensor (tv_tensors included) as numpy; BoundingBoxes of any format as XYXY."""
    if type(value).__name__ == "BoundingBoxes" and hasattr(value, "format"):
        import torch
        from torchvision.ops import box_convert

        fmt = str(getattr(value.format, "name", value.format)).lower()
        boxes = value.as_subclass(torch.Tensor).detach().cpu()
        return (box_convert(boxes, fmt, "xyxy") if fmt != "xyxy" else boxes).numpy()
    if type(value).__name__ == "Mask" and getattr(value, "ndim", 0) == 3:
        return instance_ids(value.detach().cpu().numpy())
    if hasattr(value, "numpy") and hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return value


def instance_ids(masks: np.ndarray) -> np.ndarray:
    """Instance masks (N, H, W) as one (H, W) map of ids 1..N (later objects paint over earlier)."""
    ids = np.zeros(masks.shape[1:], np.int64)
    for k, m in enumerate(masks, 1):
        ids[m.astype(bool)] = k
    return ids


def declare(requests: Iterable[FieldRequest], first: Mapping[str, Any], where: str) -> dict[str, FieldSpec]:
    """Each request's kind and dtype, given or implied by its first value (``first[name]``)."""
    out: dict[str, FieldSpec] = {}
    requests = list(requests)
    boxes = [r.name for r in requests if (r.kind or guess_kind(first.get(r.name), r, where)) == "boxes"]
    for r in requests:
        value = plain(first.get(r.name))
        kind = r.kind or guess_kind(value, r, where)
        try:
            if kind == "ragged":
                if len(boxes) != 1:
                    raise SourceError(
                        f"{where}: --field {r.text}: a ragged field's rows follow the boxes field, and "
                        f"there are {len(boxes)} ({', '.join(boxes) or 'none'}); give exactly one :boxes"
                    )
                arr = np.asarray([] if value is None else value)
                out[r.name] = FieldSpec(
                    "ragged", r.dtype or number_dtype(arr, r), tuple(arr.shape[1:]), follows=boxes[0]
                )
            elif kind == "values":
                arr = np.asarray(0 if value is None else value)
                out[r.name] = FieldSpec("values", r.dtype or number_dtype(arr, r), tuple(arr.shape))
            elif kind == "mask":
                ids = mask_array(value) if value is not None else np.zeros(0)
                out[r.name] = FieldSpec(
                    "mask", r.dtype or ("uint16" if ids.size and int(ids.max()) > 255 else "uint8")
                )
            elif kind == "boxes":
                out[r.name] = FieldSpec("boxes", r.dtype or "float32")
            else:
                out[r.name] = FieldSpec("json", "uint8")
        except (ValueError, TypeError) as e:
            raise SourceError(f"{where}: --field {r.text}: {e}") from None
    return out


def described(target: Mapping[str, Any], where: str) -> tuple[FieldRequest, ...]:
    """The fields a target dict of tv_tensors describes (none without one); a key none can store fails."""
    if not any(type(v).__module__.startswith("torchvision.tv_tensors") for v in target.values()):
        return ()
    boxes = [plain(v) for v in target.values() if type(v).__name__ == "BoundingBoxes"]
    out = []
    for key, value in target.items():
        kind, arr = {"BoundingBoxes": "boxes", "Mask": "mask"}.get(type(value).__name__), plain(value)
        if kind is None and len(boxes) == 1 and isinstance(arr, np.ndarray) and arr.dtype.kind in "biuf":
            kind = "ragged" if arr.ndim == 1 and len(arr) == len(boxes[0]) else None
        r = FieldRequest(str(key), str(key), kind)
        try:
            if not r.name.isidentifier():
                raise ValueError(f"{key!r} is not a field name")
            if guess_kind(value, r, where) == "json":
                json.dumps(value, default=lambda o: plain(o).tolist())
        except (ValueError, TypeError, AttributeError) as e:
            raise SourceError(
                f"{where}: the target's {key!r} ({type(value).__name__}) cannot be stored ({e}); keep the "
                "other keys with --field KEY for each, or return numbers, arrays or tv_tensors under it"
            ) from None
        out.append(r)
    return tuple(out)


def guess_kind(value: Any, r: FieldRequest, where: str) -> str:
    if r.kind:
        return r.kind
    value = plain(value)
    if value is None:
        raise SourceError(
            f"{where}: --field {r.text}: no sample has {r.key!r}, so its kind cannot be read from a value; "
            f"give it ({FORM}, KIND one of {', '.join(KINDS)})"
        )
    if isinstance(value, (bytes, bytearray, memoryview)) or type(value).__module__.startswith("PIL."):
        return "mask"
    if isinstance(value, (str, dict)):
        return "json"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return "json"
    if arr.dtype.kind not in "biuf":
        return "json"
    if arr.ndim == 2:
        return "boxes" if arr.shape[1] == 4 else "mask"  # no mask is 4 pixels wide
    if arr.ndim <= 1 and (arr.ndim == 0 or len(arr)):
        return "values"
    raise SourceError(
        f"{where}: --field {r.text}: cannot tell the kind from a value of shape {arr.shape}; give it "
        f"({FORM}, KIND one of {', '.join(KINDS)})"
    )


def number_dtype(arr: np.ndarray, r: FieldRequest) -> str:
    if arr.dtype.kind == "b":
        return "uint8"
    if arr.dtype.kind in "iu":
        return "int64"
    if arr.dtype.kind == "f" or arr.size == 0:
        return "float32"
    raise ValueError(f"values of {r.key!r} are {arr.dtype}, not numbers; give KIND json for other values")


def mask_array(value: Any) -> np.ndarray:
    """An image of ids (bytes, PIL, array) → (H, W) ids; a colour image's first channel."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        from PIL import Image

        with Image.open(io.BytesIO(bytes(value))) as img:
            arr = np.asarray(img)
    elif type(value).__module__.startswith("PIL."):
        arr = np.asarray(value)
    else:
        arr = np.asarray(plain(value))
    if arr.ndim == 3:
        arr = arr[:, :, 0]
    return arr


def raw_value(f: FieldSpec, value: Any) -> Any:
    """A sample's raw value of a field as ``place_targets`` takes it (None: the field's empty value)."""
    if value is None:
        return None
    if f.kind == "mask":
        return mask_array(value)
    value = plain(value)
    if f.kind == "json":
        return json.loads(json.dumps(value, default=lambda o: plain(o).tolist()))
    return np.asarray(value)
