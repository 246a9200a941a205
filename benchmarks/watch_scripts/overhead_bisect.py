"""Where does ``dlstore watch`` cost step time on a launch-bound loop? Each variant adds one piece of what
the watched child does, run alternated with the plain script, several rounds; the median of each
variant's step-time ratio to the plain run of its round:

    python benchmarks/watch_scripts/overhead_bisect.py --rounds 5 [--out FILE] -- launch_bound.py --cpu ...

Variants: ``runpy`` (the script through runpy.run_path, as boot runs it, nothing imported), ``imports``
(+ the modules the watched child imports), ``gc`` (+ gc.freeze() of what was imported before the script
starts), ``install_nosampler`` (+ the DataLoader patch and the per-next() timing, no sampler thread),
``install`` (+ the sampler thread: boot as it is), ``watch`` (the real ``dlstore watch --no-replay
--no-trial --no-parts`` CLI: the parent process and its environment too), ``library`` (``dlstore.watch`` around the
script, in-process). Figures go to ``--out`` (JSON) and a table on stdout.

``--inprocess``: watch's cost inside the loop alone, without a process start per sample (the runs above
spend ~7 s starting for ~3 s of steps, so a budget holds few pairs and the machine drifts between them):
one process builds the launch-bound script's loader and step (``launch_bound.build``) and times blocks of
``--block-steps`` steps, alternately plain and inside ``Watch`` (the library form, no replay, trial or
parts), ABBA, until ``--budget`` seconds; each pair's ratio, their median and quartiles:

    python benchmarks/watch_scripts/overhead_bisect.py --inprocess --budget 60 -- launch_bound.py

``--quick --cpu``: the dry run here (tiny sizes, a default target, two rounds).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
QUICK_TARGET = [
    "launch_bound.py",
    "--images",
    "2000",
    "--batch-size",
    "16",
    "--warmup",
    "10",
    "--steps",
    "60",
]
WARM_STEPS = 10  # untimed steps at each block's start (a new iterator; the first block: CUDA, kernels)
VARIANTS = ("runpy", "imports", "gc", "install_nosampler", "install", "watch", "library")


def child(variant: str, target: list[str]) -> None:
    """Run ``target`` (SCRIPT ARGS…) as the watched child would, with ``variant``'s pieces only."""
    if variant != "runpy":
        sys.path.insert(0, str(REPO))
        from dlstore.bench.watch.config import WatchConfig
        from dlstore.bench.watch.record import Session

        config = WatchConfig(replay=False, trial=False, parts=False, warmup=50)
        if variant == "gc":
            gc.freeze()  # what the imports left: out of every later full collection
        if variant in ("install", "install_nosampler"):
            session = Session(config)
            if variant == "install_nosampler":
                session._start_sampler = lambda: None  # type: ignore[method-assign]
            session.install()
        if variant == "library":
            import dlstore

            w = dlstore.watch(replay=False, trial=False, parts=False, warmup=50, quiet=True)
            w.__enter__()
    sys.argv = list(target)
    sys.path[0] = str(Path(target[0]).resolve().parent)
    runpy.run_path(target[0], run_name="__main__")


def result(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith('{"script_result"'):
            return json.loads(line)["script_result"]
    return None


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH")) if p)
    return e


def command(variant: str, target: list[str]) -> list[str]:
    if variant == "plain":
        return [sys.executable, *target]
    if variant == "watch":
        from accuracy import dlstore_cli

        return [
            *dlstore_cli(),
            "watch",
            "--no-replay",
            "--no-trial",
            "--no-parts",
            "--warmup",
            "50",
            "--",
            "python",
            *target,
        ]
    return [sys.executable, __file__, "--child", variant, "--", *target]


def rate(variant: str, target: list[str]) -> tuple[float, float] | None:
    """(images/s, CPU seconds per step) of one run: on a shared machine the CPU per step is the steadier
    figure of the work a step costs."""
    p = subprocess.run(command(variant, target), capture_output=True, text=True, cwd=HERE, env=env())
    got = result(p.stdout) or result(p.stderr)
    if got is None:
        print(f"! {variant}: {p.stderr[-800:]}", file=sys.stderr)
    return None if got is None else (got["img_per_s"], got["cpu_per_step_s"])


def inprocess(
    target: list[str], budget_s: float, block_steps: int, event_every: int | None
) -> dict[str, Any]:
    """Blocks of the launch-bound loop timed in this process, alternately plain and watched (ABBA); each
    pair's ratio (watched / plain step time)."""
    import launch_bound
    import torch
    from common import parse

    sys.path.insert(0, str(REPO))
    from dlstore.bench.watch import Watch, WatchConfig

    sys.argv = list(target)
    args = parse(default_workers=0, default_batch=256, default_steps=1500)
    loader, step, device = launch_bound.build(args)
    extra = {} if event_every is None else {"event_every": event_every}
    config = WatchConfig(replay=False, trial=False, parts=False, warmup=0, **extra)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def block() -> float:
        """Seconds per step over ``block_steps`` steps, after ``WARM_STEPS``; a new iterator (watched
        inside ``Watch``)."""
        it = iter(loader)
        for i in range(WARM_STEPS + block_steps):
            if i == WARM_STEPS:
                sync()
                t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        sync()
        return (time.perf_counter() - t) / block_steps

    def watched() -> float:
        with Watch(config, quiet=True):
            return block()

    block(), watched()  # warm: CUDA, kernels, watch's imports
    plain_s: list[float] = []
    ratios: list[float] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s or len(ratios) < 2:
        if len(ratios) % 2 == 0:
            p, w = block(), watched()
        else:
            w, p = watched(), block()
        plain_s.append(p)
        ratios.append(w / p)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "target": target,
        "device": device.type,
        "block_steps": block_steps,
        "event_every": config.event_every,
        "pairs": len(ratios),
        "wall_s": time.monotonic() - t0,
        "step_ms_plain": 1e3 * statistics.median(plain_s),
        "ratios": ratios,
        "median_overhead": statistics.median(ratios) - 1,
        "quartiles": [q[0] - 1, q[2] - 1],
        **abba(ratios),
    }


def abba(ratios: list[float]) -> dict[str, float]:
    """The overhead with the block's position taken out. Pairs alternate plain-then-watched (even) and
    watched-then-plain (odd); if the second block of a pair runs (1 + s) times the first whatever it is,
    log r = log(1 + o) ± log(1 + s), so the mean of the two orders' mean log ratios is log(1 + o) and half
    their difference log(1 + s). On the H200 (r3) s was +2.5%: the median of all ratios mixed both orders."""
    first, second = [math.log(r) for r in ratios[0::2]], [math.log(r) for r in ratios[1::2]]
    if len(first) < 2 or len(second) < 2:
        return {}
    o = (statistics.mean(first) + statistics.mean(second)) / 2
    se = 0.5 * math.sqrt(statistics.variance(first) / len(first) + statistics.variance(second) / len(second))
    return {
        "abba_overhead": math.exp(o) - 1,
        "abba_overhead_se": se,
        "position_effect": math.exp((statistics.mean(first) - statistics.mean(second)) / 2) - 1,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds: no round started past it")
    p.add_argument("--inprocess", action="store_true", help="alternate in one process (see above)")
    p.add_argument("--block-steps", type=int, default=300, help="--inprocess: timed steps per block")
    p.add_argument("--event-every", type=int, default=None, help="--inprocess: watch's CUDA events, 1 in N")
    p.add_argument("--quick", action="store_true", help="tiny sizes and a default target: the dry run")
    p.add_argument("--cpu", action="store_true", help="the scripts on the CPU (WATCH_SCRIPTS_CPU=1)")
    p.add_argument("target", nargs=argparse.REMAINDER)
    a = p.parse_args()
    target = a.target[1:] if a.target[:1] == ["--"] else a.target
    if a.cpu:
        os.environ["WATCH_SCRIPTS_CPU"] = "1"
    if a.child:
        child(a.child, target)
        return
    if a.quick:
        target = target or QUICK_TARGET
        a.rounds, a.block_steps = min(a.rounds, 2), min(a.block_steps, 40)
        a.budget = min(a.budget, 5.0 if a.inprocess else 120.0)
    if not target:
        p.error("give the target script after --, e.g. -- launch_bound.py (or --quick)")
    if a.inprocess:
        doc = inprocess(target, a.budget if a.budget != float("inf") else 60.0, a.block_steps, a.event_every)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(doc, indent=1))
        print(json.dumps({"inprocess_result": doc}))
        print(
            f"in-process ({doc['device']}, step {doc['step_ms_plain']:.2f} ms, {doc['pairs']} ABBA pairs of "
            f"{doc['block_steps']} steps): watched step time median {doc['median_overhead']:+.2%}, "
            f"quartiles {doc['quartiles'][0]:+.2%} / {doc['quartiles'][1]:+.2%}"
            + (
                f"; position taken out: {doc['abba_overhead']:+.2%} ± {doc['abba_overhead_se']:.2%} (standard "
                f"error), the second block of a pair {doc['position_effect']:+.2%}"
                if "abba_overhead" in doc
                else ""
            )
        )
        return
    variants = a.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in ["plain", *variants]}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    cpu_ratios: dict[str, list[float]] = {v: [] for v in variants}
    t0 = time.monotonic()
    for r in range(a.rounds):
        spent = time.monotonic() - t0
        if r and spent + 1.2 * spent / r > a.budget:
            break
        order = ["plain", *variants] if r % 2 == 0 else [*variants[::-1], "plain"]
        got = {v: rate(v, target) for v in order}
        if got["plain"] is None:
            continue
        base = got["plain"]
        for v, x in got.items():
            if x is not None:
                rates[v].append(x[0])
                if v != "plain":
                    ratios[v].append(base[0] / x[0])  # step time watched / plain
                    cpu_ratios[v].append(x[1] / base[1])  # CPU per step watched / plain
        print(
            f"round {r}: "
            + ", ".join(f"{v} {x[0]:,.0f} ({1e6 * x[1]:.0f} us cpu)" for v, x in got.items() if x),
            file=sys.stderr,
        )
    doc = {
        "target": target,
        "rounds": len(ratios[variants[0]]),
        "wall_s": time.monotonic() - t0,
        "rates": rates,
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "median_overhead": {v: statistics.median(x) - 1 for v, x in ratios.items() if x},
        "median_cpu_overhead": {v: statistics.median(x) - 1 for v, x in cpu_ratios.items() if x},
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1))
    for v, o in doc["median_overhead"].items():
        per = ", ".join(f"{x - 1:+.1%}" for x in ratios[v])
        cpu = doc["median_cpu_overhead"][v]
        print(f"{v:18s} step time median {o:+.2%}, CPU per step median {cpu:+.2%}   per round: {per}")


if __name__ == "__main__":
    main()
