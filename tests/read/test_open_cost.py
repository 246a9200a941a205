"""Opening a cache costs nothing per source file (issue 9): no filesystem access below the source
root (one stat of the root itself, for the cheap staleness hint), and the per-file source record is
not read either. Checked by recording every path Python's file functions are given, not by a clock."""

from __future__ import annotations

import builtins
import io
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_helpers import make_tree

from dlstore.errors import StaleCacheWarning
from dlstore.read.cache import open_cache
from dlstore.read.dataset import CachedDataset
from dlstore.spec import SOURCE_RECORD
from dlstore.write.conversion import convert
from dlstore.write.options import ConvertOptions


@pytest.fixture
def accessed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path passed to stat/lstat/scandir/listdir/open while the test body runs."""
    seen: list[str] = []

    def spy(fn):  # type: ignore[no-untyped-def]
        def wrapper(path, *a, **kw):  # type: ignore[no-untyped-def]
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.path.abspath(os.fsdecode(path)))
            return fn(path, *a, **kw)

        return wrapper

    for mod, name in [
        (os, "stat"),
        (os, "lstat"),
        (os, "scandir"),
        (os, "listdir"),
        (os, "open"),
        (builtins, "open"),
        (io, "open"),
    ]:
        monkeypatch.setattr(mod, name, spy(getattr(mod, name)))
    yield seen


@pytest.mark.parametrize("fmt", ["ram", "npz", "zarr"])
def test_open_touches_nothing_below_the_source_root(
    tmp_path: Path, fmt: str, request: pytest.FixtureRequest
) -> None:
    src = make_tree(tmp_path / "src", per_class=6)
    dest = tmp_path / "c"
    convert(src, dest, ConvertOptions(format=fmt, size=8, workers=1))
    root = str(src.resolve())
    seen = request.getfixturevalue("accessed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changed: no warning either
        cache = open_cache(dest)
        ds = CachedDataset(dest)
        cache.read([0, 3, 5])
        ds[2]
    below = [p for p in seen if p.startswith(root + os.sep)]
    assert below == [], below[:5]
    assert seen.count(root) <= 2  # one stat of the root per open, nothing more
    assert seen and not any(p.endswith(SOURCE_RECORD) for p in seen)  # the record is not read
    assert any(p.startswith(str(dest)) for p in seen)  # the spy did see the cache being opened


def test_a_new_class_folder_warns_on_open_without_a_scan(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    convert(src, tmp_path / "c", ConvertOptions(size=8, workers=1))
    shutil.copytree(src / "a", src / "c_new")
    with pytest.warns(StaleCacheWarning, match="source folder .* was modified"):
        open_cache(tmp_path / "c")
    with pytest.warns(StaleCacheWarning, match="label indices shifted"):
        open_cache(tmp_path / "c", check_source=True)  # the explicit check names what changed


def test_a_changed_file_needs_the_explicit_check(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    convert(src, tmp_path / "c", ConvertOptions(size=8, workers=1))
    f = src / "a" / "img001.png"
    f.write_bytes(f.read_bytes() + b"\0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_cache(tmp_path / "c")  # documented: one stat of the root cannot see inside class folders
    with pytest.warns(StaleCacheWarning, match="a/img001.png"):
        CachedDataset(tmp_path / "c", check_source=True)


def test_dest_inside_the_source_root_is_refused(tmp_path: Path) -> None:
    """It would read as a class folder of the source next time (and publishing it would change the root's
    mtime, which the one-stat check on open reads): refused before anything is written, whether SOURCE is a
    path or a Source."""
    from dlstore.errors import ConvertError
    from dlstore.write.sources import scan_folder

    src = make_tree(tmp_path / "src", per_class=3)
    for source in (src, scan_folder(src)):
        with pytest.raises(ConvertError, match="DEST is inside SOURCE"):
            convert(source, src / "a" / "cache", ConvertOptions(size=8, workers=1))
    assert not (src / "a" / "cache").exists()
