"""Stage timers: eviction detected as working or not, loaders over epochs, models, run planning."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from dlstore.bench.endtoend import RunSpec, plan_runs, rotated
from dlstore.bench.models import SMALLCNN_SEED_PARAMS, SmallCNN, build_model, count_parameters
from dlstore.bench.protocol import default_worker_counts, parse_int_list
from dlstore.bench.stages import (
    BatchStream,
    evict_files,
    eviction_worked,
    measure_h2d,
    measure_read,
    resident_fraction,
)


def fs_type(path: Path) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def write(path: Path, n: int = 4 << 20) -> Path:
    path.write_bytes(os.urandom(n))
    return path


needs_mincore = pytest.mark.skipif(resident_fraction([Path(__file__)]) is None, reason="mincore unavailable")


@needs_mincore
def test_eviction_works_on_a_disk_file(tmp_path: Path) -> None:
    if fs_type(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path)}, where pages cannot be dropped")
    f = write(tmp_path / "a.bin")
    assert resident_fraction([f]) > 0.5  # just written: cached
    report = evict_files([f])
    assert report["worked"] is True and report["resident_after"] <= 0.05


@needs_mincore
def test_eviction_is_reported_failed_for_pages_a_live_mapping_holds(tmp_path: Path) -> None:
    f = write(tmp_path / "b.bin")
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
        _ = sum(mm[i] for i in range(0, len(mm), mmap.PAGESIZE))  # touch every page
        report = evict_files([f])
    assert report["worked"] is False and report["resident_after"] > 0.5


@needs_mincore
@pytest.mark.skipif(
    not Path("/dev/shm").is_dir() or fs_type(Path("/dev/shm")) != "tmpfs", reason="no tmpfs /dev/shm"
)
def test_eviction_is_reported_failed_on_tmpfs() -> None:
    f = write(Path("/dev/shm") / f"dlstore-evict-{os.getpid()}.bin", 1 << 20)
    try:
        assert evict_files([f])["worked"] is False
    finally:
        f.unlink()


def test_eviction_judged_by_timing_without_mincore() -> None:
    assert eviction_worked(None, cold_s=1.0, warm_s=0.2) is True
    assert eviction_worked(None, cold_s=1.0, warm_s=0.9) is False
    assert eviction_worked(0.0, cold_s=1.0, warm_s=1.0) is True  # mincore's word wins


def test_measure_read_reports_failed_eviction(tmp_path: Path) -> None:
    files = [write(tmp_path / f"{i}.bin", 64 << 10) for i in range(3)]
    res = measure_read("x", files, n_images=6, evict=lambda paths: {"resident_after": 1.0, "worked": False})
    ev = res.detail["eviction"]
    assert ev["worked"] is False and ev["judged_by"] == "mincore"
    assert res.detail["bytes_per_image"] == pytest.approx(3 * (64 << 10) / 6)
    assert res.img_per_s and res.img_per_s > 0


def test_batch_stream_rolls_over_epochs() -> None:
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4, drop_last=True)
    stream = BatchStream(loader)
    seen = [stream.next() for _ in range(5)]
    assert stream.epoch == 2 and len(seen) == 5
    with pytest.raises(Exception, match="batch-size"):
        BatchStream(torch.utils.data.DataLoader(list(range(3)), batch_size=4, drop_last=True))


def test_h2d_does_not_apply_on_cpu() -> None:
    res = measure_h2d("x", (4, 3, 8, 8), torch.uint8, torch.device("cpu"), steps=2)
    assert res.img_per_s is None and "CPU" in res.label


def test_smallcnn_is_the_seed_model() -> None:
    model = SmallCNN()
    assert count_parameters(model) == SMALLCNN_SEED_PARAMS == 105_866
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("smallcnn", 3, 32, 5)(torch.zeros(1, 3, 32, 32)).shape == (1, 5)
    assert build_model("resnet18", 1, 32, 4)(torch.zeros(2, 1, 32, 32)).shape == (2, 4)
    imported = build_model("dlstore.bench.models:SmallCNN", 1, 28, 10)
    assert count_parameters(imported) == 105_866


def test_plan_and_rotation() -> None:
    specs = plan_runs(["raw", "ram"], [0, 2], cuda=True, pin_mode="auto", cold=True)
    assert RunSpec("raw", 2, False) in specs and RunSpec("ram", 2, True, cold=True) in specs
    assert all(s.pin_memory for s in specs if not s.cold and s.workers == 0)
    assert not any(s.pin_memory for s in plan_runs(["raw"], [0, 2], cuda=False, pin_mode="auto", cold=False))
    r0, r1 = rotated(specs, 0, 2), rotated(specs, 1, 2)
    assert sorted(map(str, r0)) == sorted(map(str, r1)) and r0[0] != r1[0]


def test_option_parsing() -> None:
    assert parse_int_list("4,0, 2,2") == (0, 2, 4)
    with pytest.raises(ValueError):
        parse_int_list("-1")
    assert default_worker_counts(2) == (0, 1, 2) and default_worker_counts(16) == (0, 8, 16)
