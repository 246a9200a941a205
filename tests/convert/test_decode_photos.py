"""Pixels on a real photograph, not synthetic texture: ``decode="exact"`` is torchvision's, and
``decode="fast"`` stays within the error recorded in benchmarks/RESULTS.md.

The photo is ``grace_hopper.jpg`` from matplotlib's sample data (matplotlib is in the ``test`` extra;
the photo is a U.S. Navy portrait of Grace Hopper, in the public domain). Nothing third-party is
committed: variants of it (camera-size upscale at q75, grey saved as an RGB JPEG, EXIF orientation 6)
are made per session in a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from imagegen import ORIENT_TAG
from PIL import Image, ImageOps
from torchvision import transforms

from dlstore.spec import ImagePolicy
from dlstore.write.imageops import decode_file, draft_scale


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        photo = img.convert("RGB")
    root = tmp_path_factory.mktemp("photos")
    camera = photo.resize((2560, 3000), Image.LANCZOS)  # a phone-camera-sized portrait
    grey = camera.convert("L").convert("RGB")  # grey photo stored as an RGB JPEG
    exif = Image.Exif()
    exif[ORIENT_TAG] = 6
    out = {
        "original.jpg": (photo, {"quality": 92}),
        "camera_q75.jpg": (camera, {"quality": 75}),
        "grey_rgb.jpg": (grey, {"quality": 85}),
        "rotated_exif6.jpg": (camera.transpose(Image.Transpose.ROTATE_90), {"quality": 90, "exif": exif}),
    }
    for name, (img, kw) in out.items():
        img.save(root / name, **kw)
    return [root / name for name in out]


def reference(path: Path, size: int) -> np.ndarray:
    """What a torchvision user gets from the same file (EXIF orientation applied, as dlstore does)."""
    with Image.open(path) as img:
        rgb = (ImageOps.exif_transpose(img) or img).convert("RGB")
    return np.asarray(transforms.CenterCrop(size)(transforms.Resize(size)(rgb)), dtype=np.float64)


@pytest.mark.parametrize("size", [32, 64, 224, 256])
def test_exact_equals_torchvision_on_photos(photos: list[Path], size: int) -> None:
    for path in photos:
        got = decode_file(path, ImagePolicy(size=size))
        np.testing.assert_array_equal(got, reference(path, size), err_msg=path.name)


@pytest.mark.parametrize("size", [32, 64, 224, 256])
def test_fast_stays_within_one_level_on_photos(photos: list[Path], size: int) -> None:
    drafted = 0
    for path in photos:
        policy = ImagePolicy(size=size, decode="fast")
        got = decode_file(path, policy).astype(np.float64)
        diff = np.abs(got - reference(path, size)).mean()
        assert diff <= 1.0, (path.name, size, diff)
        with Image.open(path) as img:
            drafted += draft_scale(img.size, policy) > 1
    assert drafted >= 3  # the camera-size files do take the DCT-scaled path at every size here
