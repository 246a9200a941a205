"""``dlstore watch --try-cache`` on a small ImageFolder script: a sample converted as advised, the
recommended loader timed with the script's batch size, the temporary cache removed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from dlstore.cli import main

from .conftest import write_script

# Decode-bound: 128x160 JPEGs resized to 32 on the CPU, so a pre-resized cache is advised.
RESIZE_LOOP = """
import sys
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

torch.set_num_threads(1)
tf = T.Compose([T.Resize(32), T.RandomCrop(28), T.ToTensor()])
loader = DataLoader(ImageFolder(sys.argv[1], transform=tf), batch_size=8, shuffle=True, drop_last=True)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("try_cache_imgs")
    rng = np.random.default_rng(1)
    for cls in ("a", "b"):
        (root / cls).mkdir()
        for i in range(20):
            pixels = rng.integers(0, 255, (128, 160, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.jpg", quality=90)
    return root


def test_try_cache_converts_a_sample_and_times_the_advised_loader(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = write_script(tmp_path, "train_resize.py", RESIZE_LOOP)
    child_tmp = tmp_path / "child_tmp"
    child_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(child_tmp))  # where the watched script makes its temporary cache
    args = ["watch", "--json", "--try-cache", "--no-replay", "--warmup", "2", "--parts-budget", "0.3"]
    result = CliRunner().invoke(main, [*args, "--", "python", str(script), str(photos)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rep = next(r for r in doc["loaders"] if r["index"] == doc["primary"])
    cache = [a for a in doc["advice"] if a.get("cache")]
    assert cache, doc["advice"]  # decode-bound: a cache pre-resized to Resize's 32 is advised
    advice = cache[0]
    assert advice["cache"]["size"] == 32 and "--size 32" in advice["command"]
    tried = advice["tried"]
    assert tried == rep["try_cache"] | {k: tried[k] for k in ("loop_img_per_s", "error_vs_predicted")}
    assert tried["images"] == 40 and tried["batch"] == 8 and tried["workers"] == 0
    assert tried["batches_timed"] >= 1 and tried["loader_img_per_s"] > 0 and tried["loop_img_per_s"] > 0
    assert "--try-cache: a sample of 40 images" in advice["text"]
    assert list(child_tmp.glob("dlstore-try-cache-*")) == []  # the temporary cache is gone
