"""The payload layout (JPEG codec, variable-size ``--resize shorter`` images) of every chunked format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from imagegen import smooth_rgb
from PIL import Image, ImageOps
from torchvision.transforms import Resize

from dlstore import convert, open_cache
from dlstore.errors import SampleReadError, SpecError
from dlstore.formats import FORMATS
from dlstore.formats.codecs import get_codec
from dlstore.read.dataset import CachedDataset
from dlstore.spec import ImagePolicy
from dlstore.write.imageops import decode_file
from dlstore.write.options import ConvertOptions
from dlstore.write.sources import open_source

PAYLOAD_FORMATS = [f.name for f in FORMATS.values() if f.ragged_ok]
PIXEL_ONLY_FORMATS = [f.name for f in FORMATS.values() if not f.ragged_ok]


@pytest.fixture(scope="module")
def photo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Photo-like PNGs (lossless sources, so the only loss measured is the cache's JPEG)."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(11)
    for cls in ("a", "b"):
        (root / cls).mkdir()
        for j in range(12):
            h, w = (int(rng.integers(70, 130)), int(rng.integers(70, 130)))
            Image.fromarray(smooth_rgb(rng, h, w)).save(root / cls / f"{j}.png")
    return root


def torchvision_resized(path: Path, size: int, channels: int, max_side: int | None = None) -> tuple[int, int]:
    """(h, w) of torchvision Resize(size, max_size) on the upright image, as ImageFolder would see it."""
    with Image.open(path) as img:
        upright = ImageOps.exif_transpose(img)
        out = Resize(size, max_size=max_side)(upright.convert("RGB" if channels == 3 else "L"))
    return out.size[1], out.size[0]


@pytest.mark.parametrize("fmt", PAYLOAD_FORMATS)
@pytest.mark.parametrize("codec", ["jpeg", None])  # None: the format's default (raw pixels)
def test_shorter_side_sizes_equal_torchvision_resize(
    image_tree: Path, tmp_path: Path, fmt: str, codec: str | None
) -> None:
    """Portrait, landscape, EXIF-rotated, grey, alpha, 16-bit, CMYK, draft-decoded big JPEGs: every size."""
    convert(
        image_tree,
        tmp_path / "c",
        ConvertOptions(format=fmt, size=24, resize="shorter", codec=codec, workers=2),
    )
    src = open_source(image_tree)
    cache = open_cache(tmp_path / "c")
    assert len(cache) == len(src)
    images = cache.read_images(list(range(len(cache))))
    for i, img in enumerate(images):
        assert img.shape[:2] == torchvision_resized(image_tree / src.names[i], 24, 3), src.names[i]
    orientations = {img.shape[0] > img.shape[1] for img in images} | {
        img.shape[0] < img.shape[1] for img in images
    }
    assert orientations == {True, False}  # both portrait and landscape are there
    if codec is None:  # lossless: the pixels of the reference decode, exactly
        policy = ImagePolicy(size=24, resize="shorter")
        for i in (0, 5, len(src) - 1):
            np.testing.assert_array_equal(images[i], decode_file(image_tree / src.names[i], policy))


def test_max_side_caps_the_longer_side_like_torchvision(image_tree: Path, tmp_path: Path) -> None:
    convert(
        image_tree,
        tmp_path / "c",
        ConvertOptions(format=PAYLOAD_FORMATS[0], size=24, resize="shorter", max_side=30, codec="jpeg"),
    )
    src = open_source(image_tree)
    images = open_cache(tmp_path / "c").read_images(list(range(len(src))))
    for name, img in zip(src.names, images):
        assert img.shape[:2] == torchvision_resized(image_tree / name, 24, 3, max_side=30)
        assert max(img.shape[:2]) <= 30


@pytest.mark.parametrize("fmt", PAYLOAD_FORMATS)
def test_jpeg_cache_is_within_3_levels_of_raw_and_records_its_error(
    photo_tree: Path, tmp_path: Path, fmt: str
) -> None:
    convert(photo_tree, tmp_path / "raw", ConvertOptions(format=fmt, size=64, workers=2))
    convert(
        photo_tree,
        tmp_path / "jpeg",
        ConvertOptions(format=fmt, size=64, codec="jpeg", writer_options={"quality": 90}, workers=2),
    )
    raw, jpeg = open_cache(tmp_path / "raw"), open_cache(tmp_path / "jpeg")
    idx = list(range(len(raw)))
    diff = np.abs(raw.read(idx).astype(np.int16) - jpeg.read(idx).astype(np.int16))
    assert 0 < diff.mean() <= 3.0
    assert jpeg.spec.codec == "jpeg" and jpeg.spec.writer_options["quality"] == 90
    opts = jpeg.spec.format_options  # what the writer measured
    assert 0 < opts["mean_abs_error"] <= 3.0
    assert abs(opts["mean_abs_error"] - diff.mean()) < 1.0  # the sample estimates the whole


@pytest.mark.parametrize("fmt", PAYLOAD_FORMATS)
def test_a_small_jpeg_cache_of_large_images_opens(photo_tree: Path, tmp_path: Path, fmt: str) -> None:
    """A JPEG unit holds hundreds of images (sized by their encoded bytes) but decodes one image at a
    time: a fresh cache of a few MB at 256 px was refused as "tampered" for its whole unit's pixels."""
    convert(photo_tree, tmp_path / "c", ConvertOptions(format=fmt, size=256, codec="jpeg", workers=2))
    cache = open_cache(tmp_path / "c")  # npz: 426 images a unit, 84 MB of pixels, over the 64 MB allowance
    assert cache.read(list(range(len(cache)))).shape == (24, 256, 256, 3)


@pytest.mark.parametrize("fmt", PAYLOAD_FORMATS)
def test_cached_dataset_yields_variable_size_chw_uint8(photo_tree: Path, tmp_path: Path, fmt: str) -> None:
    convert(
        photo_tree,
        tmp_path / "c",
        ConvertOptions(format=fmt, size=32, resize="shorter", codec="jpeg", workers=1),
    )
    ds = CachedDataset(tmp_path / "c")
    samples = ds.__getitems__([0, 1, 2, 3])
    shapes = {tuple(img.shape) for img, _ in samples}
    assert all(
        img.dtype == torch.uint8 and img.shape[0] == 3 and min(img.shape[1:]) == 32 for img, _ in samples
    )
    assert len(shapes) > 1
    with pytest.raises(ValueError, match="read_images"):
        ds.cache.read([0])
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b)
    assert sum(len(batch) for batch in loader) == len(ds)


def _corrupt_one_payload(cache_root: Path, position: int) -> Path:
    """Flip bytes in the middle of one image's payload inside its chunk file; return the file."""
    cache = open_cache(cache_root)
    reader = cache.reader
    k = position // reader.unit
    unit = reader.payload_unit(k)
    j = position - k * reader.unit
    path = reader.unit_path(k)
    start, end = int(unit.offsets[j]), int(unit.ends[j] if unit.ends is not None else unit.offsets[j + 1])
    payload = bytes(unit.payload(j))
    cache.close()
    blob = bytearray(path.read_bytes())
    at = blob.find(payload)
    assert at >= 0 and end - start == len(payload)
    for off in range(len(payload) // 2, len(payload) // 2 + 8):
        blob[at + off] ^= 0x5A
    path.write_bytes(bytes(blob))
    return path


@pytest.mark.parametrize("fmt", PAYLOAD_FORMATS)
def test_corrupt_jpeg_bytes_name_index_and_chunk_never_wrong_pixels(
    photo_tree: Path, tmp_path: Path, fmt: str
) -> None:
    from dlstore.write.verification import verify

    convert(
        photo_tree,
        tmp_path / "c",
        ConvertOptions(format=fmt, size=32, resize="shorter", codec="jpeg", workers=1),
    )
    cache = open_cache(tmp_path / "c")
    index = 7
    position = int(cache.positions[index])
    chunk = position // cache.reader.unit  # the unit size follows the machine's memory: not always 0
    good = cache.read_images([index - 1])[0]
    cache.close()
    path = _corrupt_one_payload(tmp_path / "c", position)
    assert not verify(tmp_path / "c").ok  # the checksum catches it first
    cache = open_cache(tmp_path / "c")
    with pytest.raises(SampleReadError) as err:
        cache.read_images([index - 1, index])
    message = str(err.value)
    assert f"index {index}" in message and f"chunk {chunk}" in message and path.name in message
    np.testing.assert_array_equal(cache.read_images([index - 1])[0], good)  # neighbours still read
    with pytest.raises(SampleReadError, match=f"index {index}"):  # and the bad one fails every time
        cache.read_images([index])


@pytest.mark.parametrize("fmt", PIXEL_ONLY_FORMATS)
def test_pixel_only_formats_refuse_jpeg_and_ragged(image_tree: Path, tmp_path: Path, fmt: str) -> None:
    with pytest.raises(SpecError, match="does not take --codec|not available"):
        convert(image_tree, tmp_path / "a", ConvertOptions(format=fmt, size=8, codec="jpeg"))
    with pytest.raises(SpecError, match="cannot store variable-size"):
        convert(image_tree, tmp_path / "b", ConvertOptions(format=fmt, size=8, resize="shorter"))


@pytest.mark.parametrize("name", ["jpeg"])
def test_codec_round_trip_grey_and_rgb(name: str) -> None:
    codec = get_codec(name, quality=95)
    rng = np.random.default_rng(0)
    for shape in ((48, 64, 3), (40, 31, 1)):
        img = smooth_rgb(rng, shape[0], shape[1])[:, :, : shape[2]]
        out = codec.decode(codec.encode(img), shape)
        assert out.shape == shape and np.abs(out.astype(int) - img).mean() < 5
