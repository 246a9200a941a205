"""How right is ``dlstore watch`` on ordinary training scripts (benchmarks/watch_scripts/, no dlstore
inside)? One command runs the whole study, inside ``--budget`` seconds (385 by default):

    python benchmarks/watch_scripts/accuracy.py --out $OUT [--budget 470] [--cases A,B] [--quick] [--cpu]

For each case: the script alone with its own hand timing of next() (the independent wait measurement),
then the same script under ``dlstore watch --json --try-cache``, then the paired replays (the script under
``dlstore watch --replay-rounds 5`` with its own ``--replay-rounds 5``: at five epochs' ends watch's replay,
then the script's own, in one process; the median of the pairs' ratios: ``paired_data_free``), then each
recommendation applied and the script re-run (DataLoader flags; a cache converted with the advised
``dlstore convert`` command and read with ``--cache``). ``--only data_free``: the paired replays alone.
The overhead case runs a launch-bound SmallCNN's blocks plain and watched in one process, then the
script alone and under watch (no replay, no parts) in short runs, both alternated ABBA for as long as the
case's time lasts; the median of the pairs' step-time ratios and their quartiles. Each case has a time budget (``case_s``): its runs are killed past it
and the case keeps what finished. ``$OUT/watch_accuracy.json`` is rewritten after every run, so a cut
study still returns what finished; the watched runs' measured parts and probes are kept in it
(``raw_parts``), so the predictions can be recomputed offline. ``--quick --cpu`` is the dry run (tiny
sizes, CPU). Prints a table last.

Targets (issue 23): data-wait share within ±5 points of the hand timing; rate with data free within ±10%
of the script's own replay (the median of the paired rounds); the verdict names input for the 0-worker augment case and compute for
ResNet-50; each recommendation's predicted rate within ±20% of the rate measured with it applied; watch's
overhead ≤ 1% on the launch-bound model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
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
    "item_every_step": ("item_every_step.py", [], None),
}
OVERHEAD_CASE = ("launch_bound.py", [])
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


def measure_case(
    name: str, sizes: dict[str, Any], out: Path, case: dict[str, Any], save: Any, only: str = "all"
) -> None:
    """One case into ``case`` (saved after each run): the script's own timing, the watched run, the paired
    replays (``paired_data_free``), each recommendation applied; ``only="data_free"``: the paired
    replays alone."""
    script, base, want = CASES[name]
    steps = sizes["steps_for"].get(name, sizes["steps"])
    args = [*base, *sizes["args"].get(script, []), "--warmup", str(sizes["warmup"]), "--steps", str(steps)]
    case.update(script=script, args=args)
    hand_args = list(args)
    if only == "data_free":
        case["paired"] = paired_data_free(script, args, sizes, out / f"{name}-paired")
        case["checks"] = checks(want, case)
        save()
        return
    t = time.monotonic()
    case["hand"] = plain(script, [*hand_args, "--hand", str(out / f"{name}-hand.json")])
    hand_s = time.monotonic() - t
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
    long_args = [*args[:-1], "1000000"]
    _, doc = watched(script, long_args, watch_args)
    if doc is None or not doc.get("loaders"):
        case["error"] = "watch gave no report"
        return
    rep = primary(doc)
    model, binding = rep.get("model") or {}, rep.get("binding") or {}
    case["watch"] = {
        "verdict": doc["verdict"],
        "steps_replayed": rep["steps_replayed"],
        "steps_trial": rep.get("steps_trial"),
        "trial": rep.get("trial"),
        "replay": rep["phases"].get("replay"),
        "wait_share": rep["steady"]["wait_share"],
        "img_per_s": rep["steady"]["img_per_s"],
        "data_free_img_per_s": model.get("data_free_img_per_s"),
        "stage": binding.get("stage"),
        "binds": binding.get("text"),
        "predicted_img_per_s": model.get("predicted_img_per_s"),
        "model": model,
        "try_cache": rep.get("try_cache"),
        "advice": doc["advice"],
    }
    case["raw_parts"] = raw_parts(out / name)
    case["checks"] = checks(want, case)
    save()
    case["paired"] = paired_data_free(script, args, sizes, out / f"{name}-paired")
    case["checks"] = checks(want, case)
    save()
    case["recommendations"] = []
    applied(script, args, doc["advice"], case["recommendations"], save, sizes["applied_s"])
    if CLOCK.left() > 1.5 * hand_s + 5:  # the machine's speed drifts (±30% within seconds on the H200):
        # the script alone once more, after the rest, shows how far
        case["hand_after"] = plain(script, [*hand_args, "--hand", str(out / f"{name}-hand-after.json")])
        case["checks"] = checks(want, case)
        save()


def epoch_steps(script: str, args: list[str]) -> int:
    """The script's steps per epoch from its arguments (len(loader), which it prints too: checked)."""

    def arg(flag: str, default: int) -> int:
        return int(args[len(args) - 1 - args[::-1].index(flag) + 1]) if flag in args else default

    batch = arg("--batch-size", 128 if script == "resnet50.py" else 256)
    images = arg("--images", 20_000)
    if script == "resnet50.py":
        images = min(images, 2048)
    return images // batch


def paired_data_free(script: str, args: list[str], sizes: dict[str, Any], out: Path) -> dict[str, Any]:
    """Watch's rate with data free against the script's own replay, in one process, alternated: the script
    under ``dlstore watch --replay-rounds R`` with its own ``--replay-rounds R``. Each round, at an epoch's
    end: watch replays inside the next() call that ends the epoch, and the script replays its epoch's
    last 4 batches by its own clock, synchronised, right after that call (rounds 1, 3, 5) or right before
    it (rounds 2, 4: ABBA; common.replay_rounds). The pairs' ratios, their median and spread. The
    script's figures are its own (printed by it), never watch's."""
    rounds, replay_s = sizes["free_rounds"], str(sizes["replay_s"])
    per_epoch = epoch_steps(script, args)
    warmup = int(args[args.index("--warmup") + 1])
    total = warmup + int(args[args.index("--steps") + 1])
    first = per_epoch * -(-total // per_epoch)  # the first epoch's end after the timed steps
    script_args = [*args, "--replay", "4", "--replay-rounds", str(rounds), "--replay-s", replay_s]
    watch_args = [
        "--no-trial", "--no-parts", "--warmup", str(warmup),
        "--replay-at", str(first), "--replay-every", str(per_epoch), "--replay-rounds", str(rounds),
        "--replay-batches", "4", "--replay-s", replay_s, "--out", str(out),
    ]  # fmt: skip
    own, doc = watched(script, script_args, watch_args)
    res: dict[str, Any] = {"rounds": rounds, "steps_per_epoch": per_epoch, "first_round_at": first}
    if own is None or doc is None or not doc.get("loaders"):
        return {**res, "error": "the paired run gave no result"}
    if own.get("steps_per_epoch") != per_epoch:
        return {
            **res,
            "error": f"epochs of {own.get('steps_per_epoch')} steps, not {per_epoch}: rounds misaligned",
        }
    replay = primary(doc)["phases"].get("replay") or {}
    watch_rates = [r["img_per_s"] for r in replay.get("rounds") or []]
    own_rates = own.get("replay_rounds_img_per_s") or []
    ratios = [w / o for w, o in zip(watch_rates, own_rates)]
    order = ["watch first" if r % 2 == 0 else "own first" for r in range(len(ratios))]
    res.update(watch_img_per_s=watch_rates, own_img_per_s=own_rates, ratios=ratios, order=order)
    if ratios:
        res["error_median"] = statistics.median(ratios) - 1
        res["error_spread"] = [min(ratios) - 1, max(ratios) - 1]
        res["own_spread"] = max(own_rates) / min(own_rates) - 1  # how far the machine moved meanwhile
    if len(watch_rates) != rounds:
        res["note"] = f"watch timed {len(watch_rates)} rounds of {rounds}"
    return res


def raw_parts(result: Path) -> dict[str, Any] | None:
    """The watched process's measured parts and probes (its raw record), to recompute the predictions."""
    path = result / "ranks" / "watch-rank0.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    keep = ("index", "images_per_batch", "settings", "parts", "probes", "try_cache")
    return {"cores": doc.get("cores"), "loaders": [{k: ld.get(k) for k in keep} for ld in doc["loaders"]]}


def checks(want: str | None, case: dict[str, Any]) -> dict[str, Any]:
    w, hand, paired = case.get("watch"), case.get("hand"), case.get("paired") or {}
    out: dict[str, Any] = {}
    if "error_median" in paired:  # the rate with data free: the median of the paired rounds' ratios
        out["data_free_error"] = paired["error_median"]
        out["data_free_error_spread"] = paired["error_spread"]
    if w is None:
        return out
    if paired.get("own_img_per_s") and w["data_free_img_per_s"]:
        # the full run's one replay (mid-epoch, in another process) against the paired run's own replays
        out["data_free_error_unpaired"] = (
            w["data_free_img_per_s"] / statistics.median(paired["own_img_per_s"]) - 1
        )
    if hand:
        out["wait_share_points"] = 100 * (w["wait_share"] - hand["wait_share"])
        out["rate_vs_hand"] = w["img_per_s"] / hand["img_per_s"] - 1
    after = case.get("hand_after")
    if after:  # the same figures against the script's second run alone (after the watched one)
        out["wait_share_points_after"] = 100 * (w["wait_share"] - after["wait_share"])
        out["rate_vs_hand_after"] = w["img_per_s"] / after["img_per_s"] - 1
        if hand:
            out["hand_drift"] = after["img_per_s"] / hand["img_per_s"] - 1
    if want == "input":
        out["verdict_ok"] = w["wait_share"] >= 0.20 and w["stage"] in INPUT_STAGES
    elif want == "compute":
        out["verdict_ok"] = w["stage"] == "compute"
    return out


def spread(ratios: list[float]) -> list[float]:
    """The quartiles of the pairs' ratios, less 1 (both the one ratio when there is one)."""
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return [q[0] - 1, q[2] - 1]


def overhead(sizes: dict[str, Any], res: dict[str, Any], save: Any) -> None:
    """Watch's overhead on the launch-bound script, two ways. In one process first (``inprocess``:
    overhead_bisect.py --inprocess, blocks of the loop plain and inside ``Watch``, ABBA, for
    ``inprocess_s``): many pairs, no start-up between them. Then the script alone and under ``dlstore
    watch`` (no replay, trial or parts; watch's default CUDA events), ABBA pairs of short runs while the
    case's time lasts: the script's own rate over its timed steps. Each: the median of
    the pairs' ratios (watched / plain step time), and their quartiles."""
    script, base = OVERHEAD_CASE
    args = [*base, *sizes["args"].get(script, []), "--warmup", "50", "--steps", str(sizes["overhead_steps"])]
    inproc = [sys.executable, "overhead_bisect.py", "--inprocess", "--budget", str(sizes["inprocess_s"])]
    inproc += ["--block-steps", str(sizes["block_steps"]), "--", script, *sizes["args"].get(script, [])]
    p = run(inproc)
    line = next((x for x in p.stdout.splitlines() if x.startswith('{"inprocess_result"')), None)
    res["inprocess"] = json.loads(line)["inprocess_result"] if line else {"error": p.stderr[-500:]}
    save()
    res.update(
        script=script,
        args=args,
        rates={"plain": [], "watched": []},
        cpu_per_step_us={"plain": [], "watched": []},
        gc={"plain": [], "watched": []},
        ratios=[],
    )
    rates = res["rates"]
    for i in range(sizes["overhead_max_rounds"]):
        if CLOCK.left() < 1.1 * res.get("round_s", 0.0):
            break
        t = time.monotonic()
        got: dict[str, Any] = {}
        for k in ("plain", "watched") if i % 2 == 0 else ("watched", "plain"):  # ABBA: drift cancels
            if k == "plain":
                got[k] = plain(script, args)
            else:
                got[k], doc = watched(
                    script, args, ["--no-replay", "--no-trial", "--no-parts", "--warmup", "50"]
                )
                if doc and doc.get("loaders"):  # NVML sampled by watch's thread (it contends with launches)
                    res["nvml"] = (primary(doc).get("resources") or {}).get("nvml")
        if not all(got.values()):
            break
        for k, r in got.items():
            rates[k].append(r["img_per_s"])
            res["cpu_per_step_us"][k].append(1e6 * r.get("cpu_per_step_s", 0.0))
            res["gc"][k].append({x: r.get(x) for x in ("gc_s", "gc_collections", "gc_objects")})
        # watched step time / plain step time, this round
        res["ratios"].append(got["plain"]["img_per_s"] / got["watched"]["img_per_s"])
        res["round_s"] = time.monotonic() - t
        p = statistics.median(rates["plain"])
        res["step_ms_plain"] = 1e3 * sizes["batch"] / p
        # the step time watching adds: the median of the alternated pairs' ratios, less 1
        res["overhead"] = statistics.median(res["ratios"]) - 1
        res["quartiles"] = spread(res["ratios"])
        res["rounds"] = len(res["ratios"])
        save()


def per_step_cost(steps: int = 3000) -> dict[str, Any]:
    """Watch's own cost per next(), in this process: a loader of ready tensors iterated alone and
    watched (CUDA up, so the device events are recorded), best of 3 each."""
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(REPO))
    from dlstore.bench.watch import Watch, WatchConfig

    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")
    dl = DataLoader([torch.zeros(4)] * steps, batch_size=None)

    def loop() -> float:
        t = time.perf_counter()
        for x in dl:
            if cuda:
                x.add_(1)  # something on the host; nothing launched
        return (time.perf_counter() - t) / steps

    out: dict[str, Any] = {"cuda_events": cuda}
    for every in (1, 4, 8, 10**9):  # CUDA events on every step, on one in 4, in 8, none
        bares, seens = [], []
        for _ in range(3):  # alternated
            bares.append(loop())
            with Watch(
                WatchConfig(replay=False, trial=False, parts=False, warmup=0, event_every=every), quiet=True
            ):
                seens.append(loop())
        bare, seen = statistics.median(bares), statistics.median(seens)
        out["no_events" if every == 10**9 else f"events_every_{every}"] = {
            "bare_us": 1e6 * bare,
            "watched_us": 1e6 * seen,
            "cost_us": 1e6 * (seen - bare),
        }
    return out


def machine() -> dict[str, Any]:
    import torch

    # a copy without .git (the GPU machine's) is given its commit; git would name an enclosing repo's
    commit = (
        os.environ.get("WATCH_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
        "commit": commit,
    }


def table(results: dict[str, Any]) -> str:
    head = f"{'case':22s} {'wait pts':>9s} {'free err':>9s} {'stage':>9s} {'verdict':>8s}  recommendations: predicted → measured"
    lines = [head]
    for name, c in results["cases"].items():
        k = c.get("checks", {})
        recs = "; ".join(
            f"{r['expected_img_per_s']:,.0f}→{r['measured_img_per_s']:,.0f} ({r['error']:+.0%}"
            + (
                f"; tried {r['grounded_img_per_s']:,.0f}: {r['grounded_error']:+.0%})"
                if "grounded_error" in r
                else ")"
            )
            for r in c.get("recommendations", [])
            if "error" in r
        )
        stage = (c.get("watch") or {}).get("stage") or "-"
        lines.append(
            f"{name:22s} {_f(k.get('wait_share_points'), '{:+.1f}'):>9s} {_f(k.get('data_free_error'), '{:+.1%}'):>9s} "
            f"{stage:>9s} {str(k.get('verdict_ok', '-')):>8s}  {recs or '-'}"
        )
        if "hand_drift" in k:
            lines.append(
                f"{'':22s} vs the script alone again: wait {_f(k.get('wait_share_points_after'), '{:+.1f}')} pts; "
                f"its rate moved {k['hand_drift']:+.1%}"
            )
        pr = c.get("paired") or {}
        if pr.get("ratios"):
            lines.append(
                f"{'':22s} data free, watch / own replay in {len(pr['ratios'])} ABBA rounds: "
                + ", ".join(f"{r - 1:+.1%}" for r in pr["ratios"])
                + f" (median {pr['error_median']:+.1%}; the own replay moved {pr['own_spread']:.1%} between rounds)"
                + (
                    f"; the full run's one replay vs their median {k['data_free_error_unpaired']:+.1%}"
                    if "data_free_error_unpaired" in k
                    else ""
                )
            )
        elif pr.get("error"):
            lines.append(f"{'':22s} paired replays: {pr['error']}")
        tried = ((c.get("watch") or {}).get("try_cache")) or {}
        if tried and "skipped" not in tried:
            lines.append(
                f"{'':22s} --try-cache: loader {tried['loader_img_per_s']:,.0f} img/s on {tried['images']} images"
            )
    ov = results.get("overhead") or {}
    ip = ov.get("inprocess") or {}
    if "median_overhead" in ip:
        lines.append(
            f"overhead in one process ({ip['pairs']} ABBA pairs of {ip['block_steps']} steps, step "
            f"{ip['step_ms_plain']:.2f} ms): median {ip['median_overhead']:+.2%} step time, quartiles "
            f"{ip['quartiles'][0]:+.2%} / {ip['quartiles'][1]:+.2%}"
            + (
                f"; position taken out {ip['abba_overhead']:+.2%} ± {ip['abba_overhead_se']:.2%}"
                if "abba_overhead" in ip
                else ""
            )
        )
    if "overhead" in ov:
        lines.append(
            f"overhead, whole runs ({ov['script']}, step {ov['step_ms_plain']:.2f} ms, {ov['rounds']} ABBA pairs): "
            f"median {ov['overhead']:+.2%} step time, quartiles {ov['quartiles'][0]:+.2%} / "
            f"{ov['quartiles'][1]:+.2%}; per pair " + ", ".join(f"{r - 1:+.1%}" for r in ov["ratios"])
        )
    if results.get("per_step"):
        ps = results["per_step"]
        costs = ", ".join(
            f"{k.replace('_', ' ')}: {v['cost_us']:.1f} µs" for k, v in ps.items() if k != "cuda_events"
        )
        lines.append(f"watch's cost per next() (CUDA events: {ps['cuda_events']}): {costs}")
    return "\n".join(lines)


def _f(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else fmt.format(v)


def sizes_for(quick: bool) -> dict[str, Any]:
    if quick:  # the dry run: tiny sizes, every path taken once
        return {
            "warmup": 3,
            "steps": 12,
            "replay_s": 0.3,
            "trial_s": 0.3,
            "applied_s": 0.2,
            "parts_budget": 0.3,
            "overhead_steps": 60,
            "overhead_max_rounds": 2,
            "inprocess_s": 3.0,
            "block_steps": 30,
            "free_rounds": 2,
            "batch": 16,
            "steps_for": {},
            # shares kept for later cases (``--cases resnet50,overhead --budget 45`` cuts ResNet-50 on a CPU:
            # the dry run of the timeout path)
            "case_s_free": {"smallcnn_augment_w0": 40, "resnet50": 40, "overhead": 30, "smallcnn_augment_w4": 40, "item_every_step": 30},
            "case_s": {"smallcnn_augment_w0": 60, "resnet50": 60, "overhead": 30, "smallcnn_augment_w4": 60, "item_every_step": 40},
            "args": {
                "smallcnn_augment.py": ["--images", "400", "--batch-size", "16", "--root", "/tmp/watch_fmnist_quick"],
                "resnet50.py": ["--images", "16", "--batch-size", "2", "--workers", "2"],
                "item_every_step.py": ["--images", "400", "--batch-size", "16", "--workers", "2"],
                "launch_bound.py": ["--images", "2000", "--batch-size", "16"],
            },
        }  # fmt: skip
    return {
        "warmup": 20,
        "steps": 120,
        # the replays (watch's and the script's own): 1.5 s timed after 0.3 s of warm-up (was 60 steps,
        # 0.16 s, ramping); the in-loop trial 1.5 s; each advice applied timed ~2 s at its predicted rate
        "replay_s": 1.5,
        "trial_s": 1.5,
        "applied_s": 2.0,
        "parts_budget": 1.5,
        # whole runs: ~7 s of start-up each for ~1.3 s of steps (was 1500 steps, 3 pairs in 115 s): more,
        # shorter pairs in the same time; in one process, blocks of 300 steps (~0.7 s) for 40 s
        "overhead_steps": 600,
        "overhead_max_rounds": 40,
        "inprocess_s": 40.0,
        "block_steps": 300,
        # the paired replays of the rate with data free: 5 rounds of (watch's, the script's own)
        "free_rounds": 5,
        "batch": 256,
        # timed steps, >= ~1 s of real steps: ~100 ms a step at 0 workers, ~30 ms for ResNet-50, ~35 ms at
        # 4 workers, ~5.5 ms for the loss.item() loop
        "steps_for": {"smallcnn_augment_w0": 50, "resnet50": 80, "item_every_step": 400},
        # --only data_free: start-up, the timed steps, then 5 × (an epoch, watch's replay, the script's)
        "case_s_free": {
            "smallcnn_augment_w0": 90,  # 78 steps an epoch, ~100 ms each
            "resnet50": 60,  # 16 steps an epoch
            "overhead": 130,
            "smallcnn_augment_w4": 70,
            "item_every_step": 50,  # 78 steps of ~5.5 ms
        },
        # seconds each case may take (its runs are killed past it); the first case makes the 20,000 PNGs.
        # The H200's figures before the paired replays, + case_s_free's for them
        "case_s": {
            "smallcnn_augment_w0": 180,  # 85 s on the H200 (the PNGs made first) + 90
            "resnet50": 145,  # 87 s (no advice to apply) + 60
            "overhead": 130,
            "smallcnn_augment_w4": 150,  # 74 s + 70
            "item_every_step": 115,  # 55 s + 50
        },
        "args": {"smallcnn_augment.py": ["--root", "/tmp/watch_fmnist_folder"]},
    }


def main() -> None:
    global CLOCK
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "watch_accuracy_out")))
    p.add_argument("--cases", default=",".join([*list(CASES)[:2], "overhead", *list(CASES)[2:]]))
    p.add_argument(
        "--only",
        choices=("all", "data_free"),
        default="all",
        help="data_free: of each case, the paired replays alone (watch's rate with data free vs the script's)",
    )
    p.add_argument("--free-rounds", type=int, default=None, help="paired replay rounds (5; --quick 2)")
    p.add_argument("--budget", type=float, default=470.0, help="seconds for the whole study")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every path")
    p.add_argument("--cpu", action="store_true", help="run the scripts on the CPU (WATCH_SCRIPTS_CPU=1)")
    for name in ("replay_s", "trial_s", "applied_s"):  # longer windows than the sizes' defaults
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    a = p.parse_args()
    if a.cpu:
        os.environ["WATCH_SCRIPTS_CPU"] = "1"
    CLOCK = Clock(a.budget)
    sizes = sizes_for(a.quick)
    if a.only == "data_free":
        sizes["case_s"] = sizes["case_s_free"]
    if a.free_rounds:
        sizes["free_rounds"] = a.free_rounds
    sizes.update(
        {k: getattr(a, k) for k in ("replay_s", "trial_s", "applied_s") if getattr(a, k) is not None}
    )
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": machine(),
        "sizes": sizes,
        "cases": {},
        "skipped": [],
        "case_wall_s": {},
    }

    def save() -> None:
        results["wall_s"] = CLOCK.elapsed()
        tmp = a.out / "watch_accuracy.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(a.out / "watch_accuracy.json")

    results["per_step"] = per_step_cost(300 if a.quick else 3000)
    save()
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
        if name == "overhead":
            results["overhead"] = {}
            overhead(sizes, results["overhead"], save)
        else:
            results["cases"][name] = {}
            try:
                measure_case(name, sizes, a.out, results["cases"][name], save, a.only)
            except Exception as e:  # one case's failure (a bad report) must not lose the others
                results["cases"][name]["error"] = f"{type(e).__name__}: {e}"
        results["case_wall_s"][name] = time.monotonic() - t
        save()
    print(table(results))


if __name__ == "__main__":
    main()
