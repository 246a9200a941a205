"""The shared ground: machine facts (cores under a cgroup quota) and durable writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dlstore import machine
from dlstore.durable import durable_file, save_npy_durably, write_json_durably


def fake_cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    "files,quota",
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cpu_quota_v1_and_v2(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    assert machine.cpu_quota(fake_cgroup(tmp_path, files)) == quota


def test_usable_cores_honours_affinity_and_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "affinity_cores", lambda: 16)
    assert machine.usable_cores(fake_cgroup(tmp_path / "a", {"cpu.max": "150000 100000"})) == 2  # rounded up
    assert machine.usable_cores(fake_cgroup(tmp_path / "b", {"cpu.max": "50000 100000"})) == 1
    assert machine.usable_cores(fake_cgroup(tmp_path / "c", {"cpu.max": "6400000 100000"})) == 16
    assert machine.usable_cores(fake_cgroup(tmp_path / "d", {})) == 16


def test_available_memory_honours_the_cgroup(tmp_path: Path) -> None:
    cg = fake_cgroup(tmp_path / "cg", {"memory.max": str(2 << 30), "memory.current": str(1 << 30)})
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 99999999 kB\nMemAvailable: 50000000 kB\n")
    avail, where = machine.available_memory(cg, meminfo)
    assert avail == 1 << 30 and "memory.max" in where


def test_durable_file_is_all_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), durable_file(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]  # no temp file left
    write_json_durably(path, '{"a": 1}')
    save_npy_durably(tmp_path / "a.npy", np.arange(3))
    assert path.read_text() == '{"a": 1}' and np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "f.bin"]
