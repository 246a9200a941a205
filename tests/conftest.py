"""Fixtures: small synthetic image trees made per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from imagegen import KINDS, ORIENT_TAG, make_image, save, smooth_rgb
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def repo_entries() -> set[str]:
    return {p.name for p in REPO.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"}


@pytest.fixture(scope="session", autouse=True)
def nothing_lands_in_the_repo() -> Iterator[None]:
    """Nothing a test writes lands in the repository (a bench without ``--out`` run from the repo
    root left ``dlstore-bench-*/`` folders there): fails the session naming what appeared."""
    before = repo_entries()
    yield
    new = sorted(repo_entries() - before)
    assert not new, f"tests wrote {new} into {REPO}: run such commands with --out or in tmp_path"


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes, every kind of image at least once, nested subfolder, one EXIF-rotated JPEG."""
    root = tmp_path_factory.mktemp("tree")
    rng = np.random.default_rng(7)
    classes = ("cat", "dog", "zebra")
    for ci, cls in enumerate(classes):
        (root / cls / "nested").mkdir(parents=True)
        for j, kind in enumerate(KINDS):
            if (j + ci) % 2 and kind not in ("rgba_png", "i16_png", "cmyk_jpg", "big_jpg"):
                continue
            img, suffix = make_image(kind, rng)
            sub = root / cls / ("nested" if j % 4 == 0 else "")
            save(img, sub / f"{kind}_{j:02d}{suffix}")
        img = Image.fromarray(smooth_rgb(rng, 50, 70))
        exif = Image.Exif()
        exif[ORIENT_TAG] = 6
        img.save(root / cls / "rotated.jpg", exif=exif, quality=92)
    return root


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Demo images and bench caches in a folder of this test module, not in ~/.cache."""
    root = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLSTORE_DEMO_DIR", str(root / "demo"))
        mp.setenv("DLSTORE_BENCH_CACHE", str(root / "caches"))
        mp.chdir(root)  # a bench without --out writes dlstore-bench-*/ into the cwd: here, not the repo
        yield root
