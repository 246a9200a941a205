"""Batched, per-sample augmentation on the device: ``from dlstore.gpu import GpuAugment``."""

from dlstore.gpu.augment import AugmentParams, GpuAugment, normalize

__all__ = ["AugmentParams", "GpuAugment", "normalize"]
