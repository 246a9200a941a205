"""Public training scripts, vendored unmodified under tests/third_party (each with its licence and a SOURCE
naming repository, commit and paths), under ``dlstore watch`` with its defaults on a tiny image folder, on
the CPU: exit code and the script's own per-step counters must equal the unwatched run's, line for line,
while watch's stand-in steps took real batches' places (RELIABILITY.md H1).

- timm's train.py (huggingface/pytorch-image-models): its own dataset and loader, and per-epoch accounting
  that derives its gradient-accumulation steps from ``len(loader)`` (one batch past it used to end in
  ``ZeroDivisionError: integer modulo by zero``).
- pytorch/examples' imagenet/main.py: ImageFolder, DataLoader and a ProgressMeter over ``len(loader)``.
- pytorch/vision's references/classification/train.py: its MetricLogger counts steps against
  ``len(data_loader)``.

Each prints a line per step (print frequency 1); only the epoch and step fields are compared, never times
or losses. Both imagenet scripts measure top-5 accuracy, hence five classes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_watch_third_party import assert_stand_ins_took_places, counters, watched_and_plain

THIRD_PARTY = Path(__file__).resolve().parents[2] / "third_party"
CLASSES, TRAIN, VAL, BATCH, EPOCHS = 5, 8, 2, 4, 2
STEPS = CLASSES * TRAIN // BATCH  # per epoch


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ and val/ splits of 5 classes of small JPEGs (8 + 2 each), made with PIL."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("imagenet_like")
    rng = np.random.default_rng(0)
    for split, n in (("train", TRAIN), ("val", VAL)):
        for c in range(CLASSES):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(img).save(root / split / f"c{c}" / f"{i}.jpg")
    return root


def check(script: Path, args: list[str], tmp_path: Path, step: str, test: str) -> None:
    """Both runs end with 0; STEP lines (one per training step) and TEST lines match watched and plain."""
    assert script.is_file(), script
    doc, watched, plain = watched_and_plain(script, args, tmp_path)
    pattern = f"^({step}|{test})"
    assert counters(watched, pattern) == counters(plain, pattern)
    assert len(counters(plain, f"^{step}")) == EPOCHS * STEPS, plain
    assert_stand_ins_took_places(doc, EPOCHS * STEPS)


def test_timm_train_py_counts_as_unwatched(imagenet_like: Path, tmp_path: Path) -> None:
    pytest.importorskip("timm")
    args = [str(imagenet_like), "--val-split", "val", "--model", "test_resnet", "--img-size", "32",
            "-b", str(BATCH), "-j", "0", "--epochs", str(EPOCHS), "--device", "cpu", "--no-prefetcher",
            "--log-interval", "1", "--output", "out"]  # fmt: skip  # in each run's own working folder
    check(THIRD_PARTY / "pytorch-image-models" / "train.py", args, tmp_path,
          r"Train: \d+ \[ *\d+/\d+", r"Test: \[ *\d+/\d+\]")  # fmt: skip


def test_pytorch_examples_imagenet_counts_as_unwatched(imagenet_like: Path, tmp_path: Path) -> None:
    # its crops are fixed at 224 px: the smallest torchvision model keeps both runs to seconds
    args = [str(imagenet_like), "-a", "mobilenet_v3_small", "--no-accel", "-b", str(BATCH), "-j", "0",
            "--epochs", str(EPOCHS), "-p", "1"]  # fmt: skip
    check(THIRD_PARTY / "examples" / "imagenet" / "main.py", args, tmp_path,
          r"Epoch: \[\d+\]\[ *\d+/\d+\]", r"Test: \[ *\d+/\d+\]")  # fmt: skip


def test_torchvision_reference_counts_as_unwatched(imagenet_like: Path, tmp_path: Path) -> None:
    args = ["--data-path", str(imagenet_like), "--device", "cpu", "--model", "resnet18", "-b", str(BATCH),
            "-j", "0", "--epochs", str(EPOCHS), "--print-freq", "1", "--train-crop-size", "32",
            "--val-resize-size", "32", "--val-crop-size", "32", "--output-dir", ""]  # fmt: skip
    check(THIRD_PARTY / "vision" / "references" / "classification" / "train.py", args, tmp_path,
          r"Epoch: \[\d+\] +\[ *\d+/\d+\]", r"Test: +\[ *\d+/\d+\]")  # fmt: skip
