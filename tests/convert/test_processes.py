"""G1, A2: nothing is left behind (issue 20 item 4). Real processes, really killed: the convert driver
killed -9 takes its workers with it, its lock is taken over at once by the re-run, which resumes; a
failed convert leaves no hidden folder a resume does not need (and names those it keeps); a failed
bench run leaves no empty ``dlstore-bench-*`` folder."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reliability_helpers import make_tree, read_all, small_units

from dlstore.errors import ConvertError, DlstoreError
from dlstore.write.conversion import convert

TESTS = Path(__file__).resolve().parents[1]
DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from dlstore.write.conversion import convert
from dlstore.write.sources import scan_folder
from dlstore.formats import FORMATS
from reliability_helpers import HangingSource

for fmt in FORMATS.values():  # units of 5 images: several units from a tiny tree
    fmt.writer.choose_unit_size = staticmethod(lambda image_bytes: 5)
src = HangingSource.of(scan_folder(Path({src!r})), {hang!r})
convert(src, {dest!r}, format="npz", size=8, workers=2, storage_order="source", decode_timeout=120)
"""


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_driver_takes_its_workers_and_the_rerun_resumes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "c"
    journal = tmp_path / ".c.dlstore-journal" / "done.jsonl"
    hang = "b/img011.png"  # the last image in source order: the last unit's worker hangs on it
    script = DRIVER.format(tests=str(TESTS), src=str(src), hang=hang, dest=str(dest))
    driver = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        wait_for(
            lambda: journal.is_file() and len(journal.read_text().splitlines()) >= 2, 120, "2 units done"
        )
        workers = children_of(driver.pid)
        assert len(workers) >= 2, workers
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    # The workers die with their driver (parent-death signal), one of them mid-decode.
    wait_for(lambda: not any(running(w) for w in workers), 5, f"workers {workers} to die with the driver")
    # The re-run right away is not refused naming a dead pid: it takes the lock over and resumes.
    small_units(monkeypatch)
    t0 = time.monotonic()
    result = convert(src, dest, format="npz", size=8, workers=1, storage_order="source")
    assert time.monotonic() - t0 < 60
    assert result.n == 24
    images, labels = read_all(dest)
    fresh = tmp_path / "fresh"
    convert(src, fresh, format="npz", size=8, workers=1, storage_order="source")
    assert np.array_equal(images, read_all(fresh)[0]) and np.array_equal(labels, read_all(fresh)[1])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_lock_still_held_for_a_dead_pid_is_taken_over_at_once(tmp_path: Path) -> None:
    """Processes a killed driver left behind still hold its lock file: the pid in it is dead, so the
    next converter takes the lock over at once instead of refusing."""
    src = make_tree(tmp_path / "src", per_class=3)
    lock = tmp_path / ".c.dlstore-lock"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    orphan = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                f"fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'{dead}')\n"
                "print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert orphan.stdout is not None and orphan.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        convert(src, tmp_path / "c", format="ram", size=8, workers=1)
        assert time.monotonic() - t0 < 30
        assert not lock.exists()
    finally:
        orphan.kill()
        orphan.wait()


def test_a_live_holder_is_still_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    lock = tmp_path / ".c.dlstore-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getppid()).encode())  # alive, and not this process
    try:
        with pytest.raises(ConvertError, match=rf"another dlstore convert \(pid {os.getppid()}\)"):
            convert(src, tmp_path / "c", format="ram", size=8, workers=1)
    finally:
        os.close(fd)


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_convert_failing_before_any_unit_leaves_nothing(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    (src / "a" / "img000.jpg").write_bytes(b"not a jpeg")  # the first image in source order
    with pytest.raises(ConvertError, match="--strict"):
        convert(src, tmp_path / "c", format="npz", size=8, workers=1, strict=True, storage_order="source")
    assert hidden(tmp_path) == []


def test_a_failed_convert_keeps_only_what_the_resume_needs_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_units(monkeypatch)
    src = make_tree(tmp_path / "src", per_class=6)
    bad = src / "b" / "img005.png"  # the last image in source order: units before it are done
    bad.write_bytes(b"not a png")
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "c", format="npz", size=8, workers=1, strict=True, storage_order="source")
    assert hidden(tmp_path) == [".c.dlstore-journal", ".c.dlstore-staging"]  # no lock file
    assert "kept for the resume" in str(e.value) and ".c.dlstore-staging" in str(e.value)
    bad.unlink()  # fixed: the re-run resumes (with --overwrite, as the message says) and cleans up
    convert(
        src,
        tmp_path / "c",
        format="npz",
        size=8,
        workers=1,
        strict=True,
        storage_order="source",
        overwrite=True,
    )
    assert hidden(tmp_path) == []


def test_a_failed_bench_run_leaves_no_empty_out_folder(tmp_path: Path) -> None:
    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.run import run_bench

    out = tmp_path / "dlstore-bench-x"
    with pytest.raises(DlstoreError):
        run_bench(BenchConfig(source=str(tmp_path / "no-such-source"), out=out, device="cpu"))
    assert not out.exists()
    kept = tmp_path / "existing"
    kept.mkdir()
    with pytest.raises(DlstoreError):
        run_bench(BenchConfig(source=str(tmp_path / "no-such-source"), out=kept, device="cpu"))
    assert kept.is_dir()  # not ours to remove
