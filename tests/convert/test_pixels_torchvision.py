"""Issue 22 item 4: ``pixels="torchvision"`` (``--pixels torchvision``) gives stock torchvision's
bytes: ``torchvision.datasets.ImageFolder``'s default loader then ``Resize``/``CenterCrop`` on the PIL
image, compared bit for bit on a real photograph saved in the modes where the default policy differs
(EXIF rotation, 16-bit, alpha, palette with transparency, CMYK, grey, bilevel).

The photo is matplotlib's ``grace_hopper.jpg`` (public domain; matplotlib is in the ``test`` extra),
as in test_decode_photos.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from imagegen import ORIENT_TAG
from PIL import Image
from torchvision import transforms
from torchvision.datasets import ImageFolder

from dlstore import ConvertOptions, convert, open_cache
from dlstore.cli import main
from dlstore.errors import SpecError
from dlstore.formats import FORMATS
from dlstore.spec import read_spec

RAGGED_FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)
# The files where dlstore's default policy and stock torchvision part ways: EXIF rotation, 16 bits,
# alpha and palette transparency.
DIFFERENT_BY_DEFAULT = ("exif6.jpg", "sixteen.png", "rgba.png", "la.png", "palette.png")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        photo = img.convert("RGB").resize((97, 131), Image.LANCZOS)  # odd sides: the crop's rounding
    grey = photo.convert("L")
    alpha = Image.linear_gradient("L").resize(photo.size)
    exif = Image.Exif()
    exif[ORIENT_TAG] = 6
    palette = photo.convert("P", palette=Image.ADAPTIVE, colors=32)
    root = tmp_path_factory.mktemp("pixels")
    files: dict[str, tuple[Image.Image, dict[str, Any]]] = {
        "b/exif6.jpg": (photo.transpose(Image.Transpose.ROTATE_90), {"quality": 90, "exif": exif}),
        "b/sixteen.png": (Image.fromarray(np.asarray(grey).astype(np.uint16) * 257 + 100), {}),
        "b/rgba.png": (Image.merge("RGBA", (*photo.split(), alpha)), {}),
        "b/la.png": (Image.merge("LA", (grey, alpha)), {}),
        "a/palette.png": (palette, {"transparency": 5}),
        "a/cmyk.jpg": (photo.convert("CMYK"), {"quality": 90}),
        "a/grey.png": (grey, {}),
        "a/bilevel.png": (grey.convert("1"), {}),
        "a/plain.jpg": (photo, {"quality": 85}),
    }
    for name, (img, kw) in files.items():
        (root / name).parent.mkdir(exist_ok=True)
        img.save(root / name, **kw)
    with Image.open(root / "b/sixteen.png") as img:
        assert img.mode.startswith("I")  # a real 16-bit file
    return root


def stock(root: Path, transform: Any) -> tuple[list[np.ndarray], list[int], list[str]]:
    ds = ImageFolder(str(root), transform=transform)
    images = [np.asarray(ds[i][0]) for i in range(len(ds))]
    return [a[:, :, None] if a.ndim == 2 else a for a in images], ds.targets, [p for p, _ in ds.samples]


def cached(root: Path, dest: Path, **options: Any) -> tuple[list[np.ndarray], list[int]]:
    convert(root, dest, ConvertOptions(workers=1, **options))
    cache = open_cache(dest)
    try:
        return cache.read_images(np.arange(len(cache))), cache.labels.tolist()
    finally:
        cache.close()


CASES = [
    ({"size": 32, "resize": "crop"}, transforms.Compose([transforms.Resize(32), transforms.CenterCrop(32)])),
    ({"size": 20, "resize": "stretch"}, transforms.Resize((20, 20))),
    (
        {"size": 24, "resize": "shorter", "max_side": 30, "format": RAGGED_FORMAT},
        transforms.Resize(24, max_size=30),
    ),
]


@pytest.mark.parametrize(("options", "transform"), CASES, ids=[c[0]["resize"] for c in CASES])
def test_equals_imagefolder_and_transforms_bit_for_bit(
    photos: Path, tmp_path: Path, options: dict[str, Any], transform: Any
) -> None:
    want, labels, paths = stock(photos, transform)
    got, got_labels = cached(photos, tmp_path / "tv", pixels="torchvision", **options)
    assert got_labels == labels
    for path, a, b in zip(paths, got, want, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_the_default_policy_differs_on_exactly_the_files_the_readme_names(
    photos: Path, tmp_path: Path
) -> None:
    want, _, paths = stock(photos, CASES[0][1])
    got, _ = cached(photos, tmp_path / "default", size=32)
    differ = sorted(
        Path(p).name for p, a, b in zip(paths, got, want, strict=True) if not np.array_equal(a, b)
    )
    assert differ == sorted(DIFFERENT_BY_DEFAULT)


def test_one_channel_is_imagefolder_then_grayscale(photos: Path, tmp_path: Path) -> None:
    tf = transforms.Compose([transforms.Grayscale(), transforms.Resize(16), transforms.CenterCrop(16)])
    want, _, _ = stock(photos, tf)
    got, _ = cached(photos, tmp_path / "grey", size=16, channels=1, pixels="torchvision")
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


def test_the_policy_is_recorded_and_one_route_from_the_cli(photos: Path, tmp_path: Path) -> None:
    dest = tmp_path / "cli"
    out = CliRunner().invoke(
        main, ["convert", str(photos), str(dest), "--size", "16", "--pixels", "torchvision"]
    )
    assert out.exit_code == 0, out.output
    spec = read_spec(dest)
    assert spec.options["pixels"] == "torchvision" and spec.image.pixels == "torchvision"
    assert spec.image.exif_transpose is False
    info = CliRunner().invoke(main, ["info", str(dest)])
    assert "pixels=torchvision" in info.output
    again = CliRunner().invoke(main, ["convert", str(photos), str(dest), "--size", "16"])
    assert again.exit_code == 1 and "pixels" in again.output  # a re-run names the changed option


@pytest.mark.parametrize(
    ("options", "named"), [({"resize": "pad"}, "resize='pad'"), ({"decode": "fast"}, "decode='fast'")]
)
def test_combinations_without_stock_pixels_are_refused(options: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError, match=named) as e:
        ConvertOptions(size=16, pixels="torchvision", **options)
    assert "use " in str(e.value)  # and the fix


def test_the_cli_refuses_pad_with_the_message(photos: Path, tmp_path: Path) -> None:
    out = CliRunner().invoke(
        main,
        [
            "convert",
            str(photos),
            str(tmp_path / "x"),
            "--size",
            "16",
            "--pixels",
            "torchvision",
            "--resize",
            "pad",
        ],
    )
    assert out.exit_code != 0 and "torchvision has no transform" in out.output
