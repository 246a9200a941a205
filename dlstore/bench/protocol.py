"""What a bench run is asked to do (``BenchConfig``) and what it returns (``StageResult``, ``StepRecord``,
``RunResult``). Plain dataclasses, no torch: the CLI, the report and the tests share them."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlstore.machine import usable_cores

SCHEMA_VERSION = 1
STAGES = ("read", "transform", "h2d", "compute")
TRANSFORMS = ("light", "augment", "gpu-augment")
DEVICES = ("auto", "cuda", "cpu")
DEFAULT_LOADERS = ("raw", "ram", "npz", "zarr")
MIN_TIMED_STEPS = 4
# Augmentation of the two seed experiments; RandomResizedCrop's scale there was (0.75, 1).
AUGMENT_SCALE = (0.75, 1.0)
AUGMENT_DEGREES = 15.0


def cycle_window(batches_per_epoch: int, workers: int, warmup: int, steps: int) -> tuple[int, int, int]:
    """(warm-up batches, timed batches, cycle): both whole cycles of the loader's delivery pattern. N workers
    hand over batches in waves of N, and persistent workers refill at every epoch end: a window from mid-wave
    to mid-wave counts batches already waiting, so it starts and ends on a wave (or short epoch) boundary."""
    if workers <= 1:
        cycle = 1
    elif batches_per_epoch <= max(steps, 2 * workers):
        cycle = max(1, batches_per_epoch)
    else:
        cycle = workers
    return -(-warmup // cycle) * cycle, -(-steps // cycle) * cycle, cycle


def default_worker_counts(cores: int | None = None) -> tuple[int, ...]:
    """0 plus the two largest powers of two that fit the cores (2 → 0,1,2; 16 → 0,8,16): each worker count
    is a fresh pool per run, and the default run must stay short."""
    cores = cores or usable_cores()
    powers = [p for p in (1, 2, 4, 8, 16, 32, 64, 128) if p <= cores]
    return (0, *powers[-2:])


@dataclass
class BenchConfig:
    """Everything that decides what is measured. ``None`` fields are resolved by ``run_bench``."""

    source: str = "demo"
    root: Path | None = None
    label: str | None = None  # the label column/field of a parquet, WebDataset, list or Dataset source
    fields: tuple[str, ...] = ()  # --field NAME=KEY[:KIND[:DTYPE]]: extra keys as fields (convert's)
    loaders: tuple[str, ...] = DEFAULT_LOADERS  # loader kinds (dlstore.bench.kinds), not storage formats
    workers: tuple[int, ...] | None = None
    size: int | None = None
    pixels: str = "dlstore"  # how the caches turn files into pixels (ConvertOptions.pixels)
    batch_size: int | None = None  # None: what a user picks for the model (models.default_batch_size)
    model: str = "smallcnn"
    step: str | None = None  # MODULE:CALLABLE, the user's own step(images, labels), instead of --model's
    precision: str | None = None  # None: bf16 autocast on CUDA, fp32 on a CPU
    channels_last: bool | None = None  # None: on for conv nets on CUDA
    compile: bool = False
    transform: str = "light"
    device: str = "auto"
    repeats: int = 2
    steps: int = 16
    warmup: int = 4
    profile: bool = False
    out: Path | None = None
    cache: Path | None = None
    demo_images: int | None = None  # None: enough for 8 batches, at least 256
    # A larger source is benched on a seeded sample (rates are per image; converting it all takes hours).
    max_images: int = 10_000
    max_megapixels: float | None = None  # the caches' conversions (convert's option)
    prefetch_factor: int = 2
    pin_memory: str = "auto"  # auto: on for CUDA, plus a pin-off run at the largest worker count
    # Cap on a run's timed phase (at least MIN_TIMED_STEPS steps): a slow configuration must not dominate.
    max_run_s: float | None = 1.0
    cold: bool = True  # a cold-cache run per loader kind at the largest worker count
    stage_steps: int = 10  # timed batches for the transform / h2d / compute stages
    # Seconds the fed step is timed per round, and the step beside each loader: short windows are noisy.
    fed_s: float = 0.15
    read_max_bytes: int = 256 << 20
    convert_workers: int | None = None
    # The CPU step's intra-op threads: one, as an OpenMP step spin-waits when workers preempt its threads.
    cpu_threads: int = 1
    seed: int = 0
    budget_s: float | None = None  # seconds the run should take (``plan.fit``); None: no budget
    budget_spent_s: float = 0.0  # of the budget, spent before run_bench (the CLI's start: Python, imports)
    user_set: tuple[str, ...] = ()  # the fields the user set: a budget never cuts them

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("root", "out", "cache"):
            d[k] = None if d[k] is None else str(d[k])
        d["loaders"], d["workers"] = list(self.loaders), None if self.workers is None else list(self.workers)
        d["user_set"] = list(self.user_set)
        return d


@dataclass
class StageResult:
    """One stage measured alone for one loader kind; ``img_per_s`` None: the stage does not apply."""

    stage: str
    loader: str
    img_per_s: float | None
    seconds: float = 0.0
    images: int = 0
    label: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepRecord:
    """One step of the real loop: the wait in ``next()`` and the step (copy + train) after it."""

    phase: str  # warmup | timed | cold
    epoch: int
    index: int
    images: int
    wait_s: float
    step_s: float
    device_step_s: float | None = None
    t_s: float = 0.0  # host clock when next() was called, from the loader's creation
    device_start_s: float | None = None  # the step's start and end on the device, same origin
    device_end_s: float | None = None


@dataclass
class RunResult:
    """One repeat of one configuration of the real loop."""

    loader: str
    workers: int
    pin_memory: bool
    repeat: int
    position: int  # order within the repeat, after rotation
    cold: bool = False
    startup_s: float = 0.0  # loader creation → first batch (worker start-up included)
    warmup_s: float = 0.0  # loader creation → end of the warm-up steps
    timed_s: float = 0.0
    img_per_s: float = 0.0  # timed steps only
    first_epoch_img_per_s: float | None = None
    first_epoch_partial: bool = False
    truncated: bool = False  # stopped early by max_run_s
    eviction: dict[str, Any] | None = None
    loader_settings: dict[str, Any] = field(default_factory=dict)  # read back from the loader that ran
    resources: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    # a loader without worker processes, probed right before and after this run (``endtoend.probe_around``)
    loader_probe: dict[str, Any] | None = None
    loader_probe_after: dict[str, Any] | None = None
    cpu_ref_s: float | None = None  # ``stages.cpu_reference_s`` right before the timed steps

    def timed(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase in ("timed", "cold")]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = {k: [getattr(s, k) for s in self.steps] for k in StepRecord.__dataclass_fields__}
        d["wait"] = summarize_waits([s.wait_s for s in self.timed()], self.timed_s)
        return d


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_waits(waits: list[float], wall_s: float) -> dict[str, float]:
    if not waits:
        return dict.fromkeys(("mean_ms", "median_ms", "p95_ms", "max_ms", "sum_over_wall"), math.nan)
    return {
        "mean_ms": 1e3 * statistics.fmean(waits),
        "median_ms": 1e3 * statistics.median(waits),
        "p95_ms": 1e3 * percentile(waits, 95),
        "max_ms": 1e3 * max(waits),
        "sum_over_wall": sum(waits) / wall_s if wall_s > 0 else math.nan,
    }


def parse_int_list(text: str) -> tuple[int, ...]:
    """'0,1,2,4' → (0, 1, 2, 4), sorted and unique; raises ValueError naming the bad item."""
    out = {int(item) for item in text.split(",") if item.strip()}
    if any(v < 0 for v in out):
        raise ValueError(f"worker counts must be >= 0, got {min(out)}")
    if not out:
        raise ValueError("give at least one worker count, e.g. 0,2,4")
    return tuple(sorted(out))


def parse_loaders(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(
            f"unknown loader kind(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(known)}"
        )
    return names
