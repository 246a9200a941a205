"""Models the bench trains, and the one training step every measurement shares.

``smallcnn`` is the model of the two seed experiments; ``resnet18``/``resnet50`` are torchvision's with
random weights; ``MODULE:CALLABLE`` imports a factory (called with whichever of ``in_channels``,
``image_size``, ``num_classes`` it accepts).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from dlstore.errors import DlstoreError

BUILTIN_MODELS = ("smallcnn", "resnet18", "resnet50")
SMALLCNN_SEED_PARAMS = 105_866  # 1×28×28 input, 10 classes, as in the seed experiments


class SmallCNN(nn.Module):
    """conv C→16 3×3 + ReLU + 2×2 max-pool, conv 16→32 3×3 + ReLU + 2×2 max-pool, Linear →64 → classes.

    At 1×28×28 and 10 classes: Linear 1568→64→10, 105,866 parameters.
    """

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
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise DlstoreError(f"--model {spec}: cannot import {attr!r} from {module_name!r} ({e})") from None
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


class TrainStep:
    """``step(x, y)``: optional on-device input transform, forward, cross-entropy, backward, Adam step.

    FP32 with TF32 off (the seeds' protocol). ``x`` and ``y`` must already be on ``device``.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        device_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self.model = model.to(device).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.device_transform = device_transform

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with record_function("forward_backward_step"):
            if self.device_transform is not None:
                x = self.device_transform(x)
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()


def configure_numerics(device: torch.device) -> None:
    """FP32 without TF32; cudnn picks kernels per shape, hence a warm-up per input shape."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
