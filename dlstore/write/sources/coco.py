"""``coco:ANNOTATIONS.json``: COCO detection, images under ``--root`` (default: the JSON's folder);
fields ``boxes`` (XYXY) and ``labels`` (category ids); ``coco-masks:`` also rasterises each
``segmentation`` into ``mask`` (category ids; later annotations paint over earlier ones).

    dlstore convert coco:annotations/instances_val2017.json cache/ --root val2017 --size 512"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from dlstore.errors import SourceError
from dlstore.spec import FieldSpec
from dlstore.write.sources.folder import ListedSource, split_spec
from dlstore.write.sources.registry import SourceArgs, register_source

PREFIXES = ("coco-masks:", "coco:")


@register_source
@dataclass
class CocoSource(ListedSource):
    claim_order = 20
    form = "coco:ANNOTATIONS.json or coco-masks:ANNOTATIONS.json (COCO detection; --root IMAGES)"

    objects: list[list[dict[str, Any]]] = field(default_factory=list)
    sizes: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def claims(cls, text: str) -> bool:
        return text.startswith(PREFIXES)

    @classmethod
    def open(cls, text: str, args: SourceArgs) -> CocoSource:
        masks = text.startswith("coco-masks:")
        path = Path(split_spec(text, PREFIXES[0] if masks else PREFIXES[1]))
        doc = read_coco(path)
        root = Path(args.root) if args.root is not None else path.parent
        names, sizes, objects = coco_images(doc, path)
        top = max((int(c["id"]) for c in doc.get("categories", [])), default=0)
        names_by_id = [""] * (top + 1)
        for c in doc.get("categories", []):
            names_by_id[int(c["id"])] = str(c.get("name", ""))
        fields = {
            "boxes": FieldSpec("boxes", "float32"),
            "labels": FieldSpec("ragged", "int64", follows="boxes", classes=tuple(names_by_id)),
        }
        if masks:
            fields["mask"] = FieldSpec("mask", "uint8" if top < 256 else "uint16", classes=tuple(names_by_id))
        return cls.listed(
            root,
            names,
            fields,
            "coco-masks" if masks else "coco",
            f"{text} (images under {root})",
            annotations=path,
            objects=objects,
            sizes=sizes,
        )

    def raw_targets(self, i: int) -> dict[str, Any]:
        objs = self.objects[i]
        boxes = np.array([o["bbox"] for o in objs], np.float64).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]  # XYWH → XYXY
        out: dict[str, Any] = {"boxes": boxes, "labels": np.array([o["category_id"] for o in objs], np.int64)}
        if "mask" in self.fields:
            out["mask"] = rasterise(objs, self.sizes[i], np.dtype(self.fields["mask"].dtype), self.names[i])
        return out

    def _subset_fields(self, idx: np.ndarray) -> dict[str, Any]:
        return {"objects": [self.objects[i] for i in idx], "sizes": [self.sizes[i] for i in idx]}


def read_coco(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SourceError(f"{path}: no such COCO annotation file") from None
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: not a readable COCO JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise SourceError(f"{path}: a COCO file has an 'images' list (and 'annotations'); this one has none")
    return doc


def coco_images(
    doc: dict[str, Any], path: Path
) -> tuple[list[str], list[tuple[int, int]], list[list[dict[str, Any]]]]:
    """(file names, (w, h), annotations) per image, in the file's image order."""
    by_image: dict[int, list[dict[str, Any]]] = {}
    for a in doc.get("annotations", []):
        try:
            if len(a["bbox"]) != 4:
                raise ValueError("bbox is not [x, y, w, h]")
            by_image.setdefault(int(a["image_id"]), []).append(a)
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(
                f"{path}: annotation {a.get('id', '?')} lacks a usable image_id/bbox ({e})"
            ) from None
    names, sizes, objects = [], [], []
    for img in doc["images"]:
        try:
            names.append(str(img["file_name"]))
            sizes.append((int(img["width"]), int(img["height"])))
            objects.append(by_image.get(int(img["id"]), []))
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(f"{path}: image entry {img} lacks id/file_name/width/height ({e})") from None
    return names, sizes, objects


def rasterise(objs: list[dict[str, Any]], size: tuple[int, int], dtype: np.dtype, where: str) -> np.ndarray:
    """The annotations' segmentations as one (H, W) map of category ids (0: none)."""
    w, h = size
    canvas = Image.new("I", (w, h), 0)
    draw = ImageDraw.Draw(canvas)
    out = None
    for o in objs:
        seg, cid = o.get("segmentation"), int(o["category_id"])
        if isinstance(seg, list):
            for poly in seg:
                if len(poly) >= 6:
                    draw.polygon([(float(x), float(y)) for x, y in zip(poly[0::2], poly[1::2])], fill=cid)
        elif isinstance(seg, dict) and isinstance(seg.get("counts"), list):
            out = np.asarray(canvas, np.int64) if out is None else out
            region = rle_decode(seg["counts"], (h, w))
            canvas = Image.fromarray(
                np.where(region, cid, np.asarray(canvas, np.int64)).astype(np.int32), "I"
            )
            draw = ImageDraw.Draw(canvas)
        elif seg:
            raise SourceError(
                f"{where}: a compressed RLE segmentation (string counts) needs pycocotools to decode; "
                "convert with coco: (boxes only) or decompress the RLE first"
            )
    return np.asarray(canvas, np.int64).astype(dtype)


def rle_decode(counts: list[int], shape: tuple[int, int]) -> np.ndarray:
    """COCO's uncompressed RLE (column-major runs, starting with 0s) → a bool (H, W) region."""
    flat = np.zeros(shape[0] * shape[1], bool)
    pos, value = 0, False
    for run in counts:
        flat[pos : pos + int(run)] = value
        pos, value = pos + int(run), not value
    return flat.reshape(shape[1], shape[0]).T
