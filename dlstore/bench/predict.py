"""The loop's rate predicted from parts measured alone, composed the way the loop runs. Pure functions.

A loop ``for x, y in loader: copy; step`` has three workers per batch: the **producer** (DataLoader workers or
a loader's thread, ``loader.period_s``), the **main thread** (its share of the loader's work, all of it at 0
workers, plus its own serial cost per step: loop, copy call, launches, any sync; ``fed.serial_s``) and the
**device** (copy + step with data free, ``fed.period_s``). They overlap, so the period is the largest of
those, of all their CPU work spread over the usable cores, and of a per-epoch storage read when the data
outgrows the page cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# What a run can be limited by, as the verdict names it.
BOTTLENECKS = ("read", "transform", "host", "h2d", "compute", "cores", "shared")


@dataclass(frozen=True)
class LoaderTiming:
    """The loader alone, per batch: its period, the main thread's share, its CPU seconds (all processes)."""

    period_s: float
    main_s: float
    cpu_s: float = 0.0
    in_caller: bool = True  # the loader works in next() on the main thread (a DataLoader with 0 workers)
    refill_s: float | None = None  # a restart's first batch (epoch end: drain, refill), when measured
    epoch_batches: int | None = None
    # the main thread's copy + step per batch while this loader runs beside it; None when not measured
    beside_serial_s: float | None = None

    def epoch_refill(self) -> tuple[float, float] | None:
        """(refill, steady period): an epoch of E batches takes refill + (E − 1) × steady, loader alone."""
        e = self.epoch_batches
        if self.in_caller or self.refill_s is None or not e or e < 2:
            return None
        return self.refill_s, max(0.0, (e * self.period_s - self.refill_s) / (e - 1))


@dataclass(frozen=True)
class FedTiming:
    """The step fed from a collated batch, per batch: ``period_s`` with data free, ``serial_s`` the main
    thread's own cost with the device busy, ``device_s`` the device time (None on a CPU), ``idle_serial_s``
    that cost after the device idled ``idle_gap_s`` (None when not measured)."""

    period_s: float
    serial_s: float
    device_s: float | None = None
    idle_serial_s: float | None = None
    idle_gap_s: float | None = None

    def serial_at(self, gap_s: float) -> float:
        """The main thread's cost per step after the device idled ``gap_s`` (linear up to the probe's gap)."""
        if self.idle_serial_s is None or self.idle_serial_s <= self.serial_s:
            return self.serial_s
        # unrecorded in older documents: one device period
        probe_gap = self.idle_gap_s if self.idle_gap_s and self.idle_gap_s > 0 else self.period_s
        share = min(1.0, max(0.0, gap_s) / probe_gap) if probe_gap > 0 else 1.0
        return self.serial_s + share * (self.idle_serial_s - self.serial_s)


def over_epochs(
    loader: LoaderTiming, workers: int, epoch: int | None, startup_s: float = 0.0
) -> LoaderTiming:
    """The loader over epochs of ``epoch`` batches: each starts empty (plus ``startup_s`` unless workers
    persist) and its N workers deliver N batches per build time; prefetch_factor is not a term."""
    if loader.in_caller or not workers or not epoch or epoch < 2:
        return loader
    build = loader.period_s * workers
    total = startup_s + math.ceil(epoch / workers) * build
    return replace(loader, period_s=total / epoch, refill_s=startup_s + build, epoch_batches=epoch)


def _pooled(windows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The per-batch mean of ``key`` over timing windows, each weighted by its batches."""
    got = [(w[key], w.get("batches") or 1) for w in windows if w.get(key) is not None]
    n = sum(b for _, b in got)
    return sum(v * b for v, b in got) / n if n else None


def fed_timing(samples: Sequence[Mapping[str, Any]]) -> FedTiming | None:
    """One ``FedTiming`` from the fed-step probe's samples (``free``: the bare fed loop; in older documents
    also ``loop``, the real loop's code, and ``idle``, the device idle before each step). ``free`` and
    ``loop`` measure the same thing, so they are pooled by batches (a maximum of noisy windows over-predicts).
    On a CPU the step runs on the main thread: its period is the serial cost."""
    if not samples:
        return None
    free = [s["free"] for s in samples]
    busy = free + [s["loop"] for s in samples if s.get("loop")]
    idle = [s["idle"] for s in samples if s.get("idle")]
    device = _pooled(free, "device_s")
    period = _pooled(busy, "period_s")
    assert period is not None
    if device is None:  # a CPU: the free loop's period and the real loop's time in the step calls
        steps = [{"x": w["period_s"], "batches": w.get("batches")} for w in free]
        steps += [
            {"x": s["loop"]["host_s"], "batches": s["loop"].get("batches")} for s in samples if s.get("loop")
        ]
        serial = _pooled(steps, "x")
    else:
        serial = _pooled(busy, "host_s")
    gaps = [
        {"gap": w["period_s"] - w["device_s"], "batches": w.get("batches")}
        for w in idle
        if w.get("device_s") is not None
    ]
    return FedTiming(
        period_s=period,
        serial_s=serial if serial is not None else period,
        device_s=device,
        idle_serial_s=_pooled(idle, "serial_s"),
        idle_gap_s=_pooled(gaps, "gap"),
    )


@dataclass(frozen=True)
class LoopParts:
    batch: int
    workers: int
    loader: LoaderTiming
    fed: FedTiming
    cores: int = 1
    read_s: float | None = None  # storage read per batch when it bounds every epoch, else None
    step_on_host: bool = False  # a CPU run: the "device" is the main thread itself
    copy_bound: bool = False  # the copy alone is slower than the step alone (names the device term h2d)


@dataclass(frozen=True)
class Prediction:
    period_s: float
    img_per_s: float
    bottleneck: str
    terms_s: dict[str, float]  # each limit's seconds per batch: producer, main, device, cores, read

    serial_s: float = 0.0  # the main thread's own cost per step used (busy or idle device, see FedTiming)

    def budget_ms(self, parts: LoopParts) -> dict[str, float | None]:
        """Per batch: what the main thread spends waiting for data, its own work, and the device step."""
        host = self.serial_s or parts.fed.serial_s
        return {
            "period_ms": 1e3 * self.period_s,
            "wait_ms": 1e3 * max(0.0, self.period_s - host),
            "host_ms": 1e3 * host,
            "device_ms": None if parts.fed.device_s is None else 1e3 * parts.fed.device_s,
            "loader_ms": 1e3 * parts.loader.period_s,
        }


def compose(parts: LoopParts) -> Prediction:
    """The loop's period, the main thread's cost taken at the device's idle gap (``FedTiming.serial_at``):
    the period sets the gap and the gap the cost, so the cost is the fixed point, found by bisection."""
    fed = parts.fed
    if parts.loader.beside_serial_s is not None:
        # measured in the loop's own pacing beside this loader (any idle gap included): no idle correction
        return compose_with(parts, parts.loader.beside_serial_s)
    lo, hi = fed.serial_s, fed.serial_at(float("inf"))
    if hi <= lo:
        return compose_with(parts, lo)

    def excess(serial: float) -> float:
        gap = compose_with(parts, serial).period_s - fed.period_s
        return fed.serial_at(gap) - serial

    for _ in range(40):
        mid = (lo + hi) / 2
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
    return compose_with(parts, (lo + hi) / 2)


def compose_with(parts: LoopParts, serial_s: float) -> Prediction:
    """The loop's period as the largest of its limits; the bottleneck is the limit that sets it. A loader
    that restarts at each epoch end drains first, so an epoch of E batches takes
    ``refill + max(E × consumer, (E − 1) × steady + consumer)`` (``consumer``: the main thread's and the
    device's limit), and at least E × the cores term."""
    main = parts.loader.main_s + serial_s
    terms: dict[str, float] = {
        "producer": parts.loader.period_s,
        "main": main,
        "device": parts.fed.period_s,
        "cores": (parts.loader.cpu_s + serial_s) / max(1, parts.cores),
    }
    if parts.read_s is not None:
        terms["read"] = parts.read_s
    refill = parts.loader.epoch_refill()
    if refill is None:
        limit = max(terms, key=lambda k: terms[k])
        period = terms[limit]
    else:
        e = parts.loader.epoch_batches or 1
        r, steady = refill
        # the cores bound is on the whole epoch's CPU work, the refill's included: not a per-batch stage
        consumers = {k: v for k, v in terms.items() if k not in ("producer", "cores")}
        limit = max(consumers, key=lambda k: consumers[k])
        consumer = consumers[limit]
        # steps launched ahead (a device slower than the host) hide the refill, never the loader's own epoch
        lead = 0.0 if parts.step_on_host else (e - 1) * max(0.0, terms["device"] - terms["main"])
        epoch = max(r + (e - 1) * steady, max(0.0, r - lead) + max(e * consumer, (e - 1) * steady + consumer))
        if e * terms["cores"] > epoch:
            epoch, limit = e * terms["cores"], "cores"
        # the loader's share: time per batch the loop waits on it, not overlapped with anything
        terms["producer"] = max(0.0, epoch / e - consumer)
        period = epoch / e
        if limit != "cores" and terms["producer"] > consumer:
            limit = "producer"
    return Prediction(
        period,
        parts.batch / period if period > 0 else float("inf"),
        name(limit, parts, serial_s),
        terms,
        serial_s,
    )


def name(limit: str, parts: LoopParts, serial_s: float | None = None) -> str:
    """A limit → the stage a user acts on."""
    if limit == "producer":
        return "transform"
    if limit == "main":
        if parts.loader.main_s >= (parts.fed.serial_s if serial_s is None else serial_s):
            return "transform"  # the loader's own work in the main process
        return "compute" if parts.step_on_host else "host"
    if limit == "device":
        return "h2d" if parts.copy_bound else "compute"
    return limit  # read, cores


def prediction_error(measured: float, predicted: float | None) -> float | None:
    """(measured − predicted) / predicted."""
    if not predicted:
        return None
    return (measured - predicted) / predicted
