"""Pixels against torchvision's own transforms and Pillow's behaviour on odd modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from imagegen import ORIENT_TAG, jpeg_bytes, smooth_rgb
from PIL import Image, ImageOps
from torchvision import transforms

from dlstore.errors import ImageDecodeError
from dlstore.spec import ImagePolicy
from dlstore.write.imageops import decode_file


def reference(path: Path, size: int) -> np.ndarray:
    """What a torchvision user gets: ImageFolder's loader (convert RGB) + Resize + CenterCrop."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    return np.asarray(transforms.CenterCrop(size)(transforms.Resize(size)(rgb)))


@pytest.mark.parametrize("size", [16, 32, 37])
def test_crop_matches_torchvision_exactly_by_default(image_tree: Path, size: int) -> None:
    checked = 0
    for path in sorted(image_tree.rglob("*")):
        if path.suffix not in (".jpg", ".png", ".bmp", ".webp") or "rotated" in path.name:
            continue
        with Image.open(path) as img:
            if img.mode not in ("RGB", "L", "P") or "transparency" in img.info:
                continue
        got = decode_file(path, ImagePolicy(size=size))
        np.testing.assert_array_equal(got, reference(path, size), err_msg=str(path))
        checked += 1
    assert checked >= 8


def test_fast_stays_within_one_level(image_tree: Path) -> None:
    bigs = sorted(image_tree.rglob("big_jpg*.jpg"))
    assert bigs
    for path in bigs:
        got = decode_file(path, ImagePolicy(size=32, decode="fast")).astype(float)
        diff = np.abs(got - reference(path, 32)).mean()
        assert 0 < diff <= 1.0, (path, diff)  # > 0: the DCT-scaled path did run


def spy_draft(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    from PIL.JpegImagePlugin import JpegImageFile

    calls: list[tuple[int, int]] = []
    orig = JpegImageFile.draft

    def spy(self: JpegImageFile, mode: str | None, size: tuple[int, int]) -> object:
        calls.append(size)
        return orig(self, mode, size)

    monkeypatch.setattr(JpegImageFile, "draft", spy)
    return calls


def test_fast_drafts_only_down_to_the_margin(image_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_draft(monkeypatch)
    path = next(image_tree.rglob("big_jpg*.jpg"))  # 410 x 300
    decode_file(path, ImagePolicy(size=32, decode="fast"))
    assert calls == [(205, 150)]  # 1/2: 150 ≥ FAST_MARGIN × 32, while 1/4 (75) would not be
    decode_file(path, ImagePolicy(size=64, decode="fast"))
    assert calls == [(205, 150)]  # 1/2 would leave 150 < 3 × 64: no DCT scaling at all


def test_exact_never_drafts(image_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_draft(monkeypatch)
    decode_file(next(image_tree.rglob("big_jpg*.jpg")), ImagePolicy(size=16))
    assert calls == []


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch"])
@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_fast_matches_exact_geometry_for_every_policy(tmp_path: Path, resize: str, orientation: int) -> None:
    """The drafted path resizes in the file's frame and orients afterwards: same geometry as exact."""
    rng = np.random.default_rng(orientation)
    exif = Image.Exif()
    exif[ORIENT_TAG] = orientation
    path = tmp_path / "o.jpg"
    Image.fromarray(smooth_rgb(rng, 403, 611)).save(path, quality=92, exif=exif)
    exact = decode_file(path, ImagePolicy(size=24, resize=resize)).astype(float)
    fast = decode_file(path, ImagePolicy(size=24, resize=resize, decode="fast")).astype(float)
    assert exact.shape == fast.shape and np.abs(exact - fast).mean() <= 1.0


def test_sixteen_bit_ramp_keeps_256_levels(tmp_path: Path) -> None:
    ramp = np.tile(np.arange(0, 65536, 16, dtype=np.uint16), (4, 1))  # 4096 columns
    path = tmp_path / "ramp.png"
    Image.fromarray(ramp).save(path)
    with Image.open(path) as img:
        assert img.mode.startswith("I")
    got = decode_file(path, ImagePolicy(size=4, resize="stretch", channels=1))
    full = decode_file(path, ImagePolicy(size=ramp.shape[1], resize="stretch", channels=1))
    assert len(np.unique(full)) == 256
    assert got.dtype == np.uint8 and full.max() == 255 and full.min() == 0


def test_bilevel_gives_0_and_255(tmp_path: Path) -> None:
    arr = (np.indices((32, 32)).sum(0) % 2).astype(bool)
    path = tmp_path / "one.png"
    Image.fromarray(arr).save(path)
    got = decode_file(path, ImagePolicy(size=32, channels=1))
    assert set(np.unique(got)) == {0, 255}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(tmp_path: Path, orientation: int) -> None:
    upright = smooth_rgb(np.random.default_rng(orientation), 40, 60)
    upright[:10, :10] = 255  # a marker in the top-left corner
    # Store pixels so that applying the orientation tag gives back `upright`.
    inverse = {
        1: None,
        2: Image.FLIP_LEFT_RIGHT,
        3: Image.ROTATE_180,
        4: Image.FLIP_TOP_BOTTOM,
        5: Image.TRANSPOSE,
        6: Image.ROTATE_90,
        7: Image.TRANSVERSE,
        8: Image.ROTATE_270,
    }[orientation]
    stored = Image.fromarray(upright)
    stored = stored if inverse is None else stored.transpose(inverse)
    exif = Image.Exif()
    exif[ORIENT_TAG] = orientation
    path = tmp_path / f"o{orientation}.png"
    stored.save(path, exif=exif)
    with Image.open(path) as img:
        expected = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
    np.testing.assert_array_equal(expected, upright)  # our inverse table is right
    got = decode_file(path, ImagePolicy(size=60, resize="stretch"))
    ref = np.asarray(Image.fromarray(upright).resize((60, 60), Image.BILINEAR))
    np.testing.assert_array_equal(got, ref)


def test_alpha_is_composited_on_white(tmp_path: Path) -> None:
    arr = np.zeros((8, 8, 4), np.uint8)
    arr[..., 0] = 200
    arr[:, :4, 3] = 0  # fully transparent half → background
    arr[:, 4:, 3] = 255  # opaque half → the colour
    path = tmp_path / "a.png"
    Image.fromarray(arr, "RGBA").save(path)
    got = decode_file(path, ImagePolicy(size=8, resize="stretch"))
    assert (got[:, :4] == 255).all()
    assert (got[:, 4:] == [200, 0, 0]).all()


def test_palette_transparency_and_grey_channels(image_tree: Path) -> None:
    path = next(image_tree.rglob("p_trns_png*"))
    with Image.open(path) as img:
        ref = np.asarray(img.convert("RGBA"))
    got = decode_file(path, ImagePolicy(size=ref.shape[1], resize="stretch"))
    transparent = ref[..., 3] == 0
    if ref.shape[0] == ref.shape[1]:
        assert (got[transparent] == 255).all()
    grey = decode_file(next(image_tree.rglob("grey_png*")), ImagePolicy(size=16, channels=1))
    assert grey.shape == (16, 16, 1)


def test_cmyk_matches_pillow_rgb(image_tree: Path) -> None:
    path = next(image_tree.rglob("cmyk_jpg*"))
    np.testing.assert_array_equal(decode_file(path, ImagePolicy(size=24)), reference(path, 24))


@pytest.mark.parametrize("policy", ["pad", "stretch"])
def test_other_policies_give_the_square(image_tree: Path, policy: str) -> None:
    path = next(image_tree.rglob("rgb_jpg*"))
    got = decode_file(path, ImagePolicy(size=20, resize=policy))
    assert got.shape == (20, 20, 3)
    if policy == "pad":
        with Image.open(path) as img:
            w, h = img.size
        if w != h:  # the short side is padded with black
            edge = got[0] if w > h else got[:, 0]
            assert (edge == 0).all()


@pytest.mark.parametrize("content", [b"", b"<html>not an image</html>", b"%!PS-Adobe-3.0 EPSF-3.0\n"])
def test_bad_files_raise_naming_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.jpg"
    path.write_bytes(content)
    with pytest.raises(ImageDecodeError, match="bad.jpg"):
        decode_file(path, ImagePolicy(size=8))


def test_truncated_jpeg_raises(tmp_path: Path) -> None:

    data = jpeg_bytes(smooth_rgb(np.random.default_rng(0), 64, 64))
    path = tmp_path / "t.jpg"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageDecodeError, match="t.jpg"):
        decode_file(path, ImagePolicy(size=8))
