"""H2: a Dataset's targets are carried or refused, never silently dropped; and a skip reason names the
record, not the stream it was read from."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torchvision import tv_tensors

from dlstore.cli import main
from dlstore.errors import SourceError
from dlstore.read.dataset import CachedDataset
from dlstore.write.conversion import convert

SIZE, N = 16, 6

DATASET = '''
import io
import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors


def photo(i):
    y, x = np.mgrid[0:20, 0:30]
    return Image.fromarray(np.stack([x * 8 + i, y * 12, np.full_like(x, 40 * i)], -1).astype(np.uint8))


def instances(i):
    m = np.zeros((2, 20, 30), bool)
    m[0, 2:8, 3 + i : 9 + i] = True
    m[1, 10:16, 10:20] = True
    return m


class Detection:
    """torchvision's detection form: (image, {boxes, masks, labels}), nothing else said."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        boxes = torch.tensor([[3.0 + i, 2, 9 + i, 8], [10, 10, 20, 16]])
        return photo(i), {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(20, 30)),
            "masks": tv_tensors.Mask(torch.from_numpy(instances(i))),
            "labels": torch.tensor([1, 2 + i]),
        }


class Junk:
    """Encoded bytes, one of them not an image."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            return b"not an image at all", 1
        buf = io.BytesIO()
        photo(i).save(buf, "PNG")
        return buf.getvalue(), i % 2
'''


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The datasets as a module of the user's own, importable as MODULE:CALLABLE from the folder."""
    (tmp_path / "userdata.py").write_text(textwrap.dedent(DATASET))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module("userdata")
    yield mod
    import sys

    sys.modules.pop("userdata", None)


def check_fields(dest: Path, module) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads((dest / "dlstore.json").read_text())
    kinds = {k: f["kind"] for k, f in doc["fields"].items()}
    assert kinds == {"boxes": "boxes", "masks": "mask", "labels": "ragged"} and doc["classes"] == []
    ds = CachedDataset(dest)
    scale = SIZE / 20  # Resize(16) scales 20x30 by 0.8, CenterCrop(16) then cuts only x
    for i in range(N):
        _, target = ds[i]
        assert isinstance(target["boxes"], tv_tensors.BoundingBoxes)
        assert target["labels"].tolist() == [1, 2 + i]
        assert isinstance(target["masks"], tv_tensors.Mask) and target["masks"].shape[-2:] == (SIZE, SIZE)
        assert set(np.unique(target["masks"].numpy()).tolist()) == {0, 1, 2}
        assert target["boxes"].shape == (2, 4) and float(target["boxes"][1, 3]) == pytest.approx(16 * scale)


def test_h2_tv_tensors_targets_become_fields_without_field_flags(module, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """H2: (image, {BoundingBoxes, Mask, labels}) converted with no --field keeps boxes, masks and the
    per-box labels as fields (before: a cache of class labels made of the dicts' reprs)."""
    dest = tmp_path / "py"
    convert(module.Detection(), dest, size=SIZE, format="zarr", workers=1)
    check_fields(dest, module)


def test_h2_tv_tensors_targets_through_the_cli(module, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """H2, as a user meets it: `dlstore convert userdata:Detection DEST`, then the fields read back."""
    res = CliRunner().invoke(
        main, ["convert", "userdata:Detection", "cli", "--size", str(SIZE), "--workers", "1"]
    )
    assert res.exit_code == 0, res.output
    check_fields(tmp_path / "cli", module)


def test_h2_field_flags_decide_when_given(module, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """H2: with --field given, only the named keys become fields."""
    dest = tmp_path / "c"
    convert(module.Detection(), dest, size=SIZE, workers=1, fields=["boxes"])
    assert list(json.loads((dest / "dlstore.json").read_text())["fields"]) == ["boxes"]


class Unstorable:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 1, 5, 5]]), format="XYXY", canvas_size=(8, 8))
        return Image.new("RGB", (8, 8)), {"boxes": boxes, "meta": object()}


class DictTargets:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return Image.new("RGB", (8, 8)), {"labels": torch.tensor([1, i]), "area": 3.0}


def test_h2_a_target_that_cannot_be_stored_is_an_error_naming_the_key(tmp_path: Path) -> None:
    """H2: a key no field kind stores is refused by name, with the fix; nothing is written."""
    with pytest.raises(SourceError, match=r"'meta' \(object\) cannot be stored.*--field KEY"):
        convert(Unstorable(), tmp_path / "c", size=8, workers=1)
    assert not (tmp_path / "c" / "dlstore.json").exists()


def test_h2_a_plain_target_dict_is_never_made_class_names(tmp_path: Path) -> None:
    """H2: a target dict without tv_tensors and no --field or --label: an error naming its keys (before:
    classes named after each dict's repr)."""
    with pytest.raises(SourceError, match=r"no 'label' key \(keys: 'labels', 'area'\).*--label KEY.*--field"):
        convert(DictTargets(), tmp_path / "c", size=8, workers=1)
    convert(DictTargets(), tmp_path / "f", size=8, workers=1, fields=["labels=labels:json", "area"])
    assert CachedDataset(tmp_path / "f")[1][1]["labels"] == [1, 1]


def test_c1_skip_reasons_name_the_record_not_a_bytesio(module, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """C1/H2: an undecodable item of a Dataset of encoded bytes is reported by its name, in the summary
    and in skipped.json, never as `<_io.BytesIO object at 0x…>`."""
    res = CliRunner().invoke(main, ["convert", "userdata:Junk", "out", "--size", "8", "--workers", "1"])
    assert res.exit_code == 0, res.output
    skipped = json.loads((tmp_path / "out" / "skipped.json").read_text())
    assert [s["index"] for s in skipped] == [2]
    for text in (res.output, skipped[0]["reason"]):
        assert "BytesIO" not in text and "object at 0x" not in text
        assert "cannot identify image file 'userdata:Junk#2'" in text
