"""Every SOURCE form (issue 25): the same photographs as an ImageFolder tree, a parquet file in
Hugging Face's layout, WebDataset shards, a CSV list and a Dataset convert to the same cache in
every format; labels equal pyarrow's and webdataset's readers'; a bad sample in each form is named."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from photo_forms import (
    CLASSES,
    PhotoDataset,
    folder_samples,
    make_photo_folder,
    picture_of,
    real_pictures,
    write_csv,
    write_hf_parquet,
    write_shards,
)

from dlstore import ConvertOptions, convert
from dlstore.errors import DlstoreError
from dlstore.read.cache import open_cache
from dlstore.write.sources import open_source

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")

N = 24


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name → (SOURCE, ConvertOptions fields it needs)."""
    tmp = tmp_path_factory.mktemp("forms")
    root = make_photo_folder(tmp / "photos", N)
    return {
        "folder": (str(root), {}),
        "parquet": (str(write_hf_parquet(root, tmp / "photos.parquet")), {}),
        "webdataset": (write_shards(root, tmp / "shards"), {}),
        "csv": (str(write_csv(root, tmp / "list.csv")), {"root": root}),
        "dataset": (PhotoDataset(root), {}),
    }


def test_the_photographs_are_cut_from_several_real_pictures(forms: dict) -> None:
    pictures = {p.stem.split("-", 1)[1] for p in Path(forms["folder"][0]).rglob("photo*")}
    names = [name for name, _ in real_pictures()]
    assert pictures == {names[picture_of(i, len(names))] for i in range(N)}
    assert len(pictures) >= min(len(names), 8) and len(names) >= 4


def cache_arrays(dest: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    cache = open_cache(dest)
    images = np.stack(cache.read_images(np.arange(cache.spec.n)))
    return images, np.asarray(cache.labels), cache.spec.source


@pytest.mark.parametrize("fmt", ["ram", "npz", "zarr"])
def test_every_form_converts_to_the_same_cache(
    forms: dict, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlstore.write.sources.parquet as parquet

    made = {}
    with monkeypatch.context() as m:  # a source larger than the row-group cache: spooled by unit
        m.setattr(parquet, "CACHE_BYTES", 1000)
        spooled = convert(
            forms["parquet"][0],
            tmp_path / "spooled",
            ConvertOptions(size=32, format=fmt, workers=2 if fmt == "ram" else 1),
        )
        assert not (tmp_path / ".spooled.dlstore-journal").exists()  # the spool went with the journal
    made["spooled"] = cache_arrays(tmp_path / "spooled")
    assert spooled.stages["setup_source_s"] > 0
    for name, (source, extra) in forms.items():
        result = convert(source, tmp_path / name, ConvertOptions(size=32, format=fmt, workers=1, **extra))
        assert (result.n, result.n_skipped) == (N, 0), name
        made[name] = cache_arrays(tmp_path / name)
    images, labels, _ = made["folder"]
    assert images.shape == (N, 32, 32, 3) and len(set(labels.tolist())) == len(CLASSES)
    for name, (other_images, other_labels, _record) in made.items():
        assert np.array_equal(other_images, images), name  # byte-identical pixels, every form
        assert np.array_equal(other_labels, labels), name
    assert {made[n][2]["kind"] for n in made} == {"folder", "parquet", "webdataset", "filelist", "dataset"}


def test_labels_and_classes_are_the_readers_own(forms: dict) -> None:
    import pyarrow.parquet as pq
    import webdataset as wds

    pq_path = forms["parquet"][0]
    src = open_source(pq_path)
    assert src.labels.tolist() == pq.read_table(pq_path).column("label").to_pylist()
    assert src.classes == CLASSES  # HF's ClassLabel names, from the schema's metadata
    assert len(src.rg_file) == -(-N // 5)  # one row group per 5 rows: the units of reading

    pattern = forms["webdataset"][0]
    shards = open_source(pattern)
    theirs = [(s["__key__"], int(s["cls"])) for s in wds.WebDataset(pattern, shardshuffle=False).decode()]
    assert [(n.split("#")[1], int(t)) for n, t in zip(shards.names, shards.labels)] == theirs

    listed = open_source(forms["csv"][0], root=forms["csv"][1]["root"])
    assert listed.classes == CLASSES  # no declaration: the sorted label values
    folder = folder_samples(Path(forms["folder"][0]))
    assert list(listed.names) == [p for p, _ in folder] and listed.labels.tolist() == [t for _, t in folder]


def test_a_dataset_of_arrays_and_tensors_gives_the_pil_pixels(forms: dict, tmp_path: Path) -> None:
    from PIL import Image

    pil = PhotoDataset(Path(forms["folder"][0]))

    class AsArrays:
        classes = list(CLASSES)

        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> tuple[Any, int]:
            img, t = pil[i + 1]  # no EXIF-rotated photo (item 0) among them: arrays carry no EXIF
            img = img if isinstance(img, Image.Image) else Image.open(io.BytesIO(img))
            arr = np.array(img.convert("RGB"))  # writable: torch.from_numpy warns on a read-only view
            return (torch.from_numpy(arr).permute(2, 0, 1).contiguous() if i % 2 else arr), t

    class AsRgb(AsArrays):
        def __getitem__(self, i: int) -> tuple[Any, int]:
            img, t = pil[i + 1]
            img = img if isinstance(img, Image.Image) else Image.open(io.BytesIO(img))
            return Image.fromarray(np.asarray(img.convert("RGB"))), t  # the same pixels, no PNG info

    a = convert(AsArrays(), tmp_path / "a", ConvertOptions(size=24, format="npz", workers=1))
    b = convert(AsRgb(), tmp_path / "b", ConvertOptions(size=24, format="npz", workers=1))
    assert a.n == b.n == 6
    assert np.array_equal(cache_arrays(tmp_path / "a")[0], cache_arrays(tmp_path / "b")[0])


# --- bad samples ------------------------------------------------------------------------------------


def good_and_bad_bytes(root: Path) -> tuple[bytes, bytes, bytes]:
    jpg = next(p for p, _ in folder_samples(root) if p.endswith(".jpg"))
    good = (root / jpg).read_bytes()
    return good, good[: len(good) // 3], b"this is not an image"


def bad_parquet(root: Path, out: Path) -> tuple[str, dict[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good, cut, junk = good_and_bad_bytes(root)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = [
        {"bytes": good, "path": "a.jpg"},
        {"bytes": cut, "path": "cut.jpg"},
        {"bytes": junk, "path": "x"},
    ]
    images += [{"bytes": None, "path": "missing.jpg"}, {"bytes": good, "path": "b.jpg"}]
    images += [{"bytes": good, "path": "c.jpg"}, {"bytes": good, "path": "d.jpg"}]
    table = pa.table({"image": pa.array(images, image_type), "label": [0, 1, 0, 1, None, 1, 0]})
    pq.write_table(table, out, row_group_size=3)
    expected = {
        "bad.parquet#1": "cannot decode",
        "bad.parquet#2": "cannot decode",
        "bad.parquet#3": "missing.jpg",
        "bad.parquet#4": "not one of the classes",
    }
    return str(out), expected


def bad_shards(root: Path, folder: Path) -> tuple[str, dict[str, str]]:
    import webdataset as wds

    good, cut, junk = good_and_bad_bytes(root)
    folder.mkdir()
    with wds.TarWriter(str(folder / "bad-0.tar")) as sink:
        sink.write({"__key__": "s0", "jpg": good, "cls": 0})
        sink.write({"__key__": "s1", "jpg": cut, "cls": 1})
        sink.write({"__key__": "s2", "jpg": junk, "cls": 0})
        sink.write({"__key__": "s3", "jpg": good})  # no label
        sink.write({"__key__": "s4", "txt": "no image here", "cls": 1})
        sink.write({"__key__": "s5", "jpg": good, "cls": 1})
        sink.write({"__key__": "s6", "jpg": good, "cls": 0})
    expected = {
        "bad-0.tar#s1": "cannot decode",
        "bad-0.tar#s2": "cannot decode",
        "bad-0.tar#s3": "no label",
        "bad-0.tar#s4": "no image member",
    }
    return str(folder / "bad-{0..0}.tar"), expected


def bad_list(root: Path, out: Path) -> tuple[str, dict[str, str]]:
    good, cut, junk = good_and_bad_bytes(root)
    imgs = out.parent / "imgs"
    imgs.mkdir()
    for name, data in {
        "a.jpg": good,
        "cut.jpg": cut,
        "junk.jpg": junk,
        "b.jpg": good,
        "c.jpg": good,
        "d.jpg": good,
    }.items():
        (imgs / name).write_bytes(data)
    rows = [
        "path,label",
        "a.jpg,cat",
        "cut.jpg,dog",
        "junk.jpg,cat",
        "gone.jpg,dog",
        "b.jpg,",
        "c.jpg,dog",
        "d.jpg,cat",
    ]
    out.write_text("\n".join(rows) + "\n")
    expected = {
        "cut.jpg": "cannot decode",
        "junk.jpg": "cannot decode",
        "gone.jpg": "line 5",
        "bad.csv:6": "no label",
    }
    return str(out), expected


class BrokenDataset:
    """Items 1 and 2 are broken images, 3 raises in ``__getitem__``, 4 is a float array."""

    def __init__(self, good: bytes, cut: bytes, junk: bytes) -> None:
        self.items: list[Any] = [good, cut, junk, None, np.zeros((8, 8, 3), np.float32), good, good]
        self.targets = [0, 1, 0, 1, 0, 1, 0]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if self.items[i] is None:
            raise KeyError(f"record {i} is gone")
        return self.items[i], self.targets[i]


def test_bad_samples_are_named_in_every_form(forms: dict, tmp_path: Path) -> None:
    root = Path(forms["folder"][0])
    cases = {
        "parquet": (*bad_parquet(root, tmp_path / "bad.parquet"), {}),
        "webdataset": (*bad_shards(root, tmp_path / "shards"), {}),
        "csv": (*bad_list(root, tmp_path / "bad.csv"), {"root": tmp_path / "imgs"}),
    }
    ds = BrokenDataset(*good_and_bad_bytes(root))
    cases["dataset"] = (
        ds,
        {
            "BrokenDataset#1": "cannot decode",
            "BrokenDataset#2": "cannot decode",
            "BrokenDataset#3": "KeyError",
            "BrokenDataset#4": "uint8",
        },
        {},
    )
    for name, (source, expected, extra) in cases.items():
        dest = tmp_path / f"c_{name}"
        result = convert(source, dest, ConvertOptions(size=16, format="npz", workers=1, max_bad=0.9, **extra))
        skipped = json.loads((dest / "skipped.json").read_text())
        assert result.n == 3, (name, skipped)
        text = json.dumps(skipped)
        for where, why in expected.items():
            entry = [s for s in skipped if where in s["path"] or where in s["reason"]]
            assert entry and why in entry[0]["reason"] + entry[0]["path"], (name, where, skipped)
        with pytest.raises(DlstoreError) as stopped:
            convert(
                source,
                tmp_path / f"s_{name}",
                ConvertOptions(size=16, format="npz", workers=1, strict=True, **extra),
            )
        assert any(where in str(stopped.value) for where in expected), (name, str(stopped.value))
        assert text


# --- re-runs and verify --deep ----------------------------------------------------------------------


def test_reruns_are_make_like_and_verify_deep_rehashes(forms: dict, tmp_path: Path) -> None:
    import os
    import shutil

    import pyarrow.parquet as pq

    from dlstore.errors import CacheExistsError
    from dlstore.write.verification import verify

    pq_path = tmp_path / "photos.parquet"
    shutil.copy(forms["parquet"][0], pq_path)
    shards = tmp_path / "shards"
    shutil.copytree(Path(forms["webdataset"][0]).parent, shards)
    sources = {"parquet": str(pq_path), "webdataset": str(shards / Path(forms["webdataset"][0]).name)}
    opts = ConvertOptions(size=16, format="npz", workers=1)
    for name, source in sources.items():
        convert(source, tmp_path / name, opts)
        assert convert(source, tmp_path / name, opts).up_to_date
        checked = verify(tmp_path / name, deep=True)
        assert checked.ok and checked.sources_hashed == N, (name, checked.problems)

    table = pq.read_table(pq_path)
    images = table.column("image").to_pylist()
    images[7]["bytes"], images[8]["bytes"] = images[8]["bytes"], images[7]["bytes"]
    import pyarrow as pa

    pq.write_table(
        table.set_column(0, "image", pa.array(images, table.schema.field("image").type)),
        pq_path,
        row_group_size=5,
    )
    problems = verify(tmp_path / "parquet", deep=True).problems
    assert [p.split(":")[0] for p in problems] == ["photos.parquet#7", "photos.parquet#8"]
    with pytest.raises(
        CacheExistsError, match=r"source changed.*first changed file photos.parquet \(size/mtime"
    ):
        convert(sources["parquet"], tmp_path / "parquet", opts)

    first = sorted(shards.glob("*.tar"))[0]
    os.utime(first, ns=(1, 1))  # shards: size and mtime are the fingerprint
    with pytest.raises(CacheExistsError, match=f"source changed.*first changed file {first.name}"):
        convert(sources["webdataset"], tmp_path / "webdataset", opts)


@pytest.mark.slow
def test_500_photographs_give_the_same_cache_in_every_form(tmp_path: Path) -> None:
    """The issue's size: 500 photographs, every form, every format, process pool of 2."""
    root = make_photo_folder(tmp_path / "photos", 500)
    forms = {
        "folder": (str(root), {}),
        "parquet": (str(write_hf_parquet(root, tmp_path / "photos.parquet", rows_per_group=100)), {}),
        "webdataset": (write_shards(root, tmp_path / "shards", per_shard=100), {}),
        "csv": (str(write_csv(root, tmp_path / "list.csv")), {"root": root}),
        "dataset": (PhotoDataset(root), {}),
    }
    for fmt in ("ram", "npz", "zarr"):
        made = {}
        for name, (source, extra) in forms.items():
            result = convert(
                source, tmp_path / f"{fmt}_{name}", ConvertOptions(size=48, format=fmt, workers=2, **extra)
            )
            assert (result.n, result.n_skipped) == (500, 0), (fmt, name)
            made[name] = cache_arrays(tmp_path / f"{fmt}_{name}")[:2]
        for name, (images, labels) in made.items():
            assert np.array_equal(images, made["folder"][0]) and np.array_equal(labels, made["folder"][1]), (
                fmt,
                name,
            )


def per_row_containers(obj: Any, n: int, where: str = "source") -> list[str]:
    """Attributes of ``obj`` (and of the arrays' holders inside it) that keep a Python object per row:
    a list, tuple or dict of about ``n`` items, or an object-dtype array."""
    found = []
    for name, value in vars(obj).items():
        if isinstance(value, (list, tuple, dict)) and len(value) >= n // 2:
            found.append(f"{where}.{name} ({type(value).__name__} of {len(value)})")
        elif isinstance(value, np.ndarray) and value.dtype == object:
            found.append(f"{where}.{name} (object array)")
        elif hasattr(value, "__dict__") and not callable(value) and len(found) < 20:
            found += per_row_containers(value, n, f"{where}.{name}")
    return found


def test_listing_keeps_arrays_not_a_python_object_per_row(tmp_path: Path) -> None:
    """Issue 25, scale: a parquet source and WebDataset shards are listed as arrays (row, row group,
    shard, offset, size, key), so a source of millions of rows holds no Python object per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    rows = 5000
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": b"\xff\xd8", "path": None}] * rows, image_type)
    pq.write_table(
        pa.table({"image": images, "label": np.arange(rows) % 7}),
        tmp_path / "big.parquet",
        row_group_size=1000,
    )
    parquet = open_source(str(tmp_path / "big.parquet"))
    assert len(parquet) == rows and per_row_containers(parquet, rows) == []
    assert parquet.names[rows - 1] == f"big.parquet#{rows - 1}"

    samples = 900
    for s in range(3):
        with wds.TarWriter(str(tmp_path / f"w-{s:06d}.tar")) as sink:
            for i in range(s * samples // 3, (s + 1) * samples // 3):
                sink.write({"__key__": f"k{i:07d}", "jpg": b"\xff\xd8", "cls": i % 5 if s else f"c{i % 5}"})
    shards = open_source(str(tmp_path / "w-{000000..000002}.tar"))
    assert len(shards) == samples and per_row_containers(shards, samples) == []
    assert shards.names[samples - 1] == f"w-000002.tar#k{samples - 1:07d}"
    # ints in two shards, text in one: all of them text, as a single list of them would be
    assert shards.classes == ("0", "1", "2", "3", "4", "c0", "c1", "c2", "c3", "c4")
