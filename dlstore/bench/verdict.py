"""From measured parts and measured runs to predictions, a bottleneck per run, one line per loader kind and
at most five recommendations, most valuable first. Pure functions over plain numbers, so tests feed them
parts of known cost (see ``predict`` for how the parts compose into a rate)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dlstore.bench import advice as rules
from dlstore.bench.advice import STAGE_WORDS, decode_lanes, decoder_code, fmt, item, plural
from dlstore.bench.predict import FedTiming, LoaderTiming, LoopParts, compose, prediction_error

KNEE_FRACTION = 0.95
PREDICTION_TOLERANCE = 0.20
RUN_KEYS = ("loader", "workers", "pin_memory", "img_per_s", "bottleneck")  # "best" and "default"


@dataclass
class KindStages:
    """What was measured alone for one loader kind: rates in images/s, per-batch timings (``predict``)."""

    read: float | None = None
    transform_by_workers: dict[int, float] = field(default_factory=dict)
    h2d_pinned: float | None = None
    h2d_pageable: float | None = None
    compute: float | None = None
    loader: dict[tuple[int, bool], LoaderTiming] = field(default_factory=dict)
    fed: dict[bool, FedTiming] = field(default_factory=dict)
    read_limit: float | None = None  # images/s of a cold read when the data cannot stay in the page cache

    def loader_at(self, workers: int, pin: bool) -> LoaderTiming | None:
        if (workers, pin) in self.loader:
            return self.loader[(workers, pin)]
        same = [k for k in self.loader if k[1] == pin] or list(self.loader)
        if not same:
            return None
        return self.loader[min(same, key=lambda k: abs(k[0] - workers))]

    def fed_at(self, pin: bool, batch: int) -> FedTiming | None:
        if pin in self.fed:
            return self.fed[pin]
        if self.fed:
            return next(iter(self.fed.values()))
        if self.compute:
            return FedTiming(batch / self.compute, 0.0)
        return None

    def copy_bound(self, pin: bool) -> bool:
        h2d = self.h2d_pinned if pin or self.h2d_pageable is None else self.h2d_pageable
        return bool(h2d and self.compute and h2d < self.compute)


@dataclass
class Facts:
    """What the advice needs besides the numbers."""

    device: str  # "cuda" or "cpu"
    device_label: str
    batch_size: int
    source: str = "demo"
    size: int = 64
    cores: int = 1
    mem_available: int | None = None
    raw_cache_bytes: int | None = None  # what a raw RAM cache of this source would hold
    pin_default: bool = False
    apply: dict[str, str] = field(default_factory=dict)  # kind → how a user gets it (command or code)
    substituted: dict[str, str] = field(default_factory=dict)  # kind → what it ran instead of what was asked
    precision: str = "fp32"
    transform: str = "light"
    bench_command: str = "dlstore bench"
    # kinds whose worker count is DecodeLoader's cpu_decoders (CPU decode processes beside nvJPEG)
    cpu_decoder_kinds: frozenset[str] = frozenset()


def parts_of(run: dict[str, Any], ks: KindStages, facts: Facts) -> LoopParts | None:
    loader = ks.loader_at(run["workers"], run["pin_memory"])
    fed = ks.fed_at(run["pin_memory"], facts.batch_size)
    if loader is None or fed is None:
        return None
    probe = run.get("loader_probe") or {}
    if loader.in_caller and probe.get("batches"):
        # the loader alone timed right before and after each repeat (``endtoend.probe_around``)
        loader = replace(loader, period_s=probe["period_s"], main_s=probe["main_s"], cpu_s=probe["cpu_s"])
    if probe.get("beside_serial_s") is not None:
        loader = replace(loader, beside_serial_s=probe["beside_serial_s"])
    return LoopParts(
        batch=facts.batch_size,
        workers=run["workers"],
        loader=loader,
        fed=fed,
        cores=facts.cores,
        read_s=facts.batch_size / ks.read_limit if ks.read_limit else None,
        step_on_host=facts.device == "cpu",
        copy_bound=ks.copy_bound(run["pin_memory"]),
    )


def annotate_runs(stages: dict[str, KindStages], runs: list[dict[str, Any]], facts: Facts) -> None:
    """Add predicted_img_per_s, bottleneck, prediction_error, limits_ms and budget_ms to each run, in place."""
    for run in runs:
        parts = parts_of(run, stages.get(run["loader"], KindStages()), facts)
        if parts is None:
            run.update(predicted_img_per_s=None, bottleneck=None, prediction_error=None, limits_ms={})
            continue
        pred = compose(parts)
        run["predicted_img_per_s"] = pred.img_per_s
        run["bottleneck"] = run_stage(pred.bottleneck, run, stages.get(run["loader"], KindStages()), facts)
        run["prediction_error"] = prediction_error(run["img_per_s"], pred.img_per_s)
        run["limits_ms"] = {k: 1e3 * v for k, v in pred.terms_s.items()}
        run["budget_ms"] = {"predicted": pred.budget_ms(parts), "measured": run.get("measured_ms")}


def run_stage(model_stage: str, run: dict[str, Any], ks: KindStages, facts: Facts) -> str:
    """The stage a run is named by (``advice.named_stage``): the model's, or the step's near its rate alone."""
    return rules.named_stage(model_stage, run["img_per_s"], ks.compute, on_host=facts.device == "cpu")


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


def kind_summary(sweep: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One kind in one line's worth of numbers: its best configuration, the knee, what more workers did."""
    k = knee(sweep)
    best = next(r for r in sweep if r["workers"] == k["best_workers"])
    return {
        **k,
        "bottleneck": best["bottleneck"],
        "predicted_img_per_s": best["predicted_img_per_s"],
        "prediction_error": best["prediction_error"],
        "by_workers": {r["workers"]: r["img_per_s"] for r in sweep},
        "errors": [r["prediction_error"] for r in sweep if r["prediction_error"] is not None],
    }


def _count(kind: str, n: int, facts: Facts) -> str:
    """``n`` of what the kind's worker count means: DataLoader workers, or CPU decode processes."""
    if kind in facts.cpu_decoder_kinds:
        return f"nvJPEG + {plural(n, 'CPU decoder')}" if n else "nvJPEG alone"
    return plural(n, "worker")


def lanes_advice(kinds: dict[str, dict[str, Any]], facts: Facts) -> dict[str, Any]:
    """Per kind with CPU decoders: the lanes and ``cpu_decoders`` measured best, and the call."""
    out = {}
    for name in sorted(facts.cpu_decoder_kinds & set(kinds)):
        k = kinds[name]
        n = k["knee_workers"]
        out[name] = {
            "lanes": decode_lanes(n),
            "cpu_decoders": n,
            "img_per_s": k["knee_img_per_s"],
            "by_cpu_decoders": k["by_workers"],
            "code": decoder_code(n, facts.batch_size),
        }
    return out


def analyse(
    stages: dict[str, KindStages], runs: list[dict[str, Any]], cold: dict[str, dict[str, Any]], facts: Facts
) -> dict[str, Any]:
    """Annotate runs, then one summary per kind, the verdict (one sentence), its detail and the advice."""
    annotate_runs(stages, runs, facts)
    sweeps = default_runs(runs, facts.pin_default)
    if not sweeps:
        return {"verdict": "No runs were measured.", "recommendations": [], "advice": []}
    kinds = {name: kind_summary(sweep) for name, sweep in sweeps.items()}
    best = max((r for s in sweeps.values() for r in s), key=lambda r: r["img_per_s"])
    compute = stages.get(best["loader"], KindStages()).compute
    default = sweeps[next(iter(sweeps))][0]  # the first kind at its fewest workers: DataLoader's default
    advice = rules.rank(
        _best_config_advice(best, default, kinds, facts)
        + _bound_advice(best, stages, facts)
        + _pin_advice(runs, facts)
    )
    alone = stages.get(default["loader"], KindStages()).compute
    return {
        "verdict": rules.lead(
            default["bottleneck"] or "",
            default["img_per_s"],
            alone,
            default["wait"]["sum_over_wall"],
            advice[0] if advice else None,
            f"{STAGE_WORDS.get(default['bottleneck'], default['bottleneck'])} for {default['loader']} with "
            f"{_count(default['loader'], default['workers'], facts)}",
        ),  # fmt: skip
        "detail": detail_text(best, kinds, compute, facts),
        "kinds": kinds,
        "recommendations": rules.recommendations(advice),
        "advice": advice,
        "lanes": lanes_advice(kinds, facts),
        **{name: {k: run[k] for k in RUN_KEYS} for name, run in (("best", best), ("default", default))},
        "prediction": prediction_summary(runs),
    }


def prediction_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["prediction_error"]) for r in runs if r.get("prediction_error") is not None]
    return {
        "runs": len(errors),
        "within_tolerance": sum(e <= PREDICTION_TOLERANCE for e in errors),
        "tolerance": PREDICTION_TOLERANCE,
        "max_abs_error": max(errors) if errors else None,
    }


def detail_text(
    best: dict[str, Any],
    kinds: dict[str, dict[str, Any]],
    compute: float | None,
    facts: Facts,
) -> str:
    """The figures behind the verdict: the step alone, raw's peak, the fastest run and what limits it."""
    text = [f"The training step alone runs {fmt(compute)} img/s ({facts.precision}) on {facts.device_label}."]
    raw = kinds.get("raw")
    speedup = (
        f", {best['img_per_s'] / raw['best_img_per_s']:.1f}× raw" if raw and best["loader"] != "raw" else ""
    )
    e = best.get("prediction_error")
    text.append(
        f"Fastest measured: {best['loader']} with {_count(best['loader'], best['workers'], facts)} at "
        f"{fmt(best['img_per_s'])} img/s (range {fmt(best['img_per_s_min'])}–{fmt(best['img_per_s_max'])}"
        f"{speedup}), limited by {STAGE_WORDS.get(best['bottleneck'], '?')}; predicted "
        f"{fmt(best['predicted_img_per_s'])} img/s"
        + ("" if e is None else f", measured {100 * e:+.0f}%")
        + "."
    )
    if best["loader"] in facts.substituted:
        text.append(f"Note: {best['loader']} {facts.substituted[best['loader']]}.")
    wait = best["wait"]
    if best["bottleneck"] == "compute":
        text.append(
            f"The input keeps up: the loop waits for data {100 * wait['sum_over_wall']:.0f}% of the time."
        )
    elif best["bottleneck"] == "shared":
        text.append(
            "Each part alone keeps up with the step, yet the loop ran below the step alone and waited for "
            f"data {100 * wait['sum_over_wall']:.0f}% of the time: no single change is sure to help."
        )
    else:
        text.append(
            f"The loop waits for data {100 * wait['sum_over_wall']:.0f}% of the time (p95 wait "
            f"{wait['p95_ms']:.1f} ms)."
        )
    return " ".join(text)


def _best_config_advice(
    best: dict[str, Any], default: dict[str, Any], kinds: dict[str, dict[str, Any]], facts: Facts
) -> list[dict[str, Any]]:
    """Move to the fastest configuration (kind and its knee worker count), measured against the default."""
    out = []
    k = kinds[best["loader"]]
    rate, base = k["knee_img_per_s"], default["img_per_s"]
    if base and rate >= rules.WORTH_FRACTION * base:
        how, workers = facts.apply.get(best["loader"]), k["knee_workers"]
        with_n = f" with {_count(best['loader'], workers, facts)}" if workers else ""
        code = rules.workers_code(workers, facts.pin_default) if workers else None
        if best["loader"] in facts.cpu_decoder_kinds:  # its count is CPU decoders: the fast loader's call
            code = decoder_code(workers, facts.batch_size)
        command = "; ".join(c for c in (how, code) if c) or None
        sub = facts.substituted.get(best["loader"])
        out.append(
            item(
                f"Use {best['loader']}{with_n}: {fmt(rate)} img/s measured, {rate / base:.1f}× the default configuration "
                f"({default['loader']} with {plural(default['workers'], 'worker')}, {fmt(base)} img/s)"
                + (f"; it {sub}." if sub else "."),
                command,
                rate / base,
                rate,
                what=f"the {best['loader']} loader{with_n}",
                rate_word="measured",
            )
        )
    for name, kk in kinds.items():  # a kind's own worker count, when it is not the best kind
        zero = kk["by_workers"].get(0)
        if name == best["loader"] or not kk["knee_workers"] or not zero:
            continue
        if kk["knee_img_per_s"] >= rules.WORTH_FRACTION * zero:
            decoders = name in facts.cpu_decoder_kinds
            n, what = kk["knee_workers"], _count(name, kk["knee_workers"], facts)
            hurts = ", ".join(f"{h['workers']}: {fmt(h['img_per_s'])}" for h in kk["hurts"])
            more = f"; more {'decoders' if decoders else 'workers'} are slower ({hurts})" if hurts else ""
            out.append(
                item(
                    f"If you keep {name}: {what} {'gives' if n == 1 else 'give'} {fmt(kk['knee_img_per_s'])} "
                    f"img/s, {kk['knee_img_per_s'] / zero:.1f}× its {'nvJPEG-alone' if decoders else '0-worker'} "
                    f"rate{more}.",
                    decoder_code(n, facts.batch_size) if decoders else rules.workers_code(n),
                    # ranks below moving to the best kind: its gain is against its own 0-worker rate
                    kk["knee_img_per_s"] / default["img_per_s"] if default["img_per_s"] else None,
                    kk["knee_img_per_s"],
                    what=f"the {name} loader with {what}",
                    rate_word="measured",
                )
            )
    return out


def _bound_advice(best: dict[str, Any], stages: dict[str, KindStages], facts: Facts) -> list[dict[str, Any]]:
    """What to change when even the best configuration is limited: the step, the copy, the host, the cores."""
    b = best["bottleneck"]
    ks = stages.get(best["loader"], KindStages())
    if b == "compute":  # named so only near the step alone's rate (``advice.named_stage``)
        faster = " --precision bf16 --channels-last --compile" if facts.precision == "fp32" else " --compile"
        command = facts.bench_command + ("" if facts.device == "cpu" else faster)
        return [rules.step_advice("compute", facts.device != "cpu", best["img_per_s"], command)]
    if b == "host":
        command = f"{facts.bench_command} --batch-size {2 * facts.batch_size} --compile"
        return [rules.step_advice("host", True, best["img_per_s"], command)]
    if b == "h2d":
        return [
            item(
                f"The copy to the GPU limits {best['loader']}: {fmt(ks.h2d_pinned)} img/s pinned vs "
                f"{fmt(ks.h2d_pageable)} pageable. Ship uint8 (4× fewer bytes than float32) from pinned memory "
                "and convert and normalise on the device.",
                "DataLoader(..., pin_memory=True); x = x.to('cuda', non_blocking=True)",
                None,
            )
        ]
    if b == "read":
        return [read_advice(best, ks, facts)]
    if b == "transform" and facts.transform == "augment":
        return [
            item(
                f"CPU augmentation limits {best['loader']}: move it to the GPU (GpuAugment after the copy).",
                f"{facts.bench_command} --transform gpu-augment",
                None,
            )
        ]
    if b == "cores":
        command, _ = rules.convert_command(
            facts.source, facts.size, needed=facts.raw_cache_bytes, avail=facts.mem_available
        )
        return [
            item(
                f"{best['loader']} needs more CPU than the {plural(facts.cores, 'usable core')} give: use fewer "
                "workers, a cheaper decode (a cache), or more cores.",
                command,
                None,
            )
        ]
    return []


def read_advice(best: dict[str, Any], ks: KindStages, facts: Facts) -> dict[str, Any]:
    """A RAM cache when it fits; otherwise a JPEG cache (about a tenth of the bytes) decoded on the GPU."""
    command, jpeg = rules.convert_command(
        facts.source, facts.size, needed=facts.raw_cache_bytes, avail=facts.mem_available
    )
    fix = (
        ", and a raw RAM cache does not fit: store JPEGs (about a tenth of the bytes) and decode them on the GPU."
        if jpeg
        else ": use fewer bytes per image (a smaller --size, a compressed cache), a faster disk, or a RAM cache "
        "if it fits."
    )
    return item(
        f"Reading the files limits {best['loader']} ({fmt(ks.read_limit)} img/s cold){fix}", command, None
    )


def _pin_advice(runs: Sequence[dict[str, Any]], facts: Facts) -> list[dict[str, Any]]:
    out = []
    by = {(r["loader"], r["workers"], r["pin_memory"]): r for r in runs}
    for (name, w, pin), r in by.items():
        other = by.get((name, w, not pin))
        if not pin or other is None:
            continue
        better, worse = (r, other) if r["img_per_s"] >= other["img_per_s"] else (other, r)
        if better["img_per_s"] >= rules.WORTH_FRACTION * worse["img_per_s"]:
            on = better["pin_memory"]
            out.append(
                item(
                    f"{name} with {plural(w, 'worker')}: pin_memory={on} gives "
                    f"{fmt(better['img_per_s'])} img/s vs {fmt(worse['img_per_s'])}.",
                    f"DataLoader(..., pin_memory={on})",
                    better["img_per_s"] / worse["img_per_s"] * 0.5,  # a gain within one kind, ranked low
                    better["img_per_s"],
                )
            )
    return out


def state_notes(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One note naming the loaders that ran without a state to resume from (a plain DataLoader)."""
    from dlstore.read.order import STATELESS_NOTE

    stateless = sorted(
        {r["loader"] for r in runs if (r.get("loader_settings") or {}).get("keeps_state") is False}
    )
    return [f"{', '.join(stateless)}: {STATELESS_NOTE}"] if stateless else []
