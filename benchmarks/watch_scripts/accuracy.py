"""How right is ``dlstore watch`` on ordinary training scripts (benchmarks/watch_scripts/, no dlstore
inside)? One command runs the study inside ``--budget`` seconds and writes its targets:

    python benchmarks/watch_scripts/accuracy.py --out $OUT [--budget 140] [--cases A,B] [--quick] [--cpu]

For each case: the script alone with its own hand timing of next() (the independent wait measurement),
then the same script under ``dlstore watch --json --try-cache``, then each recommendation applied and the
script re-run (DataLoader flags; a cache converted with the advised ``dlstore convert`` command and read
with ``--cache``). Each case has a time budget: its runs are killed past it and the case keeps what
finished. ``$OUT/watch_accuracy.json`` is rewritten after every run and ``$OUT/targets.json`` at the end.
``--quick --cpu`` is the dry run (tiny sizes, CPU).

Targets: the data-wait share within ±5 points of the hand timing; the verdict names input for the
0-worker augment case and compute for ResNet-50; each recommendation's predicted rate within ±20% of the
rate measured with it applied. The figures of the checks this study had before (the rate with data free
in paired replays, watch's overhead on a launch-bound loop) are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# name: (script, its arguments, what the verdict must name)
CASES: dict[str, tuple[str, list[str], str | None]] = {
    "smallcnn_augment_w0": ("smallcnn_augment.py", ["--workers", "0"], "input"),
    "resnet50": ("resnet50.py", [], "compute"),
    "smallcnn_augment_w4": ("smallcnn_augment.py", ["--workers", "4"], None),
}
INPUT_STAGES = ("transform", "read", "cores")
WORK = Path(os.environ.get("WATCH_ACCURACY_WORK", "/tmp/watch_accuracy_work"))  # caches made on the way
# the dlstore CLI without installing it: cli/ is the package dlstore.cli (pyproject's package-dir)
CLI = (
    "import sys, importlib.util as u; "
    f"s = u.spec_from_file_location('dlstore.cli', {str(REPO / 'cli' / '__init__.py')!r}, "
    f"submodule_search_locations=[{str(REPO / 'cli')!r}]); "
    "m = u.module_from_spec(s); sys.modules['dlstore.cli'] = m; s.loader.exec_module(m); "
    "sys.argv[0] = 'dlstore'; m.main()"
)


def dlstore_cli() -> list[str]:
    return [sys.executable, "-c", CLI]


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH")) if p)
    return e


class Clock:
    """The study's time: a global deadline and the current case's; each run gets what is left of both."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.end = self.t0 + budget_s
        self.case_end = self.end

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        """What the current case may still use."""
        return min(self.end, self.case_end) - time.monotonic()

    def study_left(self) -> float:
        return self.end - time.monotonic()

    def start_case(self, budget_s: float) -> None:
        self.case_end = min(self.end, time.monotonic() + budget_s)


CLOCK = Clock(float("inf"))


def run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group, killed whole (a watched script's child too) once the case's
    or the study's time is out; exit code -9 then, and a "timed out" line in stderr."""
    limit = max(1.0, CLOCK.left() if timeout is None else min(timeout, CLOCK.left()))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE, env=env(),
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ntimed out after {limit:.0f} s (the case's time budget)"
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if p.returncode != 0:
        print(f"! exit {p.returncode}: {' '.join(cmd[-8:])}\n{p.stderr[-1500:]}", file=sys.stderr)
    return p


def script_result(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith('{"script_result"'):
            return json.loads(line)["script_result"]
    return None


def plain(script: str, args: list[str]) -> dict[str, Any] | None:
    return script_result(run([sys.executable, script, *args]).stdout)


def watched(script: str, args: list[str], extra: list[str]) -> tuple[dict[str, Any] | None, Any]:
    """(the script's own result, watch's JSON document)."""
    p = run([*dlstore_cli(), "watch", "--json", *extra, "--", "python", script, *args])
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
    return script_result(p.stderr), doc  # with --json the script's stdout goes to stderr


def primary(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["loaders"] if r["index"] == doc["primary"])


def flags_for(command: str) -> list[str] | None:
    """A DataLoader recommendation as the scripts' flags; None when it is not one."""
    if not command.startswith("DataLoader("):
        return None
    flags: list[str] = []
    m = re.search(r"num_workers=(\d+)", command)
    if m:
        flags += ["--workers", m.group(1)]
    if "persistent_workers=True" in command:
        flags.append("--persistent")
    if "pin_memory=True" in command:
        flags.append("--pin")
    return flags or None


def override(args: list[str], flags: list[str]) -> list[str]:
    out = list(args)
    for flag in ("--workers",):
        if flag in flags and flag in out:
            i = out.index(flag)
            del out[i : i + 2]
    return out + flags


def longer(args: list[str], expected: float, seconds: float) -> list[str]:
    """``args`` with --steps raised to about ``seconds`` at ``expected`` img/s (2,000 at most), and
    --warmup to the advised workers' queue (2 × workers + 1) when longer."""
    out = list(args)
    batch = int(out[out.index("--batch-size") + 1]) if "--batch-size" in out else 256
    workers = int(out[out.index("--workers") + 1]) if "--workers" in out else 0
    for flag, least in (
        ("--steps", min(2000, round(seconds * expected / batch))),
        ("--warmup", 2 * workers + 1),
    ):
        if flag in out:
            i = out.index(flag)
            out[i + 1] = str(max(int(out[i + 1]), least))
    return out


def apply_cache(advice: dict[str, Any], work: Path) -> tuple[list[str] | None, dict[str, Any]]:
    """Run the advised ``dlstore convert SOURCE DEST --size S …`` (DEST under ``work``, not $OUT: it is not
    a result); the script's flags that read it as advised."""
    m = re.match(r"dlstore convert (\S+) DEST (--size \d+[^;#]*)", advice["command"])
    if not m:
        return None, {"why": "no convert command in the advice"}
    plan = advice["cache"]
    dest = work / f"cache-s{plan['size']}-c{plan['channels']}"
    t = time.perf_counter()
    if not (dest / "dlstore.json").is_file():
        p = run([*dlstore_cli(), "convert", m.group(1), str(dest), *m.group(2).split()])
        if p.returncode != 0:
            return None, {"why": f"convert failed: {p.stderr[-300:]}"}
    info = {
        "convert": f"dlstore convert {m.group(1)} {dest} {m.group(2).strip()}",
        "convert_s": time.perf_counter() - t,
    }
    flags = ["--cache", str(dest)] + (["--gpu-augment", "--workers", "0"] if plan["gpu"] else [])
    return flags, info


def applied(
    script: str,
    args: list[str],
    advice: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    save: Any,
    seconds: float,
) -> None:
    """Each recommendation with a predicted rate, applied to the script and re-run; a row appended to
    ``rows`` (and saved) as each finishes. The re-run times about ``seconds`` at the predicted rate (its
    --steps raised to that), after a warm-up that empties the advised workers' first queue."""
    for a in advice:
        row: dict[str, Any] = {"text": a["text"], "expected_img_per_s": a.get("expected_img_per_s")}
        rows.append(row)
        if not a.get("expected_img_per_s"):
            continue
        flags, info = apply_cache(a, WORK) if a.get("cache") else (flags_for(a.get("command") or ""), {})
        row.update(info, flags=flags)
        if flags:
            got = plain(script, longer(override(args, flags), a["expected_img_per_s"], seconds))
            row["measured"] = got
            if got:
                row["measured_img_per_s"] = got["img_per_s"]
                row["error"] = got["img_per_s"] / a["expected_img_per_s"] - 1
                if a.get("grounded_img_per_s"):  # --try-cache's measured loader composed with the step
                    row["grounded_img_per_s"] = a["grounded_img_per_s"]
                    row["grounded_error"] = got["img_per_s"] / a["grounded_img_per_s"] - 1
        save()


def measure_case(name: str, sizes: dict[str, Any], out: Path, case: dict[str, Any], save: Any) -> None:
    """One case into ``case`` (saved after each run): the script's own timing, the watched run, each
    recommendation applied."""
    script, base, want = CASES[name]
    steps = sizes["steps_for"].get(name, sizes["steps"])
    args = [*base, *sizes["args"].get(script, []), "--warmup", str(sizes["warmup"]), "--steps", str(steps)]
    case.update(script=script, args=args)
    case["hand"] = plain(script, [*args, "--hand", str(out / f"{name}-hand.json")])
    save()
    watch_args = [
        "--warmup", str(sizes["warmup"]),
        "--steps", str(sizes["warmup"] + steps),
        "--replay-batches", "4",
        "--replay-s", str(sizes["replay_s"]),
        "--trial-s", str(sizes["trial_s"]),
        "--parts-budget", str(sizes["parts_budget"]),
        "--try-cache",
        "--out", str(out / name),
    ]  # fmt: skip
    # the script is given steps enough for any window; watch's --steps ends it after the observed steps,
    # the replay and the trial (both last a time, not a count)
    _, doc = watched(script, [*args[:-1], "1000000"], watch_args)
    if doc is None or not doc.get("loaders"):
        case["error"] = "watch gave no report"
        return
    rep = primary(doc)
    model, binding = rep.get("model") or {}, rep.get("binding") or {}
    case["watch"] = {
        "verdict": doc["verdict"],
        "wait_share": rep["steady"]["wait_share"],
        "img_per_s": rep["steady"]["img_per_s"],
        "data_free_img_per_s": model.get("data_free_img_per_s"),
        "stage": binding.get("stage"),
        "binds": binding.get("text"),
        "predicted_img_per_s": model.get("predicted_img_per_s"),
        "try_cache": rep.get("try_cache"),
        "advice": doc["advice"],
    }
    case["checks"] = checks(want, case)
    save()
    case["recommendations"] = []
    applied(script, args, doc["advice"], case["recommendations"], save, sizes["applied_s"])


def checks(want: str | None, case: dict[str, Any]) -> dict[str, Any]:
    w, hand = case.get("watch"), case.get("hand")
    out: dict[str, Any] = {}
    if w is None:
        return out
    if hand:
        out["wait_share_points"] = 100 * (w["wait_share"] - hand["wait_share"])
        out["rate_vs_hand"] = w["img_per_s"] / hand["img_per_s"] - 1
    if want == "input":
        out["verdict_ok"] = w["wait_share"] >= 0.20 and w["stage"] in INPUT_STAGES
    elif want == "compute":
        out["verdict_ok"] = w["stage"] == "compute"
    return out


def targets(results: dict[str, Any]) -> Any:
    """The study's target rows (benchmarks/harness.py's)."""
    sys.path.insert(0, str(HERE.parent))
    import harness

    t = harness.Targets()
    recs = []
    for name, c in results["cases"].items():
        k, w, hand = c.get("checks", {}), c.get("watch") or {}, c.get("hand") or {}
        if "wait_share_points" in k:
            t.add(
                f"watch: {name}: data-wait share vs the script's own timing of next() (|points|, at most 5)",
                abs(k["wait_share_points"]),
                100 * hand["wait_share"],
                5.0,
                f"watch {100 * w['wait_share']:.1f}%, the script {100 * hand['wait_share']:.1f}%",
                higher=False,
            )
        if "verdict_ok" in k and not results["cpu"]:  # on the CPU the step binds: no verdict to check
            t.add(f"watch: {name}: the verdict names {CASES[name][2]}", float(k["verdict_ok"]), 1.0, 1.0,
                  f"stage {w.get('stage')}: {w.get('binds')}")  # fmt: skip
        recs += [(name, r) for r in c.get("recommendations", []) if "error" in r]
    if recs:
        t.add(
            "watch: recommendations applied, predicted rate within ±20% of the measured (share)",
            sum(abs(r["error"]) <= 0.20 for _, r in recs),
            len(recs),
            1.0,
            "; ".join(
                f"{n}: {r['expected_img_per_s']:,.0f} → {r['measured_img_per_s']:,.0f}" for n, r in recs
            ),
        )
    return t


def sizes_for(quick: bool) -> dict[str, Any]:
    if quick:  # the dry run: tiny sizes, every path taken once
        return {
            "warmup": 3, "steps": 12, "replay_s": 0.3, "trial_s": 0.3, "applied_s": 0.2, "parts_budget": 0.3,
            "steps_for": {},
            "case_s": {"smallcnn_augment_w0": 60, "resnet50": 60, "smallcnn_augment_w4": 60},
            "args": {
                "smallcnn_augment.py": ["--images", "400", "--batch-size", "16", "--root", "/tmp/watch_fmnist_quick"],
                "resnet50.py": ["--images", "16", "--batch-size", "2", "--workers", "2"],
            },
        }  # fmt: skip
    return {
        "warmup": 20,
        "steps": 120,
        # watch's replay and in-loop trial 1.5 s each; each advice applied timed ~2 s at its predicted rate
        "replay_s": 1.5,
        "trial_s": 1.5,
        "applied_s": 2.0,
        "parts_budget": 1.5,
        # timed steps, >= ~1 s of real steps: ~100 ms a step at 0 workers, ~30 ms for ResNet-50
        "steps_for": {"smallcnn_augment_w0": 50, "resnet50": 80},
        # seconds each case may take (its runs are killed past it); the first case makes the 20,000 PNGs
        "case_s": {"smallcnn_augment_w0": 85, "resnet50": 55, "smallcnn_augment_w4": 75},
        "args": {"smallcnn_augment.py": ["--root", "/tmp/watch_fmnist_folder"]},
    }


def main() -> None:
    global CLOCK
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "watch_accuracy_out")))
    p.add_argument("--cases", default="smallcnn_augment_w0,resnet50", help=f"some of {','.join(CASES)}")
    p.add_argument("--budget", type=float, default=140.0, help="seconds for the whole study")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every path")
    p.add_argument("--cpu", action="store_true", help="run the scripts on the CPU (WATCH_SCRIPTS_CPU=1)")
    a = p.parse_args()
    if a.cpu:
        os.environ["WATCH_SCRIPTS_CPU"] = "1"
    CLOCK = Clock(a.budget)
    sizes = sizes_for(a.quick)
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"sizes": sizes, "cpu": a.cpu, "cases": {}, "skipped": [], "case_wall_s": {}}

    def save() -> None:
        results["wall_s"] = CLOCK.elapsed()
        tmp = a.out / "watch_accuracy.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(a.out / "watch_accuracy.json")

    names = a.cases.split(",")
    for i, name in enumerate(names):
        if CLOCK.study_left() < 10:
            results["skipped"] += names[i:]
            break
        # a case gets what the study has left less the later cases' shares: the time earlier cases did not
        # use is its too, the later cases' never
        later = sum(sizes["case_s"].get(n, 0) for n in names[i + 1 :])
        CLOCK.start_case(max(10.0, CLOCK.study_left() - later))
        print(f"[{CLOCK.elapsed():6.1f} s] {name}", file=sys.stderr, flush=True)
        t = time.monotonic()
        results["cases"][name] = {}
        try:
            measure_case(name, sizes, a.out, results["cases"][name], save)
        except Exception as e:  # one case's failure (a bad report) must not lose the others
            results["cases"][name]["error"] = f"{type(e).__name__}: {e}"
        results["case_wall_s"][name] = time.monotonic() - t
        save()
    rows = targets(results)
    (a.out / "targets.json").write_text(json.dumps({"targets": rows}, indent=1))
    print(rows.table(90))


if __name__ == "__main__":
    main()
