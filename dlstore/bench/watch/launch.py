"""The parent side of ``dlstore watch -- python train.py ARGS…``: start the watched child, pass Ctrl-C on
to it, collect each rank's record and analyse it. Imports no torch (the child does).

``--apply`` runs the script again with the advice's DataLoader settings (its ``settings`` fields, as
watch.json holds them) put into the loader the advice was for, the same position among the loaders the
script iterates, through the child's ``DataLoader.__iter__`` hook (``inject``): no edit to the script."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import dlstore
from dlstore.bench.watch import ENV_VAR, WatchConfig, WatchError, rank_file, rank_info
from dlstore.bench.watch.analyse import analyse
from dlstore.bench.watch.watch_report import summary

PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$")
FLAGS_WITH_VALUE = ("-X", "-W", "-Q")
RANK_WAIT_S = 120.0


def child_argv(argv: list[str]) -> list[str]:
    """``python [FLAGS] train.py ARGS…``, ``python [FLAGS] -m pkg.train ARGS…`` or ``train.py ARGS…`` as the
    child's: the interpreter, its flags, then boot and the target as python gets it."""
    if not argv:
        raise WatchError("no command: give it after --, e.g. dlstore watch -- python train.py --epochs 1")
    head = argv[0]
    if PYTHON_NAME.match(os.path.basename(head)):
        # a bare "python" is this environment's (the one dlstore is installed in: the same as an activated
        # venv's); a path names another interpreter on purpose
        interpreter = head if os.sep in head else sys.executable
        rest = argv[1:]
    elif head.endswith(".py"):
        interpreter, rest = sys.executable, argv
    elif os.path.basename(head) in ("torchrun", "torch.distributed.run"):
        raise WatchError(
            "torchrun starts its own Python per rank, out of watch's reach: put watch inside it, "
            "`torchrun --nproc-per-node N $(which dlstore) watch -- python train.py ARGS…` (each rank "
            "records, rank 0 reports)"
        )
    else:
        raise WatchError(f"{head}: expected python, a .py script, or python -m MODULE (got {' '.join(argv)})")
    flags: list[str] = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] == "-c":
            raise WatchError("python -c is not supported: put the code in a script and watch that")
        flags.append(rest.pop(0))
        if flags[-1] in FLAGS_WITH_VALUE and rest:
            flags.append(rest.pop(0))
    if not rest:
        raise WatchError(f"no script in {' '.join(argv)}: give train.py ARGS… or -m MODULE ARGS…")
    if rest[0] == "-m" and len(rest) < 2:
        raise WatchError("-m needs a module name, e.g. python -m pkg.train")
    if rest[0] != "-m" and not os.path.isfile(rest[0]):
        raise WatchError(f"{rest[0]}: no such script (looked from {os.getcwd()})")
    return [interpreter, *flags, "-m", "dlstore.bench.watch.boot", *rest]


def result_dir_for(out: Path | None, world: int) -> Path:
    """Where the ranks write their records: --out DIR/ranks, else a temporary folder (under torchrun one
    all ranks of the run agree on)."""
    if out is not None:
        path = out / "ranks"
    elif world > 1:
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0")
        path = Path(tempfile.gettempdir()) / f"dlstore-watch-{run}"
    else:
        return Path(tempfile.mkdtemp(prefix="dlstore-watch-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_child(argv: list[str], config: WatchConfig, script_stdout_to_stderr: bool) -> int:
    """Run the watched child to its end; Ctrl-C here is passed on to it, so it reports what it saw."""
    # the user's interpreter may not be this one: let it import this dlstore
    here = str(Path(dlstore.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, ENV_VAR: config.to_env(), "PYTHONPATH": path}
    stdout = None
    if script_stdout_to_stderr:
        try:
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a captured stderr (tests): the process's own
            stdout = 2
    proc = subprocess.Popen(argv, env=env, stdout=stdout)
    main = threading.current_thread() is threading.main_thread()  # send_signal: a no-op once it ended
    previous = signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGINT)) if main else None
    try:
        return proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def collect(result_dir: Path, world: int, wait_s: float = RANK_WAIT_S) -> list[dict[str, Any]]:
    """Each rank's record that exists; other ranks' are waited for up to ``wait_s`` (they may end later)."""
    deadline = time.monotonic() + wait_s
    docs = []
    for r in range(world):
        path = rank_file(result_dir, r)
        while not path.exists() and r > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        if path.exists():
            docs.append(json.loads(path.read_text()))
    return docs


def lost_report(code: int) -> dict[str, Any]:
    """The child ended without writing its record (killed hard, or dlstore failed to import there)."""
    note = (
        f"The watched process ended (exit code {code}) without writing what it observed: it was killed "
        "(SIGKILL, out of memory) or could not start (see its error above)."
    )
    report = dict(status="lost", exit_code=code, error=None, device="?", cores=0, cuda=False, world_size=1)
    return {**report, "notes": [note], "verdict": note, "loaders": [], "recommendations": [], "advice": []}


def run_watch(
    argv: list[str], config: WatchConfig, out: Path | None = None, script_stdout_to_stderr: bool = False
) -> tuple[dict[str, Any] | None, int]:
    """(report, the script's exit code). The report is None on a rank other than 0 (rank 0 reports)."""
    child = child_argv(argv)
    rank, world = rank_info()
    result_dir = result_dir_for(out, world)
    config = replace(config, result_dir=str(result_dir))
    if config.profile and out is None:
        raise WatchError("--profile writes a trace file: give --out DIR as well")
    code = run_child(child, config, script_stdout_to_stderr)
    if rank != 0:
        return None, code
    docs = collect(result_dir, world)
    if not docs or docs[0].get("rank", 0) != 0:
        return lost_report(code), code
    report = analyse(docs)
    report["exit_code"] = code
    if out is None and world == 1:
        shutil.rmtree(result_dir, ignore_errors=True)
    return report, code


def advised_settings(report: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The DataLoader settings the advice names (the first advice, the largest gain, wins where two name
    one setting), and the advice they come from."""
    settings: dict[str, Any] = {}
    used = [a for a in report.get("advice") or [] if a.get("settings")]
    for a in used:
        for name, value in a["settings"].items():
            settings.setdefault(name, value)
    return settings, used


def inject(session: Any, loader: Any) -> None:
    """Before every ``iter(loader)`` in the watched child: on the advised loader's first iteration, put the
    advised settings in place of the script's (the DataLoader reads them when it starts workers)."""
    plan = session.config.apply
    if plan is None or id(loader) in session.records or len(session.records) != plan["loader"]:
        return
    s = plan["settings"]
    workers = int(s.get("num_workers", loader.num_workers))
    values = {
        "num_workers": workers,
        "prefetch_factor": s.get("prefetch_factor", loader.prefetch_factor or 2) if workers else None,
        "pin_memory": bool(s.get("pin_memory", loader.pin_memory)),
        "persistent_workers": bool(s.get("persistent_workers", loader.persistent_workers)) and workers > 0,
    }
    for name, value in values.items():
        object.__setattr__(loader, name, value)  # DataLoader refuses persistent_workers after __init__


def watch_and_apply(
    argv: list[str], config: WatchConfig, out: Path | None, stdout_to_stderr: bool, apply: bool = True
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, int]:
    """(the first run's report, with ``applied`` when ``apply``; the second run's report or None; the last
    run's exit code). With ``config.steps``, both runs stop after that many steps."""
    if apply and rank_info()[1] > 1:
        raise WatchError("--apply runs the script twice: not under torchrun (apply the advice by hand)")
    first, code = run_watch(argv, config, out, stdout_to_stderr)
    if not apply or first is None:
        return first, None, code
    settings, used = advised_settings(first)
    if code != 0 or not settings:
        why = f"the script ended with exit code {code}" if code else "no advice changes a DataLoader setting"
        if code == 0 and any(a.get("cache") for a in first.get("advice") or ()):
            why += " (a cache is applied by converting: --try-cache times one)"
        first["applied"] = {"skipped": f"{why}: nothing was applied"}
        return first, None, code
    plan = {"loader": first["primary"], "settings": settings}
    # the trial tries more workers: with them applied it has nothing left to try
    again = replace(config, apply=plan, trial=False, try_cache=False)
    second, code = run_watch(argv, again, None if out is None else out / "applied", stdout_to_stderr)
    assert second is not None
    first["applied"] = applied_summary(first, second, plan, used)
    return first, second, code


def applied_summary(
    first: dict[str, Any], second: dict[str, Any], plan: dict[str, Any], used: list[dict[str, Any]]
) -> dict[str, Any]:
    """The second run's rate on the advised loader beside the largest predicted rate of the advice applied,
    and the first run's rate: both over the real steps with later epochs' starts, as the prediction is."""
    before, after = summary(first, plan["loader"]), summary(second, plan["loader"])
    reached = all(after.get(k) == v for k, v in plan["settings"].items())
    predicted = max(a["expected_img_per_s"] or 0.0 for a in used) or None
    measured = after["loop_img_per_s"] if reached else None
    return {
        "loader": plan["loader"],
        "settings": plan["settings"],
        "advice": [a["text"] for a in used],
        # what the advice says to change in the script's own code is not applied (only the loader is)
        "not_applied": [a["command"].split(";", 1)[1].strip() for a in used if ";" in a["command"]],
        "before_img_per_s": before["loop_img_per_s"],
        "predicted_img_per_s": predicted,
        "measured_img_per_s": measured,
        "error": measured / predicted - 1 if measured and predicted else None,
        "reached": reached,
        "exit_code": second["exit_code"],
    }
