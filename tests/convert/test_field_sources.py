"""Sources that bring fields convert and read back: COCO detection JSON (boxes, labels, polygon and RLE
masks), image + mask folders, a multi-label CSV; every format; `verify` catches a flipped byte in a
mask chunk; a classification cache is exactly as before (no ``fields`` anywhere).

Images are cut from matplotlib's ``grace_hopper.jpg`` (public domain), one stored with EXIF
orientation 6, so the masks and boxes have to turn with it. References: torchvision.transforms.v2 on
the same masks and boxes (in the oriented frame).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from imagegen import ORIENT_TAG
from PIL import Image, ImageDraw
from torchvision import tv_tensors
from torchvision.transforms import v2

from dlstore import convert
from dlstore.read.dataset import CachedDataset
from dlstore.write.verification import verify as verify_cache

SIZE = 24


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        return img.convert("RGB").resize((64, 75))


def cut(photo: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    return photo.crop(box)


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory, photo: Image.Image) -> Path:
    """Three images (one stored turned, EXIF 6), polygon and RLE annotations, one box that the
    centre crop clips away."""
    root = tmp_path_factory.mktemp("coco")
    (root / "images").mkdir()
    cuts = [(0, 0, 64, 75), (0, 10, 64, 50), (5, 0, 45, 75)]
    images, anns = [], []
    for i, box in enumerate(cuts):
        img = cut(photo, box)
        w, h = img.size
        kw: dict = {"quality": 95}
        if i == 2:  # stored turned: the file holds the turned-back pixels, annotations in its frame
            exif = Image.Exif()
            exif[ORIENT_TAG] = 6
            img, kw = img.transpose(Image.Transpose.ROTATE_90), {"quality": 95, "exif": exif}
            w, h = img.size
        img.save(root / "images" / f"{i}.jpg", **kw)
        images.append({"id": 10 + i, "file_name": f"{i}.jpg", "width": w, "height": h})
        poly = [2, 3, w - 4, 5, w // 2, h - 3]
        anns.append(
            {
                "id": 3 * i,
                "image_id": 10 + i,
                "category_id": 1,
                "bbox": [2, 3, w - 6, h - 6],
                "segmentation": [poly],
            }
        )
        region = np.zeros((h, w), np.uint8)
        region[h // 3 : h // 2, 1:6] = 1
        counts = rle_encode(region)
        ys, xs = np.nonzero(region)
        bb = [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)]
        anns.append(
            {
                "id": 3 * i + 1,
                "image_id": 10 + i,
                "category_id": 300,
                "bbox": bb,
                "segmentation": {"counts": counts, "size": [h, w]},
            }
        )
        anns.append(
            {"id": 3 * i + 2, "image_id": 10 + i, "category_id": 2, "bbox": [0, 0, 1, 1], "segmentation": []}
        )
    cats = [{"id": 1, "name": "face"}, {"id": 2, "name": "corner"}, {"id": 300, "name": "strip"}]
    (root / "ann.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root


def rle_encode(region: np.ndarray) -> list[int]:
    flat = region.T.reshape(-1)
    runs, value, n = [], 0, 0
    for v in flat:
        if v != value:
            runs.append(n)
            value, n = v, 0
        n += 1
    return [*runs, n]


def reference(mask: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """v2's Resize + CenterCrop of a mask and boxes in the oriented frame; boxes left with area."""
    h, w = mask.shape
    m, b = v2.Compose([v2.Resize(SIZE), v2.CenterCrop(SIZE)])(
        tv_tensors.Mask(torch.from_numpy(mask.copy())),
        tv_tensors.BoundingBoxes(torch.from_numpy(boxes).float(), format="XYXY", canvas_size=(h, w)),
    )
    b = b.numpy()
    alive = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
    return m.numpy(), b[alive], alive


def oriented_truth(coco: Path, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Image i's mask and boxes drawn independently, then turned as the file's EXIF says."""
    doc = json.loads((coco / "ann.json").read_text())
    info = doc["images"][i]
    w, h = info["width"], info["height"]
    canvas = Image.new("I", (w, h))
    draw = ImageDraw.Draw(canvas)
    boxes = []
    for a in (a for a in doc["annotations"] if a["image_id"] == info["id"]):
        x, y, bw, bh = a["bbox"]
        boxes.append([x, y, x + bw, y + bh])
        if isinstance(a["segmentation"], list):
            for p in a["segmentation"]:
                draw.polygon(list(zip(p[0::2], p[1::2])), fill=a["category_id"])
        elif a["segmentation"]:  # the RLE strip the fixture encoded
            arr = np.asarray(canvas).copy()
            arr[h // 3 : h // 2, 1:6] = a["category_id"]
            canvas = Image.fromarray(arr.astype(np.int32), "I")
            draw = ImageDraw.Draw(canvas)
    mask = np.asarray(canvas).astype(np.uint16)
    boxes_a = np.array(boxes, np.float64)
    if i == 2:  # EXIF 6: turn clockwise; a point (x, y) goes to (h - y, x)
        mask = np.rot90(mask, -1)
        boxes_a = np.stack([h - boxes_a[:, 3], boxes_a[:, 0], h - boxes_a[:, 1], boxes_a[:, 2]], 1)
    return np.ascontiguousarray(mask), boxes_a


@pytest.mark.parametrize("fmt", ["ram", "npz", "zarr"])
def test_coco_converts_and_reads_back_as_v2_would(coco: Path, tmp_path: Path, fmt: str) -> None:
    dest = tmp_path / "cache"
    result = convert(
        f"coco-masks:{coco / 'ann.json'}", dest, size=SIZE, format=fmt, root=coco / "images", workers=1
    )
    assert result.n == 3
    manifest = json.loads((dest / "dlstore.json").read_text())
    assert (
        manifest["fields"]["mask"]["dtype"] == "uint16"
        and manifest["fields"]["labels"]["classes"][300] == "strip"
    )
    ds = CachedDataset(dest)
    dropped = 0
    for i in range(3):
        image, target = ds[i]
        assert image.shape == (3, SIZE, SIZE)
        mask, boxes = oriented_truth(coco, i)
        ref_mask, ref_boxes, alive = reference(mask, boxes)
        np.testing.assert_array_equal(target["mask"].numpy(), ref_mask)
        assert isinstance(target["boxes"], tv_tensors.BoundingBoxes) and target["boxes"].canvas_size == (
            SIZE,
            SIZE,
        )
        np.testing.assert_allclose(target["boxes"].numpy(), ref_boxes, atol=0.5)
        assert target["labels"].tolist() == np.array([1, 300, 2])[alive].tolist()
        dropped += int((~alive).sum())
    assert (
        dropped >= 3 and manifest["fields"]["boxes"]["dropped"] == dropped
    )  # the 1 px corner boxes at least


def test_verify_catches_a_flipped_byte_in_a_mask_chunk(coco: Path, tmp_path: Path) -> None:
    for fmt in ("npz", "zarr"):
        dest = tmp_path / fmt
        convert(
            f"coco-masks:{coco / 'ann.json'}", dest, size=SIZE, format=fmt, root=coco / "images", workers=1
        )
        assert verify_cache(dest).ok
        chunk = next(
            p
            for p in sorted((dest / "fields").rglob("*"))
            if p.is_file() and ("mask" in p.parts or p.suffix == ".npz")
        )
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
        report = verify_cache(dest)
        assert not report.ok and any(str(chunk.relative_to(dest)) in p for p in report.problems), (
            report.problems
        )


def test_mask_folders_convert_and_plain_zarr_opens_them(photo: Image.Image, tmp_path: Path) -> None:
    images, masks = tmp_path / "JPEGImages", tmp_path / "SegmentationClass"
    images.mkdir()
    masks.mkdir()
    truth = {}
    for i, box in enumerate([(0, 0, 64, 75), (3, 8, 60, 40), (10, 0, 40, 75)]):
        img = cut(photo, box)
        img.save(images / f"im{i}.jpg", quality=95)
        ids = (np.asarray(img.convert("L")) // 60).astype(np.uint8)
        ids[0, 0] = 255  # VOC's "void"
        pal = Image.fromarray(ids, "P")
        pal.putpalette([v for k in range(256) for v in (k, 255 - k, k // 2)])
        pal.save(masks / f"im{i}.png")
        truth[f"im{i}.jpg"] = ids
    cut(photo, (0, 0, 30, 30)).save(images / "lonely.jpg")  # no mask: listed, not converted
    dest = tmp_path / "cache"
    result = convert(f"seg:{images}:{masks}", dest, size=SIZE, format="zarr", workers=1)
    assert result.n == 3
    skipped = json.loads((dest / "skipped.json").read_text())
    assert [Path(s["path"]).name for s in skipped] == ["lonely.jpg"]
    group = zarr.open_group(dest, mode="r")
    stored = group["fields/mask"]
    assert stored.shape == (3, SIZE, SIZE) and stored.dtype == np.uint8
    ds = CachedDataset(dest)
    for i in range(3):
        _, target = ds[i]
        ref = reference(truth[f"im{i}.jpg"], np.zeros((0, 4)))[0]
        np.testing.assert_array_equal(target["mask"].numpy(), ref)
        np.testing.assert_array_equal(stored[int(ds.cache.positions[i])], ref)  # plain zarr, same ids


def test_multilabel_csv(photo: Image.Image, tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    for i in range(4):
        cut(photo, (i, i, 40 + i, 50)).save(tmp_path / "img" / f"{i}.png")
    rows = ["path,labels", "0.png,cat dog", "1.png,dog", "2.png,bird|cat", "3.png,bird"]
    (tmp_path / "labels.csv").write_text("\n".join(rows))
    dest = tmp_path / "cache"
    convert(
        f"multilabel:{tmp_path / 'labels.csv'}", dest, size=16, format="npz", root=tmp_path / "img", workers=1
    )
    ds = CachedDataset(dest)
    assert json.loads((dest / "dlstore.json").read_text())["fields"]["labels"]["classes"] == [
        "bird",
        "cat",
        "dog",
    ]
    assert [ds[i][1]["labels"].tolist() for i in range(4)] == [[0, 1, 1], [0, 0, 1], [1, 1, 0], [1, 0, 0]]


def test_a_classification_cache_has_no_fields_anywhere(image_tree: Path, tmp_path: Path) -> None:
    """The manifest a classification conversion writes has exactly the keys it had before fields
    existed, no file of the fields layout, and reads back with int targets."""
    for fmt in ("ram", "zarr"):
        dest = tmp_path / fmt
        convert(image_tree, dest, size=16, format=fmt, workers=1)
        manifest = json.loads((dest / "dlstore.json").read_text())
        assert "fields" not in manifest and not (dest / "fields").exists()
        assert isinstance(CachedDataset(dest)[0][1], int)
