"""CachedDataset under torch's own DataLoader semantics, every format, fork and spawn."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from dlstore import CachedDataset, convert
from dlstore.formats import FORMATS
from dlstore.write.options import ConvertOptions


@pytest.fixture(scope="module")
def caches(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dscaches")
    for fmt in FORMATS:
        convert(image_tree, base / fmt, ConvertOptions(format=fmt, size=16, workers=1))
    return {fmt: base / fmt for fmt in FORMATS}


def expected(ds: CachedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    imgs, labels = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(imgs), torch.tensor(labels)


def test_item_contract(caches: dict[str, Path], image_tree: Path) -> None:
    folder = ImageFolder(str(image_tree))
    for path in caches.values():
        ds = CachedDataset(path)
        img, label = ds[0]
        assert img.dtype == torch.uint8 and img.shape == (3, 16, 16) and img.is_contiguous()
        assert isinstance(label, int)
        assert ds.classes == folder.classes and ds.targets == folder.targets and len(ds) == len(folder)
        batch = ds.__getitems__([3, 1, 3])
        assert torch.equal(batch[0][0], ds[3][0]) and torch.equal(batch[1][0], ds[1][0])


def test_pil_images_take_imagefolder_transforms(caches: dict[str, Path], image_tree: Path) -> None:
    """pil=True: a pipeline written for ImageFolder (ending in ToTensor) runs unchanged, and gives what
    ImageFolder + Resize + CenterCrop + the same pipeline give (on files whose upright RGB is Pillow's
    convert("RGB"); EXIF rotation, alpha and 16-bit depth are where the cache is right and it is not)."""
    from PIL import Image
    from torchvision import transforms as T

    tail = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))])
    folder = ImageFolder(str(image_tree), transform=T.Compose([T.Resize(16), T.CenterCrop(16), tail]))
    ds = CachedDataset(caches["ram"], transform=tail, pil=True)
    checked = 0
    for i, (path, _) in enumerate(folder.samples):
        with Image.open(path) as img:
            if "rotated" in path or img.mode not in ("RGB", "L", "P") or "transparency" in img.info:
                continue
        (got, y), (want, y_ref) = ds[i], folder[i]
        assert y == y_ref
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=path)
        checked += 1
    assert checked >= 8
    plain = CachedDataset(caches["ram"])
    assert CachedDataset(caches["ram"], pil=True)[0][0].size == (16, 16)
    x, y = next(iter(DataLoader(ds, batch_size=4, num_workers=2)))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32
    with pytest.raises(TypeError, match="pass pil=True"):
        CachedDataset(caches["ram"], transform=tail)[0]
    assert plain[0][0].dtype == torch.uint8


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pickle_is_small(caches: dict[str, Path], fmt: str) -> None:
    for in_memory in [False, True] if fmt == "ram" else [False]:
        ds = CachedDataset(caches[fmt], in_memory=in_memory)
        ds[0]  # open storage first: the pickle must still carry no pixels
        blob = pickle.dumps(ds)
        assert len(blob) < 4096, len(blob)
        clone = pickle.loads(blob)
        assert torch.equal(clone[5][0], ds[5][0])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("workers,ctx", [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_epoch(caches: dict[str, Path], fmt: str, workers: int, ctx: str | None) -> None:
    ds = CachedDataset(caches[fmt], in_memory=fmt == "ram")
    ref_x, ref_y = expected(ds)  # parent reads first: workers must still open their own handles
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(
        ds, batch_size=5, shuffle=True, generator=g, num_workers=workers, multiprocessing_context=ctx
    )
    seen = []
    for x, y in loader:
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 16, 16)
        for img, lab in zip(x, y):
            seen.append(int(lab))
            matches = [i for i in range(len(ds)) if torch.equal(ref_x[i], img) and ref_y[i] == lab]
            assert matches, "a batch image that is not in the dataset"
    assert sorted(seen) == sorted(ref_y.tolist())


def test_transform_is_applied(caches: dict[str, Path]) -> None:
    ds = CachedDataset(caches["ram"], transform=lambda t: t.float() / 255)
    img, _ = ds[0]
    assert img.dtype == torch.float32 and float(img.max()) <= 1.0


def test_read_batch_returns_tensors(caches: dict[str, Path]) -> None:
    ds = CachedDataset(caches["zarr"])
    x, y = ds.read_batch([2, 0])
    assert x.shape == (2, 3, 16, 16) and y.dtype == torch.int64
    assert torch.equal(x[0], ds[2][0]) and int(y[1]) == ds[0][1]


def test_in_memory_is_one_contiguous_array(caches: dict[str, Path]) -> None:
    ds = CachedDataset(caches["ram"], in_memory=True)
    arr = ds.cache.reader.array
    assert isinstance(arr, np.ndarray) and not isinstance(arr, np.memmap) and arr.flags.c_contiguous
    assert isinstance(CachedDataset(caches["ram"]).cache.reader.array, np.memmap)
