"""The time-based replay window and the in-loop trial of the workers advice: the window's arithmetic on
given clocks, the block period, and real loops on the CPU whose dataset sleeps per sample (idle cores:
more workers are advised and tried in the loop, in the places of the user's own batches)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset
from watch_records import raw

import dlstore
from dlstore.bench.watch.analyse import analyse
from dlstore.bench.watch.steps import block_period
from dlstore.bench.watch.trial import FIXED_STEPS, Window, trial_steps
from dlstore.cli import main

from .conftest import write_script


def feed(window: Window, times: list[float]) -> int:
    """Calls ``more`` at each time until it says the window is over; the steps it fed."""
    for t in times:
        if not window.more(t):
            break
    return window.n


def test_window_drops_its_warmup_by_time_then_times_at_least_min_s() -> None:
    w = Window(first_step=100, warm_steps=1, warm_s=0.3, min_s=1.0, cap=10_000)
    steps = feed(w, [0.01 * i for i in range(1000)])  # 10 ms steps
    # warm-up: the calls up to 0.3 s (30 steps); then timed until 1.0 s after that (100 steps)
    assert w.timed_from == 30 and steps == 130
    assert w.warm() == list(range(100, 130))


def test_window_is_capped_in_steps_and_keeps_a_timed_share() -> None:
    w = Window(first_step=0, warm_steps=1, warm_s=10.0, min_s=10.0, cap=8)
    assert feed(w, [0.01 * i for i in range(100)]) == 8
    assert w.timed_from == 2  # a quarter of the cap at most is warm-up, whatever warm_s says


def test_trial_window_drops_the_queue_filling_steps() -> None:
    w = Window(first_step=0, warm_steps=9, warm_s=0.0, min_s=0.05, cap=1000)  # 4 workers × 2 + 1
    feed(w, [0.01 * i for i in range(1000)])
    assert w.timed_from == 9 and len(w.warm()) == 9 and w.n == 9 + 5


def test_fixed_window_counts_steps_only() -> None:
    """Under torchrun each rank must take the same steps: no clock."""
    w = Window(first_step=0, warm_steps=1, warm_s=0.3, min_s=1.5, cap=10_000, fixed=True)
    assert feed(w, [100.0 * i for i in range(1000)]) == FIXED_STEPS


def test_block_period_leaves_one_slow_block_out() -> None:
    periods = [0.010] * 20 + [0.030] * 10 + [0.010] * 30  # a slow stretch in the middle block
    assert block_period(periods) == pytest.approx(0.010)
    assert sum(periods) / len(periods) > 0.013  # the mean would carry it


def test_replay_summary_leaves_out_its_warmup_steps() -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    ld = doc["loaders"][0]
    first = ld["phase"].index("replay")
    # the replay's first 3 steps ramped (20 ms each): marked warm-up, they leave the period alone
    for i in range(first, first + 3):
        ld["t_next"][i] = ld["t_call"][i] + 0.020
    for i in range(first + 1, len(ld["t_call"])):
        shift = ld["t_next"][i - 1] - ld["t_call"][i]
        ld["t_call"][i] += shift
        ld["t_ret"][i] += shift
        ld["t_next"][i] += shift
    ld["window_warm"] = list(range(first, first + 3))
    rep = analyse([doc])["loaders"][0]
    assert rep["phases"]["replay"]["steps"] == 7
    assert rep["phases"]["replay"]["period_s"] == pytest.approx(0.005)
    assert rep["model"]["data_free_img_per_s"] == pytest.approx(32 / 0.005)


class Sleepy(Dataset):
    """Each sample sleeps (I/O-like: no core used), its target is its index."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import time

        time.sleep(self.sleep_s)
        return torch.full((3,), float(i)), i


SLEEPY_SCRIPT = """
import json, sys, time
import torch
from torch.utils.data import DataLoader, Dataset


class Sleepy(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.full((3,), float(i)), i


def main():
    torch.set_num_threads(1)
    loader = DataLoader(Sleepy(), batch_size=4, num_workers=0)
    seen, steps = [], []
    for epoch in range(3):  # the script's own accounting of what it trained on, epoch by epoch
        steps.append(0)
        for x, y in loader:
            seen += y.tolist()
            steps[-1] += 1
            (x * 2).sum()
    with open(sys.argv[1], "w") as f:
        json.dump({"seen": seen, "steps": steps}, f)


if __name__ == "__main__":
    main()
"""


def test_more_workers_are_tried_in_the_loop_in_real_steps_places(tmp_path: Path) -> None:
    script = write_script(tmp_path, "sleepy.py", SLEEPY_SCRIPT)
    seen_file = tmp_path / "seen.json"
    args = [
        "--warmup",
        "2",
        "--replay-at",
        "8",
        "--replay-s",
        "0.1",
        "--trial-s",
        "0.6",  # room for the workers' start on a loaded 2-core machine,
        "--parts-budget",
        "0.2",
    ]
    result = CliRunner().invoke(main, ["watch", "--json", *args, "--", "python", str(script), str(seen_file)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rep = next(r for r in doc["loaders"] if r["index"] == doc["primary"])
    trial = rep["trial"]
    assert trial and "skipped" not in trial, rep["notes"]
    workers = next(a for a in doc["advice"] if a.get("workers"))
    assert trial["workers"] == workers["workers"] > 0
    # its first N × prefetch + 1 steps dropped, the rest timed: the advice's rate is the loop's there
    assert trial["dropped"] == trial["workers"] * 2 + 1 and rep["steps_trial"] > trial["dropped"]
    assert workers["expected_img_per_s"] == pytest.approx(rep["phases"]["trial"]["img_per_s"])
    assert "tried in the loop" in workers["text"]
    assert any("second DataLoader over the same dataset" in n for n in doc["notes"])
    # the user's epochs: as long as unwatched, the replayed and trial batches in real ones' places
    got = json.loads(seen_file.read_text())
    assert got["steps"] == [96 // 4] * 3
    assert rep["stand_in_steps"] == rep["steps_replayed"] + rep["steps_trial"] > 0
    assert rep["steps_observed"] == 3 * 96 // 4 - rep["stand_in_steps"]
    assert rep["tried"]["replay"] is True and rep["tried"]["trial"] is True


def run_library(**kw: Any) -> dict[str, Any]:
    loader = DataLoader(Sleepy(48, 0.003), batch_size=4)
    with dlstore.watch(warmup=2, replay_at=6, replay_s=0.05, trial_s=0.2, quiet=True, **kw) as w:
        for _batch in loader:
            pass
    return w.report


def test_no_trial_leaves_the_workers_advice_to_the_probe() -> None:
    report = run_library(trial=False, parts=False)
    rep = report["loaders"][0]
    assert rep["steps_trial"] == 0 and rep["trial"] is None
    workers = next((a for a in report["advice"] if a.get("workers")), None)
    if workers is not None:
        assert "tried in the loop" not in workers["text"]


def test_steps_stops_after_the_observed_steps_the_replay_and_the_trial() -> None:
    loader = DataLoader(Sleepy(400, 0.003), batch_size=4)
    seen = 0
    with dlstore.watch(steps=10, warmup=2, replay_s=0.05, trial_s=0.2, parts=False, quiet=True) as w:
        for _ in range(3):
            for _batch in loader:
                seen += 1
    rep = w.report["loaders"][0]
    assert w.report["status"] == "stopped" and rep["steps_observed"] == 10
    assert rep["steps_replayed"] > 0 and rep["trial"] and "skipped" not in rep["trial"], rep["notes"]
    assert seen == 10 + rep["steps_replayed"] + rep["steps_trial"]


def test_the_sampler_thread_never_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the sampler (started at install, before the script) a CUDA query would initialise CUDA before
    the script set CUDA_VISIBLE_DEVICES; only the training thread asks."""
    import threading

    callers: list[str] = []
    real = torch.cuda.is_available

    def spy() -> bool:
        callers.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(torch.cuda, "is_available", spy)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: spy())
    # NVML present (a stand-in module): the sampler opens it, and then asked CUDA for the device
    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    loader = DataLoader(Sleepy(40, 0.0), batch_size=4)
    with dlstore.watch(replay=False, trial=False, parts=False, quiet=True) as w:
        w.session._sampler.sample()  # a tick before the loop, as the thread's first
        for _batch in loader:
            pass
    assert callers and set(callers) == {threading.main_thread().name}


def add_trial(ld: dict[str, Any], workers: int, step_s: float, start: float, steps: int = 6) -> None:
    """``steps`` in-loop trial steps of ``step_s`` each with ``workers``, recorded after the loop's own."""
    t = start
    for _ in range(steps):
        ld["t_call"].append(t)
        ld["t_ret"].append(t + 1e-4)
        t += step_s
        ld["t_next"].append(t)
        ld["phase"].append("trial")
        ld["epoch"].append(0)
    ld["trial"] = {"workers": workers, "dropped": 0, "steps": steps, "prefetch_factor": 2}


def test_a_trial_without_gain_drops_the_workers_advice_and_says_so() -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    ld = doc["loaders"][0]
    modelled = next(a for a in analyse([doc])["advice"] if a.get("workers"))
    # the loop fed by the advised workers ran 40 ms a step (slower than its 35 ms now): 6 steps timed
    add_trial(ld, modelled["workers"], step_s=0.040, start=ld["t_next"][-1])
    report = analyse([doc])
    assert not any(a.get("workers") for a in report["advice"])
    assert any(
        f"Tried in the loop with {modelled['workers']} workers: 800 img/s" in n for n in report["notes"]
    )


def pin_doc(wait: float, host: float, saving: float, replay: float) -> dict[str, Any]:
    doc = raw(wait=wait, host=host, replay_period=replay, getitem=wait / 32, cuda=True)
    ld = doc["loaders"][0]
    ld["device_s"] = [0.001] * len(ld["t_call"])  # a 1 ms device span: the host binds the step
    ld["settings"]["pin_memory"] = False
    ld["parts"]["h2d"] = {"pageable_s": saving + 0.0001, "pinned_s": 0.0001, "bytes": 2e6}
    return doc


def test_pin_advice_is_a_gain_on_the_rate_measured_now() -> None:
    # input-bound (30 ms waits): a copy 0.15 ms shorter gains nothing
    report = analyse([pin_doc(wait=0.030, host=0.005, saving=0.00015, replay=0.005)])
    assert not any("Pin the batches" in a["text"] for a in report["advice"])
    # the loop ran 5.1 ms a step, its replay 2 ms: the model rates it 2.1 ms (0.1 wait + 2), 1.0 ms with
    # the copy 1.5 ms shorter (the device's span then binds). The advice: that ratio on the rate now, not
    # the model's 32 / 1.0 ms (on the H200 such an absolute figure predicted 11,143 img/s, 8,674 ran)
    report = analyse([pin_doc(wait=0.0001, host=0.005, saving=0.0015, replay=0.002)])
    pin = next(a for a in report["advice"] if "Pin the batches" in a["text"])
    now = report["loaders"][0]["steady"]["img_per_s"]
    assert pin["expected_img_per_s"] == pytest.approx(now * 2.1 / 1.0, rel=0.02)


def test_persistent_workers_are_counted_once_across_epochs() -> None:
    """Every epoch's iter() of a persistent loader returns the same iterator: its workers once, not once
    per epoch (their memory was summed per epoch)."""
    loader = DataLoader(Sleepy(16, 0.0), batch_size=4, num_workers=2, persistent_workers=True)
    with dlstore.watch(replay=False, trial=False, parts=False, quiet=True) as w:
        for _ in range(3):
            for _batch in loader:
                pass
        rec = next(iter(w.session.records.values()))
        assert len(rec.worker_pids()) == 2 and len(rec.iterators) == 1
    # now, while its queues work: the session's records hold the iterator in a cycle, and the collector
    # closes those queues first, so each worker would sit out torch's 5 s join timeout in a later test
    loader._iterator._shutdown_workers()  # type: ignore[union-attr]


def test_a_trial_with_gain_is_advised_against_the_rate_now_not_the_model() -> None:
    """The parts model may rate the loop far above what it runs (its parts timed alone are quicker than
    in the loop; H200: 56,430 img/s modelled, 32,964 ran, 44,274 in a trial at 6 workers): a trial is held
    against the measured rate now."""
    doc = raw(wait=0.025, host=0.005, workers=4, replay_period=0.005, getitem=0.0005 / 32)
    ld = doc["loaders"][0]
    for i in range(0, len(ld["phase"]), 2):  # waits of 0.1 and 50 ms: the hand-over's p10 is short
        if ld["phase"][i] != "replay":
            ld["t_call"][i] = ld["t_ret"][i] - 0.0001
    # the trial at 8 workers: 10 ms a step (now: 17.5 ms, 30 and 5 ms alternating)
    add_trial(ld, 8, step_s=0.010, start=ld["t_next"][-1] + 1.0)
    report = analyse([doc])
    rep = report["loaders"][0]
    assert rep["model"]["predicted_img_per_s"] > 2 * rep["steady"]["img_per_s"]
    got = next(a for a in report["advice"] if a.get("workers"))
    assert got["workers"] == 8 and "tried in the loop" in got["text"]
    assert got["expected_img_per_s"] == pytest.approx(32 / 0.010)


def test_a_trial_times_two_rounds_of_its_workers_however_short_the_epoch() -> None:
    """16 workers hand their batches over in bursts: a trial capped at half of a 78-step epoch timed 6
    steps inside one burst and predicted 74,586 img/s where the loop then ran 25,179 (H100, 12-06)."""
    warm, cap = trial_steps(16, 2, 2000, 78)
    assert warm == 33 and cap - warm >= 32
    assert trial_steps(2, 2, 2000, 10_000) == (5, 2000)  # a long epoch: half of it, up to trial_steps
    assert trial_steps(1, 2, 2000, 20) == (3, 10)  # a short one: half of it, when that holds enough
