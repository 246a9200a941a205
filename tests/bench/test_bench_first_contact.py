"""Issue 22 items 4 and 6 in the bench: ``--pixels`` reaches the caches it builds and the command it
advises; a one-class folder is warned about on stderr and in the result's notes."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from reliability_helpers import make_tree

from dlstore.cli import main
from dlstore.spec import read_spec

TINY = ["--loaders", "ram", "--workers", "0", "--batch-size", "4", "--size", "16", "--steps", "3"]
TINY += ["--warmup", "2", "--repeats", "1", "--stage-steps", "2", "--no-cold", "--budget", "0"]


def test_pixels_reach_the_cache_and_a_one_class_folder_is_named(bench_env: Path, tmp_path: Path) -> None:
    root = make_tree(tmp_path / "one", per_class=8, classes=("only",), side=20)
    args = ["bench", str(root), *TINY, "--pixels", "torchvision", "--out", str(tmp_path / "out"), "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ram = doc["loaders"]["ram"]
    assert doc["protocol"]["pixels"] == "torchvision" and "--pixels torchvision" in ram["apply"]
    assert read_spec(Path(ram["cache"])).image.pixels == "torchvision"
    assert [n for n in doc["notes"] if f"{root}: has 1 class subfolder (only)" in n]
    assert "warning:" in res.stderr and f"its parent {root.resolve().parent}" in " ".join(res.stderr.split())
