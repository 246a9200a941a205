"""dlstore.gpu.ragged: crops of variable-size images (CPU tensors; the same code runs on CUDA).

The crop distribution is compared with torchvision's ``RandomResizedCrop.get_params`` the way
test_augment.py compares GpuAugment's: per image size, means within 5 standard errors and a
two-sample KS statistic below the alpha=1e-3 critical value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms import functional as TF

from dlstore.gpu.ragged import (
    RaggedCenterCrop,
    RaggedRandomResizedCrop,
    bilinear_gather,
    crop_coords,
    flat_batch,
    sample_crop_boxes,
)

N = 8_000
KS_C = math.sqrt(-math.log(1e-3 / 2) / 2)
SIZES = [(96, 128), (64, 200), (300, 40)]  # landscape, very wide (fallbacks), very tall


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    pts = np.concatenate([a, b])
    return float(
        np.abs(np.searchsorted(a, pts, "right") / a.size - np.searchsorted(b, pts, "right") / b.size).max()
    )


def _features(crops: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = crops.T
    return {
        "area_frac": h * w / (height * width),
        "aspect": w / h,
        "top_pos": (top + 0.5) / (height - h + 1),
        "left_pos": (left + 0.5) / (width - w + 1),
    }


@pytest.fixture(scope="module")
def mixed_batch_crops() -> dict[tuple[int, int], np.ndarray]:
    """One mixed batch: N images of each size, interleaved, drawn in a single call."""
    heights = torch.tensor([s[0] for s in SIZES] * N)
    widths = torch.tensor([s[1] for s in SIZES] * N)
    g = torch.Generator().manual_seed(3)
    boxes = torch.stack(sample_crop_boxes(heights, widths, generator=g), dim=1).double().numpy()
    return {size: boxes[i :: len(SIZES)] for i, size in enumerate(SIZES)}


@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_crop_distribution_matches_torchvision_per_image_size(
    mixed_batch_crops: dict[tuple[int, int], np.ndarray], size: tuple[int, int]
) -> None:
    height, width = size
    torch.manual_seed(1)
    img = torch.empty(1, height, width)
    ref = np.array([RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(N)], float)
    ours = mixed_batch_crops[size]
    top, left, h, w = ours.T
    assert (h >= 1).all() and (w >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    for name, a in _features(ref, height, width).items():
        b = _features(ours, height, width)[name]
        se = math.sqrt(a.var() / a.size + b.var() / b.size) + 1e-12
        assert abs(a.mean() - b.mean()) < 5 * se, (name, a.mean(), b.mean())
        assert _ks(a, b) < KS_C * math.sqrt(2 / N), name
    # the central fallback is hit as often as torchvision hits it
    fb = np.asarray(RandomResizedCrop.get_params(img, [5.0, 6.0], [3 / 4, 4 / 3]), float)
    p_ref, p_ours = (ref == fb).all(1).mean(), (ours == fb).all(1).mean()
    assert abs(p_ref - p_ours) < 5 * math.sqrt(max(p_ref * (1 - p_ref), 1 / N) * 2 / N)


@pytest.mark.parametrize("size", [(40, 400), (400, 40), (50, 60)])
def test_fallback_is_torchvision_central_crop(size: tuple[int, int]) -> None:
    h, w = size
    expected = RandomResizedCrop.get_params(torch.empty(1, h, w), [5.0, 6.0], [3 / 4, 4 / 3])
    got = sample_crop_boxes(torch.tensor([h] * 4), torch.tensor([w] * 4), scale=(5.0, 6.0))
    for value, tensor in zip(expected, got):
        assert (tensor == value).all()


def _image(h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)


def test_crop_pixels_equal_torchvision_resized_crop_without_antialias() -> None:
    images = [_image(40, 60, 0), _image(70, 33, 1), _image(25, 25, 2)]
    flat, starts, heights, widths = flat_batch(images)
    boxes = [(3, 5, 30, 41), (0, 0, 70, 33), (10, 12, 15, 13)]  # incl. a full image and an upscale
    top, left, h, w = (torch.tensor(v) for v in zip(*boxes))
    flip = torch.tensor([False, True, False])
    sx, sy = crop_coords(top, left, h, w, flip, (24, 32))
    out = bilinear_gather(flat, starts, heights, widths, 3, sx, sy)
    for i, (img, box) in enumerate(zip(images, boxes)):
        ref = TF.resized_crop(img.float()[None], *box, [24, 32], antialias=False)[0]
        if flip[i]:
            ref = ref.flip(-1)
        assert torch.allclose(out[i], ref, atol=1e-3), (i, (out[i] - ref).abs().max())


def test_random_resized_crop_output_and_flip_rate() -> None:
    images = [_image(40 + 3 * i, 90 - 2 * i, i) for i in range(16)]
    crop = RaggedRandomResizedCrop(
        24, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), generator=torch.Generator().manual_seed(0)
    )
    out = crop(images)
    assert out.shape == (16, 3, 24, 24) and out.dtype == torch.float32
    assert out.min() >= -2.0 - 1e-5 and out.max() <= 2.0 + 1e-5
    heights = torch.full((4000,), 10)
    flips = crop.boxes(heights, heights)[4]
    assert abs(flips.float().mean().item() - 0.5) < 5 * math.sqrt(0.25 / 4000)


def test_center_crop_matches_torchvision_resize_center_crop_on_the_square() -> None:
    img = _image(64, 96, 4)
    out = RaggedCenterCrop(32, crop_fraction=0.5, out_dtype=torch.float64)([img])
    ref = TF.resized_crop(img.float()[None], 16, 32, 32, 32, [32, 32], antialias=False)[0] / 255
    assert torch.allclose(out[0].float(), ref, atol=1e-5)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        RaggedRandomResizedCrop(8)([torch.zeros(3, 4, 4)])
    with pytest.raises(ValueError, match="empty"):
        RaggedRandomResizedCrop(8)([])


def test_flat_images_crop_like_the_list_they_came_from() -> None:
    """A loader may hand the crop one flat buffer (FlatImages) instead of a list: same boxes, same pixels."""
    from dlstore.gpu.ragged import FlatImages

    images = [_image(40, 60, 0), _image(70, 33, 1), _image(25, 25, 2)]
    flat, starts, heights, widths = flat_batch(images)
    a = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3))
    b = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3))
    assert a.takes_flat
    torch.testing.assert_close(a(FlatImages(flat, starts, heights, widths, 3)), b(images), rtol=0, atol=0)
    # with the sizes on the host too (as DecodeLoader hands them over): the same draw, the same pixels
    host = torch.stack([starts, heights, widths]).numpy()
    c = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3))
    d = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        c(FlatImages(flat, starts, heights, widths, 3, host=host)), d(images), rtol=0, atol=0
    )


def test_crop_params_rows_hold_the_boxes_drawn_for_each_image() -> None:
    """The (B, 8) parameter rows the kernels read: each image's place in the flat buffer and size, and a
    box inside it (the same draw as ``boxes`` with the same generator)."""
    from dlstore.gpu.ragged import PARAM_COLUMNS, _flat_host

    images = [_image(40 + 5 * i, 70 - 3 * i, i) for i in range(6)]
    flat, host = _flat_host(images)
    crop = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(5))
    rows = crop.params(flat.device, host, None)
    assert rows.shape == (6, len(PARAM_COLUMNS)) and rows.dtype == torch.int64
    col = {k: rows[:, i] for i, k in enumerate(PARAM_COLUMNS)}
    sizes = [img.shape[1] * img.shape[2] * 3 for img in images]
    assert col["start"].tolist() == np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    assert col["height"].tolist() == [img.shape[1] for img in images]
    assert col["width"].tolist() == [img.shape[2] for img in images]
    assert bool(((col["top"] >= 0) & (col["top"] + col["crop_h"] <= col["height"])).all())
    assert bool(((col["left"] >= 0) & (col["left"] + col["crop_w"] <= col["width"])).all())
    ref = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(5))
    top, left, h, w, flip = ref.boxes(col["height"], col["width"])
    assert torch.equal(torch.stack([top, left, h, w, flip.long()], 1), rows[:, 3:])


def test_to_device_moves_host_and_device_tensors() -> None:
    """Crop rows drawn on the host or already on the device (a device generator) both arrive."""
    from dlstore.gpu.ragged import to_device

    t = torch.arange(6)
    assert torch.equal(to_device(t, torch.device("cpu")), t)
    if torch.cuda.is_available():
        on_gpu = to_device(t, torch.device("cuda"))
        assert on_gpu.is_cuda and torch.equal(to_device(on_gpu, torch.device("cuda")).cpu(), t)


def test_scattered_images_are_read_in_place_at_their_address_offsets() -> None:
    """``scattered_flat``: images that lie anywhere (here: views at odd places of one buffer, and one
    before the base) are described by address minus the base's address; read at those starts the
    buffer gives the same crops as the list, and ``gather()`` (the copy for the PyTorch path) too."""
    import dataclasses

    from dlstore.gpu.ragged import scattered_flat

    images = [_image(40, 60, 0), _image(70, 33, 1), _image(25, 25, 2)]
    buffer = torch.zeros(20_000, dtype=torch.uint8)
    places = [9_001, 13, 17_000]  # not in batch order; the base (below) starts after the second
    views = []
    for img, at in zip(images, places):
        views.append(buffer[at : at + img.numel()].view(img.shape))
        views[-1].copy_(img)
    hwc = np.array([[h, w, c] for c, h, w in (v.shape for v in views)])
    base = buffer[1_000:]
    batch = scattered_flat(base, np.array([v.data_ptr() for v in views]), hwc, lambda: views)
    assert batch.host is not None and batch.host[0].tolist() == [8_001, -987, 16_000]
    assert batch.starts.tolist() == [8_001, -987, 16_000] and batch.gather is not None
    # in place: the whole buffer with the starts moved by the base's offset (what the kernel's
    # pointer arithmetic does), read by the PyTorch path
    host = batch.host.copy()
    host[0] += 1_000
    meta = torch.from_numpy(host)
    in_place = dataclasses.replace(batch, flat=buffer, starts=meta[0], host=host, gather=None)
    seeds = [RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(4)) for _ in range(3)]
    want = seeds[0](images)
    torch.testing.assert_close(seeds[1](in_place), want, rtol=0, atol=0)
    torch.testing.assert_close(seeds[2](batch), want, rtol=0, atol=0)  # no kernel on CPU: gathered
