"""``run_bench(config) -> dict``: the one entry point the CLI calls.

Order: open the source; prepare each loader kind (convert caches when needed); measure each stage alone
(read, transform per worker count, host→device, compute); run the real loop for every configuration in
``repeats`` rounds with rotated order; optionally profile each configuration in a separate short run;
then predict, name the bottleneck and advise. Returns the result document (see ``report``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from dlstore.bench.endtoend import (
    RunSpec,
    aggregate,
    aggregate_cold,
    move_batch,
    plan_runs,
    rotated,
    run_once,
)
from dlstore.bench.kinds import LoaderContext, PreparedLoader, prepare_loader
from dlstore.bench.kinds.base import default_size, source_channels
from dlstore.bench.models import TrainStep, build_model, configure_numerics, count_parameters
from dlstore.bench.monitor import mem_available_bytes
from dlstore.bench.protocol import (
    DEVICES,
    SCHEMA_VERSION,
    TRANSFORMS,
    BenchConfig,
    StageResult,
    default_worker_counts,
)
from dlstore.bench.report import environment, finite, profile_configuration, write_outputs
from dlstore.bench.stages import (
    BatchStream,
    device_label,
    measure_compute,
    measure_h2d,
    measure_read,
    measure_transform,
)
from dlstore.bench.verdict import Facts, KindStages, analyse
from dlstore.build.sources import open_source
from dlstore.errors import DlstoreError
from dlstore.machine import usable_cores

Log = Callable[[str], None]
PAGE_CACHE_FRACTION = 0.8  # data larger than this share of available RAM is read cold every epoch


def bench_cache_root() -> Path:
    env = os.environ.get("DLSTORE_BENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dlstore" / "bench"


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise DlstoreError(f"--device {name}: choose one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise DlstoreError("--device cuda: no CUDA device is available to torch; use --device cpu or auto")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def check_config(config: BenchConfig) -> None:
    if config.transform not in TRANSFORMS:
        raise DlstoreError(f"--transform {config.transform}: choose one of {', '.join(TRANSFORMS)}")
    for name in ("batch_size", "repeats", "steps", "warmup", "stage_steps"):
        if getattr(config, name) < 1:
            raise DlstoreError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.pin_memory not in ("auto", "on", "off", "both"):
        raise DlstoreError(f"pin_memory must be auto, on, off or both, got {config.pin_memory!r}")


def run_bench(config: BenchConfig, log: Log | None = None) -> dict[str, Any]:
    """Measure, predict, advise; write result.json, steps.csv and plots under ``config.out`` when set."""
    check_config(config)
    device = resolve_device(config.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    try:
        return _run_bench(config, device, log or (lambda msg: None))
    finally:
        torch.set_num_threads(threads)


def _run_bench(config: BenchConfig, device: torch.device, log: Log) -> dict[str, Any]:
    t_start = time.perf_counter()
    configure_numerics(device)
    torch.manual_seed(config.seed)
    source = open_source(config.source, root=config.root, demo_images=config.demo_images)
    size = config.size or default_size(source)
    channels = source_channels(source)
    workers = tuple(config.workers) if config.workers else default_worker_counts()
    ctx = LoaderContext(config, source, size, channels, device, bench_cache_root(), log)
    phases = {"source_s": time.perf_counter() - t_start}
    prepared, notes = prepare_all(config, ctx, log)
    steps = {name: make_step(p, config, size, len(source.classes), device) for name, p in prepared.items()}
    phases["prepare_s"] = time.perf_counter() - t_start - sum(phases.values())
    stage_results = measure_stages(prepared, steps, config, workers, len(source.classes), device, log)
    phases["stages_s"] = time.perf_counter() - t_start - sum(phases.values())
    workerless = frozenset(n for n, p in prepared.items() if p.info.get("ignores_workers"))
    specs = plan_runs(
        list(prepared), workers, device.type == "cuda", config.pin_memory, config.cold, workerless
    )
    probe = compute_probe(stage_results, steps, config, len(source.classes), device)
    results = run_rounds(prepared, steps, specs, config, device, log, probe)
    settle_compute(stage_results)
    phases["end_to_end_s"] = time.perf_counter() - t_start - sum(phases.values())
    runs = [aggregate(v) for k, v in results.items() if not k[3]]
    cold = {k[0]: aggregate_cold(v) for k, v in results.items() if k[3]}
    profiles = profile_all(prepared, steps, config, workers, device, specs, log) if config.profile else None
    phases["profile_s"] = time.perf_counter() - t_start - sum(phases.values())
    notes += contention_notes(runs)
    kind_stages = {name: kind_stages_of(s, prepared[name]) for name, s in stage_results.items()}
    pin_default = specs[0].pin_memory if specs else False
    facts = Facts(
        device=device.type,
        device_label=device_label(device),
        batch_size=config.batch_size,
        warmup_steps=config.warmup,
        source=_source_arg(config),
        size=size,
        cores=usable_cores(),
        cache_bytes={n: p.bytes_on_disk() for n, p in prepared.items() if n != "raw"},
        mem_available=mem_available_bytes(),
        pin_default=pin_default,
    )
    analysis = analyse(kind_stages, runs, cold, facts)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "tool": "dlstore bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(device),
        "config": config.to_dict(),
        "protocol": protocol_of(config, size, channels, workers, pin_default, device, steps, runs, prepared),
        "source": {
            "description": source.description,
            "kind": source.kind,
            "n_images": len(source),
            "classes": len(source.classes),
        },
        "loaders": {n: loader_info(p) for n, p in prepared.items()},
        "stages": {n: stage_entry(s, kind_stages[n], prepared[n]) for n, s in stage_results.items()},
        "runs": runs,
        "cold": cold,
        **{k: analysis[k] for k in ("stalls", "knees", "best") if k in analysis},
        "verdict": analysis["verdict"],
        "recommendations": analysis["recommendations"],
        "notes": notes,
        "profile": profiles,
        "phases": phases,
        "elapsed_s": time.perf_counter() - t_start,
    }
    doc = finite(doc)
    if config.out is not None:
        write_outputs(doc, Path(config.out))
    return doc


def contention_notes(runs: list[dict[str, Any]]) -> list[str]:
    """Other processes busy on this machine during the timed steps make every number noisy: say so."""
    other = sorted(
        r["resources"].get("other_cpu_cores") or 0.0
        for r in runs
        if (r.get("resources") or {}).get("wall_s", 0.0) >= 0.5
    )  # /proc ticks are 10 ms
    if other and other[len(other) // 2] > 0.5:
        return [
            f"other processes kept about {other[len(other) // 2]:.1f} of {os.cpu_count()} cores busy during the "
            "timed steps: the numbers are noisy; compare ratios within this run, or re-run on a quiet machine"
        ]
    return []


def _source_arg(config: BenchConfig) -> str:
    tv = config.root and config.source.startswith("torchvision:")
    return config.source + (f" --root {config.root}" if tv else "")


def prepare_all(
    config: BenchConfig, ctx: LoaderContext, log: Log
) -> tuple[dict[str, PreparedLoader], list[str]]:
    prepared: dict[str, PreparedLoader] = {}
    notes: list[str] = []
    for name in config.loaders:
        try:
            p = prepare_loader(name, ctx)
        except ImportError as e:  # zarr is optional on some machines
            notes.append(f"{name}: skipped, a package is missing ({e})")
            log(f"{name}: skipped ({e})")
            continue
        if p.n_images < config.batch_size:
            raise DlstoreError(
                f"{name}: {p.n_images} images but --batch-size {config.batch_size}; "
                "lower --batch-size or use more images (--demo-images)"
            )
        prepared[name] = p
    if not prepared:
        raise DlstoreError("no loader kind could be prepared; see the notes above")
    return prepared, notes


def make_step(
    p: PreparedLoader, config: BenchConfig, size: int, num_classes: int, device: torch.device
) -> TrainStep:
    c, h, _ = p.sample_shape
    side = size if config.transform == "gpu-augment" else h
    return TrainStep(build_model(config.model, c, side, num_classes), device, p.device_transform)


def measure_stages(
    prepared: dict[str, PreparedLoader],
    steps: dict[str, TrainStep],
    config: BenchConfig,
    workers: tuple[int, ...],
    num_classes: int,
    device: torch.device,
    log: Log,
) -> dict[str, dict[str, StageResult]]:
    out: dict[str, dict[str, StageResult]] = {}
    h2d_done: dict[tuple[Any, ...], StageResult] = {}
    compute_done: dict[tuple[Any, ...], StageResult] = {}
    for name, p in prepared.items():
        log(f"{name}: stages (read, transform at workers {','.join(map(str, workers))}, h2d, compute)")
        shape = (config.batch_size, *p.sample_shape)
        read = measure_read(name, p.files, p.n_images, config.read_max_bytes)
        transform = measure_transform(
            name,
            lambda w, p=p: p.loader(w, False, config),
            workers,
            min(config.warmup, 4),
            config.stage_steps,
        )
        key = (shape, p.batch_dtype)
        if p.on_device:
            h2d = StageResult("h2d", name, None, label="batches arrive on the device")
        else:
            h2d = h2d_done.get(key) or measure_h2d(name, shape, p.batch_dtype, device, config.stage_steps)
            h2d_done[key] = h2d
        ckey = (shape, p.batch_dtype, type(p.device_transform).__name__)
        if ckey not in compute_done:
            compute_done[ckey] = measure_compute(
                name,
                steps[name],
                shape,
                p.batch_dtype,
                num_classes,
                device,
                warmup=3,
                steps=max(config.stage_steps, config.steps),
            )
        out[name] = {"read": read, "transform": transform, "h2d": h2d, "compute": compute_done[ckey]}
    return out


def per_epoch_read(read: StageResult, p: PreparedLoader) -> tuple[float | None, str]:
    """The read rate an epoch sees: none for a dataset loaded once; cold when the data cannot stay cached."""
    if not p.reads_per_epoch:
        return None, "loaded once into memory: no per-epoch read"
    avail = mem_available_bytes()
    total = read.detail.get("bytes_total", 0)
    if avail is not None and total > PAGE_CACHE_FRACTION * avail:
        return read.detail.get("cold_img_per_s"), "cold: the data does not fit in the page cache"
    return read.img_per_s, "warm: the data fits in the page cache after the first epoch"


def kind_stages_of(s: dict[str, StageResult], p: PreparedLoader) -> KindStages:
    read, _ = per_epoch_read(s["read"], p)
    by = {int(w): r for w, r in s["transform"].detail.get("by_workers", {}).items()}
    h2d = s["h2d"]
    return KindStages(
        read=read,
        transform_by_workers=by,
        h2d_pinned=h2d.detail.get("pinned_img_per_s"),
        h2d_pageable=h2d.detail.get("pageable_img_per_s"),
        compute=s["compute"].img_per_s,
    )


def stage_entry(s: dict[str, StageResult], ks: KindStages, p: PreparedLoader) -> dict[str, Any]:
    _, basis = per_epoch_read(s["read"], p)
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
        "detail": {k: asdict(v) for k, v in s.items()},
    }


def compute_probe(
    stage_results: dict[str, dict[str, StageResult]],
    steps: dict[str, TrainStep],
    config: BenchConfig,
    num_classes: int,
    device: torch.device,
) -> Callable[[], None]:
    """Re-measures each distinct compute stage; called once per round so the ceiling is a median over the same
    span of time as the runs it is compared with (a shared machine drifts)."""
    distinct = {id(s["compute"]): (name, s["compute"]) for name, s in stage_results.items()}

    def probe() -> None:
        for name, stage in distinct.values():
            d = stage.detail
            again = measure_compute(
                name,
                steps[name],
                d["shape"],
                getattr(torch, d["dtype"]),
                num_classes,
                device,
                warmup=2,
                steps=max(config.stage_steps, config.steps),
            )
            d.setdefault("samples_img_per_s", [stage.img_per_s]).append(again.img_per_s)

    return probe


def settle_compute(stage_results: dict[str, dict[str, StageResult]]) -> None:
    for s in stage_results.values():
        samples = s["compute"].detail.get("samples_img_per_s")
        if samples:
            s["compute"].img_per_s = statistics.median(samples)
            s["compute"].label = s["compute"].label.split(";")[0] + f"; median of {len(samples)}"


def run_rounds(
    prepared: dict[str, PreparedLoader],
    steps: dict[str, TrainStep],
    specs: list[RunSpec],
    config: BenchConfig,
    device: torch.device,
    log: Log,
    probe: Callable[[], None] | None = None,
) -> dict[tuple[Any, ...], list[Any]]:
    results: dict[tuple[Any, ...], list[Any]] = {s.key: [] for s in specs}
    for r in range(config.repeats):
        if probe is not None:
            probe()
        order = rotated(specs, r, config.repeats)
        for pos, spec in enumerate(order):
            log(
                f"round {r + 1}/{config.repeats} [{pos + 1}/{len(order)}]: {spec.loader}, {spec.workers} workers, "
                f"pin_memory={'on' if spec.pin_memory else 'off'}{', cold' if spec.cold else ''}"
            )
            p = prepared[spec.loader]
            if spec.cold:
                p.release()  # no open memmap may pin the pages the cold run needs evicted
            res = run_once(p, spec, config, device, steps[spec.loader], r, pos)
            if spec.cold:
                _ = p.dataset  # re-open outside any timed phase
            results[spec.key].append(res)
    return results


def profile_all(
    prepared: dict[str, PreparedLoader],
    steps: dict[str, TrainStep],
    config: BenchConfig,
    workers: tuple[int, ...],
    device: torch.device,
    specs: list[RunSpec],
    log: Log,
) -> dict[str, Any]:
    """A short scheduled profiler run per (loader, workers); never used for throughput."""
    if config.out is None:
        raise DlstoreError("--profile needs an output folder (--out DIR)")
    out = Path(config.out) / "profile"
    pin = specs[0].pin_memory if specs else False
    traces: dict[str, Any] = {}
    for name, p in prepared.items():
        for w in workers:
            log(f"profiling {name} with {w} workers")
            traces[f"{name}-w{w}"] = profile_configuration(
                _profile_loop(p, w, pin, config, device, steps[name]), device, out, f"{name}-w{w}"
            )
    return {"dir": str(out), "schedule": {"wait": 1, "warmup": 2, "active": 3}, "traces": traces}


def _profile_loop(
    p: PreparedLoader,
    workers: int,
    pin: bool,
    config: BenchConfig,
    device: torch.device,
    step: TrainStep,
    n_steps: int = 6,
) -> Callable[[Callable[[], None]], None]:
    def run_steps(tick: Callable[[], None]) -> None:
        stream = BatchStream(p.loader(workers, pin, config))
        try:
            for _ in range(n_steps):
                with record_function("batch_wait"):
                    batch = stream.next()
                x, y = (batch[0], batch[1]) if p.on_device else move_batch(batch, device, pin)
                step(x, y)
                tick()
        finally:
            stream.close()

    return run_steps


def loader_info(p: PreparedLoader) -> dict[str, Any]:
    return {
        "description": p.description,
        "n_images": p.n_images,
        "files": len(p.files),
        "bytes_on_disk": p.bytes_on_disk(),
        "reads_per_epoch": p.reads_per_epoch,
        "batch_dtype": str(p.batch_dtype).removeprefix("torch."),
        "sample_shape": list(p.sample_shape),
        "device_transform": type(p.device_transform).__name__ if p.device_transform else None,
        "on_device": p.on_device,
        **p.info,
    }


def protocol_of(
    config: BenchConfig,
    size: int,
    channels: int,
    workers: tuple[int, ...],
    pin_default: bool,
    device: torch.device,
    steps: dict[str, TrainStep],
    runs: list[dict[str, Any]],
    prepared: dict[str, PreparedLoader],
) -> dict[str, Any]:
    """What ran, read back from the objects that ran: the step's optimizer and numerics, each kind's
    transforms, each run's loader settings. A setting that differs between runs is listed under
    ``varies`` and recorded in each run's ``loader_settings``."""
    any_step = next(iter(steps.values()))
    common, varies = split_settings([r.get("loader_settings") or {} for r in runs])
    return {
        "size": size,
        "channels": channels,
        "batch_size": config.batch_size,
        "model": config.model,
        "model_params": count_parameters(any_step.model),
        "optimizer": describe_optimizer(any_step.optimizer),
        "numerics": numerics(device),
        "transform": config.transform,
        "transforms": {name: kind_transforms(p) for name, p in prepared.items()},
        "workers": list(workers),
        "repeats": config.repeats,
        "steps": config.steps,
        "warmup": config.warmup,
        "stage_steps": config.stage_steps,
        "step_threads": torch.get_num_threads(),
        "loader_settings": common,
        "varies": varies,
        "pin_memory_default": pin_default,
        "pin_memory_mode": config.pin_memory,
        "device": str(device),
        "order": "rotated by repeat × runs / repeats",
        "cold_runs": config.cold,
        "timing": "per step: next() wait and step (copy + train) on the host clock; CUDA events for device time; "
        "throughput = timed steps / their wall time, after a final synchronize",
    }


def split_settings(settings: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(settings every run shared, names of those that differ between runs)."""
    names = sorted({k for s in settings for k in s})
    common: dict[str, Any] = {}
    varies: list[str] = []
    for name in names:
        values = {repr(s.get(name)) for s in settings}
        if len(values) == 1:
            common[name] = settings[0].get(name)
        else:
            varies.append(name)
    return common, varies


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    hyper = {
        k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float, str, tuple, type(None)))
    }
    return {"type": type(optimizer).__name__, **hyper}


def numerics(device: torch.device) -> dict[str, Any]:
    """The numeric settings in force while the runs ran (read from torch, not assumed)."""
    return {
        "dtype": "float32",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if device.type == "cuda" else None,
    }


def kind_transforms(p: PreparedLoader) -> dict[str, Any]:
    from dlstore.bench.kinds.base import describe_transform

    return {
        "cpu": describe_transform(getattr(p.dataset, "transform", None)),
        "device": describe_transform(p.device_transform),
    }
