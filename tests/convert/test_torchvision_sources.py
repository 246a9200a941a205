"""torchvision:CIFAR10 / CIFAR100 read by torchvision's own classes from local files (pickles written here
in the layout torchvision reads; its md5 check of the official archive is the only thing bypassed)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.datasets as tvd

from dlstore import CachedDataset, convert
from dlstore.errors import SourceError
from dlstore.write.options import ConvertOptions


def write_cifar(root: Path, name: str, n: int, seed: int = 0) -> np.ndarray:
    """The python-pickle layout of CIFAR10 (five train batches) or CIFAR100; returns the train images
    (N, 32, 32, 3) in torchvision's order."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10 if name == "CIFAR10" else 100, n).tolist()
    rows = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # CIFAR stores each image planar
    if name == "CIFAR10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        parts = np.array_split(np.arange(n), 5)
        for i, part in enumerate(parts, 1):
            batch = {"data": rows[part], "labels": [labels[j] for j in part]}
            (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
        (folder / "test_batch").write_bytes(pickle.dumps({"data": rows[:2], "labels": labels[:2]}))
        meta = {"label_names": [f"class{i}" for i in range(10)]}
        (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        (folder / "train").write_bytes(pickle.dumps({"data": rows, "fine_labels": labels}))
        (folder / "test").write_bytes(pickle.dumps({"data": rows[:2], "fine_labels": labels[:2]}))
        (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i:02d}" for i in range(100)]}))
    return images


@pytest.mark.parametrize("name", ["CIFAR10", "CIFAR100"])
def test_cifar_converts_to_torchvisions_own_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    import torchvision.datasets.cifar

    cls = getattr(tvd, name)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)  # official md5s
    images = write_cifar(tmp_path / "data", name, n=25)
    convert(
        f"torchvision:{name}",
        tmp_path / "c",
        ConvertOptions(root=tmp_path / "data", format="ram", size=32, workers=2),
    )
    ds = CachedDataset(tmp_path / "c")
    ref = cls(str(tmp_path / "data"), train=True, download=False)
    assert len(ds) == len(ref) == 25 and ds.classes == ref.classes and ds.targets == list(ref.targets)
    for i in range(len(ds)):
        x, y = ds[i]
        img, label = ref[i]
        assert y == label
        assert torch.equal(x, torch.from_numpy(np.array(img)).permute(2, 0, 1))
    np.testing.assert_array_equal(ds[7][0].permute(1, 2, 0).numpy(), images[7])


def test_corrupt_cifar_files_are_named_with_the_fix(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for f in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (folder / f).write_bytes(b"x")  # a cut-off download: right names, wrong bytes
    with pytest.raises(
        SourceError, match=r"torchvision:CIFAR10: torchvision cannot read the files under .*again"
    ):
        convert("torchvision:CIFAR10", tmp_path / "c", ConvertOptions(root=tmp_path, size=8, workers=1))
    assert not (tmp_path / "c").exists()


def test_a_sample_of_an_in_memory_source_keeps_its_pixels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision.datasets.cifar

    from dlstore.write.sources import load_torchvision

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    images = write_cifar(tmp_path, "CIFAR10", n=25)
    src = load_torchvision("CIFAR10", tmp_path)
    part = src.subset(np.array([2, 3, 11]))
    assert len(part) == 3 and part.sample.tolist() == [2, 3, 11]
    np.testing.assert_array_equal(part.data, images[[2, 3, 11]])
    assert part.labels.tolist() == src.labels[[2, 3, 11]].tolist() and part.classes == src.classes
    again = part.subset(np.array([0, 2]))  # a sample of a sample still knows where it came from
    assert again.sample.tolist() == [2, 11]
