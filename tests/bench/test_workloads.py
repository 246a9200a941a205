"""Real runs on constructed workloads: the verdict names the stage the workload was built to stress."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlstore.bench.protocol import BenchConfig
from dlstore.bench.run import run_bench


@pytest.fixture(scope="module", autouse=True)
def env(bench_env: Path) -> Path:
    return bench_env


def tiny(**kw: object) -> BenchConfig:
    base = dict(
        demo_images=40, batch_size=8, steps=4, warmup=2, repeats=1, stage_steps=3, workers=(0,), cold=False
    )
    return BenchConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_decode_heavy_is_transform_bound() -> None:
    # full-size JPEG decode + CPU augmentation per image, a model step that costs almost nothing at 16 px
    doc = run_bench(tiny(loaders=("raw",), transform="augment", size=16))
    assert doc["runs"][0]["bottleneck"] == "transform"
    assert doc["protocol"]["transforms"]["raw"]["cpu"]["hflip_p"] == 0.5  # read from the transform that ran
    assert "--format" not in " ".join(doc["recommendations"])  # no cached kind measured: no claim


def test_compute_heavy_is_compute_bound() -> None:
    # pre-resized pixels from RAM, a ResNet-18 step on the CPU
    doc = run_bench(tiny(loaders=("ram",), model="resnet18", size=32))
    assert doc["runs"][0]["bottleneck"] == "compute"
    assert any(r.startswith("The training step binds") and "no GPU here" in r for r in doc["recommendations"])


def test_cache_lifts_a_decode_bound_raw_loader() -> None:
    doc = run_bench(tiny(loaders=("raw", "ram"), transform="gpu-augment", size=16))
    by = {r["loader"]: r for r in doc["runs"]}
    assert by["raw"]["bottleneck"] == "transform"
    assert by["ram"]["img_per_s"] > by["raw"]["img_per_s"]
    assert doc["recommendations"][0].startswith("Use ram") and "--format ram" in doc["recommendations"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_run_measures_copy_pin_and_device_time() -> None:
    doc = run_bench(
        tiny(
            loaders=("raw", "ram"), workers=(0, 2), transform="gpu-augment", size=32, device="cuda", cold=True
        )
    )
    assert doc["environment"]["gpu"]["name"]
    for kind, stage in doc["stages"].items():
        assert stage["h2d"] and stage["h2d_pageable"] and "cuda" in stage["compute_label"], kind
    pins = {(r["loader"], r["workers"], r["pin_memory"]) for r in doc["runs"]}
    assert ("ram", 2, True) in pins and ("ram", 2, False) in pins and ("ram", 0, True) in pins
    steps = doc["runs"][0]["raw"][0]["steps"]
    assert all(s is not None and s > 0 for s in steps["device_step_s"])
