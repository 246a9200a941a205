"""A cache with fields read the ways users read it: CachedDataset under a torchvision v2 pipeline and
DataLoader workers (unchanged v2 code), the collate that keeps boxes as lists, and the fast loaders
(``Loader``'s pinned, resident and decode paths) yielding the same targets, moved by the GPU crops."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from dlstore import Loader, convert
from dlstore.gpu import GpuAugment, RaggedRandomResizedCrop
from dlstore.read.dataset import CachedDataset

N = 12


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 images of assorted sizes, each with 0-3 boxes (a polygon mask each; ids up to 3)."""
    root = tmp_path_factory.mktemp("fields")
    (root / "img").mkdir()
    rng = np.random.default_rng(4)
    images, anns = [], []
    for i in range(N):
        w, h = (int(v) for v in rng.integers(20, 60, 2))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": w, "height": h})
        for j in range(i % 4):
            x, y = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
            bw, bh = int(rng.integers(4, w - x)), int(rng.integers(4, h - y))
            poly = [x, y, x + bw, y, x + bw, y + bh, x, y + bh]
            anns.append(
                {
                    "id": 10 * i + j,
                    "image_id": i,
                    "category_id": j + 1,
                    "bbox": [x, y, bw, bh],
                    "segmentation": [poly],
                }
            )
    doc = {
        "images": images,
        "annotations": anns,
        "categories": [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)],
    }
    (root / "ann.json").write_text(json.dumps(doc))
    return root


@pytest.fixture(scope="module")
def fixed_cache(coco: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("c") / "ram"
    convert(
        f"coco-masks:{coco / 'ann.json'}", dest, size=16, root=coco / "img", storage_order="source", workers=1
    )
    return dest


@pytest.fixture(scope="module")
def ragged_cache(coco: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("c") / "npz"
    convert(
        f"coco-masks:{coco / 'ann.json'}",
        dest,
        size=16,
        format="npz",
        resize="shorter",
        root=coco / "img",
        storage_order="source",
        workers=1,
    )
    return dest


def test_a_v2_pipeline_runs_unchanged_in_dataloader_workers(fixed_cache: Path) -> None:
    pipeline = v2.Compose(
        [v2.RandomResizedCrop(12, antialias=False), v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes()]
    )
    ds = CachedDataset(fixed_cache, transform=pipeline)
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=ds.collate_fn)
    seen = 0
    for images, target in loader:
        assert images.shape[1:] == (3, 12, 12)
        assert isinstance(target["mask"], tv_tensors.Mask) and target["mask"].shape[1:] == (12, 12)
        assert isinstance(target["boxes"], list) and len(target["boxes"]) == len(images)
        for boxes, labels in zip(target["boxes"], target["labels"]):
            assert isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.canvas_size == (12, 12)
            assert len(boxes) == len(labels) and bool((boxes[:, 2:] <= 12).all())
        seen += len(images)
    assert seen == N


def reference_targets(path: Path, indices: list[int]) -> list[dict]:
    ds = CachedDataset(path)
    return [ds[i][1] for i in indices]


def check_same(target: dict, refs: list[dict]) -> None:
    for j, ref in enumerate(refs):
        assert torch.equal(target["mask"][j].cpu(), ref["mask"].as_subclass(torch.Tensor))
        assert torch.equal(
            target["boxes"][j].cpu().as_subclass(torch.Tensor), ref["boxes"].as_subclass(torch.Tensor)
        )
        assert torch.equal(target["labels"][j].cpu(), ref["labels"])


@pytest.mark.parametrize("via", ["pinned", "resident"])
def test_fast_loaders_yield_the_datasets_targets(fixed_cache: Path, via: str) -> None:
    loader = Loader(fixed_cache, batch_size=5, device="cpu", via=via, order="sequential", drop_last=False)
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [5, 5, 2]
    for b, (images, target) in enumerate(batches):
        check_same(target, reference_targets(fixed_cache, list(range(5 * b, 5 * b + len(images)))))
    aug = GpuAugment(8, generator=torch.Generator().manual_seed(0))
    x, moved = next(iter(Loader(fixed_cache, batch_size=5, device="cpu", via=via, transform=aug)))
    assert x.shape == (5, 3, 8, 8) and moved["mask"].shape == (5, 8, 8)
    assert all(b.canvas_size == (8, 8) for b in moved["boxes"])


def test_decode_loader_moves_ragged_masks_with_its_crop(ragged_cache: Path) -> None:
    crop = RaggedRandomResizedCrop(10, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip_p=0.0)
    loader = Loader(
        ragged_cache,
        batch_size=4,
        transform=crop,
        device="cpu",
        order="sequential",
        drop_last=False,
        via="decode",
    )
    seen = 0
    for x, target in loader:
        assert x.shape[1:] == (3, 10, 10) and target["mask"].shape[1:] == (10, 10)
        assert len(target["boxes"]) == len(x) == len(target["labels"])
        seen += len(x)
    assert seen == N
    plain = Loader(
        ragged_cache,
        batch_size=4,
        transform=lambda images, target: (images, target),
        device="cpu",
        order="sequential",
        via="decode",
    )
    images, target = next(iter(plain))
    refs = reference_targets(ragged_cache, [0, 1, 2, 3])
    for j, ref in enumerate(refs):
        assert target["mask"][j].shape == images[j].shape[1:]
        assert torch.equal(target["mask"][j], ref["mask"].as_subclass(torch.Tensor))
        assert target["boxes"][j].canvas_size == tuple(images[j].shape[1:])


def test_fields_selects_what_is_read(fixed_cache: Path) -> None:
    x, target = next(iter(Loader(fixed_cache, batch_size=4, device="cpu", fields=("mask",), via="resident")))
    assert list(target) == ["mask"]
    for via in ("pinned", "resident"):  # boxes alone: nothing resident, still a target
        _, target = next(
            iter(Loader(fixed_cache, batch_size=4, device="cpu", via=via, fields=("boxes", "labels")))
        )
        assert list(target) == ["boxes", "labels"] and len(target["boxes"]) == 4
    assert list(CachedDataset(fixed_cache, fields=["labels"])[0][1]) == ["labels"]
    with pytest.raises(ValueError, match="no field"):
        Loader(fixed_cache, batch_size=4, device="cpu", fields=("masks",), via="pinned")


def test_pinned_ring_stages_stacked_fields_in_its_own_buffers(fixed_cache: Path) -> None:
    """The pinned path on CUDA: the gather thread reads a batch's masks straight into the slot's (pinned)
    buffer, or copies them there, so the device copy reads pinned memory; the buffer is the slot's,
    reused, and holds the ids a plain read gives."""
    from dlstore.read.cache import open_cache
    from dlstore.read.field_targets import read_target
    from dlstore.read.pinned import BufferRing

    cache = open_cache(fixed_cache)
    ring = BufferRing(2, (5, *cache.spec.shape), pin=False)  # the staging, without a GPU to pin for
    copies = []

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        copies.append(src.shape)
        np.copyto(dst, src)

    for index in (np.array([0, 3, 4]), np.array([7, 1, 2, 9, 11])):
        target = read_target(cache, index)
        want = target["mask"].clone()
        ring.stage(1, target, copy)
        assert isinstance(target["mask"], tv_tensors.Mask) and torch.equal(target["mask"], want)
        assert target["mask"].data_ptr() == ring.fields[1]["mask"].data_ptr()  # the slot's buffer
        assert isinstance(target["boxes"], list) and len(target["boxes"]) == len(index)  # lists stay
        into = ring.field_buffers(0, cache, len(index))
        read = read_target(cache, index, into)  # read straight into slot 0's buffer, no copy
        assert list(into) == ["mask"] and read["mask"].data_ptr() == ring.fields[0]["mask"].data_ptr()
        assert isinstance(read["mask"], tv_tensors.Mask) and torch.equal(read["mask"], want)
    assert copies == [(3, 16, 16), (5, 16, 16)]
