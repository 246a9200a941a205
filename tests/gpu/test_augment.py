"""Tests for dlstore.gpu.augment.GpuAugment (CPU tensors).

Statistical tolerances: every comparison is seeded, so the tests are
deterministic; the bounds are still chosen so that a correct implementation
would fail them with probability ~1e-3 or less for an arbitrary seed:
means within 5 standard errors, probabilities within 5 binomial standard
errors, and two-sample KS statistics below the alpha=1e-3 critical value
c * sqrt((n + m) / (n * m)) with c = sqrt(-ln(alpha / 2) / 2) ~= 1.95
(conservative for the discrete crop sizes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dlstore.gpu.augment import AugmentParams, GpuAugment, normalize

N = 20_000
KS_C = math.sqrt(-math.log(1e-3 / 2) / 2)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _ks_stat(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample KS statistic: max |ECDF_a - ECDF_b| over all sample points."""
    a, b = np.sort(a), np.sort(b)
    pts = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, pts, side="right") / a.size
    cdf_b = np.searchsorted(b, pts, side="right") / b.size
    return float(np.abs(cdf_a - cdf_b).max())


def _torchvision_crops(height: int, width: int, n: int, seed: int) -> np.ndarray:
    from torchvision import transforms

    torch.manual_seed(seed)
    img = torch.empty(1, height, width)
    get = transforms.RandomResizedCrop.get_params
    return np.array([get(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)], dtype=np.float64)


def _ours_crops(height: int, width: int, n: int, seed: int) -> np.ndarray:
    p = GpuAugment(32, generator=_gen(seed)).sample_params(n, height, width, "cpu")
    return torch.stack([p.top, p.left, p.height, p.width], dim=1).double().numpy()


def _crop_features(crops: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = crops.T
    # Normalised by the free range so positions are ~U(0, 1) for any crop size.
    return {
        "area_frac": h * w / (height * width),
        "aspect": w / h,
        "top_pos": (top + 0.5) / (height - h + 1),
        "left_pos": (left + 0.5) / (width - w + 1),
    }


@pytest.fixture(scope="module", params=[(96, 128), (64, 200)], ids=["96x128", "64x200"])
def crop_samples(request: pytest.FixtureRequest) -> tuple[int, int, np.ndarray, np.ndarray]:
    height, width = request.param
    return height, width, _torchvision_crops(height, width, N, 1), _ours_crops(height, width, N, 2)


def test_crops_are_valid(crop_samples: tuple[int, int, np.ndarray, np.ndarray]) -> None:
    height, width, _, ours = crop_samples
    top, left, h, w = ours.T
    assert (h >= 1).all() and (w >= 1).all()
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()


@pytest.mark.parametrize("feature", ["area_frac", "aspect", "top_pos", "left_pos"])
def test_crop_distribution_matches_torchvision(
    crop_samples: tuple[int, int, np.ndarray, np.ndarray], feature: str
) -> None:
    height, width, ref, ours = crop_samples
    a = _crop_features(ref, height, width)[feature]
    b = _crop_features(ours, height, width)[feature]
    n, m = a.size, b.size

    se = math.sqrt(a.var() / n + b.var() / m)
    assert abs(a.mean() - b.mean()) < 5 * se, (a.mean(), b.mean(), se)

    # Quantiles compared on the probability scale: the reference quantile must
    # sit at ~p in our ECDF (binomial standard error of both ECDFs).
    for p in (0.1, 0.25, 0.5, 0.75, 0.9):
        q = np.quantile(a, p)
        p_ours = np.mean(b <= q)
        p_ref = np.mean(a <= q)
        tol = 5 * math.sqrt(p * (1 - p) * (1 / n + 1 / m)) + 1e-12
        assert abs(p_ours - p_ref) < tol, (feature, p, p_ref, p_ours, tol)

    ks = _ks_stat(a, b)
    assert ks < KS_C * math.sqrt((n + m) / (n * m)), (feature, ks)


def test_crop_fallback_rate_matches_torchvision(
    crop_samples: tuple[int, int, np.ndarray, np.ndarray],
) -> None:
    height, width, ref, ours = crop_samples
    fallback = GpuAugment(8, scale=(5.0, 6.0)).sample_params(1, height, width)  # every attempt fails
    expected = tuple(int(getattr(fallback, f)[0]) for f in ("top", "left", "height", "width"))
    p_ref = np.mean((ref == expected).all(axis=1))
    p_ours = np.mean((ours == expected).all(axis=1))
    if (height, width) == (64, 200):
        # in_ratio 3.125 > 4/3, so the fallback is (0, 57, 64, 85); each attempt
        # fails w.p. ~0.73, so ~4% of samples fall back.
        assert expected == (0, 57, 64, 85)
        assert 0.01 < p_ref < 0.1
    tol = 5 * math.sqrt(max(p_ref * (1 - p_ref), 1 / N) * 2 / N)
    assert abs(p_ours - p_ref) < tol, (p_ref, p_ours, tol)


@pytest.mark.parametrize(("height", "width"), [(40, 400), (400, 40), (50, 60)])
def test_fallback_is_torchvision_central_crop(height: int, width: int) -> None:
    from torchvision import transforms

    # An unreachable scale range makes all 10 attempts fail in both.
    scale, ratio = (5.0, 6.0), (3 / 4, 4 / 3)
    expected = transforms.RandomResizedCrop.get_params(
        torch.empty(1, height, width), list(scale), list(ratio)
    )
    p = GpuAugment(8, scale=scale, ratio=ratio, generator=_gen(0)).sample_params(16, height, width, "cpu")
    for field, value in zip(("top", "left", "height", "width"), expected):
        assert (getattr(p, field) == value).all(), (field, getattr(p, field)[:4], value)


def test_flip_probability() -> None:
    hflip_p = 0.3
    p = GpuAugment(16, hflip_p=hflip_p, generator=_gen(5)).sample_params(N, 32, 32, "cpu")
    assert p.flip.dtype == torch.bool
    rate = p.flip.double().mean().item()
    assert abs(rate - hflip_p) < 5 * math.sqrt(hflip_p * (1 - hflip_p) / N)
    assert not GpuAugment(16, hflip_p=0.0).sample_params(1000, 8, 8, "cpu").flip.any()
    assert GpuAugment(16, hflip_p=1.0).sample_params(1000, 8, 8, "cpu").flip.all()


def test_angles_uniform() -> None:
    d = 15.0
    angle = (
        GpuAugment(16, degrees=d, generator=_gen(6)).sample_params(N, 32, 32, "cpu").angle.double().numpy()
    )
    assert angle.min() >= -d and angle.max() <= d
    # One-sample KS against U(-d, d).
    x = np.sort(angle)
    cdf = (x + d) / (2 * d)
    i = np.arange(1, N + 1)
    ks = max(np.max(i / N - cdf), np.max(cdf - (i - 1) / N))
    assert ks < KS_C / math.sqrt(N), ks
    assert abs(angle.mean()) < 5 * (2 * d / math.sqrt(12)) / math.sqrt(N)
    assert (GpuAugment(16).sample_params(100, 8, 8, "cpu").angle == 0).all()


def test_deterministic_with_seeded_generator() -> None:
    x = torch.randint(0, 256, (4, 3, 48, 40), dtype=torch.uint8, generator=_gen(9))
    out1 = GpuAugment(24, degrees=10, generator=_gen(123))(x)
    out2 = GpuAugment(24, degrees=10, generator=_gen(123))(x)
    out3 = GpuAugment(24, degrees=10, generator=_gen(124))(x)
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, out3)


def test_forward_uses_sample_params() -> None:
    x = torch.randint(0, 256, (6, 3, 48, 40), dtype=torch.uint8, generator=_gen(10))
    g = _gen(77)
    aug = GpuAugment((20, 28), degrees=20, generator=g)
    params = aug.sample_params(6, 48, 40, x.device)
    g.manual_seed(77)
    assert torch.equal(aug(x), aug(x, params))


def _identity_aug(size: int, **kw: object) -> GpuAugment:
    return GpuAugment(size, scale=(1.0, 1.0), ratio=(1.0, 1.0), degrees=0.0, **kw)  # type: ignore[arg-type]


def test_identity_resample_is_exact() -> None:
    x = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=_gen(11))
    aug = _identity_aug(32, hflip_p=0.0, generator=_gen(0))
    p = aug.sample_params(3, 32, 32, "cpu")
    assert (p.top == 0).all() and (p.left == 0).all() and (p.height == 32).all() and (p.width == 32).all()
    out = aug(x)
    assert out.dtype == torch.float32 and out.shape == (3, 3, 32, 32)
    torch.testing.assert_close(out, x.float() / 255, atol=1e-6, rtol=0)


def test_forced_flip() -> None:
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=_gen(12))
    out = _identity_aug(32, hflip_p=1.0)(x)
    torch.testing.assert_close(out, x.flip(-1).float() / 255, atol=1e-6, rtol=0)


def _params(
    b: int, top: int, left: int, h: int, w: int, flip: bool = False, angle: float = 0.0
) -> AugmentParams:
    full = lambda v, dt: torch.full((b,), v, dtype=dt)  # noqa: E731
    return AugmentParams(
        top=full(top, torch.int64), left=full(left, torch.int64),
        height=full(h, torch.int64), width=full(w, torch.int64),
        flip=full(flip, torch.bool), angle=full(angle, torch.float32),
    )  # fmt: skip


def _tv_crop(x: torch.Tensor, top: int, left: int, h: int, w: int, size: list[int]) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as TF

    return TF.resized_crop(x.float() / 255, top, left, h, w, size, antialias=False)


def test_crop_matches_torchvision_downscale() -> None:
    # Scale factor >= 1: every sample lies between crop pixel centres, so
    # grid_sample and interpolate(align_corners=False) do identical maths.
    x = torch.randint(0, 256, (2, 3, 60, 80), dtype=torch.uint8, generator=_gen(13))
    aug = GpuAugment((16, 24), hflip_p=0.0)
    out = aug(x, _params(2, 9, 14, 40, 52))
    torch.testing.assert_close(out, _tv_crop(x, 9, 14, 40, 52, [16, 24]), atol=1e-5, rtol=0)


def test_crop_matches_torchvision_upscale() -> None:
    x = torch.randint(0, 256, (2, 3, 48, 64), dtype=torch.uint8, generator=_gen(14))
    aug = GpuAugment((40, 60), hflip_p=0.0)
    # Interior crop: the outermost output row/column lies half a source pixel
    # outside the crop's pixel centres. torchvision clamps to the crop edge,
    # we read the true neighbour pixel, so only that ring may differ.
    out = aug(x, _params(2, 5, 7, 20, 30))
    ref = _tv_crop(x, 5, 7, 20, 30, [40, 60])
    torch.testing.assert_close(out[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], atol=1e-5, rtol=0)
    assert not torch.allclose(out, ref, atol=1e-3)  # the ring really differs
    # Crop touching the image's top-left corner: padding_mode='border' clamps
    # there just like interpolate, so those edges match as well.
    out = aug(x, _params(2, 0, 0, 20, 30))
    ref = _tv_crop(x, 0, 0, 20, 30, [40, 60])
    torch.testing.assert_close(out[..., :-1, :-1], ref[..., :-1, :-1], atol=1e-5, rtol=0)


def test_flip_is_applied_after_crop() -> None:
    x = torch.randint(0, 256, (2, 3, 60, 80), dtype=torch.uint8, generator=_gen(15))
    aug = GpuAugment((16, 24))
    out = aug(x, _params(2, 9, 14, 40, 52, flip=True))
    torch.testing.assert_close(out, _tv_crop(x, 9, 14, 40, 52, [16, 24]).flip(-1), atol=1e-5, rtol=0)


def test_rotation_matches_torchvision() -> None:
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    size = 41
    x = torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8, generator=_gen(16))
    out = _identity_aug(size)(x, _params(2, 0, 0, size, size, angle=30.0))
    ref = TF.rotate(x.float() / 255, 30.0, interpolation=InterpolationMode.BILINEAR)
    # Compare inside a disc whose rotated samples stay >= 1 px from the image
    # edge, where the two differ only in fill handling.
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    c = (size - 1) / 2
    disc = (yy - c) ** 2 + (xx - c) ** 2 <= (c - 1.5) ** 2
    torch.testing.assert_close(out[..., disc], ref[..., disc], atol=1e-4, rtol=0)
    # Outside the image the fill is black (torchvision fill=0).
    assert (out[..., 0, 0] == 0).all() and (ref[..., 0, 0] == 0).all()


def test_normalisation() -> None:
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=_gen(17))
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (x.float() / 255 - mean) / std
    out = _identity_aug(32, hflip_p=0.0, mean=IMAGENET_MEAN, std=IMAGENET_STD)(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(normalize(x, IMAGENET_MEAN, IMAGENET_STD), expected, atol=1e-5, rtol=0)
    bf = normalize(x, IMAGENET_MEAN, IMAGENET_STD, torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), expected, atol=2e-2, rtol=1e-2)


def test_output_dtype_and_layout() -> None:
    x = torch.randint(0, 256, (4, 3, 50, 70), dtype=torch.uint8, generator=_gen(18))
    aug = GpuAugment(
        (24, 32), degrees=10, mean=IMAGENET_MEAN, std=IMAGENET_STD,
        out_dtype=torch.bfloat16, channels_last=True, generator=_gen(1),
    )  # fmt: skip
    out = aug(x)
    assert out.shape == (4, 3, 24, 32) and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last)
    plain = GpuAugment((24, 32), degrees=10, mean=IMAGENET_MEAN, std=IMAGENET_STD, generator=_gen(1))(x)
    torch.testing.assert_close(out.float(), plain, atol=3e-2, rtol=1e-2)
    unnormalised = GpuAugment((24, 32), degrees=10, generator=_gen(1))(x)
    assert unnormalised.min() >= 0 and unnormalised.max() <= 1


def test_rejects_bad_input() -> None:
    aug = GpuAugment(8)
    with pytest.raises(TypeError):
        aug(torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError):
        aug(torch.zeros(3, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        GpuAugment(8, mean=IMAGENET_MEAN, std=IMAGENET_STD)(torch.zeros(1, 4, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError):
        GpuAugment(8, mean=IMAGENET_MEAN)


def test_empty_batch() -> None:
    out = GpuAugment((8, 6), out_dtype=torch.bfloat16)(torch.zeros(0, 3, 10, 10, dtype=torch.uint8))
    assert out.shape == (0, 3, 8, 6) and out.dtype == torch.bfloat16
