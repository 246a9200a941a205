"""One set of photographs given in every SOURCE form dlstore reads: an ImageFolder tree, a parquet
file as Hugging Face ``datasets`` writes its ``Image`` feature, WebDataset shards written by
``webdataset.TarWriter``, a CSV list and a map-style Dataset (importable by tests).

The images are real, cut from every real picture an offline install carries (``real_pictures``):
matplotlib's sample data has a photograph (``grace_hopper.jpg``, a U.S. Navy portrait, public
domain), a rendered picture (``Minduka_Present_Blue_Pack.png``), an MRI slice of a head
(``s1045.ima.gz``, as 16-bit) and a surveyed elevation model (``jacksboro_fault_dem.npz``, shown
hill-shaded); and the photographs bundled with scikit-image (14, in the ``test`` extra) and
scikit-learn (2), where installed (the GPU machine has both; ``scikit=False`` leaves them out). Photo i is a crop of picture ``picture_of(i)`` at its own
place and scale, resized to an ImageNet-like size (longer side 192-500, aspect 3:4 to 16:9), one of
the cases a converter gets wrong every 8th: a JPEG with EXIF orientation 6, a PNG with alpha, a grey
JPEG, a palette PNG with transparency, a 16-bit grey PNG, a CMYK JPEG. Pictures load once per process.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ORIENT_TAG = 0x0112
CLASSES = ("hopper", "pack", "street")  # ImageFolder order: sorted
# scikit-image's bundled photographs (no download): camera, moon and the rest are in its wheel.
SKIMAGE_PHOTOS = (
    "astronaut", "camera", "cat", "coffee", "coins", "rocket", "hubble_deep_field",
    "immunohistochemistry", "moon", "grass", "gravel", "brick", "page", "text",
)  # fmt: skip


def _sample(name: str) -> str:
    import matplotlib.cbook as cbook

    return str(cbook.get_sample_data(name, asfileobj=False))


def matplotlib_pictures() -> dict[str, Image.Image]:
    """The real pictures in matplotlib's sample data (an install of matplotlib is enough)."""
    from matplotlib.colors import LightSource

    with Image.open(_sample("grace_hopper.jpg")) as a:
        hopper = a.convert("RGB")
    with Image.open(_sample("Minduka_Present_Blue_Pack.png")) as b:
        pack = b.convert("RGBA")
    with gzip.open(_sample("s1045.ima.gz")) as f:  # 256x256 big-endian uint16 holding 0..~215
        mri = np.frombuffer(f.read(), ">u2").reshape(256, 256).astype(np.uint32)
    mri = (mri * 65535 // max(1, int(mri.max()))).astype(np.uint16)  # spread over 16 bits
    with np.load(_sample("jacksboro_fault_dem.npz")) as dem:
        z = dem["elevation"].astype(np.float64)
    import matplotlib

    shaded = LightSource(azdeg=315, altdeg=45).shade(
        z, cmap=matplotlib.colormaps["gist_earth"], blend_mode="soft"
    )
    terrain = Image.fromarray((shaded[..., :3] * 255).round().astype(np.uint8))
    return {"hopper": hopper, "pack": pack, "mri": Image.fromarray(mri), "terrain": terrain}


def scikit_pictures() -> dict[str, Image.Image]:
    """scikit-image's and scikit-learn's bundled photographs, those this install has ({} without them)."""
    import socket

    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)  # a picture that needs a download fails fast offline, and is left out
    try:  # process-wide: left at 5 s it breaks later tests' idle sockets (batch_procs' workers)
        return _scikit_pictures()
    finally:
        socket.setdefaulttimeout(before)


def _scikit_pictures() -> dict[str, Image.Image]:
    out = {}
    try:
        import skimage.data as data

        for name in SKIMAGE_PHOTOS:
            try:
                out[name] = Image.fromarray(np.asarray(getattr(data, name)()))
            except Exception:  # not in this version, or it would need a download: not offline
                continue
    except ImportError:
        pass
    try:
        from sklearn.datasets import load_sample_image

        for name in ("china.jpg", "flower.jpg"):
            out[name.split(".")[0]] = Image.fromarray(load_sample_image(name))
    except Exception:  # scikit-learn absent, or without its sample images
        pass
    return out


@functools.lru_cache(maxsize=2)
def real_pictures(scikit: bool = True) -> tuple[tuple[str, Image.Image], ...]:
    """(name, picture) of every real picture this install carries; see the module's docstring."""
    found = {**matplotlib_pictures(), **(scikit_pictures() if scikit else {})}
    return tuple(found.items())


def imagenet_crop(base: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A crop of ``base`` at a random place, with an ImageNet-like aspect and size."""
    aspect = float(rng.choice([3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9]))
    long_side = int(rng.integers(192, 501))
    out = (long_side, round(long_side / aspect)) if aspect >= 1 else (round(long_side * aspect), long_side)
    w, h = base.size
    scale = float(rng.uniform(0.35, 1.0)) * min(w / out[0], h / out[1])
    cw, ch = max(8, int(out[0] * scale)), max(8, int(out[1] * scale))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return base.crop((x, y, x + cw, y + ch)).resize(out, Image.BICUBIC)


def picture_of(i: int, count: int) -> int:
    """Which picture photo i is cut from: every picture meets every special case (i % 8)."""
    return (i + i // 8) % count


def photo(
    i: int, pictures: tuple[tuple[str, Image.Image], ...] | None = None
) -> tuple[Image.Image, str, dict[str, Any]]:
    """Photo i: a crop of picture ``picture_of(i)``, one of the special cases every 8th."""
    pictures = pictures or real_pictures()
    rng = np.random.default_rng(i)
    _, base = pictures[picture_of(i, len(pictures))]
    img = imagenet_crop(base, rng)
    if img.mode == "I;16" or img.mode.startswith("I"):
        img = img if i % 8 == 4 else Image.fromarray((np.asarray(img, np.uint32) >> 8).astype(np.uint8))
    case = i % 8
    if case == 4:
        grey16 = np.asarray(img if img.mode.startswith("I") else img.convert("L"), np.uint16)
        grey16 = grey16 if img.mode.startswith("I") else (grey16 * 257).astype(np.uint16)
        return Image.fromarray(grey16), ".png", {}
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    if case == 0:
        exif = Image.Exif()
        exif[ORIENT_TAG] = 6
        return img.transpose(Image.Transpose.ROTATE_90), ".jpg", {"quality": 90, "exif": exif}
    if case == 1:
        alpha = Image.linear_gradient("L").resize(img.size)
        rgba = img.convert("RGB")
        rgba.putalpha(alpha)
        return rgba, ".png", {}
    if case == 2:
        return img.convert("L"), ".jpg", {"quality": 88}
    if case == 3:
        p = img.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        p.info["transparency"] = 0
        return p, ".png", {}
    if case == 5:
        return img.convert("CMYK"), ".jpg", {"quality": 90}
    return img, ".jpg", {"quality": int(rng.integers(75, 96))}


def make_photo_folder(root: Path, n: int, scikit: bool = True) -> Path:
    """ROOT/<class>/photoNNNN-<picture>.<ext>: n photographs, class i % 3 (see the module docstring)."""
    pictures = real_pictures(scikit)
    for i in range(n):
        img, suffix, kw = photo(i, pictures)
        folder = root / CLASSES[i % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"photo{i:04d}-{pictures[picture_of(i, len(pictures))][0]}{suffix}", **kw)
    return root


def folder_samples(root: Path) -> list[tuple[str, int]]:
    """(relative path, label) in ImageFolder's order (dlstore's scan, tested against ImageFolder's)."""
    from dlstore.sourcefiles import scan_tree

    scan = scan_tree(root)
    return list(zip(scan.names, scan.labels.tolist()))


def write_hf_parquet(root: Path, out: Path, rows_per_group: int = 5) -> Path:
    """As ``datasets`` writes ``Features({"image": Image(), "label": ClassLabel(names=…)})``:
    image ``struct<bytes: binary, path: string>``, label int64, the features in the schema's
    ``huggingface`` metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    samples = folder_samples(root)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"names": list(CLASSES), "_type": "ClassLabel"}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())]).with_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )
    images = [{"bytes": (root / p).read_bytes(), "path": Path(p).name} for p, _ in samples]
    table = pa.table({"image": pa.array(images, image_type), "label": [t for _, t in samples]}, schema=schema)
    pq.write_table(table, out, row_group_size=rows_per_group)
    return out


def write_shards(root: Path, folder: Path, per_shard: int = 10) -> str:
    """``webdataset.TarWriter`` shards photos-000000.tar …; returns the brace pattern."""
    import webdataset as wds

    samples = folder_samples(root)
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(samples) // per_shard)
    for s in range(n_shards):
        with wds.TarWriter(str(folder / f"photos-{s:06d}.tar")) as sink:
            for p, t in samples[s * per_shard : (s + 1) * per_shard]:
                ext = Path(p).suffix.lstrip(".")
                key = p.replace("/", "_").rsplit(".", 1)[0]
                sink.write({"__key__": key, ext: (root / p).read_bytes(), "cls": t})
    return str(folder / f"photos-{{000000..{n_shards - 1:06d}}}.tar")


def write_csv(root: Path, out: Path) -> Path:
    """path,label with class names as labels, paths relative to ``root`` (``--root``)."""
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        for p, t in folder_samples(root):
            w.writerow([p, CLASSES[t]])
    return out


class PhotoDataset:
    """A user's own map-style Dataset: (PIL image, int) for most, encoded bytes for every 5th."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.samples = folder_samples(self.root)
        self.classes = list(CLASSES)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        p, t = self.samples[i]
        data = (self.root / p).read_bytes()
        return (data if i % 5 == 0 else Image.open(io.BytesIO(data))), t


def tiny_photo_dataset() -> PhotoDataset:
    """``dlstore bench photo_forms:tiny_photo_dataset``: 16 photographs in a temporary folder."""
    import os
    import tempfile

    root = Path(tempfile.gettempdir()) / f"dlstore-test-photos-16-{os.getuid()}"
    if not (root / "street").is_dir():
        make_photo_folder(root, 16)
    return PhotoDataset(root)
