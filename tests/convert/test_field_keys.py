"""``--field NAME=KEY[:KIND[:DTYPE]]``: the extra columns and keys of a parquet file (written by pyarrow),
WebDataset shards (written by ``webdataset.TarWriter``) and a Dataset (``convert(dataset, ...)``) become
the cache's fields: a multi-hot list, floats, boxes with their labels, a PNG mask matched by the sample
key, torchvision's (image, target dict) with BoundingBoxes and instance Masks. One conversion per form,
one format each (ram, npz, zarr). References: torchvision.transforms.v2's Resize + CenterCrop of the same
masks and boxes in the image's oriented frame (one sample is stored turned, EXIF 6).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from imagegen import ORIENT_TAG
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from dlstore import convert
from dlstore.cli import main
from dlstore.errors import DlstoreError
from dlstore.read.dataset import CachedDataset
from dlstore.write.sources.fieldmap import field_texts

SIZE = 24
N = 4


def sample(i: int, photo: Image.Image) -> dict[str, Any]:
    """Sample i: JPEG bytes (i == 2 stored turned, EXIF 6), its mask and boxes in the stored frame."""
    img = photo.crop((i * 3, 0, 48 + i * 4, 60 - i * 5))
    kw: dict[str, Any] = {"quality": 95}
    if i == 2:
        exif = Image.Exif()
        exif[ORIENT_TAG] = 6
        img, kw = img.transpose(Image.Transpose.ROTATE_90), {**kw, "exif": exif}
    w, h = img.size
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    mask = np.zeros((h, w), np.uint8)
    mask[h // 4 : h // 2, w // 5 : w // 2] = 3 + i
    mask[h - 6 :, :4] = 250
    png = io.BytesIO()
    Image.fromarray(mask).save(png, "PNG")
    boxes = [[1.0, 2.0, w - 3.0, h / 2], [w / 3, h / 3, w - 1.5, h - 2.0], [0.0, 0.0, 1.0, 1.0]][: 1 + i % 3]
    return {
        "jpg": buf.getvalue(),
        "png": png.getvalue(),
        "mask": mask,
        "boxes": boxes,
        "box_labels": [7 + k for k in range(len(boxes))],
        "tags": [i % 2, 1, 0],
        "score": [0.25 * i, -1.5],
        "size": (w, h),
    }


@pytest.fixture(scope="module")
def samples() -> list[dict[str, Any]]:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        photo = img.convert("RGB").resize((64, 75))
    return [sample(i, photo) for i in range(N)]


def reference(s: dict[str, Any], i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """v2's Resize + CenterCrop of sample i's mask and boxes, turned first as its EXIF says."""
    mask, boxes = s["mask"], np.array(s["boxes"], np.float64)
    if i == 2:  # EXIF 6: turn clockwise; a point (x, y) goes to (h - y, x)
        h = mask.shape[0]
        mask = np.ascontiguousarray(np.rot90(mask, -1))
        boxes = np.stack([h - boxes[:, 3], boxes[:, 0], h - boxes[:, 1], boxes[:, 2]], 1)
    m, b = v2.Compose([v2.Resize(SIZE), v2.CenterCrop(SIZE)])(
        tv_tensors.Mask(torch.from_numpy(mask.copy())),
        tv_tensors.BoundingBoxes(torch.from_numpy(boxes).float(), format="XYXY", canvas_size=mask.shape),
    )
    b = b.numpy()
    alive = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
    return m.numpy(), b[alive], alive


def check_cache(dest: Path, samples: list[dict[str, Any]], mask: str, labels: str, tags: bool = True) -> dict:
    ds = CachedDataset(dest)
    for i, s in enumerate(samples):
        image, target = ds[i]
        assert image.shape == (3, SIZE, SIZE)
        ref_mask, ref_boxes, alive = reference(s, i)
        np.testing.assert_array_equal(target[mask].numpy(), ref_mask)
        np.testing.assert_allclose(target["boxes"].numpy(), ref_boxes, atol=0.5)
        assert target[labels].tolist() == np.array(s["box_labels"])[alive].tolist()
        if tags:
            assert target["tags"].tolist() == s["tags"] and target["tags"].dtype == torch.int64
            np.testing.assert_allclose(target["score"].numpy(), s["score"])
    return json.loads((dest / "dlstore.json").read_text())


def test_parquet_columns_become_fields_from_the_cli(samples: list[dict[str, Any]], tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array(
                [{"bytes": s["jpg"], "path": f"{i}.jpg"} for i, s in enumerate(samples)], image_type
            ),
            "seg": pa.array([s["png"] for s in samples], pa.binary()),
            "objects": pa.array([s["boxes"] for s in samples], pa.list_(pa.list_(pa.float64()))),
            "box_labels": pa.array([s["box_labels"] for s in samples], pa.list_(pa.int64())),
            "tags": pa.array([s["tags"] for s in samples], pa.list_(pa.int8())),
            "score": pa.array([s["score"] for s in samples], pa.list_(pa.float32())),
        }
    )  # no label column: with --field the source has no classes
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=2)
    dest = tmp_path / "cache"
    fields = ["mask=seg", "boxes=objects", "labels=box_labels:ragged", "tags", "score=score:values:float32"]
    args = ["convert", str(tmp_path / "data.parquet"), str(dest), "--size", str(SIZE), "--workers", "1"]
    result = CliRunner().invoke(main, [*args, *[a for f in fields for a in ("--field", f)]])
    assert result.exit_code == 0, result.output
    manifest = check_cache(dest, samples, "mask", "labels")
    assert {k: v["kind"] for k, v in manifest["fields"].items()} == {
        "mask": "mask",
        "boxes": "boxes",
        "labels": "ragged",
        "tags": "values",
        "score": "values",
    }
    assert manifest["fields"]["labels"]["follows"] == "boxes" and manifest["fields"]["tags"]["shape"] == [3]
    deep = CliRunner().invoke(main, ["verify", str(dest), "--deep"])  # reopens the source with the fields
    assert deep.exit_code == 0 and "4 source files match by content" in deep.output, deep.output
    again = CliRunner().invoke(main, [*args, *[a for f in fields[:-1] for a in ("--field", f)]])
    assert again.exit_code != 0 and "source" in again.output  # another field set is another source
    bad = CliRunner().invoke(main, [*args, "--overwrite", "--field", "mask=nope"])
    assert bad.exit_code == 1 and "no column 'nope'" in bad.output and "seg" in bad.output


def test_webdataset_members_and_json_keys_become_fields(
    samples: list[dict[str, Any]], tmp_path: Path
) -> None:
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(tmp_path / "shard-000000.tar")) as sink:
        for i, s in enumerate(samples):
            doc = {"boxes": s["boxes"], "box_labels": s["box_labels"], "tags": s["tags"], "score": s["score"]}
            # the mask member is written before the image: it must not be taken for it
            sink.write(
                {"__key__": f"s{i:03d}", "seg.png": s["png"], "jpg": s["jpg"], "json": doc, "cls": i % 2}
            )
    dest = tmp_path / "cache"
    fields = ("mask=seg.png", "boxes", "labels=box_labels:ragged", "tags", "score")
    convert(str(tmp_path / "shard-000000.tar"), dest, size=SIZE, format="npz", fields=fields, workers=1)
    manifest = check_cache(dest, samples, "mask", "labels")
    assert manifest["classes"] == ["0", "1"]  # the .cls members still are the class labels
    assert [CachedDataset(dest).cache.labels[i] for i in range(N)] == [0, 1, 0, 1]


class DetectionDataset:
    """A torchvision-style detection Dataset: (PIL image, target dict) with BoundingBoxes in XYWH and
    (N, H, W) instance masks, as ``wrap_dataset_for_transforms_v2`` gives them."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, dict[str, Any]]:
        s = self.samples[i]
        w, h = s["size"]
        xyxy = torch.tensor(s["boxes"], dtype=torch.float32)
        xywh = torch.cat([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1)
        ids = s["mask"]
        instances = np.stack([ids == v for v in np.unique(ids) if v])  # one per id, in id order
        return Image.open(io.BytesIO(s["jpg"])), {
            "boxes": tv_tensors.BoundingBoxes(xywh, format="XYWH", canvas_size=(h, w)),
            "labels": torch.tensor(s["box_labels"]),
            "masks": tv_tensors.Mask(torch.from_numpy(instances)),
        }


def test_a_datasets_target_dict_becomes_fields(samples: list[dict[str, Any]], tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    fields = {"boxes": "boxes", "labels": "labels:ragged", "instances": "masks"}
    convert(DetectionDataset(samples), dest, size=SIZE, format="zarr", fields=fields, workers=1)
    ids = []
    for s in samples:  # the instance masks come back as one map of instance numbers 1..N
        values = [v for v in np.unique(s["mask"]) if v]
        ids.append({**s, "mask": np.searchsorted(values, s["mask"]).astype(np.uint8) + (s["mask"] > 0)})
    manifest = check_cache(dest, ids, "instances", "labels", tags=False)
    assert manifest["classes"] == [] and manifest["fields"]["instances"]["dtype"] == "uint8"


def test_field_texts_are_checked_where_they_are_given() -> None:
    assert field_texts({"mask": "seg.png:mask:uint16", "tags": "tags"}) == (
        "mask=seg.png:mask:uint16",
        "tags=tags",
    )
    for bad, says in [("a b=c", "NAME=KEY"), ("m=seg:shape", "KIND"), ("m=seg:mask:int8", "DTYPE")]:
        with pytest.raises(DlstoreError, match=says):
            field_texts([bad])
    with pytest.raises(DlstoreError, match="twice"):
        field_texts(["m=a", "m=b"])
    with pytest.raises(DlstoreError, match="brings no extra keys"):
        convert("demo", "/nonexistent/x", size=8, fields=["m=seg"])
