"""One set of photographs given in every SOURCE form dlstore reads: an ImageFolder tree, a parquet
file as Hugging Face ``datasets`` writes its ``Image`` feature, WebDataset shards written by
``webdataset.TarWriter``, a CSV list and a map-style Dataset (importable by tests).

The photographs are real: crops and rescales of ``grace_hopper.jpg`` (a U.S. Navy portrait, public
domain) and ``Minduka_Present_Blue_Pack.png`` from matplotlib's sample data, saved per session. Among
them, the cases a converter gets wrong: a JPEG with EXIF orientation 6, a PNG with alpha, a grey JPEG,
a palette PNG with transparency, a 16-bit grey PNG, a CMYK JPEG.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ORIENT_TAG = 0x0112
CLASSES = ("hopper", "pack", "street")  # ImageFolder order: sorted


def sample_photos() -> tuple[Image.Image, Image.Image]:
    import matplotlib.cbook as cbook

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as a:
        hopper = a.convert("RGB").resize((320, 375), Image.LANCZOS)  # quicker to save, still a photograph
    with Image.open(cbook.get_sample_data("Minduka_Present_Blue_Pack.png", asfileobj=False)) as b:
        pack = b.convert("RGBA")
    return hopper, pack


def photo(i: int, hopper: Image.Image, pack: Image.Image) -> tuple[Image.Image, str, dict[str, Any]]:
    """Photo i: a crop at its own place and scale, one of the special cases every 8th."""
    rng = np.random.default_rng(i)
    base = hopper if i % 3 != 1 else pack.convert("RGB").resize((384, 384), Image.BICUBIC)
    w, h = base.size
    cw, ch = int(rng.integers(w // 3, w)), int(rng.integers(h // 3, h))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = base.crop((x, y, x + cw, y + ch))
    case = i % 8
    if case == 0:
        exif = Image.Exif()
        exif[ORIENT_TAG] = 6
        return img.transpose(Image.Transpose.ROTATE_90), ".jpg", {"quality": 90, "exif": exif}
    if case == 1:
        alpha = Image.linear_gradient("L").resize(img.size)
        rgba = img.copy()
        rgba.putalpha(alpha)
        return rgba, ".png", {}
    if case == 2:
        return img.convert("L"), ".jpg", {"quality": 88}
    if case == 3:
        p = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        p.info["transparency"] = 0
        return p, ".png", {}
    if case == 4:
        grey16 = (np.asarray(img.convert("L"), np.uint16) * 257).astype(np.uint16)
        return Image.fromarray(grey16), ".png", {}
    if case == 5:
        return img.convert("CMYK"), ".jpg", {"quality": 90}
    return img, ".jpg", {"quality": int(rng.integers(75, 96))}


def make_photo_folder(root: Path, n: int) -> Path:
    """ROOT/<class>/<photo>: n photographs, class i % 3."""
    hopper, pack = sample_photos()
    for i in range(n):
        img, suffix, kw = photo(i, hopper, pack)
        folder = root / CLASSES[i % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"photo{i:04d}{suffix}", **kw)
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
