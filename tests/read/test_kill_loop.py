"""kill -9 of a real training loop (gloo DDP, 2 ranks on the CPU) at random steps, resumed from its last
checkpoint: the samples it trains on are the uninterrupted run's (a small version of
``benchmarks/kill_resume.py --loop``, whose 20-kill runs are recorded in benchmarks/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_killed_training_loops_resume_with_the_same_samples_on_2_and_on_3_ranks() -> None:
    spec = importlib.util.spec_from_file_location("kill_resume", REPO / "benchmarks" / "kill_resume.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.main(
        ["--loop", "--kills", "2", "--kinds", "cached,decode,pinned", "--steps", "24", "--seed", "4"]
    )
    assert doc["failures"] == 0, json.dumps(doc, indent=1)
    assert all(k["kills"] == 2 and k["wrong_batches"] == 0 and k["complete"] for k in doc["kinds"])
    assert [e["ok"] for e in doc["elastic"]] == [True]  # pinned: killed on 2 ranks, resumed on 3
