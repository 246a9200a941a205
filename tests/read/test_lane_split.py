"""The split of a batch over decode lanes (dlstore.read.decode.split), with fake lane rates: pure logic, no
decoding. The loop that feeds it from a real DecodeLoader is tested in test_gpu_decode.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dlstore.read.decode.split import MARGIN, Busy, LaneSplit, decode_parts

RATES = {"cpu": 40_000.0, "hw": 25_000.0, "nvjpeg": 27_000.0}  # img/s of each lane's own busy time


def feed(split: LaneSplit, rates: dict[str, float], batch: int, step: float) -> float:
    """One simulated batch: each lane decodes its count at its rate, all at once; the batch takes the
    slowest lane's time or the step's, whichever is longer. Returns the batch period."""
    counts = split.counts(batch)
    busy = {n: counts[n] / rates[n] for n in counts}
    period = max(step, *busy.values())
    for n, k in counts.items():
        split.observe(n, k, busy[n], period=period)
    split.period(period)
    return period


def settle(split: LaneSplit, rates: dict[str, float], batch: int, step: float, batches: int = 60) -> float:
    for _ in range(batches):
        period = feed(split, rates, batch, step)
    return period


def best_fixed(rates: dict[str, float], batch: int, step: float) -> float:
    """The shortest period any fixed split (steps of 1/32 of the batch) gives the same lanes."""
    best = float("inf")
    grid = range(0, batch + 1, batch // 32)
    for a in grid:
        for b in grid:
            if a + b <= batch:
                counts = {"cpu": a, "hw": b, "nvjpeg": batch - a - b}
                best = min(best, max(step, *(counts[n] / rates[n] for n in counts)))
    return best


def test_loader_bound_lanes_finish_each_batch_together() -> None:
    """A step faster than the lanes: each lane takes a part in proportion to its rate, and the batch
    takes what all three lanes together need (within 5% of the best fixed split's period)."""
    split = LaneSplit(["cpu", "hw", "nvjpeg"])
    period = settle(split, RATES, 512, step=0.001)
    counts = split.counts(512)
    assert sum(counts.values()) == 512
    total = sum(RATES.values())
    for n, k in counts.items():
        assert abs(k / 512 - RATES[n] / total) < 0.02, counts
    assert period <= 1.05 * best_fixed(RATES, 512, 0.001)


@pytest.mark.parametrize("step", [0.008, 0.011, 0.030])
def test_consumer_bound_fills_the_cheapest_lane_first(step: float) -> None:
    """A step slower than the lanes: the CPU lane (first) takes what it decodes in MARGIN of a step,
    the hardware lane next, nvJPEG the rest; the loader never makes the step wait (period = step)."""
    split = LaneSplit(["cpu", "hw", "nvjpeg"])
    period = settle(split, RATES, 512, step)
    counts = split.counts(512)
    cpu_capacity = MARGIN * step * RATES["cpu"]
    if cpu_capacity >= 512:
        assert counts == {"cpu": 512, "hw": 0, "nvjpeg": 0}
    else:
        assert abs(counts["cpu"] - cpu_capacity) <= 0.1 * 512, counts
    assert period <= 1.05 * best_fixed(RATES, 512, step)


def test_cpu_starved_split_within_5_percent_of_the_best_fixed() -> None:
    """Two CPU decoders (a slow CPU lane) beside a fast step: the split leans on the GPU lanes and the
    period stays within 5% of the best fixed split's."""
    rates = {"cpu": 4_000.0, "hw": 25_000.0, "nvjpeg": 27_000.0}
    for step in (0.002, 0.010, 0.020):
        split = LaneSplit(["cpu", "hw", "nvjpeg"])
        assert settle(split, rates, 512, step) <= 1.05 * best_fixed(rates, 512, step)


def test_the_split_follows_a_change_in_the_steps_cpu_use() -> None:
    """The step starts using more CPU (the CPU lane slows to a quarter): the CPU's part shrinks to its
    new capacity and the GPU lanes take the rest; when the step lets go, the CPU takes it back."""
    split = LaneSplit(["cpu", "hw", "nvjpeg"])
    settle(split, RATES, 512, step=0.011)
    before = split.counts(512)["cpu"]
    slow = dict(RATES, cpu=RATES["cpu"] / 4)
    period = settle(split, slow, 512, step=0.011)
    during = split.counts(512)["cpu"]
    assert during < 0.5 * before
    assert period <= 1.05 * best_fixed(slow, 512, 0.011)
    settle(split, RATES, 512, step=0.011)
    assert split.counts(512)["cpu"] >= 0.9 * before


def test_a_small_last_part_goes_to_the_lanes_before() -> None:
    split = LaneSplit(["cpu", "nvjpeg"])
    settle(split, {"cpu": 40_000.0, "nvjpeg": 27_000.0}, 512, step=0.014)  # CPU decodes ~476 in 0.85 step
    assert split.counts(512) == {"cpu": 512, "nvjpeg": 0}


def test_a_fixed_split_is_exact_and_checked() -> None:
    split = LaneSplit(["cpu", "hw", "nvjpeg"], fixed={"cpu": 0.5, "hw": 0.25, "nvjpeg": 0.25})
    for batch in (1, 7, 256, 513):
        counts = split.counts(batch)
        assert sum(counts.values()) == batch
        assert abs(counts["cpu"] - 0.5 * batch) <= 1
    with pytest.raises(ValueError, match="fixed split"):
        LaneSplit(["cpu", "nvjpeg"], fixed={"hw": 1.0})
    split.fail("cpu", "gone")  # its share goes to the next live lane, as its images do: nvJPEG keeps 25%
    assert split.counts(100) == {"cpu": 0, "hw": 75, "nvjpeg": 25}


def test_a_lane_that_fails_mid_epoch_loses_and_repeats_no_image() -> None:
    """Fake lanes decode an epoch of numbered images in batches; the hardware lane raises at its 4th
    call. Its part of that batch goes to the next lane, is counted, and from then on the split gives it
    nothing: every image comes back exactly once, in its place."""
    split = LaneSplit(["hw", "nvjpeg"])
    epoch, batch = list(range(1000)), 64
    calls = {"hw": 0, "nvjpeg": 0}
    decoded_by: dict[int, str] = {}

    def lane(name: str, data: list[int]):  # type: ignore[no-untyped-def]
        def decode(a: int, b: int) -> list[int]:
            calls[name] += 1
            if name == "hw" and calls[name] == 4:
                raise RuntimeError("NVJPG: engine error")
            for x in data[a:b]:
                decoded_by[x] = name
            return Busy(data[a:b], (b - a) / 20_000)  # a stated busy time: the split cannot ride on load

        return decode

    out: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        for start in range(0, len(epoch), batch):
            data = epoch[start : start + batch]
            counts = split.counts(len(data))
            parts = [("hw", 0, counts["hw"]), ("nvjpeg", counts["hw"], len(data))]
            lanes = {n: lane(n, data) for n in ("hw", "nvjpeg")}
            failed_part = counts["hw"] if calls["hw"] == 3 else 0
            out += decode_parts(split, parts, lanes, lambda a, b: pytest.fail("no fallback"), pool)
            if failed_part:
                rerouted = failed_part
    assert out == epoch  # none lost, none repeated, each in its place
    hw = split.state["hw"]
    assert not hw.alive and "engine error" in hw.error
    assert hw.rerouted == rerouted > 0
    assert split.counts(64) == {"hw": 0, "nvjpeg": 64}
    assert sum(1 for x in epoch if decoded_by[x] == "hw") == hw.images


def test_refused_images_go_to_the_fallback_counted() -> None:
    split = LaneSplit(["hw", "nvjpeg"])

    def hw(a: int, b: int) -> list[int | None]:
        return [None if x % 3 == 0 else x for x in range(a, b)]

    out = decode_parts(
        split,
        [("hw", 0, 6), ("nvjpeg", 6, 9)],
        {"hw": hw, "nvjpeg": lambda a, b: list(range(a, b))},
        lambda a, b: [-x for x in range(a, b)],
    )
    assert out == [0, 1, 2, -3, 4, 5, 6, 7, 8]
    assert out[0] == 0  # x=0 is refused too: -0 == 0
    assert split.state["hw"].rerouted == 2 and split.state["hw"].images == 4


def test_lanes_with_a_fixed_cost_per_call_within_5_percent_of_the_best_fixed() -> None:
    """Device calls cost a fixed time however few images they carry (here 3 ms for the hardware lane,
    1 ms for nvJPEG) and timings are noisy (±5%): the fitted split stays within 5% of the best fixed
    split of each lane set, loader-bound and consumer-bound, and the faster GPU lane keeps the larger
    part."""
    import itertools
    import random

    fixed = {"cpu": 0.0, "hw": 0.003, "nvjpeg": 0.001}
    rates = {"cpu": 40e3, "hw": 26e3, "nvjpeg": 37e3}

    def seconds(lane: str, n: int) -> float:
        return fixed[lane] + n / rates[lane] if n else 0.0

    def best(lanes: list[str], step: float) -> float:
        grid = range(0, 513, 8)
        periods = (
            max(step, *(seconds(n, k) for n, k in zip(lanes, [*combo, 512 - sum(combo)])))
            for combo in itertools.product(grid, repeat=len(lanes) - 1)
            if sum(combo) <= 512
        )
        return min(periods)

    rng = random.Random(0)
    for lanes in (["hw", "nvjpeg"], ["cpu", "hw", "nvjpeg"], ["cpu", "nvjpeg"]):
        for step in (0.001, 0.011, 0.030):
            split = LaneSplit(lanes)
            for _ in range(80):
                counts = split.counts(512)
                busy = {n: seconds(n, counts[n]) * (1 + rng.uniform(-0.05, 0.05)) for n in lanes}
                period = max(step, *busy.values())
                for n in lanes:
                    split.observe(n, counts[n], busy[n], period=period)
                split.period(period)
            counts = split.counts(512)
            period = max(step, *(seconds(n, counts[n]) for n in lanes))
            assert period <= 1.05 * best(lanes, step), (lanes, step, counts)
            if lanes == ["hw", "nvjpeg"] and step < 0.01:
                assert counts["nvjpeg"] > counts["hw"] > 0.2 * 512


def loop(
    split: LaneSplit, rates: dict[str, float], cost: float, step: float, batches: int, rng: Any
) -> list[float]:
    """A simulated training loop with the loader's read-ahead (each batch split 5 batches before it is
    consumed) and what the model cannot see: a GPU lane's decode also slows the step by ``cost`` of its
    own time (kernels beside the step's). Timings ±3% noise. Returns each batch's loop period."""
    ahead = [split.counts(512) for _ in range(5)]
    out = []
    for i in range(batches):
        ahead.append(split.counts(512))
        counts = ahead.pop(0)
        busy = {n: counts[n] / rates[n] * rng.uniform(0.97, 1.03) for n in counts}
        own = step * rng.uniform(0.97, 1.03) + cost * sum(v for n, v in busy.items() if n != "cpu")
        wall = max(own, *busy.values())
        for n, k in counts.items():
            split.observe(n, k, busy[n], period=wall)
        split.period(own)
        split.loop_period(None if i < 5 else wall)
        out.append(wall)
    return out


def best_share(rates: dict[str, float], cost: float, step: float) -> float:
    """The shortest loop period of any fixed CPU share (1/64 steps) of ["cpu", "nvjpeg"]."""
    periods = []
    for k in range(0, 513, 8):
        busy = {"cpu": k / rates["cpu"], "nvjpeg": (512 - k) / rates["nvjpeg"]}
        periods.append(max(step + cost * busy["nvjpeg"], *busy.values()))
    return min(periods)


@pytest.mark.parametrize(
    ("cpu_rate", "cost", "step"),
    [
        (40_000.0, 0.8, 0.010),
        (40_000.0, 0.5, 0.004),
        (7_000.0, 0.5, 0.010),
        (20_000.0, 0.3, 0.030),
        (4_000.0, 0.2, 0.002),
    ],
)
def test_tuned_split_within_5_percent_of_the_best_fixed_where_the_model_is_not(
    cpu_rate: float, cost: float, step: float
) -> None:
    """The GPU lane costs the step part of its decode time, which the rate model does not see: the tuner
    (hill climbing on the loop's own period) ends within 5% of the best fixed share, 12 or 2 CPU
    decoders, step-bound or loader-bound."""
    import random

    rates = {"cpu": cpu_rate, "nvjpeg": 27_000.0}
    best = best_share(rates, cost, step)
    split = LaneSplit(["cpu", "nvjpeg"])
    periods = loop(split, rates, cost, step, 400, random.Random(1))
    assert sum(periods[-100:]) / 100 <= 1.05 * best, (split.counts(512), split.tuner)


def test_model_alone_misses_where_the_tuner_finds_it() -> None:
    """The case above that the rate model alone gets wrong (> 5% slower than the best fixed share)."""
    import random

    rates = {"cpu": 40_000.0, "nvjpeg": 27_000.0}
    best = best_share(rates, 0.8, 0.010)
    periods = loop(LaneSplit(["cpu", "nvjpeg"], tune=False), rates, 0.8, 0.010, 400, random.Random(1))
    assert sum(periods[-100:]) / 100 > 1.05 * best


def test_tuned_split_follows_a_change_in_the_step() -> None:
    """The step starts using CPU (the CPU lane slows to a third): within 400 batches the tuned split is
    within 5% of the new best fixed share."""
    import random

    rng = random.Random(2)
    split = LaneSplit(["cpu", "nvjpeg"])
    loop(split, {"cpu": 40_000.0, "nvjpeg": 27_000.0}, 0.8, 0.010, 300, rng)
    slow = {"cpu": 13_000.0, "nvjpeg": 27_000.0}
    periods = loop(split, slow, 0.8, 0.010, 400, rng)
    assert sum(periods[-100:]) / 100 <= 1.05 * best_share(slow, 0.8, 0.010), split.counts(512)
