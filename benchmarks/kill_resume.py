"""Kill a real ``dlstore convert`` with SIGKILL at random moments, then check and resume.

For every format: one uninterrupted reference conversion, then ``--kills`` rounds. Each round starts
``dlstore convert`` (2 workers) in its own process group, SIGKILLs the whole group after a random
delay in [0, 1.1 x reference time], and checks that DEST either refuses to open (CacheNotFoundError)
or opens complete with exactly the reference pixels and labels (or, in rebuild rounds where DEST held
an older cache, exactly that old cache). Then it re-runs the same command and checks the result equals
the reference, verifies, and that nothing is left next to DEST. Every other round is a rebuild
(``--overwrite`` over an existing cache), where DEST must never be absent.

    python benchmarks/kill_resume.py --kills 20 --out benchmarks/results/kill_resume.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from dlstore import open_cache
from dlstore.convert.verification import verify
from dlstore.errors import CacheNotFoundError

DLSTORE = str(Path(sys.executable).with_name("dlstore"))


def make_source(root: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for i in range(n):
        cls = root / f"class{i % 4}"
        cls.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 256, (48 + i % 7, 64, 3), dtype=np.uint8)
        Image.fromarray(arr).save(cls / f"img{i:05d}{'.png' if i % 3 else '.jpg'}")
    return root


def command(src: Path, dest: Path, fmt: str, size: int, overwrite: bool) -> list[str]:
    cmd = [DLSTORE, "convert", str(src), str(dest), "--format", fmt, "--size", str(size), "--workers", "2"]
    return cmd + (["--overwrite"] if overwrite else [])


def run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def snapshot(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(pixels, labels) of a cache that opens, or None when it refuses with CacheNotFoundError."""
    try:
        cache = open_cache(path, check_source=False)
    except CacheNotFoundError:
        return None
    try:
        return cache.read(np.arange(len(cache))), cache.labels.copy()
    finally:
        cache.close()


def same(a: tuple[np.ndarray, np.ndarray] | None, b: tuple[np.ndarray, np.ndarray] | None) -> bool:
    return (
        a is not None
        and b is not None
        and a[1].shape == b[1].shape
        and a[0].shape == b[0].shape
        and bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
    )


def kill_group_after(cmd: list[str], delay: float) -> int:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # workers of a run that ended by itself are gone already
    except ProcessLookupError:
        pass
    return proc.returncode


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def one_round(
    work: Path, src: Path, fmt: str, size: int, ref: Any, old_dir: Path | None, old: Any, delay: float
) -> dict[str, Any]:
    dest = work / "dest"
    shutil.rmtree(dest, ignore_errors=True)
    for name in leftovers(dest):
        shutil.rmtree(work / name, ignore_errors=True)
        (work / name).unlink(missing_ok=True)
    if old_dir is not None:
        shutil.copytree(old_dir, dest)
    cmd = command(src, dest, fmt, size, overwrite=old_dir is not None)
    rc = kill_group_after(cmd, delay)
    state = snapshot(dest)
    if state is None:
        outcome = "refused" if old_dir is None else "FAIL: old cache lost"
    elif same(state, ref):
        outcome = "new complete"
    elif old_dir is not None and same(state, old):
        outcome = "old complete"
    else:
        outcome = "FAIL: opens with wrong content"
    t0 = time.perf_counter()
    resume = subprocess.run(cmd, capture_output=True, text=True)
    # Killed after it had fully finished (journal gone): a plain re-run then says DEST already exists.
    finished = old_dir is None and resume.returncode == 1 and "already exists" in resume.stderr
    resumed_ok = (
        (resume.returncode == 0 or finished)
        and same(snapshot(dest), ref)
        and verify(dest).ok
        and not leftovers(dest)
    )
    return {
        "delay_s": round(delay, 3),
        "rebuild": old_dir is not None,
        "exit_code_when_killed": rc,
        "after_kill": outcome,
        "resume_ok": resumed_ok,
        "rerun": "already complete" if finished else "resumed",
        "resume_s": round(time.perf_counter() - t0, 2),
        **({} if resumed_ok else {"resume_stderr": resume.stderr[-500:]}),
    }


def run_format(work: Path, src: Path, fmt: str, size: int, kills: int, rng: random.Random) -> dict[str, Any]:
    ref_dir, old_dir = work / "ref", work / "old"
    ref_s = run(command(src, ref_dir, fmt, size, overwrite=False))
    run(command(src, old_dir, fmt, size, overwrite=False) + ["--resize", "pad"])  # same shape, other pixels
    ref, old = snapshot(ref_dir), snapshot(old_dir)
    rounds = [
        one_round(work, src, fmt, size, ref, old_dir if i % 2 else None, old, rng.uniform(0, 1.1 * ref_s))
        for i in range(kills)
    ]
    outcomes: dict[str, int] = {}
    for r in rounds:
        outcomes[r["after_kill"]] = outcomes.get(r["after_kill"], 0) + 1
    failures = [r for r in rounds if r["after_kill"].startswith("FAIL") or not r["resume_ok"]]
    return {
        "format": fmt,
        "reference_convert_s": round(ref_s, 2),
        "kills": kills,
        "outcomes": outcomes,
        "resumed_ok": sum(r["resume_ok"] for r in rounds),
        "failures": len(failures),
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--size", type=int, default=256, help="256 gives several units per format")
    ap.add_argument("--formats", default="ram,npz,zarr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kill_resume_") as tmp:
        src = make_source(Path(tmp) / "src", args.images, args.seed)
        results = []
        for fmt in args.formats.split(","):
            work = Path(tmp) / fmt
            work.mkdir()
            results.append(run_format(work, src, fmt, args.size, args.kills, rng))
            print(
                f"{fmt}: {results[-1]['outcomes']} resumed_ok={results[-1]['resumed_ok']}/{args.kills} "
                f"failures={results[-1]['failures']}",
                file=sys.stderr,
            )
    doc = {
        "command": "python benchmarks/kill_resume.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}, Python {platform.python_version()}",
        "images": args.images,
        "size": args.size,
        "seconds": round(time.perf_counter() - t0, 1),
        "total_failures": sum(r["failures"] for r in results),
        "formats": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    sys.exit(1 if main()["total_failures"] else 0)
