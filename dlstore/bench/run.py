"""``run_bench(config) -> dict``, the one entry point the CLI calls: open the source, prepare each loader
kind, measure each part alone, run the real loop in rotated rounds, optionally profile, then predict, name
the bottleneck and advise. Returns the result document (see ``report``)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from dlstore import settings
from dlstore.bench.endtoend import (
    RunSpec,
    aggregate,
    aggregate_cold,
    feeder,
    plan_runs,
    rotated,
    run_once,
)
from dlstore.bench.kinds import LoaderContext, PreparedLoader, prepare_loader
from dlstore.bench.kinds.context import default_size, source_arguments, source_channels
from dlstore.bench.models import (
    TrainStep,
    UserStep,
    build_model,
    configure_numerics,
    default_batch_size,
    default_precision,
    import_callable,
    numerics_state,
    resolve_step_options,
    restore_numerics,
)
from dlstore.bench.monitor import mem_available_bytes
from dlstore.bench.parts import (
    FedProbe,
    compute_probe,
    kind_stages_of,
    measure_kind,
    settle_compute,
    stage_entry,
    transform_stage,
)
from dlstore.bench.protocol import (
    DEVICES,
    SCHEMA_VERSION,
    TRANSFORMS,
    BenchConfig,
    StageResult,
    default_worker_counts,
)
from dlstore.bench.report import (
    PROFILE_SCHEDULE,
    check_out_dir,
    environment,
    finite,
    profile_configuration,
    removed_if_left_empty,
    write_outputs,
)
from dlstore.bench.stages import BatchStream, device_label, synthetic_batch
from dlstore.bench.verdict import PREDICTION_TOLERANCE, Facts, analyse, state_notes
from dlstore.errors import DlstoreError
from dlstore.machine import usable_cores
from dlstore.write.conversion_plan import source_warnings
from dlstore.write.sizes import count
from dlstore.write.sources import Source, open_source

Log = Callable[[str], None]
Step = TrainStep | UserStep
MIN_DEMO_IMAGES = 256
DEMO_BATCHES = 8  # the demo source holds at least this many batches, so an epoch is more than a batch


@dataclasses.dataclass(frozen=True)
class Session:
    """What the phases after the loaders' preparation share."""

    config: BenchConfig
    device: torch.device
    prepared: dict[str, PreparedLoader]
    steps: dict[str, Step]
    specs: list[RunSpec]
    classes: int
    log: Log


def bench_cache_root() -> Path:
    return settings.folder("DLSTORE_BENCH_CACHE", "bench")


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
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise DlstoreError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.pin_memory not in ("auto", "on", "off", "both"):
        raise DlstoreError(f"pin_memory must be auto, on, off or both, got {config.pin_memory!r}")
    # A user's step or model that cannot be imported fails now, before the caches are built.
    if config.step is not None:
        import_callable(config.step, "--step")
    if ":" in config.model:
        import_callable(config.model, "--model")
    if config.out is not None:
        check_out_dir(Path(config.out))


def run_bench(config: BenchConfig, log: Log | None = None) -> dict[str, Any]:
    """Measure, predict, advise; write result.json, steps.csv and plots under ``config.out`` when set."""
    with removed_if_left_empty(config.out):  # a failed run leaves no empty dlstore-bench-* folder
        return _checked_run_bench(config, log)


def _checked_run_bench(config: BenchConfig, log: Log | None) -> dict[str, Any]:
    check_config(config)
    device = resolve_device(config.device)
    config = resolve_config(config, device)
    threads = torch.get_num_threads()
    numerics = numerics_state()
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    try:
        return _run_bench(config, device, log or (lambda msg: None))
    finally:
        torch.set_num_threads(threads)
        restore_numerics(numerics)


def sample_source(source: Source, config: BenchConfig, log: Log) -> Source:
    """The source, or a seeded random sample of ``max_images`` of it (at least ``DEMO_BATCHES`` batches)."""
    assert config.batch_size is not None
    keep = max(config.max_images, DEMO_BATCHES * config.batch_size)
    if not config.max_images or len(source) <= keep:
        return source
    picked = np.sort(np.random.default_rng(config.seed).choice(len(source), keep, replace=False))
    log(f"benching a random sample of {keep:,} of the source's {len(source):,} images (--max-images; 0: all)")
    return source.subset(picked)


def resolve_config(config: BenchConfig, device: torch.device) -> BenchConfig:
    """Fill what depends on the device: the batch size, the precision, the demo source's size."""
    batch = config.batch_size or default_batch_size(config.model, device.type)
    demo = config.demo_images or max(MIN_DEMO_IMAGES, DEMO_BATCHES * batch)
    precision = config.precision or default_precision(device.type)
    return dataclasses.replace(config, batch_size=batch, demo_images=demo, precision=precision)


def _open(config: BenchConfig, device: torch.device, log: Log, t_start: float) -> tuple[Any, ...]:
    """Open the source, sample it, plan within the budget: (config, context, workers, budget, notes, total)."""
    full = open_source(
        config.source,
        root=config.root,
        demo_images=config.demo_images or MIN_DEMO_IMAGES,
        label=config.label,
        fields=tuple(config.fields),
    )
    source_notes = source_warnings(full)
    for warning in source_notes:
        log(f"warning: {warning}")
    source = sample_source(full, config, log)
    size, notes = bench_size(config, source, device)
    channels = source_channels(source)
    workers = tuple(config.workers) if config.workers else default_worker_counts()
    ctx = LoaderContext(config, source, size, channels, device, bench_cache_root(), log)
    budget = None
    if config.budget_s:
        config, budget = plan_within_budget(ctx, workers, len(source), log, t_start)
        workers = tuple(config.workers or workers)
        if config.max_images != ctx.config.max_images:  # the plan took a smaller sample
            source = sample_source(full, config, log)
        ctx = LoaderContext(config, source, size, channels, device, bench_cache_root(), log)
        notes += budget_notes(budget)
    notes += source_notes
    if device.type == "cpu":
        notes.append(CPU_NOTE.format(cores=usable_cores()))
    return config, ctx, workers, budget, notes, len(full)


def _run_bench(config: BenchConfig, device: torch.device, log: Log) -> dict[str, Any]:
    assert config.batch_size is not None and config.precision is not None
    t_start = time.perf_counter()
    configure_numerics(device, config.precision)
    torch.manual_seed(config.seed)
    config, ctx, workers, budget, notes, total = _open(config, device, log, t_start)
    source, size, channels = ctx.source, ctx.size, ctx.channels
    phases = {"source_s": time.perf_counter() - t_start}
    prepared, prepare_notes = prepare_all(config, ctx, log)
    notes += prepare_notes
    classes = max(1, len(source.classes))  # a source of fields alone: one stand-in class
    steps = {name: make_step(p, config, size, classes, device) for name, p in prepared.items()}
    phases["prepare_s"] = time.perf_counter() - t_start - sum(phases.values())
    workerless = frozenset(n for n, p in prepared.items() if p.info.get("ignores_workers"))
    specs = plan_runs(
        list(prepared), workers, device.type == "cuda", config.pin_memory, config.cold, workerless
    )
    pin_default = specs[0].pin_memory if specs else False
    session = Session(config, device, prepared, steps, specs, classes, log)
    stage_results = measure_all(session, pin_default)
    phases["stages_s"] = time.perf_counter() - t_start - sum(phases.values())
    fed = FedProbe(prepared, steps, specs, config, classes, device)
    ceiling = compute_probe(stage_results, steps, config, classes, device)

    def probe() -> None:  # once per round: the ceiling and the fed step drift with the machine's load
        ceiling()
        fed()

    results = run_rounds(session, probe)
    settle_compute(stage_results, warm_runs_by_kind(results) if device.type == "cpu" else None)
    phases["end_to_end_s"] = time.perf_counter() - t_start - sum(phases.values())
    runs = [aggregate(v) for k, v in results.items() if not k[3]]
    cold = {k[0]: aggregate_cold(v) for k, v in results.items() if k[3]}
    profiles = profile_all(session, workers) if config.profile else None
    phases["profile_s"] = time.perf_counter() - t_start - sum(phases.values())
    notes += contention_notes(runs) + state_notes(runs)
    kind_stages = {name: kind_stages_of(s, prepared[name], fed) for name, s in stage_results.items()}
    facts = make_facts(config, device, ctx, total, pin_default, prepared)
    notes += [f"{name} {what}" for name, what in facts.substituted.items()]
    analysis = analyse(kind_stages, runs, cold, facts)
    notes += prediction_notes(analysis.get("prediction", {}))
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
            "n_images_total": total,
            "classes": classes,
        },
        "loaders": {n: loader_info(p) for n, p in prepared.items()},
        "stages": {n: stage_entry(s, kind_stages[n], prepared[n], fed) for n, s in stage_results.items()},
        "runs": runs,
        "cold": cold,
        **{
            k: analysis[k]
            for k in ("detail", "kinds", "lanes", "best", "default", "prediction")
            if k in analysis
        },
        "verdict": analysis["verdict"],
        "recommendations": analysis["recommendations"],
        "advice": analysis.get("advice", []),
        "notes": notes,
        "profile": profiles,
        "phases": phases,
        "elapsed_s": time.perf_counter() - t_start,
        # actual_s: from the command's start (``budget_spent_s``) to the report, before the outputs are written
        "budget": None
        if budget is None
        else {**budget, "actual_s": config.budget_spent_s + time.perf_counter() - t_start},
    }
    return written(finite(doc), config, log)


def written(doc: dict[str, Any], config: BenchConfig, log: Log) -> dict[str, Any]:
    """The document, written under ``config.out`` when set; a failed write is recorded, not raised."""
    if config.out is not None:
        try:
            write_outputs(doc, Path(config.out))
        except OSError as e:  # e.g. the disk filled during the runs: the caller still gets the measurements
            doc["outputs_error"] = f"{e.filename or config.out}: {e.strerror or e}"
            log(f"could not write the outputs under {config.out}: {doc['outputs_error']}")
    return doc


def make_facts(
    config: BenchConfig,
    device: torch.device,
    ctx: LoaderContext,
    total: int,
    pin_default: bool,
    prepared: dict[str, PreparedLoader],
) -> Facts:
    assert config.batch_size is not None and config.precision is not None
    info = {n: p.info for n, p in prepared.items()}
    return Facts(
        device=device.type,
        device_label=device_label(device),
        batch_size=config.batch_size,
        source=_source_arg(config),
        size=ctx.size,
        cores=usable_cores(),
        mem_available=mem_available_bytes(),
        raw_cache_bytes=total * ctx.size * ctx.size * ctx.channels,  # the whole source's, not the sample's
        pin_default=pin_default,
        apply={n: i["apply"] for n, i in info.items() if i.get("apply")},
        substituted={n: i["substituted"] for n, i in info.items() if i.get("substituted")},
        precision=config.precision,
        transform=config.transform,
        bench_command=bench_command(config),
        cpu_decoder_kinds=frozenset(n for n, i in info.items() if i.get("workers_are") == "cpu_decoders"),
    )


# What a CPU run can and cannot say, in every CPU report.
CPU_NOTE = (
    "a CPU run: the training step runs on the same {cores} core(s) as the loaders and their workers, so "
    "every rate here is the step and the input pipeline sharing those cores, not what a GPU machine would "
    "see (there the step leaves the cores to the loaders and the input pipeline decides the rate). It can "
    "say whether each loader works, how the kinds compare with each other, and what a file costs to "
    "decode; not which loader or worker count to train with on a GPU: run the bench on the training machine"
)
CPU_DEFAULT_SIZE = 64  # a CPU's default side for folders: 224 px made the step 1–2 s a batch on 2 cores


def bench_size(config: BenchConfig, source: Source, device: torch.device) -> tuple[int, list[str]]:
    """The image side: the user's, else the source's default, at most ``CPU_DEFAULT_SIZE`` on a CPU."""
    if config.size:
        return config.size, []
    size = default_size(source)
    if device.type != "cpu" or size <= CPU_DEFAULT_SIZE:
        return size, []
    return CPU_DEFAULT_SIZE, [
        f"size {CPU_DEFAULT_SIZE}px, not the {size}px a GPU run takes for this source: on a CPU the step at "
        f"{size}px would take most of the time; pass --size {size} to measure that"
    ]


def plan_within_budget(
    ctx: LoaderContext, workers: tuple[int, ...], images: int, log: Log, t_start: float
) -> tuple[BenchConfig, dict[str, Any]]:
    """Calibrate, then fit the runs to ``config.budget_s`` (``plan.fit``); log the plan before it runs."""
    from dlstore.bench.calibrate import initial_plan, measure_costs
    from dlstore.bench.plan import PLAN_FIELDS, estimate, fit, plan_lines
    from dlstore.bench.transforms import cached_cpu_transform

    config = ctx.config
    assert config.batch_size is not None
    t0 = time.perf_counter()
    step = calibration_step(ctx)
    batch = synthetic_batch(
        (config.batch_size, ctx.channels, ctx.size, ctx.size),
        torch.uint8,
        max(1, len(ctx.source.classes)),
        ctx.device,
    )
    costs = measure_costs(ctx, step, batch, cached_cpu_transform(config.transform, ctx.size))
    calibration_s = time.perf_counter() - t0
    spent = config.budget_spent_s + time.perf_counter() - t_start
    first = initial_plan(config, workers, images, ctx.device.type == "cuda")
    named = frozenset(config.loaders) if "loaders" in config.user_set else frozenset()
    planned, cuts = fit(first, costs, config.budget_s, frozenset(config.user_set), named, spent)
    est = estimate(planned, costs)
    for line in plan_lines(planned, est, cuts, config.budget_s, spent):
        log(line)
    fitted = dataclasses.replace(
        config,
        **{f: getattr(planned, f) for f in PLAN_FIELDS if f != "max_run_s"},
        max_images=planned.images if planned.images < first.images else config.max_images,
    )
    return fitted, {
        "budget_s": config.budget_s,
        "plan": planned.to_dict(),
        "asked": first.to_dict(),
        "estimate": est,
        "estimate_total_s": est["total_s"] + spent,  # with the start-up and the calibration
        "spent_before_plan_s": spent,
        "estimate_asked_s": estimate(first, costs)["total_s"] + spent,
        "cuts": cuts,
        "costs": dataclasses.asdict(costs),
        "calibration_s": calibration_s,
    }


def calibration_step(ctx: LoaderContext) -> Step:
    """The run's step (a model of its own, as the kinds will train) on the cached kinds' uint8 batches."""
    from dlstore.bench.transforms import ToFloat

    classes = max(1, len(ctx.source.classes))
    return build_step(ctx.config, ctx.device, ToFloat(), ctx.channels, ctx.size, classes)


def budget_notes(budget: dict[str, Any]) -> list[str]:
    """What the budget cut, and whether the plan is over it even so."""
    notes = []
    if budget["cuts"]:
        notes.append(
            f"to fit --budget {budget['budget_s']:.0f} s (the run as asked: about "
            f"{budget['estimate_asked_s']:.0f} s): " + "; ".join(budget["cuts"])
        )
    if budget["estimate_total_s"] > budget["budget_s"]:
        notes.append(
            f"estimated at {budget['estimate_total_s']:.0f} s, over --budget {budget['budget_s']:.0f} s: "
            "the loaders named and the options set are never cut"
        )
    return notes


def warm_runs_by_kind(results: dict[tuple[Any, ...], list[Any]]) -> dict[str, list[Any]]:
    """The warm runs' results per loader kind (``parts.settle_compute`` takes the step's windows from them)."""
    out: dict[str, list[Any]] = {}
    for (kind, _, _, cold), runs in results.items():
        if not cold:
            out.setdefault(kind, []).extend(runs)
    return out


def measure_all(s: Session, pin_default: bool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    shared: dict[tuple[Any, ...], StageResult] = {}
    for name, p in s.prepared.items():
        counts = sorted({spec.workers for spec in s.specs if spec.loader == name})
        s.log(f"{name}: parts (read, loader alone at workers {','.join(map(str, counts))}, h2d, compute)")
        out[name] = measure_kind(p, s.steps[name], s.specs, s.config, s.classes, s.device, shared)
        out[name]["transform"] = transform_stage(name, out[name]["loader"], pin_default)
    return out


def prediction_notes(summary: dict[str, Any]) -> list[str]:
    n, ok = summary.get("runs", 0), summary.get("within_tolerance", 0)
    if not n or ok == n:
        return []
    return [
        f"predictions within ±{100 * PREDICTION_TOLERANCE:.0f}% for {ok} of {n} runs (largest miss "
        f"{100 * summary['max_abs_error']:.0f}%): where they miss, the parts interfere when run together or "
        "the machine's load changed between measurements; trust the measured rates"
    ]


def bench_command(config: BenchConfig) -> str:
    """The command that re-runs this bench, for advice that says "measure it with …"."""
    parts = ["dlstore bench", _source_arg(config), f"--loaders {','.join(config.loaders)}"]
    parts.append(f"--model {config.model}" if config.step is None else f"--step {config.step}")
    parts.append(f"--transform {config.transform}")  # no --batch-size: advice sets its own
    if config.size:
        parts.append(f"--size {config.size}")
    return " ".join(parts)


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
    return source_arguments(config.source, config.root, config.label)


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
    skipped = next((p.info for p in prepared.values() if p.info.get("skipped")), None)
    if skipped is not None:
        notes.append(
            f"{skipped['skipped']} source file(s) could not be read or decoded (named in "
            f"{skipped['skipped_list']}): the caches leave them out; raw reads each as a blank image "
            "where a plain ImageFolder loop stops at the first"
        )
    return prepared, notes


def make_step(
    p: PreparedLoader, config: BenchConfig, size: int, num_classes: int, device: torch.device
) -> Step:
    c, h, _ = p.sample_shape
    side = size if config.transform == "gpu-augment" else h
    return build_step(config, device, p.device_transform, c, side, num_classes)


def build_step(
    config: BenchConfig, device: torch.device, transform: Any, channels: int, side: int, classes: int
) -> Step:
    """The built-in step with the options a user trains with, or the user's own ``--step``."""
    if config.step is not None:
        return UserStep(config.step, device, transform)
    model = build_model(config.model, channels, side, classes)
    options = resolve_step_options(config.precision, config.channels_last, config.compile, device, model)
    return TrainStep(model, device, transform, options)


def run_rounds(s: Session, probe: Callable[[], None] | None = None) -> dict[tuple[Any, ...], list[Any]]:
    config = s.config
    results: dict[tuple[Any, ...], list[Any]] = {spec.key: [] for spec in s.specs}
    for r in range(config.repeats):
        if probe is not None:
            probe()
        # cold runs in the first round only: each costs a fresh pool and an eviction, for no predicted rate
        order = [spec for spec in rotated(s.specs, r, config.repeats) if r == 0 or not spec.cold]
        for pos, spec in enumerate(order):
            s.log(
                f"round {r + 1}/{config.repeats} [{pos + 1}/{len(order)}]: {spec.loader}, {count(spec.workers, 'worker')}, "
                f"pin_memory={'on' if spec.pin_memory else 'off'}{', cold' if spec.cold else ''}"
            )
            p = s.prepared[spec.loader]
            if spec.cold:
                p.release()  # no open memmap may pin the pages the cold run needs evicted
            res = run_once(p, spec, config, s.device, s.steps[spec.loader], r, pos)
            if spec.cold:
                _ = p.dataset  # re-open outside any timed phase
            results[spec.key].append(res)
    return results


def profile_all(s: Session, workers: tuple[int, ...]) -> dict[str, Any]:
    """A short scheduled profiler run per (loader, workers); never used for throughput."""
    if s.config.out is None:
        raise DlstoreError("--profile needs an output folder (--out DIR)")
    out = Path(s.config.out) / "profile"
    pin = s.specs[0].pin_memory if s.specs else False
    traces: dict[str, Any] = {}
    for name in s.prepared:
        for w in workers:
            s.log(f"profiling {name} with {count(w, 'worker')}")
            loop = _profile_loop(s, name, w, pin)
            traces[f"{name}-w{w}"] = profile_configuration(loop, s.device, out, f"{name}-w{w}")
    return {"dir": str(out), "schedule": PROFILE_SCHEDULE, "traces": traces}


def _profile_loop(s: Session, name: str, workers: int, pin: bool) -> Callable[[Callable[[], None]], None]:
    p, step, n_steps = s.prepared[name], s.steps[name], sum(PROFILE_SCHEDULE.values())
    feed = feeder(p, s.device, pin)

    def run_steps(tick: Callable[[], None]) -> None:
        stream = BatchStream(p.loader(workers, pin, s.config))
        try:
            for _ in range(n_steps):
                with record_function("batch_wait"):
                    batch = stream.next()
                x, y = feed(batch)
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
    steps: dict[str, Step],
    runs: list[dict[str, Any]],
    prepared: dict[str, PreparedLoader],
) -> dict[str, Any]:
    """What ran, read back from the objects that ran; a loader setting that differs between runs is listed
    under ``varies`` (each run keeps its own ``loader_settings``)."""
    step = next(iter(steps.values())).describe()
    common, varies = split_settings([r.get("loader_settings") or {} for r in runs])
    return {
        "size": size,
        "channels": channels,
        "pixels": config.pixels,
        "batch_size": config.batch_size,
        "model": config.model if config.step is None else None,
        "step": step,
        "model_params": step["model_params"],
        "optimizer": step["optimizer"],
        "numerics": numerics(device, step),
        "transform": config.transform,
        "transforms": {name: kind_transforms(p) for name, p in prepared.items()},
        "workers": list(workers),
        "repeats": config.repeats,
        "steps": config.steps,
        "warmup": config.warmup,
        "stage_steps": config.stage_steps,
        "fed_s": config.fed_s,
        "step_threads": torch.get_num_threads(),
        "loader_settings": common,
        "varies": varies,
        "pin_memory_default": pin_default,
        "pin_memory_mode": config.pin_memory,
        "device": str(device),
        "order": "rotated by repeat × runs / repeats",
        "cold_runs": config.cold,
        "cold_repeats": 1 if config.cold else 0,
        "timing": "per step: next() wait and step (copy + train) on the host clock; CUDA events for device time; "
        "throughput = timed steps / their wall time, after a final synchronize",
    }


def split_settings(settings: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(settings every run shared, names of those that differ between runs)."""
    names = sorted({k for s in settings for k in s})
    varies = [n for n in names if len({repr(s.get(n)) for s in settings}) > 1]
    return {n: settings[0].get(n) for n in names if n not in varies}, varies


def numerics(device: torch.device, step: dict[str, Any]) -> dict[str, Any]:
    """The numeric settings in force while the runs ran (read from torch and the step, not assumed)."""
    return {
        "precision": step.get("precision"),
        "autocast_dtype": step.get("autocast_dtype"),
        "grad_scaler": step.get("grad_scaler"),
        "channels_last": step.get("channels_last"),
        "compiled": step.get("compiled"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if device.type == "cuda" else None,
    }


def kind_transforms(p: PreparedLoader) -> dict[str, Any]:
    from dlstore.bench.kinds.context import describe_transform

    return {
        "cpu": describe_transform(getattr(p.dataset, "transform", None)),
        "device": describe_transform(p.device_transform),
    }
