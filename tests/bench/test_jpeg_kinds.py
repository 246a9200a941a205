"""The JPEG cache's loader kinds run in the bench next to the others (tiny demo run on this machine)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from dlstore.cli import main

TINY = ["--demo-images", "40", "--batch-size", "8", "--size", "16", "--steps", "3", "--warmup", "2"]
TINY += ["--repeats", "1", "--stage-steps", "2"]


def test_jpeg_kinds_run_and_report(bench_env: Path) -> None:
    res = CliRunner().invoke(
        main,
        ["bench", *TINY, "--workers", "0,2", "--loaders", "jpeg-gpu,jpeg-cpu,ram", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ran = {(r["loader"], r["workers"]) for r in doc["runs"]}
    assert ("jpeg-gpu", 0) in ran and {("jpeg-cpu", 0), ("jpeg-cpu", 2)} <= ran
    for r in doc["runs"]:
        assert r["img_per_s"] > 0
    info = doc["loaders"]["jpeg-gpu"]
    assert info["sample_shape"] == [3, 16, 16]
