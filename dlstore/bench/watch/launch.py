"""The parent side of ``dlstore watch -- python train.py ARGS…``: start the watched child, pass Ctrl-C
on to it, collect each rank's record and analyse it. Imports no torch (the child does)."""

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
from dlstore.bench.watch.analyse import analyse
from dlstore.bench.watch.config import ENV_VAR, WatchConfig, WatchError, rank_file, rank_info

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


def _stdout_for_child(script_stdout_to_stderr: bool) -> int | None:
    if not script_stdout_to_stderr:
        return None
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (tests): the process's own
        return 2


def run_child(argv: list[str], config: WatchConfig, script_stdout_to_stderr: bool) -> int:
    """Run the watched child to its end; Ctrl-C here is passed on to it, so it reports what it saw."""
    # the user's interpreter may not be this one: let it import this dlstore
    here = str(Path(dlstore.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, ENV_VAR: config.to_env(), "PYTHONPATH": path}
    proc = subprocess.Popen(argv, env=env, stdout=_stdout_for_child(script_stdout_to_stderr))

    def forward(signum: int, frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, forward) if main else None
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
