"""The installed ``dlstore`` entry point in a real subprocess: Ctrl-C reaches the script through watch,
and watch reports what it observed with the script's exit status."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def dlstore_exe() -> list[str]:
    exe = shutil.which("dlstore", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-c", "from dlstore.cli import main; main()"]


def test_sigint_reports_what_was_observed(scripts: dict[str, Path], tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [
            *dlstore_exe(),
            "watch",
            "--json",
            "--no-replay",
            "--",
            "python",
            str(scripts["until_interrupted"]),
            str(ready),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the script never got going: {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # to watch only: it passes Ctrl-C on to the script
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    doc = json.loads(out)
    assert doc["status"] == "interrupted" and doc["exit_code"] == 130
    seen = doc["loaders"][0]
    # the script had taken 20 steps; a trial's stand-ins (run when the wait looks high, as on a loaded
    # machine) take real steps' places and are not counted as observed
    assert seen["steps_observed"] + seen["stand_in_steps"] >= 20, seen
    assert "interrupted" in err
