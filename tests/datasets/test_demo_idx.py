"""Tests for the embedded demo dataset (dlstore.datasets.demo) and the IDX reader/writer (dlstore.datasets.mnist_idx)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dlstore.datasets import demo
from dlstore.datasets.demo import DEMO_CLASSES, demo_jpeg_bytes, ensure_demo, make_demo_image
from dlstore.datasets.mnist_idx import read_idx, synthetic_mnist_arrays, write_fashion_mnist_like, write_idx

REPO_ROOT = Path(__file__).resolve().parents[2]
N_CLASSES = len(DEMO_CLASSES)


def _siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir())


def _jpeg_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.jpg"))


# ----------------------------------------------------------------- demo images


def test_demo_image_is_deterministic() -> None:
    a = demo_jpeg_bytes(7, 2, seed=3)
    assert a == demo_jpeg_bytes(7, 2, seed=3)
    assert a != demo_jpeg_bytes(8, 2, seed=3)
    assert a != demo_jpeg_bytes(7, 2, seed=4)
    # The public image function and the writer's bytes agree.
    buf = io.BytesIO()
    make_demo_image(7, 2, seed=3).save(buf, format="JPEG", quality=demo.DEMO_JPEG_QUALITY)
    assert buf.getvalue() == a


def test_demo_image_size_and_jpeg_bytes_in_range() -> None:
    for i in range(10):
        img = make_demo_image(i, i % N_CLASSES)
        assert img.mode == "RGB"
        w, h = img.size
        landscape = 360 <= w <= 460 and 270 <= h <= 345
        portrait = 360 <= h <= 460 and 270 <= w <= 345
        assert landscape or portrait, img.size
        # Spec is ~20-60 kB at quality 90; leave margin for other Pillow/libjpeg builds.
        n = len(demo_jpeg_bytes(i, i % N_CLASSES))
        assert 15_000 < n < 75_000, (i, n)


def test_demo_image_rejects_bad_label() -> None:
    with pytest.raises(ValueError, match="label"):
        make_demo_image(0, N_CLASSES)


def test_demo_classes_sorted_for_imagefolder() -> None:
    # ImageFolder numbers classes by sorted name; labels must line up with it.
    assert list(DEMO_CLASSES) == sorted(DEMO_CLASSES)


# ----------------------------------------------------------------- ensure_demo


def test_ensure_demo_layout_matches_imagefolder(tmp_path: Path) -> None:
    from torchvision.datasets import ImageFolder

    n = 12
    root = ensure_demo(tmp_path / "demo", n_images=n, seed=1, workers=2)
    assert root == tmp_path / "demo"
    ds = ImageFolder(str(root))
    assert ds.classes == list(DEMO_CLASSES)
    expected_counts = Counter(i % N_CLASSES for i in range(n))
    assert Counter(ds.targets) == expected_counts
    for path, target in ds.samples:
        index = int(Path(path).stem)
        assert target == index % N_CLASSES
        assert Path(path).read_bytes() == demo_jpeg_bytes(index, target, seed=1)
    assert _siblings(root) == ["demo"]  # no temp dirs left behind


def test_ensure_demo_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = ensure_demo(tmp_path / "demo", n_images=6, workers=1)
    before = {p: p.stat().st_mtime_ns for p in _jpeg_files(root)}

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("complete dataset must not be regenerated")

    monkeypatch.setattr(demo, "_generate_into", boom)
    assert ensure_demo(tmp_path / "demo", n_images=6, workers=1) == root
    assert {p: p.stat().st_mtime_ns for p in _jpeg_files(root)} == before


def test_ensure_demo_rejects_different_params_in_same_root(tmp_path: Path) -> None:
    ensure_demo(tmp_path / "demo", n_images=5, workers=1)
    with pytest.raises(ValueError, match="different demo dataset"):
        ensure_demo(tmp_path / "demo", n_images=6, workers=1)


def test_crashed_run_leaves_nothing_reusable(tmp_path: Path) -> None:
    # A real crash: the child dies (os._exit, so no cleanup handlers run) right
    # before the marker is written, i.e. after every image is on disk.
    root = tmp_path / "demo"
    code = (
        "import os, sys\n"
        "from dlstore.datasets import demo\n"
        "demo._write_marker = lambda *a, **k: os._exit(3)\n"
        f"demo.ensure_demo({str(root)!r}, n_images=4, workers=1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 3
    assert not root.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".demo.tmp-")]
    assert len(leftovers) == 1 and len(list(leftovers[0].glob("*/*.jpg"))) == 4

    assert ensure_demo(root, n_images=4, workers=1) == root
    assert (root / demo._MARKER_NAME).is_file()
    assert len(_jpeg_files(root)) == 4
    assert not leftovers[0].exists()  # its process is gone: cleaned at the next start


def test_incomplete_root_is_replaced(tmp_path: Path) -> None:
    # A dir at the final path without the marker (e.g. copied by hand, half-way).
    root = tmp_path / "demo"
    (root / DEMO_CLASSES[0]).mkdir(parents=True)
    (root / DEMO_CLASSES[0] / "000000.jpg").write_bytes(b"truncated")
    ensure_demo(root, n_images=3, workers=1)
    assert (root / DEMO_CLASSES[0] / "000000.jpg").read_bytes() == demo_jpeg_bytes(0, 0)
    assert _siblings(root) == ["demo"]


def test_failed_generation_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "_write_marker", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo(tmp_path / "demo", n_images=2, workers=1)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_ensure_demo(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(ensure_demo(root, n_images=5, workers=1))
        except BaseException as e:  # re-raised below in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [root] * 3
    assert len(_jpeg_files(root)) == 5
    assert _siblings(root) == ["demo"]  # losers removed their temp dirs


def test_default_demo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLSTORE_DEMO_DIR", str(tmp_path / "from-env"))
    assert demo.default_demo_dir(512, 0) == tmp_path / "from-env" / "demo-v1-n512-s0"
    monkeypatch.delenv("DLSTORE_DEMO_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert demo.default_demo_dir(64, 2) == tmp_path / ".cache" / "dlstore" / "demo-v1-n64-s2"


# ------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("shape", [(17,), (5, 28, 28), (3, 4, 7)])
def test_idx_round_trip(tmp_path: Path, shape: tuple[int, ...]) -> None:
    arr = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    path = tmp_path / "a.idx"
    write_idx(path, arr)
    raw = path.read_bytes()
    assert raw[:4] == bytes([0, 0, 0x08, len(shape)])  # 0x00000801 / 0x00000803
    assert raw[4 : 4 + 4 * len(shape)] == b"".join(d.to_bytes(4, "big") for d in shape)
    back = read_idx(path)
    assert back.dtype == np.uint8 and back.shape == shape
    np.testing.assert_array_equal(back, arr)
    back[...] = 0  # result is writable (torch.from_numpy warns on read-only arrays)


def test_idx_size_mismatch_errors(tmp_path: Path) -> None:
    path = tmp_path / "imgs-idx3-ubyte"
    write_idx(path, np.zeros((4, 28, 28), np.uint8))
    full = path.read_bytes()
    path.write_bytes(full[:-1])
    with pytest.raises(
        ValueError, match=rf"imgs-idx3-ubyte.*expected {len(full)} bytes, found {len(full) - 1}"
    ):
        read_idx(path)
    path.write_bytes(full + b"\0")
    with pytest.raises(ValueError, match=rf"expected {len(full)} bytes, found {len(full) + 1}"):
        read_idx(path)
    path.write_bytes(full[:10])  # header itself cut short
    with pytest.raises(ValueError, match="imgs-idx3-ubyte"):
        read_idx(path)


def test_idx_bad_magic_and_dtype(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(b"\x01\x00\x08\x01" + (1).to_bytes(4, "big") + b"\x07")
    with pytest.raises(ValueError, match="magic"):
        read_idx(path)
    path.write_bytes(b"\x00\x00\x07\x01" + (1).to_bytes(4, "big") + b"\x07")
    with pytest.raises(ValueError, match="dtype code 0x07"):
        read_idx(path)


def test_idx_reads_multibyte_dtypes_big_endian(tmp_path: Path) -> None:
    values = np.array([1, -2, 300], dtype=">i2")
    path = tmp_path / "shorts"
    path.write_bytes(b"\x00\x00\x0b\x01" + (3).to_bytes(4, "big") + values.tobytes())
    np.testing.assert_array_equal(read_idx(path), [1, -2, 300])


def test_write_idx_rejects_unsupported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uint8"):
        write_idx(tmp_path / "x", np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="ndim"):
        write_idx(tmp_path / "x", np.zeros((2, 2), np.uint8))


# ------------------------------------------------------------ synthetic MNIST


@pytest.mark.parametrize("name", ["FashionMNIST", "MNIST"])
def test_torchvision_reads_synthetic_mnist(tmp_path: Path, name: str) -> None:
    import torchvision.datasets as tvd

    root = write_fashion_mnist_like(tmp_path, n_train=40, n_test=20, seed=5, name=name)
    raw = tmp_path / name / "raw"
    for split, n in (("train", 40), ("t10k", 20)):
        images = read_idx(raw / f"{split}-images-idx3-ubyte")
        labels = read_idx(raw / f"{split}-labels-idx1-ubyte")
        assert images.shape == (n, 28, 28) and labels.shape == (n,)
        ds = getattr(tvd, name)(str(root), train=split == "train", download=False)
        assert len(ds) == n
        np.testing.assert_array_equal(ds.data.numpy(), images)
        np.testing.assert_array_equal(ds.targets.numpy(), labels)
        img, label = ds[3]
        assert label == int(labels[3])
        np.testing.assert_array_equal(np.asarray(img), images[3])
    assert sorted(np.unique(read_idx(raw / "train-labels-idx1-ubyte"))) == list(range(10))


def test_synthetic_mnist_deterministic_and_learnable(tmp_path: Path) -> None:
    a = write_fashion_mnist_like(tmp_path / "a", 30, 10, seed=1)
    b = write_fashion_mnist_like(tmp_path / "b", 30, 10, seed=1)
    for f in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert (a / "FashionMNIST/raw" / f).read_bytes() == (b / "FashionMNIST/raw" / f).read_bytes()
    # Classes must be separable: even nearest-centroid on raw pixels does well.
    x, y = synthetic_mnist_arrays(np.random.default_rng(0), 2000)
    xt, yt = synthetic_mnist_arrays(np.random.default_rng(1), 500)
    x, xt = x.reshape(len(x), -1) / 255.0, xt.reshape(len(xt), -1) / 255.0
    centroids = np.stack([x[y == c].mean(0) for c in range(10)])
    pred = np.argmin(((xt[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == yt).mean() > 0.5
