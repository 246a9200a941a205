"""F6 and G1 on Dask (issue 20 parts 3 and 4), with real processes really killed: a Dask worker of
dlstore's own local cluster (``start_local_cluster``: worker processes without a nanny, as
``--scheduler local:N`` runs them) or one of its decode processes is killed -9 mid-convert.

- other workers alive: the lost units run elsewhere and the cache is the same as a run without a fault;
- no worker left: one line naming what died and "re-run the same command to resume", never
  ``FutureCancelledError … already forgotten``; the re-run resumes;
- a decode process killed: the same one line, no traceback and no worker log before it;
- nothing left running: no ``forkserver``/``resource_tracker`` or worker process outlives the command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import KillingSource, assert_same_cache, make_tree, small_units

from dlstore.errors import ConvertError
from dlstore.write.conversion import convert
from dlstore.write.sources import scan_folder

pytest.importorskip("distributed")

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _workers_import_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes (``python -m dask spec``) unpickle ``KillingSource`` from the tests folder."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    small_units(monkeypatch, 4)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=8)  # 16 images: 4 units of 4


def cluster(workers: int) -> Any:
    from dlstore.write.dask_engine import start_local_cluster

    return start_local_cluster(workers, most_threads=1)  # `workers` processes of one task thread


def killing(tree: Path, tmp_path: Path, victim: str) -> KillingSource:
    return KillingSource.of(scan_folder(tree), "b/img001.png", victim, tmp_path / "killed")


def conv(src: Any, dest: Path, **kw: Any) -> Any:
    return convert(src, dest, format="npz", size=8, storage_order="source", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("decode_timeout", [0, 30])
def test_a_killed_worker_s_units_run_on_the_other_worker(
    tree: Path, tmp_path: Path, decode_timeout: float
) -> None:
    """F6: with another worker alive the conversion finishes, the same as a run without a fault."""
    c = cluster(2)
    try:
        dest = tmp_path / "c"
        result = conv(
            killing(tree, tmp_path, "worker"),
            dest,
            scheduler=c.scheduler_address,
            decode_timeout=decode_timeout,
        )
        assert (tmp_path / "killed").exists() and result.n == 16
    finally:
        c.close()
    ref = tmp_path / "ref"
    conv(tree, ref, workers=1)
    assert_same_cache(dest, ref)


@pytest.mark.slow
def test_no_worker_left_is_one_line_and_the_rerun_resumes(tree: Path, tmp_path: Path) -> None:
    """F6: the only worker killed mid-convert: one message naming the dead worker and the re-run,
    never ``FutureCancelledError … already forgotten``; the same command then resumes."""
    c = cluster(1)
    dest = tmp_path / "c"
    try:
        with pytest.raises(ConvertError) as e:
            conv(killing(tree, tmp_path, "worker"), dest, scheduler=c.scheduler_address, decode_timeout=30)
    finally:
        c.close()
    msg = str(e.value)
    assert "FutureCancelled" not in msg and "forgotten" not in msg
    assert msg.startswith("the Dask worker tcp://127.0.0.1:") and " died " in msg
    assert "re-run the same command to resume" in msg
    result = conv(tree, dest, scheduler="local:1", decode_timeout=30)
    assert result.n == 16
    ref = tmp_path / "ref"
    conv(tree, ref, workers=1)
    assert_same_cache(dest, ref)


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import dlstore.write.conversion_plan as plan
from dlstore.cli import main
from dlstore.formats import FORMATS
from reliability_helpers import KillingSource

for fmt in FORMATS.values():
    fmt.writer.choose_unit_size = staticmethod(lambda image_bytes: 4)
real = plan.open_plan_source
plan.open_plan_source = lambda source, options: KillingSource.of(
    real(source, options), "b/img001.png", {victim!r}, Path({marker!r})
)
main(["convert", {src!r}, {dest!r}, "--size", "8", "--format", "npz", "--storage-order", "source",
      "--scheduler", "local:1"])
"""


def session_processes(sid: int) -> list[str]:
    """Every process of session ``sid`` still in /proc (zombies included): pid and command."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\\0", b" ").decode()[:120]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid:  # state ppid pgrp session
            out.append(f"{entry} {stat.rsplit(')', 1)[1].split()[0]} {cmd or stat.split()[1]}")
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("victim", [pytest.param("decoder", marks=pytest.mark.slow), "worker"])
def test_the_cli_prints_one_line_and_leaves_no_process(tree: Path, tmp_path: Path, victim: str) -> None:
    """F6 + part 4, the real command: `dlstore convert --scheduler local:1` whose decode process (or
    worker) is killed -9 prints one error line, no traceback and no Dask log; when it has exited
    no process of its session is left (no forkserver, resource_tracker or worker)."""
    script = DRIVER.format(
        tests=str(TESTS),
        victim=victim,
        marker=str(tmp_path / "killed"),
        src=str(tree),
        dest=str(tmp_path / "c"),
    )
    run = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    left = session_processes(run.pid)
    assert run.returncode == 1, err
    assert (tmp_path / "killed").exists()
    lines = [line for line in err.splitlines() if line.strip() and line.strip() != "converting"]
    assert len(lines) == 1, err
    assert lines[0].startswith("Error: ") and "re-run the same command to resume" in lines[0]
    assert ("decode process" in lines[0]) if victim == "decoder" else ("Dask worker" in lines[0])
    assert left == [], left


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_dask_run_leaves_no_process(tree: Path, tmp_path: Path, signum: int) -> None:
    """Part 4 / A2: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to
    the driver of `--scheduler local:1` mid-convert: when the command has exited no process of its
    session is left: no worker, no ``forkserver``, no ``resource_tracker``, no decode process."""
    marker = tmp_path / "killed"
    script = DRIVER.format(
        tests=str(TESTS), victim="nobody", marker=str(marker), src=str(tree), dest=str(tmp_path / "c")
    )
    run = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the conversion never reached the hanging file"
        if signum == signal.SIGINT:
            os.killpg(run.pid, signum)
        else:
            os.kill(run.pid, signum)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    left = session_processes(run.pid)
    assert run.returncode != 0
    assert left == [], left
    if signum == signal.SIGINT:
        assert (
            "interrupted" in err and "re-run the same command to resume" in err and "Traceback" not in err
        ), err


def alive(sid: int) -> list[str]:
    """The processes of session ``sid`` still running (a zombie has died: its reaper is init's)."""
    return [p for p in session_processes(sid) if p.split()[1] != "Z"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_driver_takes_its_dask_workers_at_once(tree: Path, tmp_path: Path) -> None:
    """G1 on Dask: the driver of `--scheduler local:2` killed -9 mid-convert (a worker busy on a unit):
    its worker processes, their fork servers and decode processes die with it (the workers' parent-death
    signal), not seconds later on their own; the re-run right away resumes."""
    marker = tmp_path / "killed"
    script = DRIVER.format(
        tests=str(TESTS), victim="nobody", marker=str(marker), src=str(tree), dest=str(tmp_path / "c")
    ).replace('"local:1"', '"local:2"')
    run = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the conversion never reached the hanging file"
        before = session_processes(run.pid)
        assert sum("dask\x00spec" in p for p in before) >= 1, before
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        t0 = time.monotonic()
        while alive(run.pid) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        gone_after = time.monotonic() - t0
        left = alive(run.pid)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
    assert left == [] and gone_after < 1.0, (gone_after, left, before)
    result = conv(tree, tmp_path / "c", scheduler="local:1")
    assert result.n == 16
