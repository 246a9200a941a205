"""Re-running ``convert`` on a finished DEST is make-like (issue 9): up to date → no work; other
options, another source or a changed source → refused naming the first difference; --overwrite rebuilds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from reliability_helpers import make_tree

from dlstore.errors import CacheExistsError
from dlstore.spec import MANIFEST, read_spec
from dlstore.write.conversion import convert


def conv(src: Path, dest: Path, **kw: object):  # type: ignore[no-untyped-def]
    kw = {"size": 8, "workers": 1, "format": "ram", **kw}
    return convert(src, dest, **kw)  # type: ignore[arg-type]


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path]:
    src = make_tree(tmp_path / "src", per_class=3)
    conv(src, tmp_path / "c")
    return src, tmp_path / "c"


@pytest.mark.parametrize("fmt", ["ram", "zarr"])
def test_same_command_is_up_to_date_and_does_nothing(tmp_path: Path, fmt: str) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    first = conv(src, tmp_path / "c", format=fmt)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")}
    again = conv(src, tmp_path / "c", format=fmt)
    assert again.up_to_date and not first.up_to_date
    assert (again.n, again.classes, again.shape) == (first.n, first.classes, first.shape)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*")} == before


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"size": 16}, "--size 16 was 8"),
        ({"decode": "fast"}, "--decode fast was exact"),
        ({"format": "npz"}, "--format npz was ram"),
        ({"resize": "pad"}, "--resize pad was crop"),
        ({"storage_order": "source"}, "--storage-order source was shuffled"),
    ],
)
def test_other_options_are_refused_naming_the_first_difference(
    built: tuple[Path, Path], change: dict, expect: str
) -> None:
    src, dest = built
    manifest = (dest / MANIFEST).read_bytes()
    with pytest.raises(CacheExistsError, match="built with other options") as e:
        conv(src, dest, **change)
    assert expect in str(e.value) and "--overwrite" in str(e.value)
    assert (dest / MANIFEST).read_bytes() == manifest
    result = conv(src, dest, overwrite=True, **change)
    assert not result.up_to_date and read_spec(dest).format == change.get("format", "ram")


def test_changed_source_is_refused_naming_the_first_changed_file(built: tuple[Path, Path]) -> None:
    src, dest = built
    victim = src / "b" / "img001.png"
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(CacheExistsError, match="source changed") as e:
        conv(src, dest)
    assert "b/img001.png (size/mtime changed" in str(e.value) and "--overwrite" in str(e.value)
    (src / "a" / "img000.jpg").unlink()
    with pytest.raises(CacheExistsError, match=r"a/img000.jpg \(removed\)"):
        conv(src, dest)
    assert not conv(src, dest, overwrite=True).up_to_date
    assert conv(src, dest).up_to_date


def test_another_source_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    _, dest = built
    other = make_tree(tmp_path / "other", per_class=2, seed=5)
    with pytest.raises(CacheExistsError, match="another source") as e:
        conv(other, dest)
    assert str(other) in str(e.value)


def test_the_same_source_by_another_path_is_the_same_source(
    built: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dest = built
    (src / "a" / "img000.jpg").unlink()
    monkeypatch.chdir(src.parent)
    with pytest.raises(CacheExistsError, match=r"source changed.*a/img000.jpg \(removed\)"):
        conv(Path("src"), dest)  # relative this time: still the same source, so the change is named


def test_moved_source_with_the_same_files_is_up_to_date(built: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = built
    moved = tmp_path / "moved"
    shutil.copytree(src, moved, copy_function=shutil.copy2)  # same names, sizes and mtimes
    assert conv(moved, dest).up_to_date


def test_a_folder_that_is_not_a_cache_is_still_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=2)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(CacheExistsError, match="not a dlstore cache.*choose another DEST"):
        conv(src, tmp_path / "c")
