"""The parts the prediction is composed from (see ``predict``), each measured alone for every loader kind:
the storage read, cold and warm; the loader alone at each (workers, pin_memory) the sweep runs, then on the
same running loader the step fed a fixed batch (the main thread's cost beside that loader's threads and
workers); the host→device copy; the step on synthetic on-device batches (the ceiling); the step fed through
the loop's own copy with data free. The ceiling and the fed step are re-measured once per round, so each is
pooled over the same span of time as the runs it is compared with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from dlstore.bench.endtoend import RunSpec, feeder
from dlstore.bench.kinds import PreparedLoader
from dlstore.bench.monitor import mem_available_bytes
from dlstore.bench.predict import FedTiming, LoaderTiming, fed_timing
from dlstore.bench.protocol import BenchConfig, RunResult, StageResult, cycle_window
from dlstore.bench.stages import (
    measure_compute,
    measure_fed,
    measure_h2d,
    measure_loader,
    measure_read,
    synthetic_batch,
)
from dlstore.bench.verdict import KindStages
from dlstore.write.sizes import count

Step = Callable[[torch.Tensor, torch.Tensor], None]
PAGE_CACHE_FRACTION = 0.8  # data larger than this share of available RAM is read cold every epoch
FED_MAX_STEPS = 200


def measure_kind(
    p: PreparedLoader,
    step: Step,
    specs: Sequence[RunSpec],
    config: BenchConfig,
    num_classes: int,
    device: torch.device,
    shared: dict[tuple[Any, ...], StageResult],
) -> dict[str, Any]:
    """Read, loader alone, h2d and compute for one kind (``shared``: stages of look-alike batches)."""
    assert config.batch_size is not None
    shape = (config.batch_size, *p.sample_shape)
    read = measure_read(p.name, p.files, p.n_images, config.read_max_bytes)
    loader: dict[tuple[int, bool], dict[str, Any]] = {}
    for s in (s for s in specs if s.loader == p.name and not s.cold):
        beside = beside_step(p, step, s.pin_memory, config, num_classes, device)
        loader[(s.workers, s.pin_memory)] = loader_timing(p, s.workers, s.pin_memory, config, device, beside)
    if p.on_device:
        h2d = StageResult("h2d", p.name, None, label="batches arrive on the device")
    else:
        key = ("h2d", shape, p.batch_dtype)
        h2d = shared.get(key) or measure_h2d(p.name, shape, p.batch_dtype, device, config.stage_steps)
        shared[key] = h2d
    ckey = ("compute", shape, p.batch_dtype, type(p.device_transform).__name__)
    if ckey not in shared:
        # as many warm batches as the loop's runs take before timing
        shared[ckey] = measure_compute(p.name, step, shape, p.batch_dtype, num_classes, device,
                                       warmup=config.warmup, steps=max(config.stage_steps, 8))  # fmt: skip
    return {"read": read, "loader": loader, "h2d": h2d, "compute": shared[ckey]}


def loader_timing(
    p: PreparedLoader,
    workers: int,
    pin: bool,
    config: BenchConfig,
    device: torch.device,
    beside: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """The loader alone, then (``beside``) the step fed a fixed batch while the same loader keeps running."""
    loader = p.loader(workers, pin, config)
    n = len(loader) if hasattr(loader, "__len__") else config.stage_steps  # type: ignore[arg-type]
    warm, timed, cycle = cycle_window(n, workers, min(config.warmup, 4), config.stage_steps)
    return measure_loader(loader, warm, timed, device, config.max_run_s, cycle, beside, config.fed_s)


def fed_batch(
    p: PreparedLoader, pin: bool, config: BenchConfig, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One collated batch of the kind's look where its loader leaves it (device, or pinned host memory)."""
    assert config.batch_size is not None
    x, y = synthetic_batch((config.batch_size, *p.sample_shape), p.batch_dtype, num_classes, device)
    if not p.on_device:
        x, y = x.cpu(), y.cpu()
        if pin and device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
    return x, y


def beside_step(
    p: PreparedLoader, step: Step, pin: bool, config: BenchConfig, num_classes: int, device: torch.device
) -> Callable[[], float]:
    """The loop's copy + step on a fixed batch, returning its seconds: timed beside a running loader, whose
    threads take the GIL and the CUDA driver from the launches."""
    batch = fed_batch(p, pin, config, num_classes, device)
    feed = feeder(p, device, pin)

    def work() -> float:
        a = time.perf_counter()
        x, y = feed(batch)
        step(x, y)
        return time.perf_counter() - a

    return work


def transform_stage(name: str, loader: dict[tuple[int, bool], dict[str, Any]], pin: bool) -> StageResult:
    """The loader-alone rates at the default pin_memory, as the stage table shows them."""
    by = {w: t["img_per_s"] for (w, p), t in loader.items() if p == pin} or {
        w: t["img_per_s"] for (w, _), t in loader.items()
    }
    best_w = max(by, key=lambda w: by[w])
    return StageResult(
        "transform",
        name,
        by[best_w],
        label=f"best at {count(best_w, 'worker')}",
        detail={"by_workers": {str(w): r for w, r in sorted(by.items())}, "best_workers": best_w},
    )


class FedProbe:
    """Measures the fed step per (batch look, pin_memory) once per round; ``timing`` gives the medians."""

    def __init__(
        self,
        prepared: dict[str, PreparedLoader],
        steps: dict[str, Step],
        specs: Sequence[RunSpec],
        config: BenchConfig,
        num_classes: int,
        device: torch.device,
    ) -> None:
        self.device, self.num_classes, self.config = device, num_classes, config
        self.jobs: dict[tuple[Any, ...], tuple[PreparedLoader, Step, bool]] = {}
        self.kind_keys: dict[tuple[str, bool], tuple[Any, ...]] = {}
        for s in specs:
            p = prepared[s.loader]
            look = (p.sample_shape, p.batch_dtype, type(p.device_transform).__name__, p.on_device)
            key = (*look, s.pin_memory)
            self.jobs.setdefault(key, (p, steps[s.loader], s.pin_memory))
            self.kind_keys[(s.loader, s.pin_memory)] = key
        self.samples: dict[tuple[Any, ...], list[dict[str, Any]]] = {k: [] for k in self.jobs}

    def __call__(self) -> None:
        for key, (p, step, pin) in self.jobs.items():
            self.samples[key].append(self.measure(p, step, pin))

    def measure(self, p: PreparedLoader, step: Step, pin: bool) -> dict[str, Any]:
        x, y = fed_batch(p, pin, self.config, self.num_classes, self.device)
        feed = feeder(p, self.device, pin)
        quick = measure_fed(step, (x, y), feed, self.device, warmup=3, steps=3)
        n = int(
            min(FED_MAX_STEPS, max(self.config.stage_steps, self.config.fed_s / max(quick["period_s"], 1e-6)))
        )
        free = measure_fed(step, (x, y), feed, self.device, warmup=1, steps=n)
        # The device term, and the step's host cost alone (the prediction takes the one beside each loader).
        serial = free["host_s"] if self.device.type == "cuda" else free["period_s"]
        return {"free": free, "idle": None, "loop": None, "serial_s": serial}

    def timing(self, kind: str, pin: bool) -> FedTiming | None:
        return fed_timing(self.samples.get(self.kind_keys.get((kind, pin), ()), []))

    def detail(self, kind: str) -> dict[str, Any]:
        out = {}
        for (k, pin), key in self.kind_keys.items():
            if k == kind:
                t = self.timing(kind, pin)
                out["pinned" if pin else "pageable"] = {
                    **(asdict(t) if t else {}),
                    "samples": self.samples[key],
                }
        return out


def per_epoch_read(read: StageResult, p: PreparedLoader) -> tuple[float | None, str, bool]:
    """(the read rate an epoch sees, why, whether it bounds the epoch)."""
    if not p.reads_per_epoch:
        return None, "loaded once into memory: no per-epoch read", False
    avail = mem_available_bytes()
    total = read.detail.get("bytes_total", 0)
    if avail is not None and total > PAGE_CACHE_FRACTION * avail:
        return read.detail.get("cold_img_per_s"), "cold: the data does not fit in the page cache", True
    return read.img_per_s, "warm: the data fits in the page cache after the first epoch", False


def kind_stages_of(s: dict[str, Any], p: PreparedLoader, fed: FedProbe) -> KindStages:
    read, _, bounds = per_epoch_read(s["read"], p)
    transform = s["transform"]
    h2d = s["h2d"]
    fed_by = {pin: t for pin in (True, False) if (t := fed.timing(p.name, pin)) is not None}
    return KindStages(
        read=read,
        transform_by_workers={int(w): r for w, r in transform.detail["by_workers"].items()},
        h2d_pinned=h2d.detail.get("pinned_img_per_s"),
        h2d_pageable=h2d.detail.get("pageable_img_per_s"),
        compute=s["compute"].img_per_s,
        loader={k: loader_timing_of(v) for k, v in s["loader"].items()},
        fed=fed_by,
        read_limit=read if bounds else None,
    )


def loader_timing_of(v: dict[str, Any]) -> LoaderTiming:
    return LoaderTiming(
        v["period_s"],
        v["main_s"],
        v["cpu_s"],
        v["in_caller"],
        v.get("refill_s"),
        v.get("epoch_batches"),
        v.get("beside_serial_s"),
    )


def stage_entry(s: dict[str, Any], ks: KindStages, p: PreparedLoader, fed: FedProbe) -> dict[str, Any]:
    _, basis, _ = per_epoch_read(s["read"], p)
    return {
        "read": ks.read,
        "transform": s["transform"].img_per_s,
        "h2d": ks.h2d_pinned,
        "compute": ks.compute,
        "read_basis": basis,
        "read_warm": s["read"].detail.get("warm_img_per_s"),
        "read_cold": s["read"].detail.get("cold_img_per_s"),
        "transform_by_workers": {str(k): v for k, v in ks.transform_by_workers.items()},
        "h2d_pageable": ks.h2d_pageable,
        "compute_label": s["compute"].label,
        "loader_alone": {f"w{w}-{'pin' if pin else 'nopin'}": v for (w, pin), v in s["loader"].items()},
        "fed_step": fed.detail(p.name),
        "detail": {k: asdict(v) for k, v in s.items() if isinstance(v, StageResult)},
    }


def compute_probe(
    stage_results: dict[str, dict[str, Any]],
    steps: dict[str, Step],
    config: BenchConfig,
    num_classes: int,
    device: torch.device,
) -> Callable[[], None]:
    """Re-measures each distinct compute stage; called once per round (a shared machine drifts)."""
    distinct = {id(s["compute"]): (name, s["compute"]) for name, s in stage_results.items()}

    def probe() -> None:
        for name, stage in distinct.values():
            d = stage.detail
            dtype = getattr(torch, d["dtype"])
            again = measure_compute(name, steps[name], d["shape"], dtype, num_classes, device,
                                    warmup=config.warmup, steps=max(config.stage_steps, 8))  # fmt: skip
            d.setdefault("samples_img_per_s", [stage.img_per_s]).append(again.img_per_s)

    return probe


def settle_compute(
    stage_results: dict[str, dict[str, Any]], in_loop: dict[str, list[RunResult]] | None = None
) -> None:
    """The step alone's rate: the median of its windows alone; on a CPU (``in_loop``: each kind's warm runs)
    the fastest window alone or inside the runs, since others' load on shared cores only ever slows it."""
    distinct: dict[int, tuple[StageResult, list[str]]] = {}
    for name, s in stage_results.items():
        distinct.setdefault(id(s["compute"]), (s["compute"], []))[1].append(name)
    for stage, kinds in distinct.values():
        samples = stage.detail.get("samples_img_per_s") or [stage.img_per_s]
        if stage.detail.get("settled"):
            continue
        stage.detail["settled"] = True
        rate, label = statistics.median(samples), f"median of {len(samples)} windows alone"
        loop = in_loop_step_rates(kinds, in_loop) if in_loop is not None else {}
        if loop:
            stage.detail["in_loop_img_per_s"] = loop
            rate = max(*samples, *loop.values())
            label = f"fastest of {len(samples)} windows alone and {len(loop)} inside the runs"
        stage.img_per_s = rate
        stage.label = stage.label.split(";")[0] + f"; {label}"


def in_loop_step_rates(kinds: Sequence[str], runs: dict[str, list[RunResult]]) -> dict[str, float]:
    """Per warm run of these kinds: images / the seconds of its timed steps' step calls (the wait left out)."""
    out: dict[str, float] = {}
    for kind in kinds:
        for r in runs.get(kind, []):
            timed = [s for s in r.steps if s.phase == "timed"]
            seconds = sum(s.step_s for s in timed)
            if timed and seconds > 0:
                out[f"{kind}-w{r.workers}-r{r.repeat}"] = sum(s.images for s in timed) / seconds
    return out
