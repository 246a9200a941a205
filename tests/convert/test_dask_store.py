"""Dask workers writing a URL destination's units straight to the object store (moto's S3 server, a
real LocalCluster): the same checksums as a local run, no unit file in the driver's spool, resume
from the journal, and formats whose units are not files of their own keep the spool."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import make_tree, small_units

from dlstore import Remote, convert, open_cache
from dlstore.formats import FORMATS
from dlstore.spec import read_spec
from dlstore.storage.mirror import spec_at
from dlstore.storage.stores import RemoteStore
from dlstore.write.conversion import ConvertResult
from dlstore.write.progress import ConvertProgress

pytestmark = pytest.mark.s3
distributed = pytest.importorskip("distributed")
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

BUCKET = "dask-store"


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spool")


@pytest.fixture(scope="module")
def cluster(spool: Path) -> Iterator[str]:
    """moto's server, its credentials in the environment the worker processes inherit, then the cluster."""
    from s3server import aws_env, start_server

    server = start_server()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in aws_env(server).items():
            mp.setenv(name, value)
        mp.setenv("DLSTORE_SPOOL", str(spool))
        RemoteStore(f"s3://{BUCKET}").fs.mkdir(BUCKET)
        with distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as c:
            yield c.scheduler_address
    server.stop()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=12)


@pytest.fixture(autouse=True)
def _small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    small_units(monkeypatch, 5)  # 24 images → 5 units (the last short), spread over the workers


def conv(tree: Path, dest: Path | str, fmt: str, **kw: Any) -> ConvertResult:
    return convert(tree, dest, format=fmt, size=8, workers=1, **kw)


class SpoolWatch:
    """A progress callback that records every file in the spool each time a unit is reported."""

    def __init__(self, spool: Path) -> None:
        self.spool, self.seen, self.calls = spool, set[str](), 0

    def __call__(self, event: ConvertProgress) -> None:
        self.calls += 1
        self.seen |= {p.as_posix() for p in self.spool.rglob("*") if p.is_file()}

    def unit_files_seen(self, unit_files: list[str]) -> list[str]:
        return [u for u in unit_files if any(s.endswith(f"/{u}") for s in self.seen)]


@pytest.mark.parametrize(("fmt", "options"), [("npz", {}), ("zarr", {}), ("zarr", {"shard_mb": 0.001})])
def test_workers_write_units_to_the_store_with_the_checksums_of_a_local_run(
    cluster: str, tree: Path, tmp_path: Path, spool: Path, fmt: str, options: dict[str, Any]
) -> None:
    url = f"s3://{BUCKET}/{fmt}-{len(options)}"
    local = conv(tree, tmp_path / "local", fmt, writer_options=options)
    watch = SpoolWatch(spool)
    remote = conv(tree, url, fmt, writer_options=options, scheduler=cluster, progress=watch)
    spec = spec_at(url)
    assert spec.checksums == read_spec(tmp_path / "local").checksums
    unit_files = FORMATS[fmt].reader_for(spec).unit_files(spec)
    assert len(unit_files) > 1 and watch.calls > len(unit_files) // 2
    assert watch.unit_files_seen(unit_files) == []  # the driver never held a unit
    assert remote.workers == 2 and remote.n == local.n == 24
    cache = open_cache(url, remote=Remote(cache_dir=tmp_path / "mirror"))
    np.testing.assert_array_equal(
        cache.read(np.arange(24)), open_cache(tmp_path / "local").read(np.arange(24))
    )
    left = RemoteStore(url).sizes()
    assert not [k for k in left if k.startswith(".dlstore-staging/")]  # staging removed after publish


def test_an_interrupted_conversion_resumes_from_the_units_on_the_store(
    cluster: str, tree: Path, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/resume"

    def stop_after_two(event: ConvertProgress, seen: list[int] = []) -> None:  # noqa: B006 - a counter
        if event.stage == "images" and event.done:
            seen.append(event.done)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(Exception, match="interrupted"):
        conv(tree, url, "npz", scheduler=cluster, progress=stop_after_two)
    assert not RemoteStore(url).exists("dlstore.json")  # nothing published
    staged = [k for k in RemoteStore(url).sizes() if k.startswith(".dlstore-staging/units-")]
    assert len(staged) >= 2
    again = conv(tree, url, "npz", scheduler=cluster)
    assert again.resumed_units >= 2
    assert spec_at(url).checksums == read_spec(conv(tree, tmp_path / "local", "npz").dest).checksums


def test_ram_units_share_one_file_so_the_spool_is_used(cluster: str, tree: Path, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/ram"
    conv(tree, url, "ram", scheduler=cluster)
    assert spec_at(url).checksums == read_spec(conv(tree, tmp_path / "local", "ram").dest).checksums
    assert os.environ["DLSTORE_SPOOL"]


def test_a_hanging_decode_is_a_named_bad_file_when_workers_write_to_the_store(
    cluster: str, tmp_path: Path
) -> None:
    """The per-file time-out holds on this path too: the units run (and upload) in a decode process of
    each worker, where SIGALRM can interrupt a decoder."""
    import time

    from reliability_helpers import HangingSource

    from dlstore.write.sources import scan_folder

    src = HangingSource.of(scan_folder(make_tree(tmp_path / "src", per_class=4)), "b/img002.jpg")
    url = f"s3://{BUCKET}/hang"
    t0 = time.monotonic()
    result = conv(src, url, "npz", scheduler=cluster, decode_timeout=0.5)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 25  # a hang guard, not a speed claim: without the limit it sleeps 30 s
    assert [s["path"] for s in result.skipped] == ["b/img002.jpg"]
    assert "took longer than 0.5 s" in result.skipped[0]["reason"]
    assert spec_at(url).n == len(src) - 1
