"""From stage rates and measured runs to a bottleneck, a prediction and advice. Pure functions over
plain numbers, so tests feed them stages of known cost.

Prediction: a configuration can go no faster than its slowest stage, so predicted = min(stage rates) and
that stage is the bottleneck. One exception: with 0 workers on a CPU-only run the main process decodes
and trains in turn, so the times add (1 / Σ 1/rate over transform and compute); the bottleneck is still
the slower of the two. Lost time is split as DS-Analyzer does: prep stall = t(cached, measured) −
t(synthetic, compute stage); fetch stall = t(cold) − t(warm) over the same warm-up phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dlstore.bench.protocol import STAGES
from dlstore.formats import FORMATS

KNEE_FRACTION = 0.95
COMPUTE_BOUND_FRACTION = 0.85
PREDICTION_TOLERANCE = 0.20

STAGE_WORDS = {
    "read": "storage read",
    "transform": "CPU decode/transform in the Dataset and its workers",
    "h2d": "host→device copy",
    "compute": "the training step",
}


@dataclass
class KindStages:
    """Stage rates of one loader kind in images/s (None: the stage does not apply)."""

    read: float | None = None
    transform_by_workers: dict[int, float] = field(default_factory=dict)
    h2d_pinned: float | None = None
    h2d_pageable: float | None = None
    compute: float | None = None

    def rates(self, workers: int, pin_memory: bool) -> dict[str, float | None]:
        return {
            "read": self.read,
            "transform": self.transform_at(workers),
            "h2d": self.h2d_pinned if pin_memory or self.h2d_pageable is None else self.h2d_pageable,
            "compute": self.compute,
        }

    def transform_at(self, workers: int) -> float | None:
        if not self.transform_by_workers:
            return None
        if workers in self.transform_by_workers:
            return self.transform_by_workers[workers]
        nearest = min(self.transform_by_workers, key=lambda w: abs(w - workers))
        return self.transform_by_workers[nearest]


def predict(rates: dict[str, float | None], serial: bool = False) -> tuple[float | None, str | None]:
    """(predicted images/s, bottleneck stage) from the stages that apply."""
    usable = {k: v for k, v in rates.items() if k in STAGES and v is not None and v > 0}
    if not usable:
        return None, None
    bottleneck = min(usable, key=lambda k: usable[k])
    if serial:
        in_turn = [usable[k] for k in ("transform", "compute") if k in usable]
        rate = 1.0 / sum(1.0 / r for r in in_turn) if in_turn else usable[bottleneck]
        others = [v for k, v in usable.items() if k not in ("transform", "compute")]
        return min([rate, *others]), bottleneck
    return usable[bottleneck], bottleneck


def annotate_runs(stages: dict[str, KindStages], runs: list[dict[str, Any]], cpu_only: bool) -> None:
    """Add stage_rates, predicted_img_per_s, bottleneck, prediction_error to each run, in place."""
    for run in runs:
        ks = stages.get(run["loader"], KindStages())
        rates = ks.rates(run["workers"], run["pin_memory"])
        predicted, bottleneck = predict(rates, serial=cpu_only and run["workers"] == 0)
        run["stage_rates"] = rates
        run["predicted_img_per_s"] = predicted
        run["bottleneck"] = bottleneck
        run["prediction_error"] = (run["img_per_s"] - predicted) / predicted if predicted else None


def default_runs(runs: Sequence[dict[str, Any]], pin_default: bool) -> dict[str, list[dict[str, Any]]]:
    """Per loader, the sweep over workers with the default pin_memory, sorted by workers."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r["pin_memory"] == pin_default:
            out.setdefault(r["loader"], []).append(r)
    return {k: sorted(v, key=lambda r: r["workers"]) for k, v in out.items()}


def knee(sweep: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Smallest worker count within 5% of the best rate, and where adding workers made things worse."""
    best = max(sweep, key=lambda r: r["img_per_s"])
    knee_run = next(r for r in sweep if r["img_per_s"] >= KNEE_FRACTION * best["img_per_s"])
    hurts = [
        r
        for r in sweep
        if r["workers"] > best["workers"] and r["img_per_s"] < KNEE_FRACTION * best["img_per_s"]
    ]
    return {
        "best_workers": best["workers"],
        "best_img_per_s": best["img_per_s"],
        "knee_workers": knee_run["workers"],
        "knee_img_per_s": knee_run["img_per_s"],
        "hurts": [{"workers": r["workers"], "img_per_s": r["img_per_s"]} for r in hurts],
    }


def stalls(
    stages: dict[str, KindStages],
    sweeps: dict[str, list[dict[str, Any]]],
    cold: dict[str, dict[str, Any]],
    batch_size: int,
    warmup_steps: int,
) -> dict[str, dict[str, Any]]:
    """Per loader at the cold run's worker count: prep stall and fetch stall in ms per batch."""
    out: dict[str, dict[str, Any]] = {}
    for name, sweep in sweeps.items():
        compute = stages.get(name, KindStages()).compute
        c = cold.get(name)
        w = c["workers"] if c else sweep[-1]["workers"]
        run = next((r for r in sweep if r["workers"] == w), sweep[-1])
        t_synth = batch_size / compute if compute else None
        t_cached = batch_size / run["img_per_s"] if run["img_per_s"] else None
        entry: dict[str, Any] = {
            "workers": w,
            "synthetic_ms": _ms(t_synth),
            "cached_ms": _ms(t_cached),
            "prep_stall_ms": _ms(max(0.0, t_cached - t_synth)) if t_synth and t_cached else None,
            "fetch_stall_ms": None,
            "cold_ms": None,
            "fetch_note": "no cold run",
        }
        if c:
            per_batch_cold = c["warmup_s"] / max(1, warmup_steps)
            per_batch_warm = run["warmup_s"] / max(1, warmup_steps)
            entry["cold_ms"] = _ms(per_batch_cold)
            entry["fetch_stall_ms"] = _ms(max(0.0, per_batch_cold - per_batch_warm))
            entry["fetch_note"] = (
                "cold vs warm over the warm-up steps, start-up included"
                if c.get("eviction_worked")
                else "eviction did not take (files cached elsewhere, mapped, or on tmpfs): "
                "the cold run is not cold"
            )
        out[name] = entry
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:,.0f}"


@dataclass
class Facts:
    """What the advice needs besides the numbers."""

    device: str  # "cuda" or "cpu"
    device_label: str
    batch_size: int
    warmup_steps: int
    source: str = "demo"
    size: int = 64
    cores: int = 1
    cache_bytes: dict[str, int] = field(default_factory=dict)
    mem_available: int | None = None
    pin_default: bool = False


def analyse(
    stages: dict[str, KindStages], runs: list[dict[str, Any]], cold: dict[str, dict[str, Any]], facts: Facts
) -> dict[str, Any]:
    """Annotate runs, then the verdict (text) and recommendations (list of text)."""
    cpu_only = facts.device == "cpu"
    annotate_runs(stages, runs, cpu_only)
    sweeps = default_runs(runs, facts.pin_default)
    if not sweeps:
        return {"verdict": "no runs were measured", "recommendations": [], "stalls": {}, "knees": {}}
    knees = {name: knee(sweep) for name, sweep in sweeps.items()}
    best = max((r for s in sweeps.values() for r in s), key=lambda r: r["img_per_s"])
    compute = stages.get(best["loader"], KindStages()).compute
    recs: list[str] = []
    text = [f"The training step alone runs {_fmt(compute)} img/s on {facts.device_label}."]
    raw = knees.get("raw")
    if raw:
        raw_run = next(r for r in sweeps["raw"] if r["workers"] == raw["best_workers"])
        text.append(
            f"raw (per-file decode, as torchvision users have it) peaks at {_fmt(raw['best_img_per_s'])} "
            f"img/s with {_workers(raw['best_workers'])}, limited by "
            f"{STAGE_WORDS.get(raw_run['bottleneck'], '?')}."
        )
    speedup = (
        f", {best['img_per_s'] / raw['best_img_per_s']:.1f}× raw" if raw and best["loader"] != "raw" else ""
    )
    text.append(
        f"Fastest measured: {best['loader']} with {_workers(best['workers'])} at {_fmt(best['img_per_s'])} img/s "
        f"(range {_fmt(best['img_per_s_min'])}–{_fmt(best['img_per_s_max'])}{speedup}); bottleneck: "
        f"{best['bottleneck']} ({STAGE_WORDS.get(best['bottleneck'], '?')}); predicted "
        f"{_fmt(best['predicted_img_per_s'])} img/s{_err(best)}."
    )
    compute_bound = bool(
        best["bottleneck"] == "compute" and compute and best["img_per_s"] >= COMPUTE_BOUND_FRACTION * compute
    )
    if compute_bound:
        text.append(
            f"The step is the limit: the input pipeline keeps up (Σwait/wall "
            f"{100 * best['wait']['sum_over_wall']:.0f}%)."
        )
    else:
        text.append(
            f"The input pipeline starves the step: the loop waits for data "
            f"{100 * best['wait']['sum_over_wall']:.0f}% of the time "
            f"(p95 wait {best['wait']['p95_ms']:.1f} ms)."
        )
    recs += _worker_advice(knees)
    recs += _cache_advice(knees, sweeps, facts)
    recs += _bound_advice(best, stages, compute_bound, facts)
    recs += _pin_advice(runs, facts)
    stall = stalls(stages, sweeps, cold, facts.batch_size, facts.warmup_steps)
    recs += _stall_advice(stall)
    if best["prediction_error"] is not None and abs(best["prediction_error"]) > PREDICTION_TOLERANCE:
        why = (
            f"on a CPU-only run the workers and the training step share {facts.cores} cores"
            if cpu_only and best["workers"] > 0
            else "the stages interfere when run together, or the machine's load changed between measurements"
        )
        recs.append(
            f"The prediction for the fastest configuration missed by {100 * best['prediction_error']:+.0f}%: "
            f"{why}; trust the measured rate."
        )
    return {
        "verdict": " ".join(text),
        "recommendations": recs,
        "stalls": stall,
        "knees": knees,
        "best": {
            "loader": best["loader"],
            "workers": best["workers"],
            "img_per_s": best["img_per_s"],
            "bottleneck": best["bottleneck"],
        },
    }


def _err(run: dict[str, Any]) -> str:
    e = run.get("prediction_error")
    return "" if e is None else f", measured {100 * e:+.0f}% vs predicted"


def _worker_advice(knees: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, k in knees.items():
        out.append(
            f"{name}: {_workers(k['knee_workers'])} reach {_fmt(k['knee_img_per_s'])} img/s, within 5% of its "
            f"best ({_fmt(k['best_img_per_s'])} at {k['best_workers']}); use num_workers={k['knee_workers']}."
        )
        for h in k["hurts"]:
            out.append(
                f"{name}: more workers hurt: {h['workers']} give {_fmt(h['img_per_s'])} img/s vs "
                f"{_fmt(k['best_img_per_s'])} at {k['best_workers']}."
            )
    return out


def _cache_advice(
    knees: dict[str, dict[str, Any]], sweeps: dict[str, list[dict[str, Any]]], facts: Facts
) -> list[str]:
    cached = {k: v for k, v in knees.items() if k != "raw"}
    if "raw" not in knees or not cached:
        return []
    raw = knees["raw"]["best_img_per_s"]
    fmt = max(cached, key=lambda k: cached[k]["best_img_per_s"])
    k = cached[fmt]
    run = next(r for r in sweeps[fmt] if r["workers"] == k["knee_workers"])
    if k["best_img_per_s"] < 1.05 * raw:
        return [
            f"A cache does not lift the bound here: the best cached kind ({fmt}) reaches "
            f"{_fmt(k['best_img_per_s'])} img/s vs raw {_fmt(raw)}."
        ]
    size = facts.cache_bytes.get(fmt)
    mem = ""
    if loads_into_ram(fmt) and size is not None:
        mem = f"; {fmt} keeps it in memory ({size / 1e6:,.0f} MB"
        mem += f" of {facts.mem_available / 1e6:,.0f} MB available)" if facts.mem_available else ")"
    disk = f", {size / 1e6:,.1f} MB on disk" if size is not None else ""
    return [
        f"Convert once: `dlstore convert {facts.source} DEST --format {fmt} --size {facts.size}`{disk}{mem}. "
        f"Measured here {_fmt(k['knee_img_per_s'])} img/s with {_workers(k['knee_workers'])} "
        f"({k['best_img_per_s'] / raw:.1f}× raw's best); expect about {_fmt(run['predicted_img_per_s'])} img/s, "
        f"bounded then by {run['bottleneck']}."
    ]


def loads_into_ram(kind: str) -> bool:
    """Whether a loader kind named after a cache format reads a cache held in RAM (its trait)."""
    return kind in FORMATS and FORMATS[kind].traits.loads_into_ram


def _bound_advice(
    best: dict[str, Any], stages: dict[str, KindStages], compute_bound: bool, facts: Facts
) -> list[str]:
    b = best["bottleneck"]
    if compute_bound:
        if facts.device == "cpu":
            return [
                "No GPU here: the CPU training step is the limit. On a GPU the step is far faster and the input "
                "pipeline decides the rate; run `dlstore bench` on the training machine."
            ]
        return [
            f"The GPU is the limit at {_fmt(best['img_per_s'])} img/s: nothing in the input pipeline needs to "
            f"change ({best['loader']} with {_workers(best['workers'])} is enough). To go faster, speed up the "
            "step (bf16 autocast, channels_last, a larger batch)."
        ]
    ks = stages.get(best["loader"], KindStages())
    if b == "h2d":
        return [
            f"The host→device copy limits {best['loader']}: {_fmt(ks.h2d_pinned)} img/s pinned vs "
            f"{_fmt(ks.h2d_pageable)} pageable. Keep pin_memory=True and ship uint8 (4× fewer bytes than "
            "float32), converting and normalising on the device."
        ]
    if b == "read":
        return [
            f"Storage read limits {best['loader']} ({_fmt(ks.read)} img/s): use fewer bytes per image (a smaller "
            "--size, a compressed zarr/npz cache), a faster disk, or the ram kind if it fits in memory."
        ]
    if b == "transform":
        return [
            f"CPU work per image limits {best['loader']}: move augmentation to the device "
            "(--transform gpu-augment with a cached kind) or add cores/workers."
        ]
    return []


def _pin_advice(runs: Sequence[dict[str, Any]], facts: Facts) -> list[str]:
    out = []
    by = {(r["loader"], r["workers"], r["pin_memory"]): r for r in runs}
    for (name, w, pin), r in by.items():
        other = by.get((name, w, not pin))
        if pin and other:
            out.append(
                f"{name} at {_workers(w)}: pin_memory on {_fmt(r['img_per_s'])} vs off "
                f"{_fmt(other['img_per_s'])} img/s."
            )
    return out


def _stall_advice(stall: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, s in stall.items():
        if s["prep_stall_ms"] is None:
            continue
        line = (
            f"{name} at {_workers(s['workers'])}: {s['cached_ms']:.1f} ms per batch vs {s['synthetic_ms']:.1f} ms "
            f"on synthetic data: prep stall {s['prep_stall_ms']:.1f} ms"
        )
        if s["fetch_stall_ms"] is not None:
            line += f", fetch stall {s['fetch_stall_ms']:.1f} ms ({s['fetch_note']})"
        out.append(line + ".")
    return out
