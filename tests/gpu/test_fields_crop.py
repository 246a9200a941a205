"""Masks and boxes through GpuAugment and RaggedRandomResizedCrop (CPU tensors), each sample against
torchvision.transforms.v2 applied with the same drawn parameters.

Bounds: without rotation masks equal v2's exactly (the same nearest indices) and boxes are within
1 px (float rounding: ~1e-4). With rotation a mask pixel may differ from v2's only where v2's own
output has another id within 1 px (a nearest-rounding tie of the composite grid vs v2's two steps)
or where v2 filled 0 (outside its rotated crop, where GpuAugment shows the real surroundings, as it
does for the image); boxes stay within 1 px. The parameters are the images' own (drawn once), so the
distribution tests of tests/gpu/test_augment.py and test_ragged.py are theirs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.ops import masks_to_boxes
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from dlstore.gpu.augment import GpuAugment
from dlstore.gpu.ragged import RaggedRandomResizedCrop, _flat_host
from dlstore.read.field_targets import collate_fields


@pytest.fixture(scope="module")
def photo_ids() -> np.ndarray:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        return (np.asarray(img.convert("L")) // 52).astype(np.uint8)  # 600 x 512, ids 0..4


def boxes_of(mask: torch.Tensor) -> torch.Tensor:
    ids = torch.unique(mask)
    return masks_to_boxes(torch.stack([mask == i for i in ids])) + torch.tensor([0, 0, 1, 1])


def samples(photo: np.ndarray, shapes: list[tuple[int, int]], seed: int) -> list[tuple[torch.Tensor, dict]]:
    """(image, target) pairs cut from the photo: the image is the ids scaled (any pixels do)."""
    rng = np.random.default_rng(seed)
    out = []
    for h, w in shapes:
        top, left = rng.integers(0, 600 - h + 1), rng.integers(0, 512 - w + 1)
        mask = torch.from_numpy(photo[top : top + h, left : left + w].copy())
        image = (mask * 50).expand(3, h, w).contiguous()
        boxes = tv_tensors.BoundingBoxes(boxes_of(mask), format="XYXY", canvas_size=(h, w))
        out.append(
            (image, {"mask": tv_tensors.Mask(mask), "boxes": boxes, "labels": torch.unique(mask).long()})
        )
    return out


def v2_sample(mask, boxes, top, left, h, w, flip, angle, size):  # noqa: ANN001, ANN202
    m = F.resized_crop(mask, top, left, h, w, list(size), interpolation=InterpolationMode.NEAREST)
    b = F.resized_crop(boxes, top, left, h, w, list(size))
    if flip:
        m, b = F.horizontal_flip(m), F.horizontal_flip(b)
    if angle:
        m = F.rotate(m, angle, interpolation=InterpolationMode.NEAREST)
        b = F.rotate(b, angle)
    return m.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)


def check_boxes(got: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor, ref_labels: torch.Tensor) -> None:
    alive = (ref[:, 2] > ref[:, 0]) & (ref[:, 3] > ref[:, 1])
    assert torch.equal(labels, ref_labels[alive])
    torch.testing.assert_close(got, ref[alive], atol=1.0, rtol=0)


@pytest.mark.parametrize("degrees", [0.0, 20.0])
def test_gpu_augment_moves_masks_and_boxes_as_v2(photo_ids: np.ndarray, degrees: float) -> None:
    batch = samples(photo_ids, [(96, 80)] * 24, seed=1)
    images, target = collate_fields(batch, ragged=frozenset({"boxes", "labels"}))
    aug = GpuAugment((48, 40), degrees=degrees, generator=torch.Generator().manual_seed(3))
    params = aug.sample_params(len(batch), 96, 80)
    out, moved = aug(images, params, target)
    assert out.shape == (24, 3, 48, 40) and isinstance(moved["mask"], tv_tensors.Mask)
    flips = 0
    for i, (_, t) in enumerate(batch):
        p = [int(v[i]) for v in (params.top, params.left, params.height, params.width)]
        flip, angle = bool(params.flip[i]), float(params.angle[i])
        flips += flip
        ref_mask, ref_boxes = v2_sample(t["mask"], t["boxes"], *p, flip, angle, (48, 40))
        got = moved["mask"][i]
        if degrees == 0:
            assert torch.equal(got, ref_mask), i
        else:
            differ = got != ref_mask
            near_edge = torch.nn.functional.max_pool2d(boundary(ref_mask)[None].float(), 3, 1, 1)[0] > 0
            filled = F.rotate(torch.ones(1, 48, 40), angle)[0] == 0  # v2's fill
            assert not (differ & ~near_edge & ~filled).any(), i
            assert differ.float().mean() < 0.01
        check_boxes(moved["boxes"][i], moved["labels"][i], ref_boxes, t["labels"])
        assert moved["boxes"][i].canvas_size == (48, 40)
    assert 0 < flips < 24


def boundary(mask: torch.Tensor) -> torch.Tensor:
    """Pixels with another id among their 4 neighbours."""
    m = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")[0, 0]
    c = m[1:-1, 1:-1]
    return (c != m[:-2, 1:-1]) | (c != m[2:, 1:-1]) | (c != m[1:-1, :-2]) | (c != m[1:-1, 2:])


def test_ragged_crop_moves_masks_and_boxes_as_v2(photo_ids: np.ndarray) -> None:
    shapes = [(int(h), int(w)) for h, w in np.random.default_rng(5).integers(20, 200, (16, 2))]
    batch = samples(photo_ids, shapes, seed=2)
    images, target = collate_fields(batch, ragged=frozenset({"boxes", "labels", "mask"}))
    assert isinstance(images, list) and isinstance(target["mask"], list)
    crop = RaggedRandomResizedCrop(32, generator=torch.Generator().manual_seed(7))
    params = crop.params(torch.device("cpu"), _flat_host(images)[1], None)
    crop.generator.manual_seed(7)
    out, moved = crop(images, target)
    assert out.shape == (16, 3, 32, 32) and moved["mask"].shape == (16, 32, 32)
    for i, (_, t) in enumerate(batch):
        _, _, _, top, left, h, w, flip = params[i].tolist()
        ref_mask, ref_boxes = v2_sample(t["mask"], t["boxes"], top, left, h, w, bool(flip), 0.0, (32, 32))
        assert torch.equal(moved["mask"][i], ref_mask), i
        check_boxes(moved["boxes"][i], moved["labels"][i], ref_boxes, t["labels"])


def test_uint16_masks_and_empty_boxes() -> None:
    images = torch.zeros(2, 3, 10, 10, dtype=torch.uint8)
    mask = tv_tensors.Mask(torch.full((2, 10, 10), 40000, dtype=torch.uint16))
    one = tv_tensors.BoundingBoxes(
        torch.tensor([[0.0, 0.0, 10.0, 10.0]]), format="XYXY", canvas_size=(10, 10)
    )
    none = tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(10, 10))
    labels = [torch.tensor([7]), torch.zeros(0, dtype=torch.long)]
    out, moved = GpuAugment(4)(images, target={"mask": mask, "boxes": [one, none], "labels": labels})
    assert moved["mask"].dtype == torch.uint16 and bool((moved["mask"] == 40000).all())
    assert [len(b) for b in moved["boxes"]] == [1, 0] and moved["labels"][0].tolist() == [7]
