"""The bench's time budget: the estimate from fake per-batch costs, the cuts that fit it, and a real tiny CPU
run that prints its plan first, records it, and whose step-alone rate is measured the way the loop runs it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dlstore.bench.parts import in_loop_step_rates, settle_compute
from dlstore.bench.plan import (
    BUDGET_SHARE,
    LOOP_STEP_FACTOR,
    RUN_OVERHEAD_S,
    Costs,
    Plan,
    estimate,
    fit,
    loop_period,
    plan_lines,
    run_s,
    timed_batches,
)
from dlstore.bench.protocol import MIN_TIMED_STEPS, RunResult, StageResult, StepRecord
from dlstore.cli import main

KINDS = ("raw", "ram", "npz", "zarr")


def costs(step: float = 0.1, raw: float = 0.2, convert: float = 0.0) -> Costs:
    """Fake timings: a step, a raw batch decode, a cheap cache batch, a conversion per image."""
    return Costs(
        step_s=step,
        batch_s={"raw": raw, "ram": 0.002, "npz": 0.003, "zarr": 0.004},
        convert_s={"raw": 0.0, "ram": convert, "npz": convert, "zarr": convert},
        pool_s=0.2,
        cores=2,
        step_on_host=True,
        fixed_s=3.0,
    )


def plan(**kw: Any) -> Plan:
    base = {
        "loaders": KINDS,
        "workers": (0, 1, 2),
        "repeats": 2,
        "steps": 16,
        "warmup": 4,
        "stage_steps": 10,
        "cold": True,
        "images": 10_000,
        "batch_size": 32,
        "step_looks": 2,
    }
    return Plan(**{**base, **kw})


def test_a_cpu_loop_shares_the_cores_between_the_step_and_the_workers() -> None:
    c = costs(step=0.16 / LOOP_STEP_FACTOR, raw=0.2)  # a step of 0.16 s in the loop
    assert loop_period(c, "raw", 0) == pytest.approx(0.36)  # decode, then the step, in one thread
    assert loop_period(c, "raw", 1) == pytest.approx(0.2)  # one worker decodes while the step runs
    assert loop_period(c, "raw", 2) == pytest.approx(0.18)  # all the work over both cores
    assert loop_period(c, "raw", 2, epoch_batches=1) == pytest.approx(0.36)  # an epoch of one batch: serial
    assert loop_period(c, "raw", 2, epoch_batches=4) == pytest.approx(0.75 * 0.18 + 0.25 * 0.36)
    gpu = dataclasses.replace(c, step_on_host=False)
    assert loop_period(gpu, "raw", 2) == pytest.approx(0.16)  # the device takes the step off the cores


def test_a_run_is_cut_at_max_run_s_but_never_below_the_minimum() -> None:
    assert timed_batches(16, 0.1, 1.0) == 10
    assert timed_batches(16, 1.0, 1.0) == MIN_TIMED_STEPS
    assert timed_batches(16, 0.01, 1.0) == 16 and timed_batches(16, 1.0, None) == 16
    p, c = plan(max_run_s=None, fed_s=0.0), costs()
    one = run_s(p, c, "ram", 1)
    period = loop_period(c, "ram", 1, p.epoch_batches)
    assert one == pytest.approx(RUN_OVERHEAD_S + 0.2 + (4 + 16) * period)  # pool + warm-up + timed


def test_the_estimate_grows_with_each_thing_planned() -> None:
    c = costs(convert=0.01)
    base = estimate(plan(), c)
    assert base["total_s"] == pytest.approx(sum(v for k, v in base.items() if k != "total_s"))
    assert base["prepare_s"] == pytest.approx(3 * (1.0 + 10_000 * 0.01))  # three caches to build
    assert estimate(plan(repeats=4), c)["runs_s"] > base["runs_s"]
    assert estimate(plan(cold=False), c)["runs_s"] < base["runs_s"]
    assert estimate(plan(loaders=("raw",)), c)["total_s"] < base["total_s"]
    assert estimate(plan(), costs(step=0.2, convert=0.01))["total_s"] > base["total_s"]
    reused = estimate(plan(), costs(convert=0.0))
    assert reused["prepare_s"] == 0.0


def test_fit_cuts_cheapest_first_and_says_what_and_why() -> None:
    c = costs(step=0.1, raw=0.2)
    asked = estimate(plan(images=40), c)["total_s"]
    fitted, cuts = fit(plan(images=40), c, budget_s=asked * 0.6)
    assert estimate(fitted, c)["total_s"] <= BUDGET_SHARE * asked * 0.6
    assert cuts[0].startswith("no cold runs") and not fitted.cold
    assert all("→" in why or "not" in why for why in cuts[1:])
    assert fitted.loaders == KINDS  # cutting the loaders is the last resort
    untouched, none = fit(plan(images=40), c, budget_s=asked * 2)
    assert untouched == plan(images=40) and none == []
    assert fit(plan(), c, budget_s=None) == (plan(), [])


def test_fit_keeps_what_the_user_set_and_never_drops_a_named_loader() -> None:
    c = costs(step=0.5, raw=1.0)  # far over any budget
    fitted, cuts = fit(
        plan(images=40), c, 5.0, fixed=frozenset({"repeats", "loaders"}), named=frozenset(KINDS)
    )
    assert fitted.repeats == 2 and fitted.loaders == KINDS
    assert not any(why.startswith("repeats") for why in cuts)
    lines = plan_lines(fitted, estimate(fitted, c), cuts, 5.0)
    assert lines[0].startswith("plan: raw at workers 0,2") and "2 rounds" in lines[0]
    assert lines[-1].startswith("over --budget 5 s even so") and "name fewer loaders" in lines[-1]
    dropped, why = fit(plan(images=40), c, 5.0)  # the defaults, not named: the last ones go
    assert dropped.loaders[0] == "raw" and len(dropped.loaders) < len(KINDS)
    assert any(w.startswith("loader zarr not run (a default, not named)") for w in why)


def test_a_smaller_sample_is_taken_only_when_the_caches_must_be_built() -> None:
    building = costs(convert=0.01)
    fitted, cuts = fit(plan(cold=False), building, 60.0)
    assert fitted.images < 10_000 and any("a sample of" in w for w in cuts)
    reused = costs(convert=0.0)
    kept, cuts = fit(plan(), reused, 30.0)
    assert kept.images == 10_000 and not any("a sample of" in w for w in cuts)


# --- the step alone, measured as the loop runs it ------------------------------------------------------


def run_with_steps(kind: str, step_s: list[float], wait_s: float, workers: int = 0) -> RunResult:
    r = RunResult(kind, workers, False, 0, 0)
    r.steps = [StepRecord("timed", 0, i, 32, wait_s, s) for i, s in enumerate(step_s)]
    r.timed_s = sum(step_s) + wait_s * len(step_s)
    r.img_per_s = 32 * len(step_s) / r.timed_s
    return r


def test_on_a_cpu_the_step_alone_is_never_below_a_run_that_contains_it() -> None:
    """Recorded from the issue's run: windows alone at 12.7–36 img/s, the median below the runs."""
    stage = StageResult("compute", "ram", 21.3, label="cpu", detail={"samples_img_per_s": [21.3, 32.2, 12.7]})
    stages = {k: {"compute": stage} for k in ("ram", "npz")}
    fast = run_with_steps("ram", [0.83, 0.83, 0.82, 0.72], wait_s=0.003)  # 38 img/s end to end
    slow = run_with_steps("npz", [1.5, 1.6], wait_s=0.01)
    settle_compute(stages, {"ram": [fast], "npz": [slow]})
    assert stage.img_per_s >= fast.img_per_s >= slow.img_per_s
    assert stage.img_per_s == pytest.approx(32 * 4 / sum([0.83, 0.83, 0.82, 0.72]))
    assert "fastest of 3 windows alone and 2 inside the runs" in stage.label
    assert set(stage.detail["in_loop_img_per_s"]) == {"ram-w0-r0", "npz-w0-r0"}
    settle_compute(stages, {"ram": [fast]})  # settled once: a second call changes nothing
    assert stage.img_per_s == pytest.approx(32 * 4 / sum([0.83, 0.83, 0.82, 0.72]))


def test_on_a_gpu_the_step_alone_stays_the_median_of_its_windows() -> None:
    stage = StageResult(
        "compute", "ram", 900.0, label="cuda", detail={"samples_img_per_s": [900.0, 1000.0, 800.0]}
    )
    settle_compute({"ram": {"compute": stage}})
    assert stage.img_per_s == 900.0 and "median of 3 windows alone" in stage.label
    assert in_loop_step_rates(["ram"], {}) == {}


@pytest.fixture(scope="module")
def tiny_run(bench_env: Path) -> tuple[dict[str, Any], str]:
    args = ["--demo-images", "40", "--batch-size", "8", "--size", "16", "--steps", "3", "--warmup", "2"]
    args += ["--stage-steps", "2", "--workers", "0,1", "--loaders", "raw,ram", "--no-cold"]
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(bench_env / "out"), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), res.stderr


def test_the_plan_is_printed_first_and_recorded(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, stderr = tiny_run
    lines = [line for line in stderr.splitlines() if line.startswith("[bench]")]
    assert lines[0].startswith(
        "[bench] plan: raw at workers 0,1, ram at workers 0,1; 2 rounds × 3 timed steps"
    )
    assert lines[1].startswith("[bench] estimate: about") and "within --budget 60 s" in lines[1]
    budget = doc["budget"]
    assert budget["budget_s"] == 60.0 and budget["cuts"] == []  # a tiny run fits: nothing cut
    assert budget["plan"]["loaders"] == ["raw", "ram"] and budget["plan"]["steps"] == 3
    assert 0 < budget["estimate"]["total_s"] and 0 < budget["actual_s"] <= doc["elapsed_s"] + 1
    assert budget["costs"]["step_s"] > 0 and budget["costs"]["batch_s"]["raw"] > 0
    assert set(doc["config"]["user_set"]) >= {"loaders", "workers", "steps", "warmup", "stage_steps", "cold"}


def test_a_cpu_run_says_what_it_can_and_cannot_say(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = tiny_run
    assert any(n.startswith("a CPU run: the training step runs on the same") for n in doc["notes"])
    assert any("run the bench on the training machine" in n for n in doc["notes"])


def test_the_step_alone_is_timed_as_the_loop_runs_it(tiny_run: tuple[dict[str, Any], str]) -> None:
    """The mechanism, not a timing: as many warm batches and the same threads as the runs, and the runs' own
    step windows folded in, so the rate alone is never below a run that contains the step."""
    doc, _ = tiny_run
    for kind, stage in doc["stages"].items():
        compute = stage["detail"]["compute"]
        assert compute["detail"]["warmup_batches"] == doc["protocol"]["warmup"]
        assert compute["detail"]["threads"] == doc["protocol"]["step_threads"] == 1
        loop = compute["detail"]["in_loop_img_per_s"]
        assert any(key.startswith(f"{kind}-w") for key in loop)
        assert stage["compute"] >= max(loop.values())
        for run in (r for r in doc["runs"] if r["loader"] == kind):
            assert stage["compute"] >= run["img_per_s"]


def test_budget_zero_runs_what_is_asked(bench_env: Path) -> None:
    args = ["--demo-images", "40", "--batch-size", "8", "--size", "16", "--steps", "3", "--warmup", "2"]
    args += ["--stage-steps", "2", "--workers", "0", "--loaders", "ram", "--no-cold", "--repeats", "1"]
    res = CliRunner().invoke(
        main, ["bench", *args, "--budget", "0", "--out", str(bench_env / "o0"), "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["budget"] is None and "[bench] plan:" not in res.stderr


def test_a_cpu_takes_a_smaller_default_size_and_says_so() -> None:
    from types import SimpleNamespace

    import torch

    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.run import CPU_DEFAULT_SIZE, bench_size

    folder = SimpleNamespace(kind="folder")
    size, notes = bench_size(BenchConfig(), folder, torch.device("cpu"))  # type: ignore[arg-type]
    assert size == CPU_DEFAULT_SIZE == 64 and "pass --size 224 to measure that" in notes[0]
    assert bench_size(BenchConfig(size=224), folder, torch.device("cpu")) == (224, [])  # type: ignore[arg-type]
    assert bench_size(BenchConfig(), folder, torch.device("cuda")) == (224, [])  # type: ignore[arg-type]
    assert bench_size(BenchConfig(), SimpleNamespace(kind="demo"), torch.device("cpu")) == (32, [])  # type: ignore[arg-type]
