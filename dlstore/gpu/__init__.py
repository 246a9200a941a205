"""Batched, per-sample augmentation on the device: ``from dlstore.gpu import GpuAugment``; crops of
variable-size (ragged) batches: ``RaggedRandomResizedCrop``, ``RaggedCenterCrop``."""

from dlstore.gpu.augment import AugmentParams, GpuAugment, normalize
from dlstore.gpu.ragged import RaggedCenterCrop, RaggedRandomResizedCrop

__all__ = ["AugmentParams", "GpuAugment", "RaggedCenterCrop", "RaggedRandomResizedCrop", "normalize"]
