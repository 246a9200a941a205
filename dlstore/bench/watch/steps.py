"""Per-step numbers from a loader's raw record, and their summaries by phase. Pure functions."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from dlstore.bench.protocol import percentile


def step_rows(loader: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per step: phase, epoch, wait, host work, period, device span and device wait (seconds)."""
    rows = []
    device = loader.get("device_s") or [None] * len(loader["t_call"])
    gap = loader.get("device_gap_s") or [None] * len(loader["t_call"])
    warm = set(loader.get("window_warm") or ())
    firsts = {e["first_step"] for e in loader.get("epochs", [])}
    for i, (tc, tr, tn) in enumerate(zip(loader["t_call"], loader["t_ret"], loader["t_next"])):
        rows.append(
            {
                "step": i,
                "epoch": loader["epoch"][i],
                "phase": loader["phase"][i],
                "t_s": tc,
                "wait_s": tr - tc,
                "host_s": None if tn is None else tn - tr,
                "period_s": None if tn is None else tn - tc,
                "device_s": device[i],
                "device_wait_s": gap[i],
                "warm": i in warm,  # a replay's or trial's warm-up step, not timed
                "epoch_first": i in firsts,
            }
        )
    return rows


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def block_period(periods: Sequence[float], blocks: int = 3) -> float:
    """The median of the mean periods of ``blocks`` consecutive blocks of steps: a window's steady period,
    one slow block (a collection, a clock change) left out."""
    n = len(periods)
    if n < blocks:
        return sum(periods) / n
    cuts = [b * n // blocks for b in range(blocks + 1)]
    return sorted(sum(periods[a:b]) / (b - a) for a, b in zip(cuts, cuts[1:]))[blocks // 2]


def summarise(
    rows: Sequence[dict[str, Any]], images: int | None, blocks: bool = False
) -> dict[str, Any] | None:
    """Σwait/Σperiod, means and p95 of a group of steps (those with a complete period only); ``blocks``:
    the period is the median of three blocks' (a window watch fed, ``block_period``)."""
    done = [r for r in rows if r["period_s"] is not None]
    if not done:
        return None
    wait, periods = [r["wait_s"] for r in done], [r["period_s"] for r in done]
    mean_period = sum(periods) / len(done)
    period = block_period(periods) if blocks else mean_period
    device = [r["device_s"] for r in done if r["device_s"] is not None]
    dwait = [r["device_wait_s"] for r in done if r["device_wait_s"] is not None]
    return {
        "steps": len(done),
        "period_s": period,
        "period_mean_s": mean_period,
        "img_per_s": images / period if images and period > 0 else None,
        "wait_share": sum(wait) / sum(periods) if period > 0 else 0.0,
        "wait_mean_s": mean(wait),
        "wait_p50_s": percentile(wait, 50),
        "wait_p95_s": percentile(wait, 95),
        "wait_p10_s": percentile(wait, 10),
        "host_mean_s": mean([r["host_s"] for r in done]),
        "device_mean_s": mean(device),
        "device_wait_share": sum(dwait) / sum(periods) if dwait else None,
        "t_first_s": done[0]["t_s"],
        "t_last_s": done[-1]["t_s"] + done[-1]["period_s"],
    }


def group(row: dict[str, Any]) -> str:
    """The summary a step counts in: its phase, but a later epoch's first real step is that epoch's
    start-up (``start``), kept out of the steady figure: it costs once an epoch (``epoch_start_excess``)."""
    if row["phase"] == "real" and row["epoch_first"] and row["epoch"] > 0:
        return "start"
    return row["phase"]


def by_phase(rows: Sequence[dict[str, Any]], images: int | None) -> dict[str, Any]:
    """Summaries of the warm-up, the steady real steps, the later epochs' starts, the replayed steps and
    the trial's (their timed steps: warm-up left out), and the refill after them."""
    out: dict[str, Any] = {}
    for phase in ("warmup", "real", "start", "replay", "trial", "refill", "profiled"):
        fed = phase in ("replay", "trial")
        # the replay's period by blocks (a slow block left out); the trial's is its mean: its loader's
        # epoch ends (a refill every epoch) recur and are part of the rate it reaches
        s = summarise(
            [r for r in rows if group(r) == phase and not (fed and r["warm"])], images, phase == "replay"
        )
        if s is not None:
            out[phase] = s
    if "replay" in out:
        _replay_rounds(out["replay"], rows, images)
    return out


def _replay_rounds(replay: dict[str, Any], rows: Sequence[dict[str, Any]], images: int | None) -> None:
    """With several replay rounds: each round's steady period (``rounds``), and the replay's period the
    median round's (a round on a slow stretch of a shared machine left out)."""
    runs = [list(run) for inside, run in groupby(rows, key=lambda r: r["phase"] == "replay") if inside]
    rounds = [summarise([r for r in run if not r["warm"]], images, True) for run in runs]
    done = [r for r in rounds if r is not None]
    if len(done) < 2:
        return
    replay["rounds"] = [{k: r[k] for k in ("steps", "period_s", "img_per_s", "t_first_s")} for r in done]
    period = statistics.median(r["period_s"] for r in done)
    replay["period_s"] = period
    replay["img_per_s"] = images / period if images and period > 0 else None


def epoch_start_excess(rows: Sequence[dict[str, Any]], steady_wait: float | None) -> float | None:
    """Mean extra wait of an epoch's first step beyond the steady wait, after the first epoch (worker
    start-up each epoch when workers are not persistent); the first epoch's is counted too when it is
    the only one (its start is the same cost)."""
    firsts = [r for r in rows if r["epoch_first"] and r["phase"] not in ("replay", "trial")]
    later = [r for r in firsts if r["epoch"] > 0] or firsts
    if not later or steady_wait is None:
        return None
    return max(0.0, sum(r["wait_s"] for r in later) / len(later) - steady_wait)


def slope(samples: Sequence[Sequence[float | None]], t0: float, t1: float, column: int) -> float | None:
    """Rate of change of a cumulative column over [t0, t1] (e.g. CPU seconds per second = cores busy)."""
    inside = [s for s in samples if s[column] is not None and t0 - 0.6 <= s[0] <= t1 + 0.6]  # type: ignore[operator]
    # samples come every ~0.5 s: a rate over less than a second of them is noise, not a figure
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < max(1.0, 0.5 * (t1 - t0)):  # type: ignore[operator]
        return None
    return (inside[-1][column] - inside[0][column]) / (inside[-1][0] - inside[0][0])  # type: ignore[operator]


def window_mean(samples: Sequence[Sequence[float | None]], t0: float, t1: float, column: int) -> float | None:
    vals = [s[column] for s in samples if s[column] is not None and t0 <= s[0] <= t1]  # type: ignore[operator]
    return mean(vals) if vals else None  # type: ignore[arg-type]


def window_max(samples: Sequence[Sequence[float | None]], column: int) -> float | None:
    vals = [s[column] for s in samples if s[column] is not None]
    return max(vals) if vals else None  # type: ignore[type-var]
