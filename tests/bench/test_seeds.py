"""The seeds' reproduction script runs end to end on a tiny FashionMNIST-format set."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seeds.py"


def test_seeds_script_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("seeds_script", SCRIPT)
    assert spec and spec.loader
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    out = tmp_path / "out"
    rc = seeds.main(
        [
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--n-train",
            "512",
            "--workers",
            "0",
            "--cached-workers",
            "0",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--batch-size",
            "64",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--parts",
            "raw-augment,cached-gpu-augment",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "seeds.json").read_text())
    assert set(summary["parts"]) == {"raw-augment", "cached-gpu-augment"} and not summary["skipped"]
    raw = json.loads((out / "raw-augment.json").read_text())
    assert raw["protocol"]["model_params"] == 105_866 and raw["protocol"]["batch_size"] == 64
    assert raw["source"]["n_images"] == 512 and raw["protocol"]["channels"] == 1
    loaders = {r["loader"] for r in summary["table"]}
    assert "raw" in loaders and "ram" in loaders
    assert "seeds reproduction" in capsys.readouterr().out
    assert not (out / "data").exists()  # data and caches stay out of OUT (it is copied back)
