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


def write_fashion_mnist(root: Path, n: int) -> None:
    """FashionMNIST's raw idx files, as torchvision reads them (random pixels)."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(2)
    for split in ("train", "t10k"):  # torchvision checks that both splits are there
        header = np.array([2051, n, 28, 28], dtype=">i4").tobytes()
        pixels = rng.integers(0, 255, n * 784, np.uint8).tobytes()
        (raw / f"{split}-images-idx3-ubyte").write_bytes(header + pixels)
        labels = np.array([2049, n], dtype=">i4").tobytes() + rng.integers(0, 10, n, np.uint8).tobytes()
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(labels)


def test_try_cache_reads_a_torchvision_set_with_the_users_transform(tmp_path: Path) -> None:
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from torchvision.datasets import FashionMNIST

    from dlstore.bench.watch.describe_loop import dataset_info
    from dlstore.bench.watch.probes import try_cache

    write_fashion_mnist(tmp_path, 96)
    ds = FashionMNIST(str(tmp_path), train=True, download=False, transform=T.ToTensor())
    loader = DataLoader(ds, batch_size=16)
    plan = {"size": 32, "channels": 1, "format": "ram", "in_memory": True, "gpu": False, "jpeg": False}
    tried = try_cache(loader, dataset_info(ds), plan, cuda=False, budget_s=0.1)
    assert tried["images"] == 96 and tried["batch"] == 16 and tried["workers"] == 0
    assert tried["batches_timed"] >= 3 and tried["loader_img_per_s"] > 0 and not tried["gpu_augment"]
