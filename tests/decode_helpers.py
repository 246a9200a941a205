"""A DecodeLoader whose batches are split with CPU decode workers, on a machine without a GPU: the
"device" is the CPU and torchvision's CPU decode stands in for nvJPEG (tests/read)."""

from __future__ import annotations

from pathlib import Path

from dlstore.read.gpu_decode import DecodeLoader


def cpu_split_loader(
    path: Path, share: float | None, batch: int = 4, order: str = "sequential", **kw: object
) -> DecodeLoader:
    """Batches of ``batch`` (the last one short) as lists of decoded tensors, ``share`` of each decoded by
    2 CPU worker processes (None: the automatic split)."""
    loader = DecodeLoader(
        path,
        batch_size=batch,
        transform=lambda images: images,  # type: ignore[arg-type,return-value]
        device="cpu",
        order=order,
        drop_last=False,
        cpu_decoders=2,
        cpu_share=share,
        **kw,  # type: ignore[arg-type]
    )
    loader.gpu = True
    return loader
