"""Tests for the embedded demo dataset (dlstore.datasets.demo)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from dlstore.datasets import demo
from dlstore.datasets.demo import DEMO_CLASSES, demo_jpeg_bytes, ensure_demo, make_demo_image

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
