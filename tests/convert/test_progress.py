"""Issue 22 item 3: ``convert``'s progress events track the work done, in absolute counts a bar can
draw: images written (per finished unit, in a process pool and in this process) and, for a URL DEST,
bytes uploaded. ``done`` never decreases and reaches the total only with the stage's last piece of work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import make_tree, small_units

from dlstore import ConvertOptions, convert
from dlstore.spec import MANIFEST
from dlstore.storage.stores import RemoteStore
from dlstore.write.progress import ConvertProgress


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("progress") / "src", per_class=12)  # 24 images


def check_stage(events: list[ConvertProgress], stage: str, unit: str, total: int) -> list[int]:
    """The stage's counts, checked: one total and unit, monotone, the total reached only at the end."""
    mine = [e for e in events if e.stage == stage]
    assert mine and {(e.total, e.unit) for e in mine} == {(total, unit)}
    done = [e.done for e in mine]
    assert done == sorted(done) and done[0] == 0
    assert done[-1] == total and total not in done[:-1]
    return done


@pytest.mark.parametrize("workers", [1, 2])  # in this process, and a process pool
def test_images_progress_counts_finished_units(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    small_units(monkeypatch, 5)  # 24 images → units of 5, 5, 5, 5, 4
    events: list[ConvertProgress] = []
    result = convert(tree, tmp_path / "c", ConvertOptions(size=8, workers=workers), progress=events.append)
    assert result.workers == workers
    done = check_stage(events, "images", "images", 24)
    assert len(done) == 1 + 5  # the start, then one event per finished unit
    assert sorted(b - a for a, b in zip(done, done[1:], strict=False)) == [4, 5, 5, 5, 5]


def test_resumed_images_are_counted_from_the_first_event(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_units(monkeypatch, 5)

    def stop_after_two_units(event: ConvertProgress) -> None:
        if event.done >= 10:
            raise KeyboardInterrupt

    with pytest.raises(Exception, match="re-run the same command to resume"):
        convert(tree, tmp_path / "c", ConvertOptions(size=8, workers=1), progress=stop_after_two_units)
    events: list[ConvertProgress] = []
    convert(tree, tmp_path / "c", ConvertOptions(size=8, workers=1), progress=events.append)
    assert events[0].done == 10  # the two journaled units, before any new work
    check_stage([ConvertProgress("images", 0, 24, "images"), *events], "images", "images", 24)


@pytest.mark.s3
def test_upload_progress_counts_the_bytes_of_every_uploaded_file(server: Any, tree: Path) -> None:
    pytest.importorskip("s3fs")
    RemoteStore("s3://progress").fs.mkdir("progress")
    url = "s3://progress/cache"
    events: list[ConvertProgress] = []
    convert(tree, url, ConvertOptions(size=8, format="npz", workers=1), progress=events.append)
    stages = [e.stage for e in events]
    assert stages == sorted(stages, key=["images", "upload"].index)  # images first, then the upload
    sizes = RemoteStore(url).sizes()
    uploaded = sum(size for rel, size in sizes.items() if rel != MANIFEST)  # the manifest goes apart
    check_stage(events, "images", "images", 24)
    done = check_stage(events, "upload", "bytes", uploaded)
    assert len(done) == 1 + len(sizes) - 1  # the start, then one event per uploaded file
