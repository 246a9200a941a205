"""Parquet and WebDataset sources through the other runners and faults (issue 25): a Dask cluster, a
real ``kill -9`` mid-conversion and the re-run that resumes it, shards read from an object store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from photo_forms import make_photo_folder, write_hf_parquet, write_shards
from reliability_helpers import small_units

from dlstore import ConvertOptions, convert
from dlstore.read.cache import open_cache

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")
REPO = Path(__file__).resolve().parents[2]


def pixels(dest: Path) -> tuple[np.ndarray, np.ndarray]:
    cache = open_cache(dest)
    return np.stack(cache.read_images(np.arange(cache.spec.n))), np.asarray(cache.labels)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("runs") / "photos", 40)


@pytest.mark.slow
def test_dask_converts_parquet_and_shards_as_the_pool_does(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("distributed")
    import dlstore.write.sources.parquet as parquet

    monkeypatch.setattr(parquet, "CACHE_BYTES", 1000)  # spooled by unit in the driver, read by the workers
    pq = write_hf_parquet(photos, tmp_path / "p.parquet", rows_per_group=7)
    shards = write_shards(photos, tmp_path / "shards", per_shard=9)
    for name, source in {"parquet": str(pq), "webdataset": shards}.items():
        opts = ConvertOptions(size=16, format="npz", workers=1)
        convert(source, tmp_path / f"pool_{name}", opts)
        convert(source, tmp_path / f"dask_{name}", ConvertOptions(size=16, format="npz", scheduler="local:2"))
        a, b = pixels(tmp_path / f"pool_{name}"), pixels(tmp_path / f"dask_{name}")
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), name


SLOW_CLI = """
import sys, time
import dlstore.write.sources.encoded as enc
real = enc.decode_file
def slow(name, policy, data=None):
    time.sleep(0.15)
    return real(name, policy, data)
enc.decode_file = slow
from dlstore.formats import FORMATS
for fmt in FORMATS.values():  # units of 6 images, as small_units sets in the test: a kill finds some done
    fmt.writer.choose_unit_size = staticmethod(lambda image_bytes: 6)
from dlstore.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_kill_9_mid_parquet_conversion_resumes_to_the_same_cache(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_units(monkeypatch, 6)  # 40 images in one unit would finish before any unit is journalled
    pq = write_hf_parquet(photos, tmp_path / "p.parquet", rows_per_group=6)
    dest = tmp_path / "cache"
    args = [
        str(pq),
        str(dest),
        "--size",
        "16",
        "--format",
        "npz",
        "--workers",
        "1",
        "--storage-order",
        "source",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, "convert", *args], env=env, start_new_session=True
    )
    done = tmp_path / ".cache.dlstore-journal" / "done.jsonl"
    deadline = time.monotonic() + 120
    while not (done.is_file() and done.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert done.read_text().strip() and not dest.exists()
    result = convert(str(pq), dest, ConvertOptions(size=16, format="npz", workers=1, storage_order="source"))
    assert result.resumed_units >= 1 and result.n == 40
    convert(
        str(pq), tmp_path / "whole", ConvertOptions(size=16, format="npz", workers=1, storage_order="source")
    )
    a, b = pixels(dest), pixels(tmp_path / "whole")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_shards_on_an_object_store_convert_like_local_ones(
    photos: Path, tmp_path: Path, server: object
) -> None:
    import s3fs

    shards = write_shards(photos, tmp_path / "shards", per_shard=16)
    fs = s3fs.S3FileSystem()
    fs.mkdir("wds-src")
    for f in sorted((tmp_path / "shards").glob("*.tar")):
        fs.put_file(str(f), f"wds-src/train/{f.name}")
    remote = "s3://wds-src/train/" + Path(shards).name
    opts = ConvertOptions(size=16, format="npz", workers=1)
    convert(shards, tmp_path / "local", opts)
    result = convert(remote, tmp_path / "remote", opts)
    assert result.n == 40
    a, b = pixels(tmp_path / "local"), pixels(tmp_path / "remote")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert convert(remote, tmp_path / "remote", opts).up_to_date  # sizes and ETags unchanged
    to_store = convert(shards, "s3://wds-src/caches/photos", opts)  # and an object-store DEST
    assert to_store.n == 40
