"""Training loops that nobody here wrote, under ``dlstore watch`` with its defaults, on a tiny image folder:
the loop cannot tell it is watched (RELIABILITY.md H1). Each runs once unwatched and once watched, in real
child processes through the installed entry point, and the loop's own counters must match line for line
while watch's stand-in steps (replay, trial) took real batches' places. Whole public training scripts
(timm, pytorch/examples, torchvision's reference) are in test_watch_real_scripts.py.

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


def start(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    # one intra-op thread: on a shared 2-core machine more spin against each other and the data
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} ran past 300 s\n{err[-3000:]}") from None
    return proc.returncode, out, err


def watched_and_plain(script: Path, args: list[str], tmp_path: Path) -> tuple[dict[str, Any], str, str]:
    """(watch's report, the script's output watched, its output unwatched), both runs ended with 0.

    The two runs go side by side, each in a folder of its own (a script may write checkpoints or logs into
    its working folder): the unwatched one is the reference, and the comparison is of counters, never of
    times, so sharing the machine changes nothing checked and halves the wait."""
    plain_run = start([sys.executable, str(script), *args], tmp_path / "plain")
    try:
        watched_run = start(
            [*dlstore_exe(), "watch", "--json", "--", "python", str(script), *args], tmp_path / "watched"
        )
        code, report, err = finish(watched_run)
    finally:
        plain_code, plain, plain_err = finish(plain_run)
    assert plain_code == 0, plain_err
    assert code == 0, err  # --json: the script's stdout goes to stderr, the report to stdout
    doc = json.loads(report)
    assert doc["status"] == "completed" and doc["exit_code"] == 0
    # stdout and stderr both: a script may count its steps through logging, which writes to stderr
    return doc, err, plain + plain_err


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
