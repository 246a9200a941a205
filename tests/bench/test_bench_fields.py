"""The bench on a source of fields (COCO boxes + masks): the transform stage runs the field work - v2
moving each sample's mask and boxes with its crop, the collate that keeps the ragged boxes as lists - for
the raw kind (files + annotations per sample) and the cached kinds; the fast kinds hand the target to
GpuAugment in the step; the model's step trains on stand-in labels (the source has no classes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors

from dlstore.bench.kinds import prepare_loader
from dlstore.bench.kinds.context import LoaderContext
from dlstore.bench.models import TrainStep, build_model
from dlstore.bench.protocol import BenchConfig
from dlstore.bench.stages import measure_loader
from dlstore.write.sources import open_source

SIZE, BATCH = 16, 4


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> LoaderContext:
    root = tmp_path_factory.mktemp("coco")
    (root / "img").mkdir()
    rng = np.random.default_rng(2)
    images, anns = [], []
    for i in range(12):
        w, h = (int(v) for v in rng.integers(24, 48, 2))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        images.append({"id": i, "file_name": f"{i}.png", "width": w, "height": h})
        for j in range(1 + i % 3):
            x, y, bw, bh = 2 + j, 3, w // 2, h // 2
            poly = [x, y, x + bw, y, x + bw, y + bh, x, y + bh]
            anns.append({"id": 10 * i + j, "image_id": i, "category_id": j + 1, "bbox": [x, y, bw, bh],
                         "segmentation": [poly]})  # fmt: skip
    cats = [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]
    (root / "ann.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    text = f"coco-masks:{root / 'ann.json'}"
    config = BenchConfig(source=text, root=root / "img", batch_size=BATCH, transform="augment", size=SIZE)
    source = open_source(text, root=root / "img")
    return LoaderContext(config, source, SIZE, 3, torch.device("cpu"), root / "caches")


@pytest.mark.parametrize("kind", ["raw", "ram"])
def test_the_transform_stage_moves_masks_and_boxes(context: LoaderContext, kind: str) -> None:
    prepared = prepare_loader(kind, context)
    assert prepared.info["fields"] == ["boxes", "labels", "mask"]
    images, target = next(iter(prepared.loader(0, False, context.config)))
    assert images.shape == (BATCH, 3, SIZE, SIZE)
    assert isinstance(target["mask"], tv_tensors.Mask) and target["mask"].shape == (BATCH, SIZE, SIZE)
    assert isinstance(target["boxes"], list) and len(target["boxes"]) == BATCH == len(target["labels"])
    for boxes, labels in zip(target["boxes"], target["labels"]):
        assert boxes.canvas_size == (SIZE, SIZE) and len(boxes) == len(labels)  # sanitised together
        assert bool((boxes[:, 2:] > boxes[:, :2]).all()) and bool((boxes <= SIZE).all())
    timed = measure_loader(prepared.loader(0, False, context.config), 1, 2, torch.device("cpu"))
    assert timed["batches"] == 2 and timed["img_per_s"] > 0
    prepared.release()


def test_the_fast_kinds_and_the_step_take_the_target(context: LoaderContext) -> None:
    prepared = prepare_loader("pinned", context)
    assert "x, y = aug(x, target=y)" in prepared.info["apply"]
    x, y = next(iter(prepared.loader(0, False, context.config)))
    assert isinstance(y, dict) and y["mask"].shape[1:] == (SIZE, SIZE)
    model = build_model("smallcnn", 3, SIZE, 1)
    seen: list[tuple[int, ...]] = []
    model.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    step = TrainStep(model, torch.device("cpu"), prepared.device_transform)
    step(x, y)  # GpuAugment moves the masks and boxes; the classifier trains on stand-in labels
    assert seen == [(BATCH, 3, SIZE, SIZE)]
    moved = prepared.device_transform(x, target=y)[1]
    assert moved["mask"].shape == (len(x), SIZE, SIZE) and all(
        b.canvas_size == (SIZE, SIZE) for b in moved["boxes"]
    )


def test_watch_times_the_transform_with_its_target(context: LoaderContext) -> None:
    """``dlstore watch``'s side measurement on a user's loop over a cache with fields: the transform is
    timed on (image, target), so moving the masks and boxes is in its share; collate_fields is timed."""
    from torch.utils.data import DataLoader

    from dlstore.bench.transforms import cached_cpu_transform
    from dlstore.bench.watch.loop_parts import measure_parts
    from dlstore.read.dataset import CachedDataset

    pipeline = cached_cpu_transform("augment", SIZE, boxes=True)
    targets: list[dict] = []

    def transform(image: torch.Tensor, target: dict) -> tuple:
        targets.append(target)
        return pipeline(image, target)

    ds = CachedDataset(prepare_loader("ram", context).info["cache"], transform=transform)
    loader = DataLoader(ds, batch_size=BATCH, collate_fn=ds.collate_fn)
    parts = measure_parts(loader, None, cuda=False, budget_s=0.3)
    assert parts["transform_s"] > 0 and parts["collate_s"] > 0 and parts["collate_batch"] == BATCH
    assert targets and all("mask" in t and "boxes" in t for t in targets)
