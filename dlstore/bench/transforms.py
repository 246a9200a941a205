"""The bench's transforms: torchvision on PIL images for raw files, v2 on uint8 tensors for cached kinds,
and what runs on the device after the copy. Module-level classes, so they pickle into spawn workers."""

from __future__ import annotations

from typing import Any

import torch

from dlstore.bench.protocol import AUGMENT_DEGREES, AUGMENT_SCALE


class ToFloat(torch.nn.Module):
    """uint8 → float32 in [0, 1], the ToTensor scaling, done on the device after the copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) / 255.0  # never in place: a float input may be a reused batch


def augment_steps(T: Any, size: int, **crop: Any) -> list[Any]:
    """The bench's augmentation in torchvision's module ``T`` (v1 or v2): crop, rotation, flip."""
    return [
        T.RandomResizedCrop(size, scale=AUGMENT_SCALE, **crop),
        T.RandomRotation(AUGMENT_DEGREES),
        T.RandomHorizontalFlip(),
    ]


def raw_transform(kind: str, size: int, native: int | None) -> Any:
    """torchvision transforms on PIL images, as users write them."""
    from torchvision import transforms as T

    fit = [] if native == size else [T.Resize(size), T.CenterCrop(size)]
    if kind == "light":
        return T.Compose([*fit, T.ToTensor()])
    if kind == "augment":
        return T.Compose([*augment_steps(T, size), T.ToTensor()])
    return T.Compose([*fit, T.PILToTensor()])  # gpu-augment: uint8 to the device


def cached_cpu_transform(kind: str, size: int, boxes: bool = False) -> Any:
    """Per-sample CPU augmentation of uint8 CHW tensors (torchvision v2), for cached kinds. A cache with
    fields hands it (image, target): v2 moves the masks and boxes too, and with ``boxes`` drops the ones
    left with no area (``SanitizeBoundingBoxes``), as a detection pipeline does."""
    if kind != "augment":
        return None
    from torchvision.transforms import v2

    return v2.Compose(
        [*augment_steps(v2, size, antialias=True), *([v2.SanitizeBoundingBoxes()] if boxes else [])]
    )


def raw_field_transform(kind: str, size: int, boxes: bool) -> Any:
    """``raw_transform`` for a source of fields, in v2: masks and boxes move with the image."""
    from torchvision.transforms import v2

    fit = augment_steps(v2, size) if kind == "augment" else [v2.Resize(size), v2.CenterCrop(size)]
    tail = [] if kind == "gpu-augment" else [v2.ToDtype(torch.float32, scale=True)]
    return v2.Compose([v2.ToImage(), *fit, *([v2.SanitizeBoundingBoxes()] if boxes else []), *tail])


def device_transform(kind: str, size: int, device: torch.device) -> torch.nn.Module:
    if kind == "gpu-augment":
        from dlstore.gpu import GpuAugment

        return GpuAugment(size, scale=AUGMENT_SCALE, degrees=AUGMENT_DEGREES).to(device)
    return ToFloat()
