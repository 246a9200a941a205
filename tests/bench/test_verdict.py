"""The verdict names the right stage: stages of known cost, fed through the real measurement functions
where they can be faked (sleeping datasets, steps and readers), and through the pure analysis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dlstore.bench.protocol import STAGES
from dlstore.bench.stages import measure_compute, measure_read, measure_transform
from dlstore.bench.verdict import Facts, KindStages, analyse, knee, predict, stalls

CPU = torch.device("cpu")


def run(loader: str, workers: int, rate: float, pin: bool = False, warmup_s: float = 1.0) -> dict[str, Any]:
    return {
        "loader": loader,
        "workers": workers,
        "pin_memory": pin,
        "img_per_s": rate,
        "img_per_s_min": rate,
        "img_per_s_max": rate,
        "warmup_s": warmup_s,
        "wait": {"sum_over_wall": 0.1, "p95_ms": 1.0, "mean_ms": 0.5, "median_ms": 0.2},
    }


def facts(device: str = "cuda", **kw: Any) -> Facts:
    return Facts(
        device=device, device_label=device, batch_size=32, warmup_steps=4, pin_default=device == "cuda", **kw
    )


@pytest.mark.parametrize("slow", STAGES)
def test_predict_names_the_slowest_stage(slow: str) -> None:
    rates = {s: 10_000.0 for s in STAGES}
    rates[slow] = 100.0
    assert predict(rates) == (100.0, slow)


def test_predict_skips_stages_that_do_not_apply_and_adds_serial_work() -> None:
    assert predict({"read": None, "transform": 200.0, "h2d": None, "compute": 300.0}) == (200.0, "transform")
    rate, stage = predict({"read": None, "transform": 200.0, "h2d": None, "compute": 200.0}, serial=True)
    assert stage in ("transform", "compute") and rate == pytest.approx(100.0)
    assert predict({s: None for s in STAGES}) == (None, None)


# --- stages of known cost, measured ------------------------------------------------------------------


class SleepyDataset(Dataset):
    """Costs ``seconds`` per image in __getitem__: a decode of known cost."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.seconds)
        return torch.zeros(3, 4, 4), i % 2


def sleepy_step(seconds_per_batch: float) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        time.sleep(seconds_per_batch)

    return step


def measured_stages(decode_s: float, step_s: float, read_s_per_mb: float, tmp_path: Path) -> KindStages:
    """Each stage measured for real on fakes of known cost (batch 8)."""
    files = []
    for i in range(4):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(b"x" * (256 << 10))
        files.append(p)

    def slow_reader(paths: Any) -> int:
        n = sum(p.stat().st_size for p in paths)
        time.sleep(read_s_per_mb * n / 1e6)
        return n

    read = measure_read(
        "fake", files, n_images=64, reader=slow_reader, evict=lambda paths: {"resident_after": 0.0}
    )
    transform = measure_transform(
        "fake", lambda w: DataLoader(SleepyDataset(64, decode_s), batch_size=8), [0], warmup=1, steps=3
    )
    compute = measure_compute(
        "fake", sleepy_step(step_s), (8, 3, 4, 4), torch.float32, 2, CPU, warmup=1, steps=3
    )
    return KindStages(
        read=read.img_per_s,
        transform_by_workers={0: transform.img_per_s},
        compute=compute.img_per_s,
        h2d_pinned=None,
    )


@pytest.mark.parametrize(
    ("decode_s", "step_s", "read_s_per_mb", "expected"),
    [
        (0.004, 0.002, 0.0, "transform"),  # decode-heavy: 250 img/s vs 4,000 img/s step
        (0.0002, 0.040, 0.0, "compute"),  # compute-heavy: 200 img/s step vs 5,000 img/s decode
        (0.0002, 0.002, 0.5, "read"),  # read-heavy: 16 kB per image at 2 MB/s → 125 img/s
    ],
)
def test_measured_fakes_name_the_bottleneck(
    tmp_path: Path, decode_s: float, step_s: float, read_s_per_mb: float, expected: str
) -> None:
    ks = measured_stages(decode_s, step_s, read_s_per_mb, tmp_path)
    _, bottleneck = predict(ks.rates(0, False))
    assert bottleneck == expected


def test_h2d_bound_configuration_is_named_and_advised() -> None:
    stages = {
        "raw": KindStages(
            read=1e6,
            transform_by_workers={4: 50_000.0},
            h2d_pinned=2_000.0,
            h2d_pageable=900.0,
            compute=40_000.0,
        )
    }
    runs = [run("raw", 4, 1_900.0, pin=True), run("raw", 4, 850.0, pin=False)]
    out = analyse(stages, runs, {}, facts())
    assert runs[0]["bottleneck"] == "h2d" and runs[1]["bottleneck"] == "h2d"
    assert runs[1]["predicted_img_per_s"] == 900.0  # pin off → pageable rate
    assert any("host→device copy limits" in r for r in out["recommendations"])
    assert any("pin_memory on" in r for r in out["recommendations"])


# --- analysis -----------------------------------------------------------------------------------------


def test_knee_is_smallest_within_five_percent_and_hurts_are_reported() -> None:
    sweep = [run("raw", 0, 400), run("raw", 2, 960), run("raw", 4, 1000), run("raw", 8, 700)]
    k = knee(sweep)
    assert k["knee_workers"] == 2 and k["best_workers"] == 4
    assert [h["workers"] for h in k["hurts"]] == [8]


def test_gpu_limit_says_nothing_needs_to_change() -> None:
    stages = {
        "ram": KindStages(
            read=None, transform_by_workers={0: 90_000.0, 2: 120_000.0}, h2d_pinned=80_000.0, compute=5_000.0
        )
    }
    runs = [run("ram", 0, 4_900.0, pin=True), run("ram", 2, 4_950.0, pin=True)]
    out = analyse(stages, runs, {}, facts())
    assert out["best"]["bottleneck"] == "compute"
    assert any(
        "GPU is the limit" in r and "nothing in the input pipeline" in r for r in out["recommendations"]
    )


def test_cache_advice_names_the_best_format_and_the_rate_to_expect() -> None:
    stages = {
        "raw": KindStages(
            read=50_000.0, transform_by_workers={0: 500.0, 4: 1_800.0}, h2d_pinned=60_000.0, compute=20_000.0
        ),
        "ram": KindStages(
            read=None, transform_by_workers={0: 30_000.0, 4: 60_000.0}, h2d_pinned=60_000.0, compute=20_000.0
        ),
        "zarr": KindStages(
            read=90_000.0,
            transform_by_workers={0: 2_000.0, 4: 6_000.0},
            h2d_pinned=60_000.0,
            compute=20_000.0,
        ),
    }
    runs = [
        run("raw", 0, 480, True),
        run("raw", 4, 1_700, True),
        run("ram", 0, 19_000, True),
        run("ram", 4, 18_500, True),
        run("zarr", 0, 1_900, True),
        run("zarr", 4, 5_500, True),
    ]
    out = analyse(stages, runs, {}, facts(size=64, cache_bytes={"ram": 10_000_000, "zarr": 4_000_000}))
    assert {r["loader"]: r["bottleneck"] for r in runs if r["workers"] == 4} == {
        "raw": "transform",
        "ram": "compute",
        "zarr": "transform",
    }
    advice = [r for r in out["recommendations"] if r.startswith("Convert once")]
    assert advice and "--format ram" in advice[0] and "--size 64" in advice[0] and "20,000" in advice[0]
    assert "raw" in out["verdict"] and "ram" in out["verdict"]


def test_stall_split_from_synthetic_cached_and_cold() -> None:
    stages = {"raw": KindStages(transform_by_workers={2: 500.0}, compute=1_000.0)}
    sweeps = {"raw": [run("raw", 2, 500.0, warmup_s=1.0)]}
    cold = {"raw": {"workers": 2, "warmup_s": 3.0, "eviction_worked": True}}
    s = stalls(stages, sweeps, cold, batch_size=50, warmup_steps=4)["raw"]
    assert s["synthetic_ms"] == pytest.approx(50.0) and s["cached_ms"] == pytest.approx(100.0)
    assert s["prep_stall_ms"] == pytest.approx(50.0) and s["fetch_stall_ms"] == pytest.approx(500.0)
