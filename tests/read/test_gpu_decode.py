"""DecodeLoader and the batched JPEG decode with its CPU fallback (run on CPU; CUDA uses the same code)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.io

from dlstore import convert, open_cache
from dlstore.formats import FORMATS
from dlstore.gpu.ragged import RaggedRandomResizedCrop
from dlstore.read.gpu_decode import DecodeLoader, decode_on_device

FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)


@pytest.fixture(scope="module")
def jpeg_cache(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("gpu-decode") / "c"
    convert(image_tree, dest, format=FORMAT, size=24, resize="shorter", codec="jpeg", workers=2)
    return dest


@pytest.mark.parametrize("decode_in", ["stream", "thread"])
def test_loader_yields_fixed_size_batches_covering_the_epoch(jpeg_cache: Path, decode_in: str) -> None:
    crop = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(0))
    loader = DecodeLoader(
        jpeg_cache, batch_size=5, transform=crop, device="cpu", drop_last=False, decode_in=decode_in
    )
    labels = []
    for images, batch_labels in loader:
        assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.float32
        labels += batch_labels.tolist()
    cache = open_cache(jpeg_cache)
    assert sorted(labels) == sorted(cache.labels.tolist())
    assert loader.stats.cpu_images == len(cache)


def test_ragged_cache_needs_a_transform(jpeg_cache: Path) -> None:
    with pytest.raises(ValueError, match="RaggedRandomResizedCrop"):
        DecodeLoader(jpeg_cache, batch_size=4, device="cpu")
    with pytest.raises(ValueError, match="decode_in"):
        DecodeLoader(jpeg_cache, batch_size=4, transform=lambda x: x, device="cpu", decode_in="gpu")


def test_batched_decode_equals_cpu_decode_and_falls_back_per_image(
    jpeg_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = open_cache(jpeg_cache)
    index = np.arange(6)
    payloads, shapes = cache.read_payloads(index)
    positions = cache.positions[index]
    out, fallbacks = decode_on_device(cache, payloads, shapes, positions, torch.device("cpu"))
    assert fallbacks == 0
    cpu = cache.read_images(index)
    for a, b in zip(out, cpu):
        assert tuple(a.shape) == (b.shape[2], b.shape[0], b.shape[1])
        assert (a.permute(1, 2, 0).int() - torch.from_numpy(b).int()).abs().float().mean() < 1.5

    real = torchvision.io.decode_jpeg

    def refuse_third(data, mode, device):  # type: ignore[no-untyped-def]
        if isinstance(data, list):
            raise RuntimeError("nvjpeg: batch failed")
        if data.numel() == len(payloads[2]):
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, mode=mode, device=device)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuse_third)
    out, fallbacks = decode_on_device(cache, payloads, shapes, positions, torch.device("cpu"))
    assert fallbacks == 1
    np.testing.assert_array_equal(out[2].permute(1, 2, 0).numpy(), cpu[2])


@pytest.mark.parametrize("decode_in", ["stream", "thread"])
def test_an_abandoned_epoch_stops_its_threads_promptly(jpeg_cache: Path, decode_in: str) -> None:
    import threading

    crop = RaggedRandomResizedCrop(8)
    loader = DecodeLoader(
        jpeg_cache, batch_size=2, transform=crop, device="cpu", read_ahead=1, decode_in=decode_in
    )
    it = iter(loader)
    next(it)
    it.close()  # type: ignore[attr-defined]
    # a join that had timed out would leave them alive
    assert not [t for t in threading.enumerate() if t.name in ("dlstore-read-ahead", "dlstore-decode")]
