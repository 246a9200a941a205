"""The step runs like the user's: precision, channels_last, batch-size defaults, a user's own step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dlstore.bench.models import (
    SmallCNN,
    StepOptions,
    TrainStep,
    UserStep,
    configure_numerics,
    default_batch_size,
    numerics_state,
    resolve_step_options,
    restore_numerics,
)
from dlstore.bench.protocol import BenchConfig
from dlstore.errors import DlstoreError

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only resolved, never used, so these tests need no GPU


def test_defaults_are_what_a_user_trains_with() -> None:
    assert default_batch_size("resnet50", "cuda") == 256 and default_batch_size("resnet18", "cuda") == 256
    assert default_batch_size("resnet50", "cpu") == 32
    assert resolve_step_options(None, None, False, CUDA, SmallCNN()) == StepOptions("bf16", True, False)
    assert resolve_step_options(None, None, False, CPU, SmallCNN()) == StepOptions("fp32", False, False)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    assert resolve_step_options(None, None, False, CUDA, mlp).channels_last is False  # not a conv net
    assert resolve_step_options("tf32", False, True, CUDA, SmallCNN()) == StepOptions("tf32", False, True)
    with pytest.raises(DlstoreError, match="fp16 needs CUDA"):
        resolve_step_options("fp16", None, False, CPU, SmallCNN())
    with pytest.raises(DlstoreError, match="--precision"):
        StepOptions("fp8")


def test_bf16_channels_last_step_runs_and_says_so() -> None:
    step = TrainStep(SmallCNN(3, 16, 4), CPU, None, StepOptions("bf16", channels_last=True))
    before = [p.detach().clone() for p in step.model.parameters()]
    step(torch.rand(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))
    assert any(not torch.equal(a, b) for a, b in zip(before, step.model.parameters()))  # it trained
    assert step.model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    d = step.describe()
    assert d["precision"] == "bf16" and d["autocast_dtype"] == "bfloat16" and d["channels_last"] is True
    assert d["optimizer"]["type"] == "Adam" and d["model_params"] > 0


def test_numerics_follow_the_precision_and_are_restored() -> None:
    saved = numerics_state()
    try:
        configure_numerics(CPU, "tf32")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        configure_numerics(CPU, "fp32")
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        restore_numerics(saved)
    assert numerics_state() == saved


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_train.py").write_text(
        "calls = []\n"
        "def train_step(images, labels):\n"
        "    calls.append((tuple(images.shape), str(images.dtype), tuple(labels.shape)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_train", None)
    return "my_train:train_step"


def test_user_step_gets_device_batches_after_the_device_transform(user_module: str) -> None:
    from dlstore.bench.transforms import ToFloat

    step = UserStep(user_module, CPU, ToFloat())
    step(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))
    assert sys.modules["my_train"].calls == [((2, 3, 4, 4), "torch.float32", (2,))]
    with pytest.raises(DlstoreError, match="MODULE:CALLABLE"):
        UserStep("no_colon", CPU)
    with pytest.raises(DlstoreError, match="cannot import"):
        UserStep("my_train:missing", CPU)


def test_bench_runs_a_user_step_end_to_end(user_module: str, bench_env: Path) -> None:
    from dlstore.bench.run import run_bench

    doc = run_bench(
        BenchConfig(
            loaders=("ram",),
            workers=(0,),
            step=user_module,
            demo_images=40,
            size=16,
            batch_size=8,
            steps=2,
            warmup=1,
            repeats=1,
            stage_steps=2,
            cold=False,
        )
    )
    assert doc["protocol"]["step"] == {
        "kind": "user",
        "step": user_module,
        "model_params": None,
        "optimizer": None,
    }
    assert doc["runs"][0]["img_per_s"] > 0 and len(sys.modules["my_train"].calls) > 3
    assert doc["config"]["batch_size"] == 8 and doc["protocol"]["numerics"]["precision"] is None
