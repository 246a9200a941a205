"""The CLI through click's runner, plus the installed entry point and packaging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlstore.cli import main


def run(*args: str) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_convert_json_is_one_document(image_tree: Path, tmp_path: Path) -> None:
    res = run(
        "convert", image_tree, tmp_path / "c", "--format", "zarr", "--size", "12", "--workers", "2", "--json"
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # raises if stdout holds anything but one JSON document
    assert doc["format"] == "zarr" and doc["n"] > 0 and doc["shape"] == [12, 12, 3]
    assert doc["bytes_on_disk"] > 0 and doc["classes"] == ["cat", "dog", "zebra"]


def test_convert_info_verify_roundtrip(image_tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "c"
    res = run("convert", image_tree, dest, "--format", "npz", "--size", "8", "--workers", "1")
    assert res.exit_code == 0 and "images" in res.stdout and "images/s" in res.stdout
    info = json.loads(run("info", dest, "--json").stdout)
    assert {"format", "n", "shape", "classes"} <= set(info) and info["format"] == "npz"
    assert "npz cache" in run("info", dest).stdout
    assert run("verify", dest).exit_code == 0


def test_verify_names_the_bad_file(image_tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "c"
    assert run("convert", image_tree, dest, "--format", "npz", "--size", "8", "--workers", "1").exit_code == 0
    shard = sorted((dest / "shards").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    res = run("verify", dest)
    assert res.exit_code == 1 and shard.name in res.output


def test_rerun_is_up_to_date_or_refused_naming_the_difference(image_tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "c"
    args = ("convert", image_tree, dest, "--format", "ram", "--size", "8", "--workers", "1")
    assert run(*args).exit_code == 0
    manifest = (dest / "dlstore.json").read_bytes()
    res = run(*args)
    assert res.exit_code == 0 and f"{dest} is up to date" in res.stderr
    doc = json.loads(run(*args, "--json").stdout)
    assert doc["up_to_date"] is True and doc["n"] > 0
    assert (dest / "dlstore.json").read_bytes() == manifest  # no work done
    res = CliRunner().invoke(main, [str(a) for a in (*args[:-4], "--size", "16", "--workers", "1")])
    assert res.exit_code == 1 and "--size 16 was 8" in res.output and "--overwrite" in res.output
    res = run(*args[:-4], "--size", "16", "--workers", "1", "--overwrite")
    assert res.exit_code == 0 and "up to date" not in res.stderr


def test_bad_source_message(tmp_path: Path) -> None:
    res = run("convert", tmp_path / "nope", tmp_path / "c", "--size", "8")
    assert res.exit_code == 1 and "nope" in res.output
    res = run("convert", "torchvision:FashionMNIST", tmp_path / "c", "--size", "8", "--root", tmp_path)
    assert res.exit_code == 1 and "train-images-idx3-ubyte" in res.output and "never downloads" in res.output
    assert run("convert", "x", "y").exit_code == 2  # usage error: --size missing


def test_unwritable_dest_message(image_tree: Path, tmp_path: Path) -> None:
    """A DEST whose folder takes no files (/proc here; a read-only mount or a full disk alike): the
    message names the folder and the fix, no traceback."""
    res = run("convert", image_tree, "/proc/dlstore-test-cache", "--size", "8")
    assert (
        res.exit_code == 1 and "/proc: cannot write there" in res.output and "writable folder" in res.output
    )


def test_dest_inside_source_is_refused_before_anything_is_written(image_tree: Path) -> None:
    before = sorted(image_tree.rglob("*"))
    res = run("convert", image_tree, image_tree / "cache", "--size", "8")
    assert res.exit_code == 1 and "DEST is inside SOURCE" in res.output and "outside it" in res.output
    assert sorted(image_tree.rglob("*")) == before  # the shared tree is as it was


def test_full_disk_at_the_first_write_message(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import dlstore.write.staging as staging

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging.os, "pwrite", full)
    res = run("convert", image_tree, tmp_path / "c", "--size", "8")
    assert (
        res.exit_code == 1
        and f"disk full while writing .c.dlstore-lock under {tmp_path}" in res.output
        and "re-run" in res.output
    )
    monkeypatch.undo()
    assert run("convert", image_tree, tmp_path / "c", "--size", "8").exit_code == 0  # the lock was let go


def test_sizes_read_as_people_read_them() -> None:
    from dlstore.write.sizes import human_bytes

    assert [human_bytes(n) for n in (0, 999, 270_300, 4.2e9)] == ["0 B", "999 B", "270.3 KB", "4.2 GB"]


def test_installed_entry_point_and_no_top_level_cli(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("dlstore")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "convert" in out.stdout
    probe = "import importlib.util as u; print(u.find_spec('cli'), u.find_spec('dlstore.cli').origin)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    none, origin = out.stdout.split()
    assert none == "None" and origin.endswith(os.path.join("cli", "__init__.py"))


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    probe = "import sys; from dlstore.cli import main; print('torch' in sys.modules, 'zarr' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split() == ["False", "False"]


def test_decode_option_is_recorded_in_the_manifest(image_tree: Path, tmp_path: Path) -> None:
    for mode in ("exact", "fast"):
        dest = tmp_path / mode
        args = ["--decode", mode] if mode == "fast" else []  # exact is the default
        assert run("convert", image_tree, dest, "--size", "8", "--workers", "1", *args).exit_code == 0
        assert json.loads(run("info", dest, "--json").stdout)["image"]["decode"] == mode
