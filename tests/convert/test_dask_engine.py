"""Conversion on Dask (``scheduler=``): the same cache, journal, resume and bad-file handling as the
built-in pool, against a real ``distributed.LocalCluster`` of worker processes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from reliability_helpers import FORMAT_NAMES, HangingSource, assert_same_cache, make_tree, small_units

from dlstore.cli import main
from dlstore.errors import ConvertError, MissingExtraError
from dlstore.spec import read_spec
from dlstore.write.conversion import ConvertResult, convert
from dlstore.write.dask_engine import SchedulerSpec, local_layout, parse_scheduler
from dlstore.write.progress import ConvertProgress
from dlstore.write.sources import scan_folder

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    ) as c:
        yield c.scheduler_address


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two classes of 12 images and one truncated JPEG (skipped and reported)."""
    root = make_tree(tmp_path_factory.mktemp("src"), per_class=12)
    bad = root / "a" / "img000.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    return root


@pytest.fixture(autouse=True)
def _small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    small_units(monkeypatch, 5)  # 25 images → 5 units, spread over the workers


def conv(tree: Path, dest: Path, fmt: str = "npz", **kw: Any) -> ConvertResult:
    return convert(tree, dest, format=fmt, size=8, workers=1, **kw)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_dask_result_is_byte_identical_to_the_pool(
    tree: Path, tmp_path: Path, cluster: str, fmt: str
) -> None:
    local = conv(tree, tmp_path / "local", fmt)
    dask = conv(tree, tmp_path / "dask", fmt, scheduler=cluster)
    assert read_spec(tmp_path / "dask").checksums == read_spec(tmp_path / "local").checksums
    assert dask.workers == 2 and dask.n == local.n == 23
    assert dask.skipped == local.skipped and dask.skipped[0]["path"].endswith("img000.jpg")
    assert_same_cache(tmp_path / "local", tmp_path / "dask")


def test_dask_run_resumes_from_the_journal(tree: Path, tmp_path: Path, cluster: str) -> None:
    reported = []

    def interrupt_after_two_units(event: ConvertProgress) -> None:
        reported.append(event.done)
        if len(reported) == 3:  # the first call reports resumed images (0), then one per unit
            raise KeyboardInterrupt

    with pytest.raises(ConvertError, match="re-run the same command to resume"):
        conv(tree, tmp_path / "c", scheduler=cluster, progress=interrupt_after_two_units)
    assert not (tmp_path / "c").exists()  # nothing published
    resumed = conv(tree, tmp_path / "c", scheduler=cluster)
    assert resumed.resumed_units >= 2  # the journaled units were not redone
    conv(tree, tmp_path / "ref")
    assert read_spec(tmp_path / "c").checksums == read_spec(tmp_path / "ref").checksums


def test_strict_on_dask_names_the_file(tree: Path, tmp_path: Path, cluster: str) -> None:
    with pytest.raises(ConvertError, match=r"--strict.*img000\.jpg"):
        conv(tree, tmp_path / "c", scheduler=cluster, strict=True)
    assert not (tmp_path / "c").exists()


def test_a_hanging_decode_on_a_dask_worker_is_a_named_bad_file(tmp_path: Path, cluster: str) -> None:
    """Issue 11: Dask runs tasks in threads, where SIGALRM cannot interrupt a decoder; the units run in
    a decode process of each worker instead, so the per-file time-out holds as in the pool."""
    root = make_tree(tmp_path / "src", per_class=4)
    src = HangingSource.of(scan_folder(root), "b/img002.jpg")
    t0 = time.monotonic()
    result = conv(src, tmp_path / "c", scheduler=cluster, decode_timeout=0.5)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 25  # a hang guard, not a speed claim: without the limit it sleeps 30 s
    assert [s["path"] for s in result.skipped] == ["b/img002.jpg"]
    assert "took longer than 0.5 s" in result.skipped[0]["reason"]
    assert result.n == len(src) - 1

    def decode_processes() -> int:  # in each worker (a local function: cloudpickle sends it by value)
        from dlstore.write import dask_engine

        return len(dask_engine._CHILD)

    with distributed.Client(cluster) as client:
        assert set(client.run(decode_processes).values()) == {0}  # none left behind on any worker


def test_local_n_starts_its_own_cluster(
    tree: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with contextlib.ExitStack() as held, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(OSError):  # Dask's default dashboard port taken, as by another cluster
            held.enter_context(socket.create_server(("", 8787)))
        result = conv(tree, tmp_path / "c", scheduler="local:1")
    assert result.workers == 1 and result.n == 23
    # Nothing of Dask's on the user's terminal (it warned "Port 8787 is already in use" before).
    assert [str(w.message) for w in caught if "distributed" in w.filename] == []
    assert "distributed" not in capfd.readouterr().err
    st = result.stages  # the start steps, in order, within the wait for the cluster
    steps = [st[f"dask_{s}_at_s"] for s in ("start", "cluster", "client", "workers", "warm", "scattered")]
    assert steps == sorted(steps) and steps[-1] <= result.seconds and st["dask_close_s"] >= 0


@pytest.mark.parametrize(
    ("slots", "layout"), [(1, (1, 1)), (2, (1, 2)), (4, (1, 4)), (6, (2, 3)), (16, (4, 4)), (5, (5, 1))]
)
def test_local_layout_puts_n_threads_in_few_equal_workers(slots: int, layout: tuple[int, int]) -> None:
    assert local_layout(slots) == layout


def test_more_units_than_the_submission_window(
    tree: Path, tmp_path: Path, cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 units of one file, 8 submitted ahead (4 per task thread): the window refills until every unit
    is done, each once, and the cache is the pool's."""
    small_units(monkeypatch, 1)
    units = len(scan_folder(tree))  # 24 files (one of them undecodable): 24 units
    dask = conv(tree, tmp_path / "dask", scheduler=cluster)
    conv(tree, tmp_path / "local")
    assert read_spec(tmp_path / "dask").checksums == read_spec(tmp_path / "local").checksums
    st = dask.stages
    assert units > 4 * dask.workers
    assert st["units_per_slot_min"] * st["slots"] <= units <= st["units_per_slot_max"] * st["slots"]


def test_local_cluster_workers_do_not_import_the_callers_main(tree: Path, tmp_path: Path) -> None:
    """multiprocessing's spawn (``LocalCluster``'s workers, and a fork server's children) runs the
    caller's ``__main__`` script again in every process it starts: a script that imports torch made
    each of 16 workers and 16 decode processes import it. The ``local:N`` cluster's processes do not:
    the script below runs once, in the driver only."""
    import subprocess
    import sys

    marks = tmp_path / "marks"
    script = tmp_path / "convert_script.py"
    script.write_text(
        "import os, sys\n"
        f"with open({str(marks)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "from dlstore.write.conversion import convert\n"
        "if __name__ == '__main__':\n"
        "    r = convert(sys.argv[1], sys.argv[2], format='npz', size=8, scheduler='local:2')\n"
        "    print(r.n, r.workers)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), str(tree), str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split() == ["23", "2"], out.stderr[-2000:]
    assert len(marks.read_text().split()) == 1  # the driver; not the 2 workers nor their decode processes


def test_cli_json_is_the_same_document(tree: Path, tmp_path: Path, cluster: str) -> None:
    docs = []
    for name, extra in (("local", []), ("dask", ["--scheduler", cluster])):
        args = ["convert", str(tree), str(tmp_path / name), "--format", "npz", "--size", "8", "--json"]
        res = CliRunner().invoke(main, args + ["--workers", "1", *extra])
        assert res.exit_code == 0, res.output
        docs.append(json.loads(res.stdout))
    assert docs[0].keys() == docs[1].keys()
    for key in ("n", "n_skipped", "classes", "shape", "bytes_on_disk", "skipped", "resumed_units"):
        assert docs[0][key] == docs[1][key], key


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("local:3", SchedulerSpec(local_workers=3)),
        ("tcp://10.0.0.1:8786", SchedulerSpec(address="tcp://10.0.0.1:8786")),
    ],
)
def test_parse_scheduler(text: str, spec: SchedulerSpec) -> None:
    assert parse_scheduler(text) == spec


@pytest.mark.parametrize("text", ["local:0", "local:x", "dask", "10.0.0.1:8786"])
def test_bad_scheduler_is_refused_before_any_work(tree: Path, tmp_path: Path, text: str) -> None:
    with pytest.raises(ConvertError, match="--scheduler"):
        conv(tree, tmp_path / "c", scheduler=text)
    assert list(tmp_path.iterdir()) == []


def test_without_the_extra_the_message_names_it(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "distributed" else real(name, *a)
    )
    with pytest.raises(MissingExtraError, match=r"pip install 'dlstore\[dask\]'"):
        conv(tree, tmp_path / "c", scheduler="local:1")


def test_a_local_cluster_sees_the_environment_of_its_start() -> None:
    """Each new local cluster's workers see the caller's environment as it is now (e.g. credentials
    set between two conversions), which workers forked from a long-lived fork server would not. In a
    fresh process, so that no earlier test started any server."""
    import subprocess
    import sys

    code = """if True:
        import os
        from dlstore.write.dask_engine import EarlyClient, SchedulerSpec
        if __name__ == "__main__":
            for value in ("first", "second"):
                os.environ["DLSTORE_TEST_ENV"] = value
                early = EarlyClient(SchedulerSpec(local_workers=1))
                try:
                    # a lambda: a bound os.environ.get would carry the caller's environ along
                    print(*early.client().run(lambda: os.environ.get("DLSTORE_TEST_ENV")).values())
                finally:
                    early.close()
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["first", "second"], out.stderr[-2000:]
