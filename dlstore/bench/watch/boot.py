"""The watched child, ``python -m dlstore.bench.watch.boot SCRIPT ARGS…`` (or ``-m MODULE ARGS…``): runs
the target as python would under the observer, and writes what was observed to this rank's file whatever
the ending (an exception: exit code 1; ``sys.exit(n)``: n; Ctrl-C: 130)."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback
from typing import Any

from dlstore.bench.watch import WatchConfig, WatchError, rank_file, rank_info


def exit_code_of(e: SystemExit) -> int:
    """The process exit status Python gives ``sys.exit(code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def run_target(argv: list[str]) -> None:
    """``SCRIPT ARGS…`` or ``-m MODULE ARGS…``, run as python runs them."""
    if argv[0] == "-m":
        sys.argv = argv[1:]  # run_module puts the module's file in argv[0], as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    path = os.path.abspath(argv[0])
    if not os.path.exists(path):
        raise WatchError(f"{argv[0]}: no such script (looked in {os.getcwd()})")
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(path)  # python SCRIPT puts the script's folder first, not the cwd
    runpy.run_path(path, run_name="__main__")


def first_interrupt(signum: int, frame: Any) -> None:
    """SIGINT raises KeyboardInterrupt once; more (the terminal's and the parent's forwarded copy of the
    same Ctrl-C) are ignored so the record still gets written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    from dlstore.bench.watch.record import Session, WatchStop

    config = WatchConfig.from_env()
    if not argv or argv == ["-m"]:
        raise WatchError("no target: give a script (train.py ARGS…) or -m MODULE ARGS…")
    signal.signal(signal.SIGINT, first_interrupt)
    session = Session(config)
    session.install()
    status, code, error = "completed", 0, None
    try:
        run_target(argv)
    except WatchStop:
        status = "stopped"
    except SystemExit as e:
        code = exit_code_of(e)
        status = "completed" if code == 0 else "exited"
    except KeyboardInterrupt:
        status, code = "interrupted", 130
        print("dlstore watch: interrupted; reporting what was observed", file=sys.stderr)
    except BaseException as e:
        traceback.print_exc()
        status, code, error = "error", 1, f"{type(e).__name__}: {e}"
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    write_record(session.finish(status, code, error), config)
    return code


def write_record(doc: dict[str, Any], config: WatchConfig) -> None:
    if not config.result_dir:
        return
    rank, _ = rank_info()
    path = rank_file(config.result_dir, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)  # the parent (and rank 0) only ever see a whole file


if __name__ == "__main__":
    sys.stdout.flush()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
