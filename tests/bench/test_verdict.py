"""The prediction composes measured parts the way the loop runs, and the verdict names the right stage: pure
functions fed parts of known cost, plus parts measured for real on fakes of known cost (sleeping datasets
and steps)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dlstore.bench.advice import FAST_LOADER, MAX_RECOMMENDATIONS, lead, rank
from dlstore.bench.endtoend import pool_probes
from dlstore.bench.predict import BOTTLENECKS, FedTiming, LoaderTiming, LoopParts, compose, fed_timing
from dlstore.bench.protocol import RunResult
from dlstore.bench.stages import measure_fed, measure_loader, probe_loader
from dlstore.bench.verdict import (
    Facts,
    KindStages,
    analyse,
    annotate_runs,
    kind_summary,
    knee,
    read_advice,
)

CPU = torch.device("cpu")
MS = 1e-3


def parts(
    workers: int,
    loader_ms: float,
    main_ms: float,
    fed_ms: float,
    serial_ms: float,
    cpu_ms: float = 0.0,
    cores: int = 16,
    **kw: Any,
) -> LoopParts:
    return LoopParts(
        batch=100,
        workers=workers,
        loader=LoaderTiming(loader_ms * MS, main_ms * MS, cpu_ms * MS),
        fed=FedTiming(fed_ms * MS, serial_ms * MS, None),
        cores=cores,
        **kw,
    )


# --- composition ------------------------------------------------------------------------------------


def test_a_loop_over_short_epochs_never_outruns_its_loader_alone() -> None:
    """H100, Lightning under watch: 12 workers at 87.5 ms a batch alone, 36-batch epochs, a step the device
    binds at 50 ms. The device's lead hid the workers' refill and the epoch's other batches came at the
    loader's bunched pace: 4,287 img/s predicted where the loader alone ran 2,925 (the loop measured 3,311)."""
    from dataclasses import replace

    from dlstore.bench.predict import over_epochs

    loader = over_epochs(LoaderTiming(87.5 * MS, 0.5 * MS, 12 * 87.5 * MS, in_caller=False), 12, 36)
    looped = LoopParts(256, 12, loader, FedTiming(50 * MS, 10 * MS, 50 * MS), cores=16)
    assert compose(looped).period_s >= 87.5 * MS * (1 - 1e-9)
    fast = over_epochs(LoaderTiming(10 * MS, 0.5 * MS, 120 * MS, in_caller=False), 12, 36)
    assert compose(replace(looped, loader=fast)).period_s == pytest.approx(
        50 * MS, rel=0.05
    )  # the step binds


def test_zero_workers_run_serially() -> None:
    # the loader's 10 ms run on the main thread before its 2 ms of step work: 12 ms, not max(10, 5)
    p = compose(parts(0, loader_ms=10, main_ms=10, fed_ms=5, serial_ms=2))
    assert p.period_s == pytest.approx(12 * MS) and p.bottleneck == "transform"
    assert p.img_per_s == pytest.approx(100 / 0.012)


def test_workers_pipeline_with_the_main_thread_and_the_device() -> None:
    # 4 workers make a batch every 10 ms; the main thread needs 0.5 + 2 ms; the device 5 ms: workers set it
    assert compose(parts(4, 10, 0.5, 5, 2)).period_s == pytest.approx(10 * MS)
    # fast workers: the device's 5 ms sets it
    p = compose(parts(8, 1, 0.5, 5, 2))
    assert p.period_s == pytest.approx(5 * MS) and p.bottleneck == "compute"
    # a device batch every 1 ms, but the main thread spends 0.5 ms receiving and 2 ms launching: host-bound
    p = compose(parts(8, 1, 0.5, 1, 2))
    assert p.period_s == pytest.approx(2.5 * MS) and p.bottleneck == "host"


def test_a_synchronising_step_is_serial_without_a_special_case() -> None:
    # a step that waits for the device (loss.item(), pageable copy) has serial ≈ its device time: the
    # loader's main-thread work then adds to it instead of overlapping
    p = compose(parts(0, loader_ms=3, main_ms=3, fed_ms=5, serial_ms=5))
    assert p.period_s == pytest.approx(8 * MS)
    # an asynchronous step of the same device time hides the loader behind the device
    assert compose(parts(0, 3, 3, 5, 1)).period_s == pytest.approx(5 * MS)


def test_a_device_that_idles_between_steps_costs_the_idle_launch() -> None:
    # launching onto an idle device costs 3 ms where a busy one costs 2 (measured apart, FedTiming)
    fed = FedTiming(5 * MS, 2 * MS, 5 * MS, idle_serial_s=3 * MS)
    # 0 workers, 10 ms of loader work on the main thread: the device waits for the host every step
    p = compose(LoopParts(100, 0, LoaderTiming(10 * MS, 10 * MS), fed))
    assert p.period_s == pytest.approx(13 * MS) and p.serial_s == pytest.approx(3 * MS)
    assert p.budget_ms(LoopParts(100, 0, LoaderTiming(10 * MS, 10 * MS), fed))["host_ms"] == pytest.approx(3)
    # a slow producer with workers: the device idles too, and the main thread's 0.5 + 3 ms stay hidden
    p = compose(LoopParts(100, 8, LoaderTiming(20 * MS, 0.5 * MS, in_caller=False), fed))
    assert p.period_s == pytest.approx(20 * MS) and p.serial_s == pytest.approx(3 * MS)
    # fast workers: the device never idles, the busy cost holds (period = the device's 5 ms)
    p = compose(LoopParts(100, 8, LoaderTiming(1 * MS, 0.5 * MS, in_caller=False), fed))
    assert p.period_s == pytest.approx(5 * MS) and p.serial_s == pytest.approx(2 * MS)
    # a short gap (0.4 ms of loader work on the main thread, the probe's gap unrecorded: the device period)
    # costs its share of the extra, at the fixed point s = 2 + (0.4 + s − 2.3) / 2.3 × (3 − 2)
    near = LoopParts(100, 0, LoaderTiming(0.4 * MS, 0.4 * MS), FedTiming(2.3 * MS, 2 * MS, 2.3 * MS, 3 * MS))
    s = (2 - 1.9 / 2.3) / (1 - 1 / 2.3)
    assert compose(near).serial_s == pytest.approx(s * MS, rel=1e-6)
    assert compose(near).period_s == pytest.approx((0.4 + s) * MS, rel=1e-6)
    # not measured (a CPU run): the one serial cost
    assert compose(parts(0, 10, 10, 5, 2)).period_s == pytest.approx(12 * MS)


def test_idle_launch_cost_grows_with_the_gap_up_to_the_probes() -> None:
    fed = FedTiming(10 * MS, 10 * MS, 10 * MS, idle_serial_s=14 * MS, idle_gap_s=20 * MS)
    assert fed.serial_at(0.0) == pytest.approx(10 * MS)
    assert fed.serial_at(5 * MS) == pytest.approx(11 * MS)  # a quarter of the probe's gap: a quarter of +4
    assert fed.serial_at(40 * MS) == pytest.approx(14 * MS)  # past the probe's gap: its cost, no more
    # an idle probe that measured less than the busy loop (noise) adds nothing
    assert FedTiming(10 * MS, 10 * MS, 10 * MS, 9 * MS, 20 * MS).serial_at(40 * MS) == pytest.approx(10 * MS)
    # 0 workers, 6 ms of loader work: gap = 6 + s − 10, s = 10 + gap / 20 × 4 → s = 11.5, period 17.5
    p = compose(LoopParts(100, 0, LoaderTiming(6 * MS, 6 * MS), fed))
    assert p.serial_s == pytest.approx(11.5 * MS, rel=1e-6) and p.period_s == pytest.approx(
        17.5 * MS, rel=1e-6
    )


def window(period_ms: float, host_ms: float, batches: int, device_ms: float | None = None) -> dict[str, Any]:
    return {"period_s": period_ms * MS, "host_s": host_ms * MS, "device_s": None if device_ms is None else device_ms * MS,
            "serial_s": host_ms * MS, "batches": batches}  # fmt: skip


def test_fed_timing_pools_the_free_and_loop_windows_by_batches() -> None:
    # the same busy-device cost measured in two windows (12 and 36 batches): their batch-weighted mean, not
    # the larger (round B: a maximum of noisy windows over-predicted 12 of 15 runs)
    sample = {
        "free": window(18.0, 17.0, 12, device_ms=16.0),
        "loop": window(12.0, 11.0, 36),
        "idle": {**window(40.0, 15.0, 10, device_ms=15.0), "serial_s": 15.5 * MS},
    }
    t = fed_timing([sample])
    assert t is not None
    assert t.period_s == pytest.approx((18 * 12 + 12 * 36) / 48 * MS)
    assert t.serial_s == pytest.approx((17 * 12 + 11 * 36) / 48 * MS)
    assert t.device_s == pytest.approx(16 * MS)
    assert t.idle_serial_s == pytest.approx(15.5 * MS) and t.idle_gap_s == pytest.approx(25 * MS)
    # two rounds pool all their windows
    t2 = fed_timing([sample, {**sample, "loop": window(6.0, 5.0, 36)}])
    assert t2 is not None and t2.serial_s == pytest.approx((17 * 24 + 11 * 36 + 5 * 36) / 96 * MS)
    # a CPU (no device time, no idle probe): the free period and the loop's step calls are the serial cost
    cpu = fed_timing([{"free": window(20.0, 19.0, 10), "loop": window(25.0, 22.0, 10), "idle": None}])
    assert cpu is not None and cpu.serial_s == pytest.approx(21 * MS) and cpu.idle_serial_s is None
    assert fed_timing([]) is None


def test_short_epochs_pay_the_loader_refill_unoverlapped() -> None:
    # 3 batches per epoch; 4 workers: after a restart the first batch takes 20 ms, the other two are ready
    # at once (loader alone: 22 ms per epoch). The loop's main thread needs 15 ms per batch, so an epoch is
    # 20 + 3 × 15 = 65 ms: 21.7 ms per batch, not max(7.3, 15) = 15
    loader = LoaderTiming(22 * MS / 3, 0.3 * MS, 0.0, in_caller=False, refill_s=20 * MS, epoch_batches=3)
    p = compose(LoopParts(100, 4, loader, FedTiming(13 * MS, 14.7 * MS), cores=16))
    assert p.period_s == pytest.approx(65 * MS / 3) and p.bottleneck == "host"
    # a slow producer: every batch 80 ms apart after a 100 ms refill: the loader sets the pace
    slow = LoaderTiming(260 * MS / 3, 0.3 * MS, 0.0, in_caller=False, refill_s=100 * MS, epoch_batches=3)
    p = compose(LoopParts(100, 1, slow, FedTiming(13 * MS, 14.7 * MS), cores=16))
    assert p.period_s == pytest.approx((100 + 2 * 80 + 15) * MS / 3) and p.bottleneck == "transform"
    # long epochs or an unmeasured refill: the plain pipeline
    long = LoaderTiming(7 * MS, 0.3 * MS, 0.0, in_caller=False, refill_s=None, epoch_batches=300)
    assert compose(LoopParts(100, 4, long, FedTiming(13 * MS, 14.7 * MS))).period_s == pytest.approx(15 * MS)


def test_worker_cpu_is_not_charged_again_after_the_refill() -> None:
    # 8 batches per epoch, the first after a 150 ms refill (loader alone: 152 ms per epoch), workers burn 140 ms
    # CPU per batch. On 16 cores that CPU fits inside the refill: epoch = 150 + max(8 × 3.5, 7 × 2/7 + 3.5) =
    # 178 ms, not 150 + 8 × (140 + 3.4) / 16 (the workers' CPU counted once in the refill, again per batch)
    loader = LoaderTiming(19 * MS, 0.1 * MS, 140 * MS, in_caller=False, refill_s=150 * MS, epoch_batches=8)
    p = compose(LoopParts(64, 8, loader, FedTiming(2.8 * MS, 3.4 * MS), cores=16))
    assert p.period_s == pytest.approx(178 * MS / 8) and p.bottleneck == "transform"
    # on 2 cores the epoch's CPU (8 × (140 + 3.4) ms over 2 cores) is the bound
    p = compose(LoopParts(64, 8, loader, FedTiming(2.8 * MS, 3.4 * MS), cores=2))
    assert p.period_s == pytest.approx(143.4 * MS / 2) and p.bottleneck == "cores"


def test_cores_limit_when_workers_and_main_thread_need_more_than_there_are() -> None:
    # 2 cores; workers burn 30 ms CPU per batch, the main thread 4: (30 + 4) / 2 = 17 ms > the 10 ms period
    p = compose(parts(4, loader_ms=10, main_ms=1, fed_ms=4, serial_ms=4, cpu_ms=30, cores=2))
    assert p.period_s == pytest.approx(17 * MS) and p.bottleneck == "cores"


def test_device_term_names_the_copy_and_cpu_steps_name_compute() -> None:
    assert compose(parts(8, 1, 0.1, 5, 1, copy_bound=True)).bottleneck == "h2d"
    # on a CPU the step is main-thread work: a step-bound CPU run is compute-bound, not host-bound
    assert compose(parts(0, 1, 1, 20, 20, step_on_host=True)).bottleneck == "compute"
    assert compose(parts(8, 1, 0.1, 1, 0.5, read_s=30 * MS)).bottleneck == "read"


def test_budget_splits_the_period() -> None:
    pp = parts(4, 10, 0.5, 5, 2)
    b = compose(pp).budget_ms(pp)
    assert b["period_ms"] == pytest.approx(10) and b["host_ms"] == pytest.approx(2)
    assert b["wait_ms"] == pytest.approx(8)


@pytest.mark.parametrize("limit", ["producer", "main", "device", "cores"])
def test_every_limit_can_be_the_bottleneck(limit: str) -> None:
    big = 50.0
    p = parts(
        4,
        loader_ms=big if limit == "producer" else 1,
        main_ms=big if limit == "main" else 0.1,
        fed_ms=big if limit == "device" else 1,
        serial_ms=0.5,
        cpu_ms=8 * big if limit == "cores" else 1,
        cores=4,
    )
    pred = compose(p)
    assert max(pred.terms_s, key=lambda k: pred.terms_s[k]) == limit and pred.bottleneck in BOTTLENECKS


# --- parts of known cost, measured for real -----------------------------------------------------------


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


def measured_parts(decode_s: float, step_s: float, workers: int) -> LoopParts:
    """The loader alone and the fed step, measured on fakes of known cost (batch 8)."""
    loader = DataLoader(
        SleepyDataset(64, decode_s), batch_size=8, num_workers=workers, persistent_workers=workers > 0
    )
    lt = measure_loader(loader, warmup=max(1, workers), steps=max(2, 2 * workers), device=CPU)
    fed = measure_fed(sleepy_step(step_s), (torch.zeros(8, 3, 4, 4), torch.zeros(8)), lambda b: b, CPU, 1, 3)
    return LoopParts(
        batch=8,
        workers=workers,
        loader=LoaderTiming(lt["period_s"], lt["main_s"], lt["cpu_s"]),
        fed=FedTiming(fed["period_s"], fed["period_s"]),
        cores=64,  # sleeping costs no CPU: keep the cores limit out of this test
        step_on_host=True,
    )


@pytest.mark.parametrize(
    ("decode_s", "step_s", "workers", "expected"),
    [
        (0.004, 0.002, 0, "transform"),  # decode-heavy: 32 ms of decode + 2 ms step per batch, serially
        (0.0002, 0.040, 0, "compute"),  # compute-heavy: 40 ms step vs 1.6 ms decode
        (0.004, 0.002, 2, "transform"),  # two workers still take 16 ms per batch vs the 2 ms step
    ],
)
def test_measured_fakes_name_the_bottleneck(
    decode_s: float, step_s: float, workers: int, expected: str
) -> None:
    p = measured_parts(decode_s, step_s, workers)
    assert compose(p).bottleneck == expected
    if workers == 0:  # at 0 workers the main thread does the loading: its share is the whole period
        assert p.loader.main_s == pytest.approx(p.loader.period_s, rel=0.2)
    else:  # with workers it only receives batches: waiting for them costs it nothing
        assert p.loader.main_s < 0.5 * p.loader.period_s


def test_the_step_beside_a_running_loader_is_timed_per_batch() -> None:
    loader = DataLoader(SleepyDataset(48, 0.0005), batch_size=8, num_workers=0)
    calls: list[float] = []

    def work() -> float:  # a step of known cost: 3 ms, returned as its seconds in the calls
        a = time.perf_counter()
        time.sleep(0.003)
        calls.append(time.perf_counter() - a)
        return calls[-1]

    out = measure_loader(loader, warmup=1, steps=4, device=CPU, beside=work, beside_s=0.0)
    assert out["beside_batches"] == 4 and len(calls) == 4 + 3  # three warm-up calls not counted
    assert out["beside_serial_s"] == pytest.approx(sum(calls[3:]) / 4)
    assert out["beside_serial_s"] >= 0.003
    assert measure_loader(loader, warmup=1, steps=4, device=CPU)["beside_serial_s"] is None


def test_the_step_measured_beside_the_loader_replaces_the_fed_cost() -> None:
    # alone the step's calls take 10 ms; beside this loader (its threads take the GIL) 13 ms: the loop's
    # main thread needs 0.2 + 13 ms per batch, and no idle-launch correction is added on top
    fed = FedTiming(10 * MS, 10 * MS, 10 * MS, idle_serial_s=14 * MS, idle_gap_s=20 * MS)
    loader = LoaderTiming(2 * MS, 0.2 * MS, in_caller=False, beside_serial_s=13 * MS)
    p = compose(LoopParts(100, 4, loader, fed))
    assert p.period_s == pytest.approx(13.2 * MS) and p.serial_s == pytest.approx(13 * MS)
    assert p.bottleneck == "host"


def test_the_loader_probed_around_a_zero_worker_run_replaces_its_parts_timing() -> None:
    # parts phase: 100 ms per batch in next(); probed around the run: 150 ms. The 0-worker run's main
    # thread needs 150 + 10 ms; the 4-worker run keeps its loader-alone timing (a probe there is ignored)
    ks = KindStages(
        loader={
            (0, True): LoaderTiming(100 * MS, 100 * MS, 1.6, in_caller=True),
            (4, True): LoaderTiming(50 * MS, 0.3 * MS, 0.2, in_caller=False),
        },
        fed={True: FedTiming(10 * MS, 10 * MS)},
    )
    probe = {"period_s": 0.15, "main_s": 0.15, "cpu_s": 2.4, "batches": 6}
    runs = [{**run("raw", 0, 600, pin=True), "loader_probe": probe}, {**run("raw", 4, 1900, pin=True)}]
    runs[1]["loader_probe"] = probe
    annotate_runs({"raw": ks}, runs, facts(cores=16))
    assert runs[0]["limits_ms"]["main"] == pytest.approx(160) and runs[0]["bottleneck"] == "transform"
    assert runs[0]["predicted_img_per_s"] == pytest.approx(100 / 0.160)
    assert runs[1]["limits_ms"]["producer"] == pytest.approx(50)


def test_the_step_probed_beside_a_loader_replaces_the_parts_phase_cost() -> None:
    # a resident loader (no worker processes, not in the caller): 15.5 ms of step calls beside it in the parts
    # phase, 12 ms in the probes around its run (round E's case). The host term is the probes' 12 ms, and the
    # producer keeps the parts phase (a probe without an alone pass does not touch it)
    ks = KindStages(
        loader={(0, True): LoaderTiming(1 * MS, 0.1 * MS, in_caller=False, beside_serial_s=15.5 * MS)},
        fed={True: FedTiming(11 * MS, 11 * MS)},
    )
    probe = {"beside_serial_s": 12 * MS, "beside_batches": 8}
    runs = [{**run("resident", 0, 40000, pin=True), "loader_probe": probe}]
    annotate_runs({"resident": ks}, runs, facts(cores=16))
    assert runs[0]["limits_ms"]["main"] == pytest.approx(12.1)
    assert runs[0]["limits_ms"]["producer"] == pytest.approx(1)
    runs[0]["loader_probe"] = None  # the model before: the parts phase
    annotate_runs({"resident": ks}, runs, facts(cores=16))
    assert runs[0]["limits_ms"]["main"] == pytest.approx(15.6)


def test_a_loader_probe_times_next_alone_and_the_step_beside_over_enough_batches_and_seconds() -> None:
    loader = DataLoader(SleepyDataset(64, 0.001), batch_size=4, num_workers=0)
    seen: list[int] = []

    def step(batch: Any) -> float:  # 2 ms of "step" on the loader's first batch, every time
        seen.append(int(batch[0].shape[0]))
        time.sleep(0.002)
        return 0.002

    out = probe_loader(loader, min_batches=3, min_s=0.05, device=CPU, beside=step)
    assert out["batches"] >= 3 and out["batches"] * out["period_s"] >= 0.05
    assert out["main_s"] == out["period_s"] >= 4 * 0.001  # four sleeping images per batch
    assert len(out["next_s"]) == out["batches"] and min(out["next_s"]) >= 4 * 0.001
    assert out["cpu_s"] >= 0 and out["cpu_ref_s"] > 0 and out["cpu_ref_after_s"] > 0
    # the beside pass: ≥ 3 timed steps after one warm-up, each after a next() of ≥ 4 ms, its cost the step's
    assert out["beside_batches"] >= 3 and len(seen) == out["beside_batches"] + 1 and set(seen) == {4}
    assert out["beside_serial_s"] == pytest.approx(0.002) and out["beside_next_s"] >= 4 * 0.001
    assert out["order"] == "alone-beside" and out["wall_s"] >= (out["batches"] + 1) * 4 * 0.001
    # the mirrored order after a run; a loader not working in the caller gets the beside pass only
    after = probe_loader(
        loader, min_batches=3, min_s=0.0, device=CPU, beside=step, alone=False, beside_first=True
    )
    assert "main_s" not in after and after["beside_batches"] == 3 and after["order"] == "beside-alone"


def test_probes_pool_per_batch_over_repeats_before_and_after() -> None:
    a, b = RunResult("raw", 0, True, 0, 0), RunResult("raw", 0, True, 1, 0)
    a.loader_probe = {"period_s": 0.1, "main_s": 0.1, "cpu_s": 1.0, "batches": 6, "when": "before"}
    a.loader_probe_after = {"period_s": 0.3, "main_s": 0.3, "cpu_s": 3.0, "batches": 2, "when": "after",
                            "beside_serial_s": 0.02, "beside_batches": 4}  # fmt: skip
    b.loader_probe = {"period_s": 0.2, "main_s": 0.2, "cpu_s": 2.0, "batches": 2, "beside_serial_s": 0.01,
                      "beside_batches": 4}  # fmt: skip
    pooled = pool_probes([a, b])
    assert pooled is not None and pooled["batches"] == 10 and len(pooled["samples"]) == 3
    assert pooled["period_s"] == pytest.approx((6 * 0.1 + 2 * 0.3 + 2 * 0.2) / 10)
    assert pooled["cpu_s"] == pytest.approx((6 * 1.0 + 2 * 3.0 + 2 * 2.0) / 10)
    assert pooled["beside_serial_s"] == pytest.approx(0.015) and pooled["beside_batches"] == 8
    only_beside = RunResult("resident", 0, True, 0, 0)
    only_beside.loader_probe = {"beside_serial_s": 0.01, "beside_batches": 4}
    pooled = pool_probes([only_beside])
    assert pooled is not None and "period_s" not in pooled and pooled["beside_serial_s"] == 0.01
    assert pool_probes([RunResult("raw", 4, True, 0, 0)]) is None


def test_fed_step_with_a_delay_measures_the_serial_cost() -> None:
    out = measure_fed(
        sleepy_step(0.003), (torch.zeros(2), torch.zeros(2)), lambda b: b, CPU, 1, 4, delay_s=0.002
    )
    assert out["delay_s"] >= 0.002 and out["serial_s"] >= 0.003
    assert out["period_s"] == pytest.approx(out["serial_s"] + out["delay_s"])


# --- analysis -----------------------------------------------------------------------------------------


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
    return Facts(device=device, device_label=device, batch_size=100, pin_default=device == "cuda", **kw)


def stages_of(
    loader_ms: dict[int, float], main_ms: dict[int, float], fed_ms: float, serial_ms: float, **kw: Any
) -> KindStages:
    return KindStages(
        transform_by_workers={w: 100 / (ms * MS) for w, ms in loader_ms.items()},
        loader={(w, True): LoaderTiming(ms * MS, main_ms[w] * MS) for w, ms in loader_ms.items()},
        fed={True: FedTiming(fed_ms * MS, serial_ms * MS)},
        compute=100 / (fed_ms * MS),
        **kw,
    )


def test_analysis_predicts_each_run_and_advises_the_best_configuration() -> None:
    stages = {
        "raw": stages_of({0: 200, 4: 55}, {0: 200, 4: 0.5}, fed_ms=5, serial_ms=2),  # decode-bound
        "ram": stages_of({0: 1, 4: 2}, {0: 1, 4: 0.3}, fed_ms=5, serial_ms=2),  # GPU-bound
    }
    runs = [
        run("raw", 0, 480, True),
        run("raw", 4, 1_800, True),
        run("ram", 0, 19_000, True),
        run("ram", 4, 18_500, True),
    ]
    out = analyse(
        stages, runs, {}, facts(size=64, apply={"ram": "dlstore convert demo DEST --format ram --size 64"})
    )
    by = {(r["loader"], r["workers"]): r for r in runs}
    assert by[("raw", 0)]["predicted_img_per_s"] == pytest.approx(100 / 0.202)  # serial: 200 + 2 ms
    assert by[("raw", 4)]["bottleneck"] == "transform" and by[("ram", 0)]["bottleneck"] == "compute"
    assert by[("ram", 0)]["predicted_img_per_s"] == pytest.approx(20_000)  # max(5, 1 + 2) ms
    assert by[("ram", 0)]["budget_ms"]["predicted"]["host_ms"] == pytest.approx(2)
    first = out["advice"][0]
    assert "Use ram" in first["text"] and "--format ram" in first["command"]
    assert first["gain"] == pytest.approx(19_000 / 480)
    assert out["kinds"]["raw"]["best_workers"] == 4 and out["kinds"]["ram"]["bottleneck"] == "compute"
    assert any(r.startswith("The training step binds at 19,000 img/s") for r in out["recommendations"])
    # one sentence first: what binds the default, by how much, the best fix and its measured gain
    assert out["verdict"] == (
        "Preparing the images on the CPU (decode and transform) for raw with 0 workers binds: the loop runs "
        "480 img/s and waits for data 10% of the time, where the step alone runs 20,000 img/s; best fix: "
        "the ram loader, measured 19,000 img/s (39.6× now)."
    )
    assert out["prediction"]["runs"] == 4 and out["default"]["loader"] == "raw"


def test_recommendations_are_ranked_and_capped() -> None:
    advice = [{"text": str(g), "gain": g} for g in (1.2, None, 5.0, 2.0, 1.1, 3.0, 1.5)]
    ranked = rank(advice)
    assert [a["gain"] for a in ranked] == [5.0, 3.0, 2.0, 1.5, 1.2] and len(ranked) == MAX_RECOMMENDATIONS


def test_host_bound_best_configuration_is_advised() -> None:
    stages = {"pinned": stages_of({0: 0.2}, {0: 0.1}, fed_ms=1, serial_ms=3)}
    runs = [run("pinned", 0, 32_000, True)]
    out = analyse(stages, runs, {}, facts())
    assert runs[0]["bottleneck"] == "host"
    assert any(
        "main thread's own work per step binds" in r and "--batch-size 200" in r
        for r in out["recommendations"]
    )


def test_a_loop_as_fast_as_the_step_alone_is_named_compute() -> None:
    """Held out on the H200: a ResNet-50 loop ran 2,375 img/s, the step alone 2,364; the parts put the main
    thread first (host). A loop that runs as fast as its step alone is bound by the step: "compute"."""
    ks = stages_of({0: 1.0}, {0: 0.5}, fed_ms=40, serial_ms=41.5)
    ks.compute = 2_364.0
    runs = [run("ram", 0, 2_375, True)]
    out = analyse({"ram": ks}, runs, {}, facts())
    assert (
        runs[0]["bottleneck"] == "compute" and runs[0]["limits_ms"]["main"] > runs[0]["limits_ms"]["device"]
    )
    assert out["verdict"].startswith(
        "The training step binds: the loop runs 2,375 img/s, as fast as the step alone"
    )
    assert "Preparing" not in out["verdict"] and "host" not in out["verdict"]
    # well below the step alone, the same parts keep the model's name
    slow = [run("ram", 0, 1_900, True)]
    analyse({"ram": ks}, slow, {}, facts())
    assert slow[0]["bottleneck"] == "host"


def test_a_compute_lead_claims_the_step_alone_only_when_the_loop_keeps_up_with_it() -> None:
    """Watch's CPU dry run: a 0-worker loop named "compute" ran 848 img/s, its step alone 1,384 and its
    loader alone 2,539 (they took turns); the lead said "as fast as the step alone ... needs no change"
    beside advice of 1 worker at 1.3x."""
    best = {"what": "1 DataLoader worker", "expected_img_per_s": 1085.0, "gain": 1.28}
    slow = lead("compute", 848.0, 1384.0, 0.33, best)
    assert "as fast as" not in slow and "needs no change" not in slow
    assert slow.startswith(
        "The training step binds: the loop runs 848 img/s, where the step alone runs 1,384"
    )
    assert "best fix: 1 DataLoader worker, predicted 1,085 img/s" in slow
    assert "as fast as the step alone (1,384 img/s)" in lead("compute", 1380.0, 1384.0, 0.01, None)


def test_knee_and_kind_summary_fold_the_sweep() -> None:
    sweep = [run("raw", 0, 400), run("raw", 2, 960), run("raw", 4, 1000), run("raw", 8, 700)]
    for r in sweep:
        r.update(bottleneck="transform", predicted_img_per_s=r["img_per_s"], prediction_error=0.0)
    k = knee(sweep)
    assert k["knee_workers"] == 2 and k["best_workers"] == 4
    assert [h["workers"] for h in k["hurts"]] == [8]
    s = kind_summary(sweep)
    assert s["by_workers"] == {0: 400, 2: 960, 4: 1000, 8: 700} and s["bottleneck"] == "transform"


def test_read_bound_advice_weighs_a_raw_cache_against_available_memory() -> None:
    ks = stages_of({0: 1}, {0: 1}, fed_ms=5, serial_ms=2, read_limit=900.0)
    best = {"loader": "zarr"}
    fits = read_advice(best, ks, facts(size=256, raw_cache_bytes=8 * 10**9, mem_available=20 * 10**9))
    assert "--codec" not in fits["command"] and "RAM cache" in fits["text"]
    unknown = read_advice(best, ks, facts(size=256, raw_cache_bytes=8 * 10**9))
    assert unknown["command"] == fits["command"]
    too_big = read_advice(best, ks, facts(size=256, raw_cache_bytes=190 * 10**9, mem_available=64 * 10**9))
    assert "--size 256 --format npz --codec jpeg --resize shorter" in too_big["command"]
    assert "190.0 GB" in too_big["command"] and "64.0 GB" in too_big["command"]
    assert FAST_LOADER in too_big["command"] and "does not fit" in too_big["text"]


def test_a_kind_that_ran_another_transform_says_so_in_its_advice_and_the_verdict() -> None:
    """Issue 22 item 2: the pinned kind runs GpuAugment where --transform augment asked for the CPU's."""
    stages = {
        "raw": stages_of({0: 200, 4: 55}, {0: 200, 4: 0.5}, fed_ms=5, serial_ms=2),
        "pinned": stages_of({0: 1}, {0: 1}, fed_ms=5, serial_ms=2),
    }
    runs = [run("raw", 0, 480, True), run("raw", 4, 1_800, True), run("pinned", 0, 19_000, True)]
    note = "ran GpuAugment on the device in place of the CPU augmentation asked for (--transform augment)"
    out = analyse(
        stages, runs, {}, facts(apply={"pinned": "PinnedLoader(DEST, 100)"}, substituted={"pinned": note})
    )
    first = out["recommendations"][0]
    assert first.startswith("Use pinned") and note in first
    assert note in out["detail"]


def test_one_bottleneck_per_verdict() -> None:
    """A run the model names compute-bound never reads 'does not get data fast enough' in the same verdict."""
    stages = {"ram": stages_of({0: 1}, {0: 1}, fed_ms=5, serial_ms=2)}
    runs = [run("ram", 0, 9_000, True)]  # the model says the step, but well below the 20,000 it sustains
    out = analyse(stages, runs, {}, facts())
    assert runs[0]["bottleneck"] == "shared"  # the parts slow each other: neither the step nor the input
    assert "training step binds" not in out["verdict"] and out["verdict"].startswith(
        "Contention between the parts running together"
    )
    assert "no single change is sure to help" in out["detail"]


def test_the_jpeg_gpu_sweep_over_cpu_decoders_recommends_the_lanes_for_the_model() -> None:
    """Issue 27 item 5: on a GPU, jpeg-gpu's worker count is DecodeLoader's CPU decoders beside nvJPEG:
    the advice names the lanes and cpu_decoders measured best (the fewest within 5% of the fastest) as
    a DecodeLoader call, in the text and the JSON, and never a DataLoader worker count."""
    stages = {
        "raw": stages_of({0: 200, 4: 55}, {0: 200, 4: 0.5}, fed_ms=5, serial_ms=2),
        "jpeg-gpu": stages_of({0: 20, 4: 12, 12: 6}, {0: 1, 4: 1, 12: 1}, fed_ms=5, serial_ms=2),
    }
    runs = [
        run("raw", 0, 480, True),
        run("raw", 4, 1_800, True),
        run("jpeg-gpu", 0, 5_000, True),
        run("jpeg-gpu", 4, 9_000, True),
        run("jpeg-gpu", 12, 16_000, True),
    ]
    out = analyse(stages, runs, {}, facts(cpu_decoder_kinds=frozenset({"jpeg-gpu"})))
    lanes = out["lanes"]["jpeg-gpu"]
    assert lanes["lanes"] == ["cpu", "hw", "nvjpeg"] and lanes["cpu_decoders"] == 12
    assert lanes["by_cpu_decoders"] == {0: 5_000, 4: 9_000, 12: 16_000}
    first = out["recommendations"][0]
    assert "Use jpeg-gpu with nvJPEG + 12 CPU decoders" in first
    assert (
        "dlstore.Loader(cache, 100, transform=crop, cpu_decoders=12, lanes=['cpu', 'hw', 'nvjpeg'])" in first
    )
    assert "num_workers=12" not in first and "nvJPEG + 12 CPU decoders" in out["detail"]
    # where the CPU decoders do not help, nvJPEG alone is what it recommends
    slow = [run("jpeg-gpu", 0, 16_000, True), run("jpeg-gpu", 12, 15_900, True)]
    out = analyse(
        {"jpeg-gpu": stages["jpeg-gpu"]}, slow, {}, facts(cpu_decoder_kinds=frozenset({"jpeg-gpu"}))
    )
    assert out["lanes"]["jpeg-gpu"] | {"by_cpu_decoders": None, "img_per_s": None} == {
        "lanes": ["hw", "nvjpeg"],
        "cpu_decoders": 0,
        "by_cpu_decoders": None,
        "img_per_s": None,
        "code": f"{FAST_LOADER}(cache, 100, transform=crop, cpu_decoders=0, lanes=['hw', 'nvjpeg'])",
    }
