"""Training loops that nobody here wrote, under ``dlstore watch`` with its defaults, on a tiny image folder:
the loop cannot tell it is watched (RELIABILITY.md H1). Each runs once unwatched and once watched, in real
child processes through the installed entry point, and the loop's own counters must match line for line
while watch's stand-in steps (replay, trial) took real batches' places.

- timm: its dataset, loader, model, optimizer and scheduler from the library, and train.py's per-epoch
  accounting, which derives its gradient-accumulation steps from ``len(loader)`` (one batch past it used
  to end in ``ZeroDivisionError: integer modulo by zero``).
- Lightning: the ``Trainer``'s own fit loop, which prefetches a batch ahead, learns the epoch's end from
  ``StopIteration`` and counts ``batch_idx``, ``num_training_batches`` and ``global_step`` itself.
- Ignite: its ``Engine`` takes ``epoch_length`` from ``len(loader)`` and counts iterations and epochs
  against it (an epoch that ends early is an error there, one that runs long is cut).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import write_script

# train.py's train_one_epoch accounting (huggingface/pytorch-image-models), on timm's own loader parts
TIMM_LOOP = """
import sys
import torch
from timm import create_model
from timm.data import create_dataset, create_loader
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

root, epochs, accum = sys.argv[1], 2, 1
torch.manual_seed(0)
dataset = create_dataset("", root=root, split="train", is_training=True)
loader = create_loader(dataset, input_size=(3, 16, 16), batch_size=4, is_training=True, use_prefetcher=False,
                       num_workers=0, device=torch.device("cpu"))
model = create_model("test_resnet", num_classes=2)
optimizer = create_optimizer_v2(model, opt="sgd", lr=0.01)
updates_per_epoch = (len(loader) + accum - 1) // accum
scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=epochs, warmup_epochs=0,
                                   updates_per_epoch=updates_per_epoch)
num_updates = 0
for epoch in range(epochs):
    accum_steps = accum
    last_accum_steps = len(loader) % accum_steps
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    for batch_idx, (x, y) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        update_idx = batch_idx // accum_steps
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        loss = torch.nn.functional.cross_entropy(model(x), y) / accum_steps
        loss.backward()
        if need_update:
            optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            scheduler.step_update(num_updates=num_updates)
        print(f"Train: {epoch} [{update_idx:>4d}/{updates_per_epoch}]", flush=True)
    scheduler.step(epoch + 1)
print(f"updates {num_updates}", flush=True)
"""

LIGHTNING_LOOP = """
import sys
import lightning as L
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                       torch.nn.Flatten(), torch.nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        print(f"epoch {self.current_epoch} batch {batch_idx}/{self.trainer.num_training_batches}", flush=True)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
loader = DataLoader(ImageFolder(sys.argv[1], T.Compose([T.RandomResizedCrop(16), T.ToTensor()])), batch_size=4,
                    shuffle=True)
trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Net(), loader)
print(f"global_step {trainer.global_step}", flush=True)
"""


IGNITE_LOOP = """
import sys
import torch
import torchvision.transforms as T
from ignite.engine import Events, create_supervised_trainer
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

torch.manual_seed(0)
loader = DataLoader(ImageFolder(sys.argv[1], T.Compose([T.RandomResizedCrop(16), T.ToTensor()])), batch_size=4,
                    shuffle=True, num_workers=1)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                            torch.nn.Flatten(), torch.nn.Linear(4, 2))
trainer = create_supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                    torch.nn.functional.cross_entropy)


@trainer.on(Events.ITERATION_COMPLETED)
def log(engine):
    s = engine.state
    print(f"epoch {s.epoch} iteration {s.iteration} of {s.epoch_length}", flush=True)


trainer.run(loader, max_epochs=2)
print(f"done {trainer.state.iteration}", flush=True)
"""


def dlstore_exe() -> list[str]:
    exe = shutil.which("dlstore", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-c", "from dlstore.cli import main; main()"]


def run(command: list[str], cwd: Path) -> tuple[int, str, str]:
    # one intra-op thread: on a shared 2-core machine more spin against each other and the data
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def watched_and_plain(script: Path, args: list[str], tmp_path: Path) -> tuple[dict[str, Any], str, str]:
    """(watch's report, the script's output watched, its output unwatched), both runs ended with 0."""
    code, plain, err = run([sys.executable, str(script), *args], tmp_path)
    assert code == 0, err
    code, report, err = run([*dlstore_exe(), "watch", "--json", "--", "python", str(script), *args], tmp_path)
    assert code == 0, err  # --json: the script's stdout goes to stderr, the report to stdout
    doc = json.loads(report)
    assert doc["status"] == "completed" and doc["exit_code"] == 0
    return doc, err, plain


def counters(text: str, pattern: str) -> list[str]:
    return re.findall(pattern, text, flags=re.MULTILINE)


def assert_stand_ins_took_places(doc: dict[str, Any], batches: int) -> None:
    train = next(r for r in doc["loaders"] if r["index"] == doc["primary"])
    assert train["stand_in_steps"] == train["steps_replayed"] + train["steps_trial"] > 0
    assert train["steps_observed"] + train["stand_in_steps"] == batches


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ and validation/ splits of 2 classes of small JPEGs (24 + 4 each), made with PIL."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("third_party_imgs")
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("validation", 4)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(img).save(root / split / cls / f"{i}.jpg")
    return root


def test_timm_train_loop_counts_as_unwatched(folders: Path, tmp_path: Path) -> None:
    pytest.importorskip("timm")
    script = write_script(tmp_path, "timm_loop.py", TIMM_LOOP)
    doc, watched, plain = watched_and_plain(script, [str(folders)], tmp_path)
    pattern = r"^(Train: \d+ \[ *\d+/\d+\]|updates \d+)$"
    assert counters(watched, pattern) == counters(plain, pattern)
    assert len(counters(plain, r"^Train: ")) == 2 * 12 and "updates 24" in plain
    assert_stand_ins_took_places(doc, 2 * 12)


@pytest.mark.slow
def test_lightning_trainer_counts_as_unwatched(folders: Path, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    script = write_script(tmp_path, "lightning_loop.py", LIGHTNING_LOOP)
    doc, watched, plain = watched_and_plain(script, [str(folders / "train")], tmp_path)
    pattern = r"^(epoch \d+ batch \d+/\d+|global_step \d+)$"
    assert counters(watched, pattern) == counters(plain, pattern)
    assert len(counters(plain, r"^epoch ")) == 2 * 12 and "global_step 24" in plain
    assert_stand_ins_took_places(doc, 2 * 12)


@pytest.mark.slow
def test_ignite_engine_counts_as_unwatched(folders: Path, tmp_path: Path) -> None:
    pytest.importorskip("ignite")
    script = write_script(tmp_path, "ignite_loop.py", IGNITE_LOOP)
    doc, watched, plain = watched_and_plain(script, [str(folders / "train")], tmp_path)
    pattern = r"^(epoch \d+ iteration \d+ of \d+|done \d+)$"
    assert counters(watched, pattern) == counters(plain, pattern)
    assert len(counters(plain, r"^epoch ")) == 2 * 12 and "done 24" in plain
    assert_stand_ins_took_places(doc, 2 * 12)
