"""Models the bench trains (``smallcnn``, torchvision's ``resnet18``/``resnet50`` with random weights, or a
``MODULE:CALLABLE`` factory taking any of ``in_channels``, ``image_size``, ``num_classes``) and the one
training step every measurement shares."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from dlstore.errors import DlstoreError

BUILTIN_MODELS = ("smallcnn", "resnet18", "resnet50")
SMALLCNN_SEED_PARAMS = 105_866  # 1×28×28 input, 10 classes, as in the seed experiments


class SmallCNN(nn.Module):
    """conv C→16 + ReLU + pool, conv 16→32 + ReLU + pool, Linear →64 → classes (105,866 params at 1×28×28)."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        side = image_size // 4
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * side * side, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(name: str, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    if name == "smallcnn":
        model: nn.Module = SmallCNN(in_channels, image_size, num_classes)
        if (in_channels, image_size, num_classes) == (1, 28, 10):
            assert count_parameters(model) == SMALLCNN_SEED_PARAMS, count_parameters(model)
        return model
    if name in ("resnet18", "resnet50"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
        if in_channels != 3:
            model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)  # type: ignore[union-attr]
        return model
    if ":" in name:
        return _import_model(name, in_channels, image_size, num_classes)
    raise DlstoreError(f"unknown model {name!r}; choose {', '.join(BUILTIN_MODELS)} or MODULE:CALLABLE")


def _import_model(spec: str, in_channels: int, image_size: int, num_classes: int) -> nn.Module:
    factory = import_callable(spec, "--model")
    offered = {"in_channels": in_channels, "image_size": image_size, "num_classes": num_classes}
    try:
        params = inspect.signature(factory).parameters
        kwargs = {k: v for k, v in offered.items() if k in params}
    except (TypeError, ValueError):
        kwargs = {}
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise DlstoreError(f"--model {spec}: returned {type(model).__name__}, expected a torch.nn.Module")
    return model


PRECISIONS = ("bf16", "fp16", "fp32", "tf32")
# What a user would pick on a GPU (ResNets: 256, as in torchvision's reference recipes scaled to one GPU);
# on a CPU a training run is a smoke test, so the bench keeps batches small there.
GPU_BATCH_SIZES = {"smallcnn": 64, "resnet18": 256, "resnet50": 256}
GPU_BATCH_SIZE_OTHER = 128
CPU_BATCH_SIZE = 32


def default_batch_size(model: str, device_type: str) -> int:
    if device_type != "cuda":
        return CPU_BATCH_SIZE
    return GPU_BATCH_SIZES.get(model, GPU_BATCH_SIZE_OTHER)


def default_precision(device_type: str) -> str:
    """bf16 autocast on CUDA (what nearly everyone trains with on Hopper); fp32 on a CPU."""
    return "bf16" if device_type == "cuda" else "fp32"


def is_conv_net(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


@dataclass(frozen=True)
class StepOptions:
    """How the step runs: autocast precision, memory format, torch.compile."""

    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise DlstoreError(f"--precision {self.precision}: choose one of {', '.join(PRECISIONS)}")


def resolve_step_options(
    precision: str | None, channels_last: bool | None, compile_: bool, device: torch.device, model: nn.Module
) -> StepOptions:
    """Fill the defaults: bf16 on CUDA and fp32 on CPU; channels_last on for CUDA conv nets."""
    if precision == "fp16" and device.type == "cpu":
        raise DlstoreError("--precision fp16 needs CUDA; on a CPU use bf16 or fp32")
    cl = channels_last if channels_last is not None else device.type == "cuda" and is_conv_net(model)
    return StepOptions(precision or default_precision(device.type), cl, compile_)


def configure_numerics(device: torch.device, precision: str = "fp32") -> None:
    """TF32 only for tf32 (cudnn's also under autocast); cudnn picks kernels per shape (a warm-up each)."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32 or precision in ("bf16", "fp16")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def numerics_state() -> dict[str, Any]:
    """The global switches as they are now, to restore after a run."""
    b = torch.backends
    return {"matmul": b.cuda.matmul.allow_tf32, "cudnn": b.cudnn.allow_tf32, "benchmark": b.cudnn.benchmark}


def restore_numerics(state: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = state["matmul"]
    torch.backends.cudnn.allow_tf32 = state["cudnn"]
    torch.backends.cudnn.benchmark = state["benchmark"]


class TrainStep:
    """``step(x, y)`` as a user's loop runs it: device transform, forward, cross-entropy, backward, Adam;
    autocast (GradScaler for fp16), channels_last, optionally ``torch.compile``. Inputs on ``device``."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        device_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        options: StepOptions = StepOptions(),
    ) -> None:
        self.device = device
        self.options = options
        self.memory_format = torch.channels_last if options.channels_last else torch.contiguous_format
        self.model = model.to(device, memory_format=self.memory_format).train()
        self.forward = torch.compile(self.model) if options.compile else self.model
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.device_transform = device_transform
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.precision)
        self.scaler = torch.amp.GradScaler(device.type) if options.precision == "fp16" else None

    def __call__(self, x: torch.Tensor, y: Any) -> None:
        with record_function("forward_backward_step"):
            x, y = transformed(self.device_transform, x, y)
            if not isinstance(y, torch.Tensor):  # a target dict: the classifier's loss on stand-in labels
                y = torch.zeros(len(x), dtype=torch.long, device=x.device)
            x = x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(
                self.device.type,
                dtype=self.autocast_dtype or torch.float32,
                enabled=self.autocast_dtype is not None,
            ):
                loss = F.cross_entropy(self.forward(x), y)
            if self.scaler is None:
                loss.backward()
                self.optimizer.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "built-in",
            "model_params": count_parameters(self.model),
            "optimizer": describe_optimizer(self.optimizer),
            "precision": self.options.precision,
            "autocast_dtype": None
            if self.autocast_dtype is None
            else str(self.autocast_dtype).removeprefix("torch."),
            "grad_scaler": self.scaler is not None,
            "channels_last": self.options.channels_last,
            "compiled": self.options.compile,
        }


class UserStep:
    """``--step MODULE:CALLABLE``'s ``CALLABLE(images, labels)``, fed the built-in step's batches."""

    def __init__(
        self,
        spec: str,
        device: torch.device,
        device_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.spec = spec
        self.device = device
        self.fn = import_callable(spec, "--step")
        self.device_transform = device_transform
        self.model = None

    def __call__(self, x: torch.Tensor, y: Any) -> None:
        with record_function("forward_backward_step"):
            x, y = transformed(self.device_transform, x, y)
            self.fn(x, y)

    def describe(self) -> dict[str, Any]:
        return {"kind": "user", "step": self.spec, "model_params": None, "optimizer": None}


def transformed(transform: Callable[..., Any] | None, x: torch.Tensor, y: Any) -> tuple[torch.Tensor, Any]:
    """The device transform of a batch; with a target dict, a transform taking ``target`` moves it too."""
    if transform is None:
        return x, y
    if isinstance(y, dict) and "target" in inspect.signature(transform).parameters:
        return transform(x, target=y)  # type: ignore[no-any-return]
    return transform(x), y


def import_callable(spec: str, option: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DlstoreError(f"{option} {spec}: expected MODULE:CALLABLE, e.g. mytrain:train_step")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise DlstoreError(f"{option} {spec}: cannot import {attr!r} from {module_name!r} ({e})") from None
    if not callable(fn):
        raise DlstoreError(f"{option} {spec}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    hyper = {
        k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float, str, tuple, type(None)))
    }
    return {"type": type(optimizer).__name__, **hyper}
