"""Errors that lead somewhere: each user mistake ends in one line that names the thing and the fix that
works, through the command where the user meets it (issue 40 item 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree

from dlstore import CachedDataset
from dlstore.cli import main
from dlstore.errors import CacheNotFoundError

REPO = Path(__file__).resolve().parents[2]
DLSTORE = str(Path(sys.executable).with_name("dlstore"))


def run(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("photos") / "photos", per_class=3, side=12)


def test_a_folder_that_is_not_a_cache_is_refused_at_once_without_a_useless_overwrite(
    photos: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        res = run("convert", photos, mine, "--size", "8", *extra)
        assert res.exit_code == 1
        assert "not a dlstore cache" in res.output and "choose another DEST" in res.output
        assert "pass --overwrite" not in res.output
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("command", ["info", "verify"])
def test_info_and_verify_on_an_image_folder_suggest_converting_it(command: str, photos: Path) -> None:
    res = run(command, photos)
    assert res.exit_code == 1
    assert f"`dlstore convert {photos} cache/photos --size 224`" in res.output
    assert "SOURCE" not in res.output and "--overwrite" not in res.output


def test_cached_dataset_on_an_image_folder_suggests_converting_it(photos: Path) -> None:
    with pytest.raises(CacheNotFoundError, match=rf"`dlstore convert {photos} cache/photos --size 224`"):
        CachedDataset(photos)


def test_a_folder_of_other_files_is_named_not_a_cache(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    res = run("info", tmp_path)
    assert res.exit_code == 1 and "not a dlstore cache" in res.output and "--overwrite" not in res.output


def test_watch_on_a_script_that_fails_before_any_loader_says_fix_the_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = (\n")
    res = run("watch", "--", "python", script)
    assert res.exit_code == 1
    assert "The script failed before any DataLoader ran; fix the error above" in res.output
    assert "dlstore.watch(loader)" not in res.output


def test_a_mistyped_source_names_the_nearest_and_points_to_help(photos: Path) -> None:
    res = run("convert", photos.parent / "phots", photos.parent / "cache", "--size", "8")
    assert res.exit_code == 1
    (line,) = [x for x in res.output.splitlines() if x.startswith("Error")]
    assert "no such file or folder" in line and f"did you mean {photos}?" in line
    assert "dlstore convert --help" in line and len(line) < 300


def test_a_codec_of_another_format_names_the_format_that_takes_it(photos: Path, tmp_path: Path) -> None:
    res = run("convert", photos, tmp_path / "c", "--size", "8", "--codec", "jpeg")
    assert res.exit_code == 1 and "--codec jpeg needs --format npz or zarr" in res.output


# A terminal's Ctrl-C on a conversion slowed enough to be caught mid-run.
SLOW_CLI = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import dlstore.write.sources.encoded as s
real = s.decode_file
def slow(path, policy, data=None):
    time.sleep(0.2)
    return real(path, policy, data)
s.decode_file = slow
from dlstore.cli import main
sys.exit(main())
"""


def test_ctrl_c_exits_130_and_the_resume_counts_images(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=24, side=16)  # 48 images: 8 zarr chunks of 6 at 256 px
    dest = tmp_path / "cache"
    args = ["convert", str(src), str(dest), "--format", "zarr", "--size", "256", "--workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *args], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    done = tmp_path / ".cache.dlstore-journal" / "done.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (done.exists() and done.read_text().count("\n") >= 1):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted:" in err and "re-run the same command to resume" in err
    again = subprocess.run([DLSTORE, *args], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    resumed = int(again.stdout.split(" images were already converted")[0].rsplit("; ", 1)[1])
    assert 0 < resumed < 48 and resumed % 6 == 0 and "units" not in again.stdout


def test_a_killed_first_demo_generation_leaves_no_hidden_folder(tmp_path: Path) -> None:
    env = {**os.environ, "DLSTORE_DEMO_DIR": str(tmp_path / "demo")}
    cmd = [DLSTORE, "convert", "demo", str(tmp_path / "c1"), "--size", "8", "--demo-images", "20000"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list((tmp_path / "demo").glob(".*tmp-*")):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert list((tmp_path / "demo").glob(".*tmp-*"))  # what the kill left
    cmd = [DLSTORE, "convert", "demo", str(tmp_path / "c2"), "--size", "8", "--demo-images", "8"]
    assert subprocess.run(cmd, capture_output=True, env=env, timeout=120).returncode == 0
    assert sorted(p.name for p in (tmp_path / "demo").iterdir() if p.name.startswith(".")) == []


def test_a_script_that_opened_a_cache_exits_quietly(photos: Path, tmp_path: Path) -> None:
    assert run("convert", photos, tmp_path / "c", "--size", "8", "--workers", "1").exit_code == 0
    script = (
        "import dlstore.read.cache as m\n"
        "from dlstore import CachedDataset\n"
        f"ds = CachedDataset({str(tmp_path / 'c')!r}); ds[0]\n"
        "m.kept = m.Generation(ds.path)  # freed only when the module's globals are torn down\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""


def test_a_hugging_face_dataset_names_its_classes_from_its_class_label(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import numpy as np
    from PIL import Image

    from dlstore import ConvertOptions, convert

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])}
    )
    images = [Image.fromarray(np.full((10, 12, 3), 40 * i, np.uint8)) for i in range(4)]
    ds = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 1, 0]}, features=features)
    result = convert(ds, tmp_path / "c", ConvertOptions(size=8, workers=1))
    assert result.classes == ["cat", "dog"]
    assert list(CachedDataset(tmp_path / "c").spec.classes) == ["cat", "dog"]


def test_a_script_beside_the_clone_folder_is_told_why_dlstore_is_empty(tmp_path: Path) -> None:
    (tmp_path / "dlstore").symlink_to(REPO, target_is_directory=True)  # a clone named dlstore, here
    done = subprocess.run(
        [sys.executable, "-c", "from dlstore import CachedDataset"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"found {tmp_path / 'dlstore'}, the folder of dlstore's source clone" in done.stderr
    assert "run it from another folder" in done.stderr


def test_ctrl_c_in_any_command_exits_130(photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlstore.storage.mirror as mirror

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mirror, "spec_at", interrupted)
    res = CliRunner().invoke(main, ["info", str(photos)])
    assert res.exit_code == 130 and "interrupted" in res.output
