"""Generating the demo images says what is happening (a line at the start, progress, a line at the end),
and the CLI shows it on stderr, so a first ``make demo`` is never silent."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlstore.datasets.demo as demo
from dlstore.cli import main


def test_generation_logs_start_progress_and_end(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dlstore.datasets.demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "PROGRESS_EVERY_S", 0.0)  # every image counts as "a while"
        demo.ensure_demo(tmp_path / "d", n_images=6, workers=1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "generating 6 demo images on 1 process (once; later runs reuse them) …"
    assert "demo images: 1 of 6 written" in lines[1] and lines[-1].startswith("generated 6 demo images in")
    caplog.clear()
    demo.ensure_demo(tmp_path / "d", n_images=6, workers=1)  # already there: nothing to say
    assert caplog.records == []


def test_the_cli_shows_it_on_stderr_and_keeps_stdout_one_document(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLSTORE_DEMO_DIR", str(tmp_path / "demo"))
        res = CliRunner().invoke(
            main,
            [
                "convert",
                "demo",
                str(tmp_path / "c"),
                "--format",
                "ram",
                "--size",
                "16",
                "--demo-images",
                "12",
            ],
        )
    assert res.exit_code == 0, res.output
    assert "[dlstore] generating 12 demo images on" in res.stderr
    assert "[dlstore] generated 12 demo images in" in res.stderr
    assert "generating" not in res.stdout
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DLSTORE_DEMO_DIR", str(tmp_path / "demo2"))
        args = [
            "convert",
            "demo",
            str(tmp_path / "j"),
            "--format",
            "ram",
            "--size",
            "16",
            "--demo-images",
            "12",
        ]
        res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    assert isinstance(json.loads(res.stdout), dict) and "[dlstore] generated 12" in res.stderr
