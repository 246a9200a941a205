"""Where does ``dlstore watch`` cost step time on a launch-bound loop? Each variant adds one piece of what
the watched child does, run alternated with the plain script, several rounds; the median of each
variant's step-time ratio to the plain run of its round:

    python benchmarks/watch_scripts/overhead_bisect.py --rounds 5 [--out FILE] -- launch_bound.py --cpu ...

Variants: ``runpy`` (the script through runpy.run_path, as boot runs it, nothing imported), ``imports``
(+ the modules the watched child imports), ``gc`` (+ gc.freeze() of what was imported before the script
starts), ``install_nosampler`` (+ the DataLoader patch and the per-next() timing, no sampler thread),
``install`` (+ the sampler thread: boot as it is), ``watch`` (the real ``dlstore watch --no-replay
--no-parts`` CLI: the parent process and its environment too), ``library`` (``dlstore.watch`` around the
script, in-process). Figures go to ``--out`` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds: no round started past it")
    p.add_argument("target", nargs=argparse.REMAINDER)
    a = p.parse_args()
    target = a.target[1:] if a.target[:1] == ["--"] else a.target
    if a.child:
        child(a.child, target)
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
