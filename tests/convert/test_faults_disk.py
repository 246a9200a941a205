"""A5 (disk full) and DEST on a mount point, against a real small tmpfs where this machine lets the test
mount one (root on Linux), else an injected ENOSPC from zarr's own ``_atomic_write``: every stage of a
conversion that meets a full disk ends in the one disk-full message (issue 20 part 3), never a raw
``OSError: [Errno 28]``; and the re-run after freeing space resumes to the same cache."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_helpers import assert_same_cache, make_tree

from dlstore.cli import main
from dlstore.errors import ConvertError
from dlstore.write.conversion import convert


def mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    return done.returncode == 0


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs of its own, or a skip where mounting is not permitted."""
    where = tmp_path / "small-disk"
    if not mount_tmpfs(where, "2m"):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount); the injected variant runs")
    try:
        yield where
    finally:
        unmount(where)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=40, side=64)


def fill(disk: Path, leave_kb: int) -> Path:
    """Fill ``disk`` but ``leave_kb`` KB; returns the filler file."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    free = shutil.disk_usage(disk).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave_kb * 1024))
    return filler


# Free space left on the 2 MB disk: the lock file, the staging journal, zarr's own layout files
# (zarr.json through ``_atomic_write``), a unit, and the manifest each meet the full disk first at
# one of these (the cache needs about 1 MB).
LEAVE_KB = (0, 4, 12, 24, 64, 1000)


def test_a_full_disk_at_every_stage_is_one_message_and_the_rerun_resumes(
    tree: Path, tmpfs: Path, tmp_path: Path
) -> None:
    """A5 on a real full disk (zarr: its writes go through zarr's ``_atomic_write``)."""
    dest = tmpfs / "c"
    messages = []
    for leave in LEAVE_KB:
        filler = fill(tmpfs, leave)
        with pytest.raises(ConvertError) as e:
            convert(tree, dest, format="zarr", size=64, workers=1)
        msg = str(e.value)
        assert msg.startswith("disk full while ") and " is free" in msg, msg
        assert str(tmpfs) in msg and "re-run the same command" in msg
        messages.append(msg)
        filler.unlink()
        assert not dest.exists()
    assert any("writing the cache" in m or "writing unit" in m for m in messages)
    result = convert(tree, dest, format="zarr", size=64, workers=1)  # space freed: the re-run finishes
    assert result.n == 80
    ref = tmp_path / "ref"
    convert(tree, ref, format="zarr", size=64, workers=1)
    assert_same_cache(dest, ref)
    assert sorted(p.name for p in tmpfs.iterdir()) == ["c"]  # nothing hidden left beside it


def test_a_full_disk_in_zarrs_atomic_write_injected(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A5 where no tmpfs can be mounted: zarr's ``_atomic_write`` itself raises ENOSPC."""
    import zarr.storage._local as zlocal

    real = zlocal._atomic_write

    def full(path: Path, *args: object, **kwargs: object) -> object:
        if Path(path).name == "zarr.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(zlocal, "_atomic_write", full)
    res = CliRunner().invoke(
        main, ["convert", str(tree), str(tmp_path / "c"), "--format", "zarr", "--size", "8", "--workers", "1"]
    )
    assert res.exit_code == 1
    assert "Traceback" not in res.output and "Errno" not in res.output
    assert (
        "Error: disk full while writing the cache under" in res.output
        and "re-run the same command" in res.output
    )
    monkeypatch.undo()
    assert convert(tree, tmp_path / "c", format="zarr", size=8, workers=1).n == 80


def test_a_mount_point_as_dest_is_refused_naming_it_and_the_fix(tree: Path, tmp_path: Path) -> None:
    """`--overwrite` onto a mount point (read-only or not) was ``OSError: [Errno 16] Device or resource
    busy`` from the final rename: now one line before any work, naming the path and a folder inside."""
    mnt = tmp_path / "mnt"
    if not mount_tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        for ro in (False, True):
            if ro:
                subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            for flags in ([], ["--overwrite"]):
                res = CliRunner().invoke(main, ["convert", str(tree), str(mnt), "--size", "8", *flags])
                assert res.exit_code == 1 and "Traceback" not in res.output
                assert f"{mnt}: DEST is a mount point" in res.output
                assert f"use a folder inside it as DEST (e.g. {mnt / 'cache'})" in res.output
        assert not any(p.name.startswith(".mnt.") for p in tmp_path.iterdir())  # nothing left beside
    finally:
        unmount(mnt)


def test_a_publish_rename_refused_by_the_system_is_one_line(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any other refusal of the final rename (EBUSY, EROFS...) names DEST and where the cache waits."""
    import dlstore.write.staging as staging

    dest = tmp_path / "c"
    convert(tree, dest, format="npz", size=8, workers=1)
    real = os.rename

    def busy(a: object, b: object) -> None:
        if Path(str(a)) == dest:
            raise OSError(errno.EBUSY, "Device or resource busy", str(a))
        real(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    monkeypatch.setattr(staging.os, "rename", busy)
    with pytest.raises(
        ConvertError, match=r"cannot publish the finished cache there \(Device or resource busy"
    ):
        convert(tree, dest, format="npz", size=16, workers=1, overwrite=True)
    monkeypatch.undo()
    assert convert(tree, dest, format="npz", size=16, workers=1, overwrite=True).n == 80
