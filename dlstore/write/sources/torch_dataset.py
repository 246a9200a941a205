"""``MODULE:CALLABLE`` or ``convert(dataset, ...)``: a map-style Dataset of ``(image, target)`` or
dicts (``image`` and ``--label KEY``); the image a PIL image, uint8 array or tensor, or encoded bytes.
tv_tensors targets become fields. Labels: ``ds.targets``, else each item's; classes: ``ds.classes``.
Fingerprint: ``ds.fingerprint()``, else only SOURCE, length and labels (``fingerprint_check``)."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from dlstore.errors import ImageDecodeError, SourceError
from dlstore.spec import ImagePolicy
from dlstore.write.geometry import Geometry
from dlstore.write.imageops import (
    DECODE_ERRORS,
    array_to_image,
    decode_with_geometry,
    image_geometry,
    prepare,
)
from dlstore.write.sources.encoded import EncodedSource, IndexedNames, labels_from_values
from dlstore.write.sources.fieldmap import declare, described, raw_value, requests_of
from dlstore.write.sources.registry import SourceArgs, register_source
from dlstore.write.targets import place_targets

_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
DEFAULT_LABEL = "label"


def load_callable(text: str) -> Any:
    """``pkg.module:name`` → the object (called when a function or class), importable from here."""
    module, _, name = text.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SourceError(f"{text}: cannot load {name} from module {module} ({type(e).__name__}: {e})") from e
    if isinstance(obj, type) or callable(obj) and not hasattr(obj, "__getitem__"):
        obj = obj()  # a factory or a Dataset class: called with no arguments
    return obj


@register_source
@dataclass
class DatasetSource(EncodedSource):
    claim_order = 130
    form = "MODULE:CALLABLE returning a map-style Dataset of (image, int label)"
    field_form = "a key of each item's dict, or of its target dict for (image, target) items"

    dataset: Any = None
    label_key: str = DEFAULT_LABEL
    indices: np.ndarray | None = None  # a subset's items in the dataset (None: all)
    fingerprint_check: str = ""

    @classmethod
    def claims(cls, text: str) -> bool:
        return bool(_CALLABLE.match(text)) and not os.path.exists(text)

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> DatasetSource:
        return cls.of(load_callable(text), text, args)

    @classmethod
    def of(cls, dataset: Any, text: str = "", args: SourceArgs | None = None) -> DatasetSource:
        """A Source over a Dataset object (``convert(dataset, …)``)."""
        args = args or SourceArgs()
        where = text or type(dataset).__name__
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise SourceError(
                f"{where}: not a map-style Dataset (it needs __len__ and __getitem__); "
                "an IterableDataset has no index to split the work by"
            )
        n = len(dataset)
        label = args.label or DEFAULT_LABEL
        targets = getattr(dataset, "targets", None)
        requests = requests_of(args.fields) or described(target_dict(dataset, n), where)
        src = cls(
            description=where,
            classes=(),
            names=IndexedNames([where], np.zeros(n, np.int8), np.arange(n)),  # type: ignore[arg-type]
            labels=np.zeros(0, np.int64),
            kind="dataset",
            dataset=dataset,
            label_key=label,
            field_requests=requests,
        )
        optional = bool(requests) and args.label is None
        items: dict[int, Any] = {}
        if targets is not None and len(targets) == n and not (optional and not is_label_list(targets)):
            values = [int(t) for t in targets]
        else:
            items = {i: dataset[i] for i in range(n)}
            values = [src._target(items[i], i, optional) for i in range(n)]
        declared = getattr(dataset, "classes", None) or getattr(
            (getattr(dataset, "features", None) or {}).get(label), "names", None
        )
        if optional and all(v is None for v in values):
            src.classes, src.labels = (), np.zeros(n, np.int64)
        elif declared is not None and all(isinstance(v, int) and 0 <= v < len(declared) for v in values):
            src.classes, src.labels = tuple(str(c) for c in declared), np.asarray(values, np.int64)
        else:
            if any(v is None for v in values):
                i = values.index(None)
                raise SourceError(
                    f"{where}[{i}]: no {label!r} label while other items have one; name it with --label"
                )
            src.classes, src.labels = labels_from_values(values, f"{where} targets")
        if requests:
            first = {}
            for r in requests:
                found = (item_fields(items.get(i, dataset[i])).get(r.key) for i in range(min(n, 64)))
                first[r.name] = next((v for v in found if v is not None), None)
            src.fields = declare(requests, first, where)
        own = getattr(dataset, "fingerprint", None)
        src.fingerprint_check = "declared" if callable(own) else "length and labels only"
        return src

    def _target(self, item: Any, i: int, optional: bool = False) -> Any:
        if isinstance(item, (tuple, list)) and len(item) >= 2 and not isinstance(item[1], dict):
            return int_or_value(item[1])
        if not isinstance(item, dict) and not (isinstance(item, (tuple, list)) and len(item) >= 2):
            raise SourceError(
                f"{self.description}[{i}]: an item must be (image, target) or a dict; found {type(item).__name__}"
            )
        values = item_fields(item)  # an item's dict, or the target dict of (image, target)
        if self.label_key in values:
            return int_or_value(values[self.label_key])
        if optional:
            return None
        keys = ", ".join(repr(k) for k in values if k != "image") or "none besides the image"
        raise SourceError(
            f"{self.description}[{i}]: no {self.label_key!r} key (keys: {keys}); name the class key with "
            "--label KEY, or keep the keys as fields with --field KEY"
        )

    def _item(self, i: int) -> Any:
        try:
            return self.dataset[int(self.indices[i]) if self.indices is not None else i]
        except Exception as e:  # noqa: BLE001 - the user's __getitem__ may raise anything
            raise ImageDecodeError(f"{self.names[i]}: the Dataset raised {type(e).__name__}: {e}") from e

    def _image(self, i: int, item: Any = None) -> Any:
        item = self._item(i) if item is None else item
        return item.get("image") if isinstance(item, dict) else item[0]

    def decode_and_digest(self, i: int, policy: ImagePolicy) -> tuple[np.ndarray, str, float]:
        image = self._image(i)
        return (
            self._image_geometry(image, i, policy)[0],
            hashlib.sha256(self._bytes_of(image, i)).hexdigest(),
            0.0,
        )

    def decode(self, i: int, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        return self._image_geometry(self._image(i), i, policy)[0]

    def field_value(self, i: int, key: str) -> Any:
        return item_fields(self._item(i)).get(key)

    def decode_geometry(
        self, i: int, policy: ImagePolicy, data: bytes | None = None
    ) -> tuple[np.ndarray, Geometry]:
        return self._image_geometry(self._image(i), i, policy)

    def _image_geometry(self, image: Any, i: int, policy: ImagePolicy) -> tuple[np.ndarray, Geometry]:
        if isinstance(image, (bytes, bytearray, memoryview)):
            pixels, geometry = decode_with_geometry(self.names[i], policy, bytes(image))
            return pixels, geometry  # type: ignore[return-value]
        img = self._pil(image, i)
        try:
            return prepare(img, policy), image_geometry(img, policy)
        except DECODE_ERRORS as e:
            raise ImageDecodeError(f"{self.names[i]}: cannot decode image ({type(e).__name__}: {e})") from e

    def decode_targets_and_digest(
        self, i: int, policy: ImagePolicy
    ) -> tuple[np.ndarray, str, float, dict[str, np.ndarray], dict[str, int]]:
        """One ``ds[i]``: decoded, hashed, fields placed in the cache image's frame."""
        item = self._item(i)
        image = self._image(i, item)
        digest = hashlib.sha256(self._bytes_of(image, i)).hexdigest()
        pixels, geometry = self._image_geometry(image, i, policy)
        values = item_fields(item)
        raw = {r.name: raw_value(self.fields[r.name], values.get(r.key)) for r in self.field_requests}
        rows, dropped = place_targets(raw, self.fields, geometry, policy, self.names[i])
        return pixels, digest, 0.0, rows, dropped

    def _pil(self, image: Any, i: int) -> Image.Image:
        if isinstance(image, Image.Image):
            image.load()
            return image
        if hasattr(image, "numpy") and hasattr(image, "permute"):  # a torch tensor, C,H,W
            if str(image.dtype) != "torch.uint8":
                raise ImageDecodeError(f"{self.names[i]}: a tensor image must be uint8, found {image.dtype}")
            image = image.permute(1, 2, 0).numpy() if image.ndim == 3 else image.numpy()
        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim not in (2, 3):
                raise ImageDecodeError(
                    f"{self.names[i]}: an array image must be uint8 H,W or H,W,C; found {image.dtype} {image.shape}"
                )
            return array_to_image(image)
        raise ImageDecodeError(
            f"{self.names[i]}: the image is a {type(image).__name__}; give a PIL image, a uint8 ndarray or "
            "tensor, or encoded bytes"
        )

    def _bytes_of(self, image: Any, i: int) -> bytes:
        """The digest's bytes: encoded bytes as given, else the pixels and their mode."""
        if isinstance(image, (bytes, bytearray, memoryview)):
            return bytes(image)
        try:
            img = self._pil(image, i)
        except ImageDecodeError:
            return b""
        return img.mode.encode() + repr(img.size).encode() + img.tobytes()

    def read_bytes(self, i: int) -> bytes:
        return self._bytes_of(self._image(i), i)

    def open_image(self, i: int) -> Image.Image:
        image = self._image(i)
        if isinstance(image, (bytes, bytearray, memoryview)):
            return Image.open(io.BytesIO(bytes(image)))
        return self._pil(image, i)

    def reopen(self) -> dict[str, Any] | None:
        if not _CALLABLE.match(self.description):
            return None
        return self.reopen_with(self.description, self.label_key)

    def fingerprint(self) -> str:
        own = getattr(self.dataset, "fingerprint", None)
        doc = [self.classes, len(self), own() if callable(own) else self.description]
        if self.field_requests:  # a classification source's fingerprint stays what it was
            doc.append([r.text for r in self.field_requests])
        h = hashlib.sha256(json.dumps(doc).encode())
        h.update(self.labels.astype(np.int64).tobytes())
        if self.indices is not None:
            h.update(self.indices.tobytes())
        return h.hexdigest()

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"indices": idx if self.indices is None else self.indices[idx]}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "fingerprint_check": self.fingerprint_check}


def item_fields(item: Any) -> dict[str, Any]:
    """What --field KEYs name: an item's dict, or the target dict of (image, target)."""
    if isinstance(item, dict):
        return item
    if isinstance(item, (tuple, list)) and len(item) >= 2 and isinstance(item[1], dict):
        return item[1]
    return {}


def int_or_value(t: Any) -> Any:
    return int(t) if hasattr(t, "__index__") or (hasattr(t, "item") and np.ndim(t) == 0) else t


def target_dict(dataset: Any, n: int) -> dict[str, Any]:
    """The first item's target dict when items are (image, target dict); else empty."""
    try:
        item = dataset[0] if n else None
    except Exception:  # noqa: BLE001 - a failing item is skipped and named later, like any other
        return {}
    ok = isinstance(item, (tuple, list)) and len(item) >= 2 and isinstance(item[1], dict)
    return item[1] if ok else {}


def is_label_list(targets: Any) -> bool:
    """``ds.targets`` holds one int label per item (not, say, annotation dicts)."""
    try:
        return all(hasattr(t, "__index__") or np.ndim(t) == 0 for t in list(targets)[:64])
    except TypeError:
        return False
