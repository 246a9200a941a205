"""The real loop: loader → copy → training step, timed per step (the wait in ``next()``, the step after
it, CUDA events read at the end), in repeats with rotated order. Warm-up (worker start-up included) is
reported apart; a cold run evicts the files, starts a fresh loader and times only its warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from dlstore.bench.kinds import PreparedLoader
from dlstore.bench.kinds.context import loader_settings
from dlstore.bench.monitor import ResourceMonitor
from dlstore.bench.protocol import (
    MIN_TIMED_STEPS,
    BenchConfig,
    RunResult,
    StepRecord,
    cycle_window,
    summarize_waits,
)
from dlstore.bench.stages import (
    BatchStream,
    batch_images,
    cpu_reference_s,
    evict_files,
    probe_loader,
    works_in_caller,
)
from dlstore.machine import synchronize

Step = Callable[[torch.Tensor, torch.Tensor], None]
# batches of each probe pass of a loader without worker processes (``probe_around``), with half of fed_s
PROBE_MIN_BATCHES = 3


@dataclass(frozen=True)
class RunSpec:
    loader: str
    workers: int
    pin_memory: bool
    cold: bool = False

    @property
    def key(self) -> tuple[str, int, bool, bool]:
        return (self.loader, self.workers, self.pin_memory, self.cold)


def plan_runs(
    loaders: Sequence[str],
    workers: Sequence[int],
    cuda: bool,
    pin_mode: str,
    cold: bool,
    workerless: frozenset[str] = frozenset(),
) -> list[RunSpec]:
    """Every (loader, workers) with the device's pin_memory; on CUDA one run with the other pin_memory, and
    with ``cold`` one cold run, per loader at its largest worker count; ``workerless`` loaders at 0 only."""
    pin_default = cuda if pin_mode == "auto" else pin_mode == "on"

    def counts(name: str) -> list[int]:
        return [0] if name in workerless else list(workers)

    specs = [RunSpec(name, w, pin_default) for name in loaders for w in counts(name)]
    if cuda and pin_mode in ("auto", "both"):
        specs += [
            RunSpec(name, max(counts(name)), not pin_default) for name in loaders if name not in workerless
        ]
    if cold:
        specs += [RunSpec(name, max(counts(name)), pin_default, cold=True) for name in loaders]
    return specs


def rotated(specs: Sequence[RunSpec], repeat: int, repeats: int) -> list[RunSpec]:
    """Repeat r starts r/R of the way through the list, so each configuration moves position."""
    if not specs:
        return []
    shift = (repeat * len(specs)) // max(1, repeats)
    return list(specs[shift:]) + list(specs[:shift])


def move_batch(batch: Any, device: torch.device, non_blocking: bool) -> tuple[torch.Tensor, Any]:
    """The batch on the device; a cache with fields: its target dict too (boxes as lists, one copy each)."""
    x, y = batch[0], batch[1]
    with record_function("h2d_transfer"):
        if isinstance(y, dict):
            from dlstore.read.field_targets import target_to_device

            return x.to(device, non_blocking=non_blocking), target_to_device(y, device)
        return x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)


def feeder(
    prepared: PreparedLoader, device: torch.device, pin_memory: bool
) -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    """How the loop hands a loader's batch to the step (the fed-step measurement uses the same)."""
    if prepared.on_device:
        return lambda batch: (batch[0], batch[1])
    return lambda batch: move_batch(batch, device, pin_memory)


def run_once(
    prepared: PreparedLoader,
    spec: RunSpec,
    config: BenchConfig,
    device: torch.device,
    step: Step,
    repeat: int = 0,
    position: int = 0,
) -> RunResult:
    """One repeat of one configuration; returns every step's timings.

    Warm-up and timed steps are whole cycles of the loader's delivery pattern (``cycle_window``); a run cut
    short by ``max_run_s`` stops on a cycle boundary too."""
    result = RunResult(prepared.name, spec.workers, spec.pin_memory, repeat, position, cold=spec.cold)
    if spec.cold:
        result.eviction = evict_files(prepared.files)
    fresh = spec.cold and prepared.fresh_for_cold
    loader = prepared.loader(spec.workers, spec.pin_memory, config, fresh=fresh)
    result.loader_settings = loader_settings(loader)
    feed = feeder(prepared, device, spec.pin_memory)
    probed = spec.workers == 0 and not spec.cold
    if probed:
        result.loader_probe = probe_around(loader, feed, step, config, device, after=False)
    n_batches = len(loader) if hasattr(loader, "__len__") else config.steps  # type: ignore[arg-type]
    window = cycle_window(n_batches, spec.workers, config.warmup, config.steps)
    monitor = ResourceMonitor()
    ref = _reference_event(device)
    t0 = time.perf_counter()
    stream = BatchStream(loader)  # worker start-up counts in the first step's time
    try:
        events = _timed_loop(result, stream, t0, feed, step, spec, config, device, monitor, window)
    finally:
        stream.close()
    for rec, ev in zip(result.steps, events):
        rec.device_step_s = ev[0].elapsed_time(ev[1]) / 1e3
        if ref is not None:
            rec.device_start_s = ref.elapsed_time(ev[0]) / 1e3
            rec.device_end_s = ref.elapsed_time(ev[1]) / 1e3
    if probed:
        result.loader_probe_after = probe_around(loader, feed, step, config, device, after=True)
    return result


def _timed_loop(
    result: RunResult,
    stream: BatchStream,
    t0: float,
    feed: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    step: Step,
    spec: RunSpec,
    config: BenchConfig,
    device: torch.device,
    monitor: ResourceMonitor,
    window: tuple[int, int, int],
) -> list[tuple[Any, Any]]:
    """The loop itself, filling ``result``; returns the CUDA events of each step (read after the run)."""
    warm, timed, cycle = window
    events: list[tuple[Any, Any]] = []
    first_epoch_end: float | None = None
    first_epoch_images = 0
    t_timed = t0
    for i in range(warm + (0 if spec.cold else timed)):
        if i == warm and not spec.cold:
            synchronize(device)
            result.cpu_ref_s = cpu_reference_s()
            monitor.start(stream.worker_pids())
            t_timed = time.perf_counter()
            result.warmup_s = t_timed - t0
        ta = time.perf_counter()
        if _past_limit(config, i - warm, cycle, ta - t_timed) and not spec.cold:
            result.truncated = True
            break
        with record_function("batch_wait"):
            batch = stream.next()
        tb = time.perf_counter()
        if i == 0:
            result.startup_s = tb - t0
        if stream.epoch == 1 and first_epoch_end is None:
            first_epoch_end = ta
        n = batch_images(batch)
        if stream.epoch == 0:
            first_epoch_images += n
        x, y = feed(batch)
        if device.type == "cuda":
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        step(x, y)
        if device.type == "cuda":
            ev[1].record()
            events.append(ev)
        phase = "cold" if spec.cold else ("warmup" if i < warm else "timed")
        result.steps.append(
            StepRecord(phase, stream.epoch, i, n, tb - ta, time.perf_counter() - tb, t_s=ta - t0)
        )
    synchronize(device)
    t_end = time.perf_counter()
    if spec.cold:
        result.warmup_s = result.timed_s = t_end - t0
        result.img_per_s = sum(s.images for s in result.steps) / result.timed_s
    else:
        result.resources = monitor.stop()
        result.timed_s = t_end - t_timed
        result.img_per_s = sum(s.images for s in result.timed()) / result.timed_s
    end = first_epoch_end if first_epoch_end is not None else t_end
    result.first_epoch_partial = first_epoch_end is None
    result.first_epoch_img_per_s = first_epoch_images / (end - t0) if end > t0 else None
    return events


def probe_around(
    loader: Any,
    feed: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    step: Step,
    config: BenchConfig,
    device: torch.device,
    after: bool,
) -> dict[str, Any]:
    """The parts the model takes from next to a run of a loader without worker processes: the loader alone
    when it works in the caller, and the step beside it; after the run in mirrored order."""

    def work(batch: Any) -> float:
        a = time.perf_counter()
        x, y = feed(batch)
        step(x, y)
        return time.perf_counter() - a

    out = probe_loader(
        loader,
        PROBE_MIN_BATCHES,
        config.fed_s / 2,
        device,
        beside=work,
        alone=works_in_caller(loader),
        beside_first=after,
    )
    return {**out, "when": "after" if after else "before"}


def _reference_event(device: torch.device) -> Any:
    """A CUDA event at the host's time origin: device times become host-clock offsets (the timeline)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    return ref


def _past_limit(config: BenchConfig, timed_index: int, cycle: int, elapsed: float) -> bool:
    return (
        config.max_run_s is not None
        and timed_index >= MIN_TIMED_STEPS
        and timed_index % cycle == 0
        and elapsed > config.max_run_s
    )


def aggregate(results: Sequence[RunResult]) -> dict[str, Any]:
    """Repeats of one warm configuration → median and min–max, wait statistics, resources."""
    rates = [r.img_per_s for r in results]
    first = [r.first_epoch_img_per_s for r in results if r.first_epoch_img_per_s is not None]
    waits = [summarize_waits([s.wait_s for s in r.timed()], r.timed_s) for r in results]
    r0 = results[0]
    return {
        "loader": r0.loader,
        "workers": r0.workers,
        "pin_memory": r0.pin_memory,
        "repeats": len(results),
        "img_per_s": statistics.median(rates),
        "img_per_s_min": min(rates),
        "img_per_s_max": max(rates),
        "first_epoch_img_per_s": statistics.median(first) if first else None,
        "first_epoch_partial": any(r.first_epoch_partial for r in results),
        "startup_s": statistics.median(r.startup_s for r in results),
        "warmup_s": statistics.median(r.warmup_s for r in results),
        "wait": {k: statistics.median(w[k] for w in waits) for k in waits[0]},
        "loader_settings": r0.loader_settings,
        "measured_ms": statistics_ms(results),
        "resources": results[-1].resources,
        "loader_probe": pool_probes(results),
        "cpu_ref_ms": [None if r.cpu_ref_s is None else 1e3 * r.cpu_ref_s for r in results],
        "raw": [r.to_dict() for r in results],
    }


def pool_probes(results: Sequence[RunResult]) -> dict[str, Any] | None:
    """The probes taken before and after each repeat (``probe_around``), pooled (``pool_probe_dicts``)."""
    return pool_probe_dicts([p for r in results for p in (r.loader_probe, r.loader_probe_after) if p])


def pool_probe_dicts(probes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Probes pooled per batch: the loader alone (``period_s``, ``main_s``, ``cpu_s``) and the step beside
    it (``beside_serial_s``), each where some probe timed it, with every probe in ``samples``."""
    if not probes:
        return None
    out: dict[str, Any] = {"samples": list(probes)}
    alone = [p for p in probes if p.get("batches")]
    n = sum(p["batches"] for p in alone)
    if n:
        out.update({k: sum(p[k] * p["batches"] for p in alone) / n for k in ("period_s", "main_s", "cpu_s")})
        out["batches"] = n
    beside = [p for p in probes if p.get("beside_batches")]
    m = sum(p["beside_batches"] for p in beside)
    if m:
        out["beside_serial_s"] = sum(p["beside_serial_s"] * p["beside_batches"] for p in beside) / m
        out["beside_batches"] = m
    return out


def statistics_ms(results: Sequence[RunResult]) -> dict[str, float | None]:
    """The measured per-batch budget over the timed steps of all repeats: period, wait, host work, device."""
    steps = [s for r in results for s in r.timed()]
    if not steps:
        return {"period_ms": None, "wait_ms": None, "host_ms": None, "device_ms": None}
    device = [s.device_step_s for s in steps if s.device_step_s is not None]
    wall = sum(r.timed_s for r in results)
    return {
        "device_busy": sum(device) / wall if device and wall > 0 else None,
        "period_ms": 1e3 * statistics.median(r.timed_s / max(1, len(r.timed())) for r in results),
        "wait_ms": 1e3 * statistics.fmean(s.wait_s for s in steps),
        "host_ms": 1e3 * statistics.fmean(s.step_s for s in steps),
        "device_ms": 1e3 * statistics.fmean(device) if device else None,
    }


def aggregate_cold(results: Sequence[RunResult]) -> dict[str, Any]:
    worked = [r.eviction.get("worked") for r in results if r.eviction]
    return {
        "workers": results[0].workers,
        "repeats": len(results),
        "warmup_s": statistics.median(r.warmup_s for r in results),
        "img_per_s": statistics.median(r.img_per_s for r in results),
        "startup_s": statistics.median(r.startup_s for r in results),
        "eviction_worked": all(w is True for w in worked) if worked and None not in worked else None,
        "eviction": results[-1].eviction,
        "raw": [r.to_dict() for r in results],
    }
