"""Tiny ImageFolders and ordinary training scripts written into tmp folders for ``dlstore watch``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# A SmallCNN loop on an ImageFolder, in the manner of the seeds: crop + rotation on the CPU, and a
# transform that burns CPU for SPIN seconds per sample (a slow augmentation). It times its own next()
# waits by hand and writes them to HAND (JSON) so a test can hold watch's figure against it.
SMALL_CNN = '''
import json, sys, time
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

root, workers, spin, hand = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
epochs = int(sys.argv[5]) if len(sys.argv) > 5 else 1


class Spin:
    """CPU work per sample (a costly augmentation), not a sleep: it takes a core."""

    def __call__(self, x):
        t = time.perf_counter()
        while time.perf_counter() - t < spin:
            pass
        return x


def main():
    # one intra-op thread: on a shared 2-core machine a second one spins against the rest of the load and
    # made the tiny step take 100+ ms, as long as the data wait
    torch.set_num_threads(1)
    tf = T.Compose([T.RandomResizedCrop(28, scale=(0.75, 1.0)), T.RandomRotation(15), T.ToTensor(), Spin()])
    loader = DataLoader(ImageFolder(root, transform=tf), batch_size=8, shuffle=True, num_workers=workers,
                        drop_last=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    waits = []
    t0 = time.perf_counter()
    for _ in range(epochs):
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with open(hand, "w") as f:
        json.dump({"waits": waits, "wall": time.perf_counter() - t0}, f)
    print("trained", len(waits), "steps")


if __name__ == "__main__":
    main()
'''

RAISES = """
import torch
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(64, 3), torch.zeros(64)), batch_size=4)
for i, (x, y) in enumerate(loader):
    if i == 9:
        raise RuntimeError("boom at step 9")
"""

NO_LOADER = """
import sys
print("this script never touches a DataLoader")
sys.exit(3)
"""

# Runs until interrupted: after STEP steps it writes READY, then keeps iterating slowly.
UNTIL_INTERRUPTED = """
import sys, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader, TensorDataset

ready = Path(sys.argv[1])
loader = DataLoader(TensorDataset(torch.randn(64, 3)), batch_size=4)
step = 0
while True:
    for (x,) in loader:
        time.sleep(0.005)
        step += 1
        if step == 20:
            ready.write_text("ready")
"""

# Stops only by --steps: marks the file if it ever gets past its loop.
LONG = """
import sys
from pathlib import Path
import torch
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(400, 3)), batch_size=4)
for epoch in range(100):
    for (x,) in loader:
        (x * 2).sum()
Path(sys.argv[1]).write_text("the loop ended by itself")
"""


def write_script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of 2 classes × 24 small JPEGs made with PIL."""
    root = tmp_path_factory.mktemp("watch_imgs")
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (root / cls).mkdir()
        for i in range(24):
            Image.fromarray(rng.integers(0, 255, (36, 44, 3), dtype=np.uint8)).save(root / cls / f"{i}.jpg")
    return root


@pytest.fixture
def scripts(tmp_path: Path) -> dict[str, Path]:
    return {
        "small_cnn": write_script(tmp_path, "train_cnn.py", SMALL_CNN),
        "raises": write_script(tmp_path, "raises.py", RAISES),
        "no_loader": write_script(tmp_path, "no_loader.py", NO_LOADER),
        "until_interrupted": write_script(tmp_path, "until_int.py", UNTIL_INTERRUPTED),
        "long": write_script(tmp_path, "long.py", LONG),
    }
