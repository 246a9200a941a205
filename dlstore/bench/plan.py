"""Plan a bench run to fit a time budget (``--budget SECONDS``).

The bench's time is a sum of per-batch costs times the batches each phase takes (the phases of
``run.run_bench``), so the estimate is a pure function of a few measured costs (``Costs``) and of what is
planned (``Plan``). ``fit`` shrinks a plan, cheapest loss first, until it fits, and says what it cut; a
loader the user named and an option the user set are never cut.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dlstore.bench.protocol import MIN_TIMED_STEPS
from dlstore.write.sizes import count

BUDGET_SHARE = 0.85  # plan to 85% of the budget: on 2 shared cores the estimate was 10–25% low
MIN_STAGE_STEPS = 4
MIN_SAMPLE_BATCHES = 8  # as run.DEMO_BATCHES: an epoch is more than a batch
PROBE_BATCHES = 3  # endtoend.PROBE_MIN_BATCHES
BESIDE_WARMUP = 3  # stages.BESIDE_WARMUP
READ_STAGE_S = 0.05  # reading a kind's files twice (small next to the rest; the sample is small)
FIXED_S = 3.0  # the source, the models, the verdict, the outputs (matplotlib dominates)
RUN_OVERHEAD_S = 0.1  # each run and loader-alone measurement: building and closing the loader
LOOP_STEP_FACTOR = 1.25  # a loop's batch over the step alone: bookkeeping, epoch refills, cache misses
# The BenchConfig fields a plan carries (and the budget may shrink), besides the sample's size.
PLAN_FIELDS = (
    "loaders",
    "workers",
    "repeats",
    "steps",
    "warmup",
    "stage_steps",
    "cold",
    "max_run_s",
    "fed_s",
)


@dataclass(frozen=True)
class Costs:
    """What the calibration measured, in seconds. ``batch_s``: one process producing one batch of a loader
    kind (decode or read, transform, collate); ``convert_s``: building a kind's cache, per image of the sample
    (0 when a matching cache is reused or the kind has none)."""

    step_s: float
    batch_s: Mapping[str, float]
    convert_s: Mapping[str, float] = field(default_factory=dict)
    convert_fixed_s: float = 1.0  # a conversion's own start: its pool, the journal, verification
    pool_s: float = 0.3  # starting and stopping a DataLoader's worker processes
    cores: int = 2
    step_on_host: bool = True  # a CPU run: the step takes a core from the loaders' workers
    fixed_s: float = FIXED_S


@dataclass(frozen=True)
class Plan:
    """What the bench will run: the BenchConfig fields the budget may shrink, plus the sample's size."""

    loaders: tuple[str, ...]
    workers: tuple[int, ...]
    repeats: int
    steps: int
    warmup: int
    stage_steps: int
    cold: bool
    images: int  # images the caches are built from (the run's sample)
    batch_size: int
    max_run_s: float | None = 1.0
    fed_s: float = 0.15
    workerless: frozenset[str] = frozenset()  # kinds without worker processes: one run, at 0 workers
    step_looks: int = 1  # distinct batch looks (shape, dtype, device transform): the step alone per look

    def counts(self, kind: str) -> tuple[int, ...]:
        return (0,) if kind in self.workerless else self.workers

    @property
    def epoch_batches(self) -> int:
        return max(1, self.images // self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(loaders=list(self.loaders), workers=list(self.workers), workerless=sorted(self.workerless))
        return d


# --- the estimate -------------------------------------------------------------------------------------


def loader_period(costs: Costs, kind: str, workers: int) -> float:
    """Seconds per batch of the loader alone: one process, or ``workers`` sharing the cores."""
    batch = costs.batch_s[kind]
    return batch if workers == 0 else batch / min(workers, costs.cores)


def loop_period(costs: Costs, kind: str, workers: int, epoch_batches: int | None = None) -> float:
    """Seconds per batch of the loop: at 0 workers produce then step; else the slower of the step and the
    workers (on a CPU no faster than all the work over the cores), one batch an epoch waiting for a refill."""
    batch, step = costs.batch_s[kind], LOOP_STEP_FACTOR * costs.step_s
    if workers == 0:
        return batch + step if costs.step_on_host else max(batch, step)
    period = max(step, batch / min(workers, costs.cores))
    if costs.step_on_host:
        period = max(period, (batch + step) / costs.cores)
    refill = 1 / epoch_batches if epoch_batches else 0.0
    return (1 - refill) * period + refill * (batch + step)


def timed_batches(steps: int, period: float, max_run_s: float | None, floor: int = MIN_TIMED_STEPS) -> int:
    """Timed batches of a run or a loader alone: ``steps``, cut after ``max_run_s`` but never below ``floor``."""
    if max_run_s is None or period <= 0:
        return steps
    return min(steps, max(floor, math.ceil(max_run_s / period)))


def pool_s(costs: Costs, workers: int) -> float:
    return costs.pool_s if workers else 0.0


def run_s(plan: Plan, costs: Costs, kind: str, workers: int, cold: bool = False) -> float:
    """One run of the loop (``endtoend.run_once``); a cold one times only its warm-up, on a fresh pool."""
    period = loop_period(costs, kind, workers, plan.epoch_batches)
    seconds = RUN_OVERHEAD_S + pool_s(costs, workers) + plan.warmup * period
    if cold:
        return seconds
    seconds += timed_batches(plan.steps, period, plan.max_run_s) * period
    if workers == 0:  # probed before and after (``endtoend.probe_around``): the loader alone, the step beside
        alone = costs.batch_s[kind] * max(PROBE_BATCHES, plan.fed_s / 2 / max(costs.batch_s[kind], 1e-9))
        beside = period * (1 + max(PROBE_BATCHES, plan.fed_s / 2 / period))
        seconds += 2 * (costs.batch_s[kind] + alone + beside)
    return seconds


def parts_s(plan: Plan, costs: Costs, kind: str) -> float:
    """The parts phase for one kind (``parts.measure_kind``) at each worker count."""
    seconds = READ_STAGE_S
    for w in plan.counts(kind):
        alone = loader_period(costs, kind, w)
        period = loop_period(costs, kind, w, plan.epoch_batches)
        seconds += RUN_OVERHEAD_S + pool_s(costs, w) + min(plan.warmup, 4) * alone
        seconds += timed_batches(plan.stage_steps, alone, plan.max_run_s, MIN_STAGE_STEPS) * alone
        seconds += (BESIDE_WARMUP + max(plan.stage_steps, math.ceil(plan.fed_s / period))) * period
    return seconds


def step_alone_s(plan: Plan, costs: Costs) -> float:
    """The step alone once per batch look (``stages.measure_compute``): warm-up, then the timed steps."""
    return plan.step_looks * (plan.warmup + max(plan.stage_steps, 8)) * costs.step_s


def probe_s(plan: Plan, costs: Costs) -> float:
    """Once per round: the step alone again, and the fed step (``parts.FedProbe``) per batch look."""
    fed = 7 + max(plan.stage_steps, plan.fed_s / max(costs.step_s, 1e-9))
    return step_alone_s(plan, costs) + plan.step_looks * fed * costs.step_s


def prepare_s(plan: Plan, costs: Costs) -> float:
    """Building the caches the kinds need (``convert_s`` is 0 for a kind whose cache is reused)."""
    building = [k for k in plan.loaders if costs.convert_s.get(k, 0.0) > 0]
    return sum(costs.convert_fixed_s + plan.images * costs.convert_s[k] for k in building)


def estimate(plan: Plan, costs: Costs) -> dict[str, float]:
    """Seconds per phase and in all (``total_s``) for ``plan`` at ``costs``; a pure function."""
    runs = sum(run_s(plan, costs, k, w) for k in plan.loaders for w in plan.counts(k)) * plan.repeats
    if plan.cold:  # one cold run per kind, in the first round only
        runs += sum(run_s(plan, costs, k, max(plan.counts(k)), cold=True) for k in plan.loaders)
    phases = {
        "prepare_s": prepare_s(plan, costs),
        "parts_s": sum(parts_s(plan, costs, k) for k in plan.loaders) + step_alone_s(plan, costs),
        "probes_s": plan.repeats * probe_s(plan, costs),
        "runs_s": runs,
        "fixed_s": costs.fixed_s,
    }
    return {**phases, "total_s": sum(phases.values())}


# --- fitting a plan to a budget -----------------------------------------------------------------------

Cut = Callable[[Plan], "tuple[Plan, str] | None"]


def _set(name: str, value: Any, why: str) -> Cut:
    def cut(plan: Plan) -> tuple[Plan, str] | None:
        old = getattr(plan, name)
        if old is None or (value is not None and old <= value):
            return None
        return dataclasses.replace(plan, **{name: value}), f"{name.replace('_', '-')} {old} → {value} ({why})"

    return cut


def _no_cold(plan: Plan) -> tuple[Plan, str] | None:
    if not plan.cold:
        return None
    return dataclasses.replace(plan, cold=False), "no cold runs (the fetch stall is not measured)"


def _fewer_workers(plan: Plan) -> tuple[Plan, str] | None:
    """Keep 0 and the largest worker count: the ends of the sweep."""
    if len(plan.workers) <= 2:
        return None
    kept = (plan.workers[0], plan.workers[-1])
    dropped = ",".join(str(w) for w in plan.workers[1:-1])
    return dataclasses.replace(
        plan, workers=kept
    ), f"workers {dropped} not swept (kept {kept[0]} and {kept[1]})"


def _smaller_sample(plan: Plan) -> tuple[Plan, str] | None:
    least = MIN_SAMPLE_BATCHES * plan.batch_size
    if plan.images <= least:
        return None
    n = max(least, plan.images // 2)
    return dataclasses.replace(
        plan, images=n
    ), f"a sample of {n:,} images, not {plan.images:,} (the caches' build)"


def _drop_loader(named: frozenset[str]) -> Cut:
    """The last kind the user did not name (the defaults), never the first one."""

    def cut(plan: Plan) -> tuple[Plan, str] | None:
        droppable = [k for k in plan.loaders[1:] if k not in named]
        if not droppable:
            return None
        gone = droppable[-1]
        kept = tuple(k for k in plan.loaders if k != gone)
        return dataclasses.replace(plan, loaders=kept), f"loader {gone} not run (a default, not named)"

    return cut


def cuts_in_order(fixed: frozenset[str], named: frozenset[str]) -> list[tuple[str, Cut]]:
    """(the option a cut changes, the cut), cheapest loss first; ``fixed`` options are the user's and kept."""
    ladder: list[tuple[str, Cut]] = [
        ("cold", _no_cold),
        ("stage_steps", _set("stage_steps", MIN_STAGE_STEPS, "the parts' windows")),
        ("steps", _set("steps", 8, "each run's timed window")),
        ("warmup", _set("warmup", 2, "the warm-up")),
        ("repeats", _set("repeats", 1, "no min–max spread")),
        ("steps", _set("steps", MIN_TIMED_STEPS, "each run's timed window")),
        ("fed_s", _set("fed_s", 0.05, "the fed step's window")),
        ("workers", _fewer_workers),
        ("max_images", _smaller_sample),
        ("loaders", _drop_loader(named)),
    ]
    return [(name, cut) for name, cut in ladder if name not in fixed]


def fit(
    plan: Plan,
    costs: Costs,
    budget_s: float | None,
    fixed: frozenset[str] = frozenset(),
    named: frozenset[str] = frozenset(),
    spent_s: float = 0.0,
) -> tuple[Plan, list[str]]:
    """The plan shrunk, cheapest loss first, until its estimate is within ``BUDGET_SHARE`` of what is left of
    ``budget_s`` after ``spent_s``, and what was cut; ``fixed`` options and ``named`` loaders stay."""
    if not budget_s:
        return plan, []
    target = BUDGET_SHARE * (budget_s - spent_s)
    cuts: list[str] = []
    for _, cut in cuts_in_order(fixed, named):
        while (now := estimate(plan, costs)["total_s"]) > target:
            step = cut(plan)
            if step is None or estimate(step[0], costs)["total_s"] >= now:
                break  # nothing left to cut there, or a cut that saves nothing (a sample whose caches exist)
            plan, why = step
            cuts.append(why)
        if estimate(plan, costs)["total_s"] <= target:
            break
    return plan, cuts


def plan_lines(
    plan: Plan, est: Mapping[str, float], cuts: list[str], budget_s: float | None, spent_s: float = 0.0
) -> list[str]:
    """The plan and its estimate, as the bench logs them before it starts."""
    total = est["total_s"] + spent_s
    within = budget_s and total <= budget_s
    kinds = ", ".join(f"{k} at workers {','.join(map(str, plan.counts(k)))}" for k in plan.loaders)
    lines = [
        f"plan: {kinds}; {count(plan.repeats, 'round')} × {count(plan.steps, 'timed step')} after "
        f"{plan.warmup} warm-up, parts {count(plan.stage_steps, 'batch', 'batches')}"
        f"{', cold runs' if plan.cold else ''}; {count(plan.images, 'image')}",
        "estimate: about {:.0f} s (start-up and calibration {:.0f} s, build caches {:.0f} s, parts {:.0f} s, "
        "probes {:.0f} s, runs {:.0f} s, report {:.0f} s){}".format(
            total,
            spent_s,
            est["prepare_s"],
            est["parts_s"],
            est["probes_s"],
            est["runs_s"],
            est["fixed_s"],
            f" within --budget {budget_s:.0f} s" if within else "",
        ),
    ]
    if cuts:
        lines.append(f"cut to fit --budget {budget_s:.0f} s: " + "; ".join(cuts))
    if budget_s and not within:
        lines.append(
            f"over --budget {budget_s:.0f} s even so: the loaders you named and the options you set are kept; "
            "name fewer loaders, lower --steps/--repeats or raise --budget"
        )
    return lines
