"""The CPU JPEG decoders: simplejpeg (``dlstore[jpeg]``) and the Pillow fallback give the same pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from imagegen import smooth_rgb

from dlstore import convert, open_cache
from dlstore.errors import SpecError
from dlstore.formats.codecs import PayloadError, get_codec
from dlstore.write.options import ConvertOptions


def _photo_like(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = smooth_rgb(rng, shape[0], shape[1]).astype(np.int16)
    img += rng.integers(-12, 13, img.shape, dtype=np.int16)  # texture, so the IDCT has work to do
    return np.clip(img, 0, 255).astype(np.uint8)[:, :, : shape[2]].copy()


@pytest.mark.parametrize("shape", [(96, 128, 3), (75, 61, 3), (64, 80, 1)])
def test_simplejpeg_and_pillow_decode_identical_pixels(shape: tuple[int, int, int], monkeypatch) -> None:
    pytest.importorskip("simplejpeg")  # in the test extra: CI runs this
    codec = get_codec("jpeg", quality=90)
    payload = codec.encode(_photo_like(shape, 3))
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", "pillow")
    assert codec.decoder == "pillow"
    pillow = codec.decode(payload, shape)
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", "simplejpeg")
    assert codec.decoder == "simplejpeg"
    fast = codec.decode(payload, shape)
    assert fast.shape == pillow.shape == shape
    np.testing.assert_array_equal(fast, pillow)


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_both_decoders_refuse_corrupt_or_mismatched_payloads(decoder: str, monkeypatch) -> None:
    if decoder == "simplejpeg":
        pytest.importorskip("simplejpeg")
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", decoder)
    codec = get_codec("jpeg", quality=90)
    payload = codec.encode(_photo_like((40, 48, 3), 5))
    with pytest.raises(PayloadError):
        codec.decode(payload[: len(payload) // 3], (40, 48, 3))  # truncated
    with pytest.raises(PayloadError):
        codec.decode(payload, (48, 40, 3))  # the index says another shape
    with pytest.raises(PayloadError):
        codec.decode(b"not a jpeg at all", (40, 48, 3))


def test_unknown_decoder_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", "libjpeg9")
    with pytest.raises(SpecError, match="DLSTORE_JPEG_DECODER"):
        get_codec("jpeg").decode(b"", (1, 1, 3))


@pytest.mark.parametrize("decoder", ["pillow", "simplejpeg"])
def test_threaded_batch_decode_equals_one_by_one(decoder: str, tmp_path: Path, monkeypatch) -> None:
    """read (decode into the batch, threads over slices) == read_images == each image alone."""
    if decoder == "simplejpeg":
        pytest.importorskip("simplejpeg")
    from PIL import Image

    src = tmp_path / "src"
    for j in range(20):
        (src / f"c{j % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(_photo_like((50 + j, 60, 3), j)).save(src / f"c{j % 2}" / f"{j}.png")
    convert(src, tmp_path / "c", ConvertOptions(format="npz", size=32, codec="jpeg", workers=1))
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", decoder)
    cache = open_cache(tmp_path / "c")
    cache.reader.threads = 3
    idx = np.random.default_rng(0).permutation(len(cache))
    batch = cache.read(idx)
    listed = cache.read_images(idx)
    cache.reader.threads = 1
    single = np.stack([cache.read_images([i])[0] for i in idx])
    np.testing.assert_array_equal(batch, single)
    np.testing.assert_array_equal(np.stack(listed), single)


def test_reader_pool_follows_a_changed_thread_count(tmp_path: Path) -> None:
    """Setting ``reader.threads`` after the first read must widen the pool (it used to stay at 4)."""
    from PIL import Image

    for j in range(4):
        (tmp_path / "src" / "c").mkdir(parents=True, exist_ok=True)
        Image.fromarray(_photo_like((40, 40, 3), j)).save(tmp_path / "src" / "c" / f"{j}.png")
    convert(tmp_path / "src", tmp_path / "c", ConvertOptions(format="npz", size=16, codec="jpeg", workers=1))
    reader = open_cache(tmp_path / "c").reader
    reader.threads = 2
    assert reader._thread_pool()._max_workers == 2
    reader.threads = 5
    assert reader._thread_pool()._max_workers == 5
    assert reader._thread_pool() is reader._thread_pool()  # reused while the count stays
