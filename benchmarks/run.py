#!/usr/bin/env python3
"""Run the benchmark suite and write one ``targets.json``: every target with its measured value, reference,
ratio, goal and met, plus machine, versions, commit and command.

    python benchmarks/run.py [--suite gpu|cpu] [--only AREA[,AREA]] [--out DIR] [--quick] [--budget-s S]

Each area is one script of this folder (``watch_scripts/accuracy.py`` for ``watch``: ``dlstore watch`` on the
plain training scripts there) run in its own process (``OUT/AREA/``: its JSON, its own
``targets.json``, ``log.txt``) with the sizes recorded below; ``OUT/targets.json`` gathers them. An area that
fails (exit status, time-out, no targets) is reported with its own error and the log's tail, and the others
still run; the exit status is then 1. A target that is not met is a result, not a failure.

``--out`` defaults to ``$OUT`` when that is set (the GPU machine), else ``benchmarks/results/latest-SUITE``.
A full run (no ``--only``, no ``--quick``) also replaces ``benchmarks/results/targets.json`` (gpu) or
``benchmarks/results/targets_cpu.json`` (cpu); on the GPU machine that copy stays there, so copy
``$OUT/targets.json`` back. ``--suite gpu`` is sized for one call of about 9 minutes on the lent H200
(16 cores): areas run in order of priority and one whose estimate would pass ``--budget-s`` is recorded as
skipped. It installs the wheels in ``.whl/`` (``../shared/tools/device-wheels``: zarr) and the project
itself into a temporary folder when they are missing, so the command is the whole call::

    python3 benchmarks/run.py --suite gpu --commit "$(git rev-parse --short HEAD)"   # carry .whl

Put simplejpeg in ``.whl`` too (``device-wheels simplejpeg==1.8.2``): the jpeg area's CPU decoders run
Pillow without it, 1.5-1.8x slower a core (its targets' notes say which ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
SUITES = ("gpu", "cpu")


@dataclass(frozen=True)
class Context:
    """What an area's arguments depend on: its output and scratch folders, and the sizes asked for."""

    out: Path
    work: Path
    quick: bool
    commit: str


@dataclass(frozen=True)
class Area:
    """One benchmark script with the arguments of the current figures and how its targets are read."""

    name: str
    suite: str
    script: str
    what: str
    estimate_s: float  # wall seconds of a full run on its suite's machine (recorded runs), for the budget
    argv: Callable[[Context], list[str]]
    targets: Callable[[Path], list[dict[str, Any]]]
    launcher: tuple[str, ...] = ()  # the interpreter's arguments before the script (e.g. torchrun's)


# --- target rows ---------------------------------------------------------------------------------------


def target(
    name: str, measured: float, reference: float, goal: float, note: str = "", higher: bool = True
) -> dict[str, Any]:
    """A row as ``harness.Targets`` makes it: a goal under 5 is a ratio to the reference, else a value."""
    ratio = measured / reference if reference else float("nan")
    value = ratio if goal < 5 else measured
    return {
        "name": name,
        "measured": round(measured, 3),
        "reference": round(reference, 3),
        "ratio": round(ratio, 4),
        "goal": goal,
        "goal_on": "ratio" if goal < 5 else "measured",
        "higher_is_better": higher,
        "met": bool(value >= goal if higher else value <= goal),
        "note": note,
    }


def script_targets(out: Path) -> list[dict[str, Any]]:
    """The ``targets.json`` a sectioned script wrote (``harness.Targets`` rows), in this file's field names."""
    path = out / "targets.json"
    if not path.is_file():
        raise AreaError(f"{path}: the script wrote no targets.json")
    rows = json.loads(path.read_text()).get("targets", [])
    renamed = []
    for row in rows:
        row = dict(row)
        row["reference"] = row.pop("ceiling_or_baseline", row.get("reference"))
        row.setdefault("goal_on", "ratio" if row["goal"] < 5 else "measured")
        renamed.append(row)
    return renamed


def _read(path: Path) -> Any:
    if not path.is_file():
        raise AreaError(f"{path}: not written (see log.txt next to it)")
    return json.loads(path.read_text())


def kill_targets(out: Path) -> list[dict[str, Any]]:
    doc = _read(out / "kill_resume.json")
    kills = sum(f["kills"] for f in doc["formats"])
    resumed = sum(f["resumed_ok"] for f in doc["formats"])
    formats = ",".join(f["format"] for f in doc["formats"])
    return [
        target(
            f"kill -9 at random moments ({formats}): DEST refused or complete, then resumed to the reference",
            resumed,
            kills,
            1.0,
            f"{doc['total_failures']} failures",
        )
    ]


def resume_targets(out: Path) -> list[dict[str, Any]]:
    doc = _read(out / "kill_train.json")
    kinds = ",".join(k["kind"] for k in doc["kinds"])
    elastic = "; ".join(f"{e['kind']} {e['ranks']} ranks ok={e['ok']}" for e in doc.get("elastic", []))
    return [
        target(
            f"kill -9 of a 2-rank DDP training loop ({kinds}): resumed runs train on the uninterrupted run's samples",
            sum(k["kills"] for k in doc["kinds"] if k["ok"]),
            doc["total_kills"],
            1.0,
            f"{doc['failures']} failures; {elastic}",
        )
    ]


def fuzz_targets(out: Path) -> list[dict[str, Any]]:
    doc = _read(out / "fuzz_convert.json")
    converts = doc["real_converts"]
    return [
        target(
            "fuzz: mutated JPEG/PNG/WebP files in conversions that crash (share; none allowed)",
            doc["crashes"],
            doc["files_tried"],
            0.0,
            f"{doc['skipped']} skipped as undecodable, slowest convert {doc['slowest_convert_s']} s",
            higher=False,
        ),
        target(
            "fuzz: real conversions of the mutated files that finish, bad files skipped",
            converts["runs"] - len(converts["failures"])
            if not converts["all_finished"]
            else converts["runs"],
            converts["runs"],
            1.0,
            "" if converts["all_finished"] else f"first failures: {converts['failures']}",
        ),
    ]


def ddp_targets(out: Path) -> list[dict[str, Any]]:
    """Each rank's recorded indices per epoch: equal shares, disjoint but for the padding."""
    ranks = [json.loads((out / "record" / f"rank{r}.json").read_text())["epochs"] for r in range(2)]
    epochs = len(ranks[0])
    equal = sum(len(ranks[0][e]["indices"]) == len(ranks[1][e]["indices"]) for e in range(epochs))
    disjoint = sum(len(set(ranks[0][e]["indices"]) & set(ranks[1][e]["indices"])) <= 1 for e in range(epochs))
    return [
        target("ddp: 2 gloo ranks, epochs with equal shares per rank", equal, epochs, 1.0),
        target(
            "ddp: 2 gloo ranks, epochs whose shares are disjoint (but for the padding)", disjoint, epochs, 1.0
        ),
    ]


def scale_targets(out: Path) -> list[dict[str, Any]]:
    """Issue 9's goals, stated at 100k images, checked at the largest count run."""
    rows = _read(out / "scale_convert.json")["rows"]
    big = max(rows, key=lambda r: r["n"])
    n = f"{big['n']:,} images"
    return [
        target(
            f"scale: convert peak RSS (MB, process tree), {n}",
            big["peak_rss"] / 1e6,
            400.0,
            400.0,
            higher=False,
        ),  # fmt: skip
        target(
            f"scale: metadata bytes per image, {n}", big["metadata_bytes_per_image"], 40.0, 40.0, higher=False
        ),  # fmt: skip
        target(
            f"scale: open_cache time (ms, fresh interpreter, best of 5), {n}",
            big["open_cache_s"] * 1e3,
            250.0,
            250.0,
            higher=False,
        ),  # fmt: skip
    ]


def replay_targets(out: Path) -> list[dict[str, Any]]:
    rows = _read(out / "replay.json")
    errors = [r["error"] for r in rows if r["error"] is not None]
    if not errors:
        raise AreaError(f"{out / 'replay.json'}: no run could be replayed")
    same = sum(
        r["recorded_predicted"] is not None
        and abs(r["predicted"] - r["recorded_predicted"]) <= 1e-6 * r["predicted"]
        for r in rows
        if r["predicted"] is not None
    )
    return [
        target(
            "replay: recorded bench runs (round F) re-predicted by the current model within ±20% (share)",
            sum(abs(e) <= 0.20 for e in errors),
            len(errors),
            1.0,
            f"errors {100 * min(errors):+.0f}% … {100 * max(errors):+.0f}%; {same}/{len(rows)} predictions "
            "unchanged from the recorded ones",
        )
    ]


# --- the areas -----------------------------------------------------------------------------------------

ROUND_F_BENCH = RESULTS / "roundF_h200" / "bench" / "bench_batches.json"


def _sized(ctx: Context, full: list[str], quick: list[str]) -> list[str]:
    return quick if ctx.quick else full


def _io(ctx: Context) -> list[str]:
    return ["--out", str(ctx.out), "--work", str(ctx.work)]


# In order of priority: a --suite gpu run that would pass its budget skips the last ones.
AREAS: dict[str, Area] = {
    a.name: a
    for a in [
        Area("fastpaths", "gpu", "fastpaths.py", "a raw cache: loader alone, chunked reads, ResNet-18/50 and "
             "SmallCNN vs their ceilings", 105,
             lambda c: [*_io(c), "--sections", "data,loader,random_reads,fashion,resnet18,resnet50",
                        *_sized(c, ["--images", "8192", "--repeats", "1"], ["--images", "1024", "--repeats", "1"])],
             script_targets),
        Area("jpeg", "gpu", "jpeg_cache.py", "a JPEG cache: ResNet-18/50 vs their ceilings, loader vs bare decode", 80,
             lambda c: [*_io(c), "--sections", "data,train,loader", "--cpu-decoders", "12",
                        *_sized(c, ["--images", "4096", "--steps", "20", "--warmup", "5", "--repeats", "2"],
                                ["--images", "1024", "--steps", "8", "--warmup", "3", "--repeats", "1"])],
             script_targets),
        Area("watch", "gpu", "watch_scripts/accuracy.py", "`dlstore watch` on plain scripts: wait share, verdict, "
             "advice predicted vs applied", 180,  # 140 s left ResNet-50 49 s of its 55 (H100, 12-06)
             lambda c: ["--out", str(c.out), "--cases", "smallcnn_augment_w0,resnet50",
                        *_sized(c, ["--budget", "170"], ["--budget", "60", "--quick"])],
             script_targets),
        Area("bench", "gpu", "bench_batches.py", "`dlstore bench`: predictions within ±20%, default run ≤ 60 s", 65,
             lambda c: [*_io(c), "--sections", "default,batches,decode", "--batches", "32,512",
                        "--raw-batches", "", "--fed-s", "0.4",
                        *_sized(c, ["--images", "2048", "--budget-s", "116"],
                                ["--images", "512", "--budget-s", "60"])],
             script_targets),
        Area("dlw", "gpu", "slowpaths.py", "DataLoader(CachedDataset) workers vs memcpy", 40,
             lambda c: [*_io(c), "--sections", "data,dataloader",
                        *_sized(c, ["--images", "4096", "--dl-epoch-images", "262144", "--dl-warmup", "60",
                                    "--loader-batches", "200", "--repeats", "3"],
                                ["--images", "1024", "--dl-epoch-images", "32768", "--dl-warmup", "10",
                                 "--loader-batches", "40", "--repeats", "1"])],
             script_targets),
        Area("convert", "gpu", "slowpaths.py", "convert vs the cores' decode+resize; Dask vs the pool", 60,
             lambda c: [*_io(c), "--sections", "convert,convert_dask", "--one-core-images", "250",
                        "--convert-dask", "local:16",
                        *_sized(c, ["--images", "4096", "--convert-seconds", "20"],
                                ["--images", "1024", "--convert-seconds", "5"])],
             script_targets),
        Area("zstd", "gpu", "zarr_readahead.py", "zarr zstd-3 ChunkSampler batches vs numcodecs' decode", 50,
             lambda c: [*_io(c), *_sized(c, ["--images", "8192", "--repeats", "3", "--epochs", "3"],
                                         ["--images", "2048", "--repeats", "1", "--epochs", "1"])],
             script_targets),
        Area("replay", "cpu", "replay_predictions.py", "round F's bench runs through the current prediction model", 10,
             lambda c: [str(ROUND_F_BENCH), "--json", str(c.out / "replay.json")],
             replay_targets),
        Area("fuzz", "cpu", "fuzz_convert.py", "byte-mutated images through convert", 40,
             lambda c: ["--out", str(c.out / "fuzz_convert.json"),
                        *_sized(c, ["--seconds", "30", "--batch", "200"], ["--seconds", "5", "--batch", "50"])],
             fuzz_targets),
        Area("kill", "cpu", "kill_resume.py", "SIGKILL a real `dlstore convert`, then check and resume", 120,
             lambda c: ["--out", str(c.out / "kill_resume.json"), "--formats", "ram,npz,zarr",
                        *_sized(c, ["--kills", "4", "--images", "160"], ["--kills", "1", "--images", "60"])],
             kill_targets),
        Area("resume", "cpu", "kill_resume.py", "SIGKILL a DDP training loop, resume from its checkpoint, compare the samples", 300,
             lambda c: ["--loop", "--out", str(c.out / "kill_train.json"),
                        *_sized(c, ["--kills", "4"], ["--kills", "1", "--kinds", "cached,pinned", "--steps", "20"])],
             resume_targets),
        Area("scale", "cpu", "scale_convert.py", "convert and open at growing N: memory, metadata, open time", 90,
             lambda c: ["--out", str(c.out / "scale_convert.json"), "--work", str(c.work),
                        *_sized(c, ["--counts", "2000,20000"], ["--counts", "500,2000"])],
             scale_targets),
        Area("ddp", "cpu", "ddp.py", "ddp.py under torchrun: 2 gloo ranks read equal, disjoint shares", 60,
             lambda c: [str(c.work / "cache"), "--demo", "301" if c.quick else "1000", "--model", "smallcnn",
                        "--size", "32", "--batch-size", "16", "--epochs", "1" if c.quick else "2",
                        "--record", str(c.out / "record")],
             ddp_targets, ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")),
        Area("watch_cpu", "cpu", "watch_scripts/accuracy.py", "`dlstore watch` on a plain script, on the CPU (a dry run: "
             "its verdict need not be the GPU's)", 90,
             lambda c: ["--out", str(c.out), "--cases", "smallcnn_augment_w0", "--quick", "--cpu", "--budget", "80"],
             script_targets),
    ]
}  # fmt: skip


class AreaError(RuntimeError):
    """An area did not produce its results: the message names the file or the exit status and the fix."""


# --- machine, versions, commit -------------------------------------------------------------------------


def commit_of(given: str) -> str:
    """--commit, else ``DLSTORE_COMMIT``, else git's short hash (``-dirty`` with uncommitted changes)."""
    if given or os.environ.get("DLSTORE_COMMIT"):
        return given or os.environ["DLSTORE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"
    return head + ("-dirty" if dirty else "")


VERSIONS_PROBE = """
import json, platform, sys
out = {"python": platform.python_version()}
for m in ("dlstore", "torch", "torchvision", "numpy", "PIL", "zarr", "numcodecs", "simplejpeg"):
    try:
        out[m.lower()] = __import__(m).__version__
    except Exception as e:
        out[m.lower()] = None
try:
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB)"
except Exception:
    pass
try:
    import dlstore.cli  # noqa: F401  (the `dlstore` command the scripts start)
    out["dlstore_cli"] = True
except Exception:
    out["dlstore_cli"] = False
print(json.dumps(out))
"""


def probe_versions(env: dict[str, str]) -> dict[str, Any]:
    """Versions as the areas' interpreter sees them (after any install into the temporary site)."""
    proc = subprocess.run([sys.executable, "-c", VERSIONS_PROBE], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr[-500:]}
    return json.loads(proc.stdout)


def machine(versions: dict[str, Any]) -> str:
    cpu = "unknown CPU"
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else platform.processor() or platform.machine()
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    gpu = versions.get("gpu") or "no GPU"
    return f"{gpu}; {len(os.sched_getaffinity(0))} usable cores ({cpu}){mem}; {platform.platform()}"


def prepare(suite: str, site: Path, wheels: Path) -> tuple[dict[str, str], list[str]]:
    """The areas' environment: the checkout first on the path, and on the GPU machine what it lacks
    (zarr from ``wheels``, the project's ``dlstore`` command) installed into ``site``. Returns the
    environment and what was done, for the record; a failed install is recorded, not raised: only the
    areas that need the missing package then fail, each with its own error."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    notes: list[str] = []
    if suite != "gpu":
        return env, notes
    have = probe_versions(env)
    wanted: list[list[str]] = []
    if have.get("zarr") is None and sorted(wheels.glob("*.whl")):
        wanted.append([*map(str, sorted(wheels.glob("*.whl")))])
    if not have.get("dlstore_cli"):
        wanted.append(["--no-build-isolation", str(REPO)])
    for args in wanted:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", str(site), *args]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        notes.append(
            f"{' '.join(cmd[4:8])} … {Path(args[-1]).name}: rc {proc.returncode} {proc.stderr[-300:]}"
        )
    if wanted:
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
        env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    if have.get("zarr") is None and not sorted(wheels.glob("*.whl")):
        notes.append(f"zarr missing and no wheels in {wheels}: the zarr areas will fail (run device-wheels)")
    return env, notes


# --- running an area -----------------------------------------------------------------------------------


def run_area(area: Area, ctx: Context, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """The area's script in its own process group, output to ``log.txt``; its targets, or its error."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *area.launcher, str(HERE / area.script), *area.argv(ctx)]
    record: dict[str, Any] = {"what": area.what, "script": area.script,
                              "command": "python3 " + " ".join(_shown(a) for a in cmd[1:])}  # fmt: skip
    t0 = time.perf_counter()
    log = ctx.out / "log.txt"
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the script's workers too
            proc.wait()
            rc = None
    record["seconds"] = round(time.perf_counter() - t0, 1)
    errors = [] if rc == 0 else [f"timed out after {timeout_s:.0f} s" if rc is None else f"exit status {rc}"]
    try:  # a script that failed late still leaves the targets of its finished sections
        record["targets"] = [{"area": area.name, **t} for t in area.targets(ctx.out)]
    except (AreaError, KeyError, ValueError, TypeError) as e:
        record["targets"] = []
        errors.append(f"{type(e).__name__}: {e}")
    if not errors and not record["targets"]:
        errors.append("no targets measured")
    record["status"] = "failed" if errors else "ok"
    if errors:
        record["error"] = "; ".join(errors)
        record["log_tail"] = log.read_text(errors="replace")[-3000:]
    return record


def _shown(arg: str) -> str:
    return arg if arg and " " not in arg else json.dumps(arg)


def areas_of(suite: str, only: str) -> list[Area]:
    names = (
        [a for a in only.split(",") if a] if only else [a.name for a in AREAS.values() if a.suite == suite]
    )
    unknown = [n for n in names if n not in AREAS or AREAS[n].suite != suite]
    if unknown:
        choices = ", ".join(a.name for a in AREAS.values() if a.suite == suite)
        raise SystemExit(f"--only {','.join(unknown)}: not an area of --suite {suite}; choose from {choices}")
    return [AREAS[n] for n in names]


def default_out(suite: str) -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS / f"latest-{suite}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=SUITES, default="gpu")
    ap.add_argument("--only", default="", help="comma-separated areas of the suite (default: all of them)")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: $OUT if set, else benchmarks/results/latest-SUITE"
    )
    ap.add_argument(
        "--quick", action="store_true", help="small sizes: a check that every area runs, not figures"
    )
    ap.add_argument("--budget-s", type=float, default=None, help="start no area whose estimate ends past this "
                    "(default: 540 for gpu, none for cpu)")  # fmt: skip
    ap.add_argument("--commit", default="", help="the commit measured (default: DLSTORE_COMMIT, else git)")
    ap.add_argument(
        "--wheels", type=Path, default=REPO / ".whl", help="wheels to install when zarr is missing"
    )
    ap.add_argument("--work", type=Path, default=None, help="scratch data and caches (default: a temp dir)")
    args = ap.parse_args(argv)
    areas = areas_of(args.suite, args.only)
    out = (args.out or default_out(args.suite)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s if args.budget_s is not None else (540.0 if args.suite == "gpu" else float("inf"))
    work_root = Path(tempfile.mkdtemp(prefix="dlstore-bench-", dir=args.work))
    t0 = time.perf_counter()
    try:
        env, setup = prepare(args.suite, work_root / "site", args.wheels)
        commit = commit_of(args.commit)
        env["DLSTORE_COMMIT"] = commit
        versions = probe_versions(env)
        doc: dict[str, Any] = {
            "suite": args.suite,
            "machine": machine(versions),
            "versions": versions,
            "commit": commit,
            "command": "python3 benchmarks/run.py " + " ".join(_shown(a) for a in (argv if argv is not None else sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "quick": args.quick,
            "setup": setup,
            "note": "Each area is one script run alone, one after another; every ratio is measured side by side "
                    "inside its area's run. Raw output: AREA/ next to this file.",
            "areas": {},
            "targets": [],
        }  # fmt: skip
        for area in areas:
            elapsed = time.perf_counter() - t0
            if elapsed + area.estimate_s > budget and not args.only:
                doc["areas"][area.name] = {"what": area.what, "status": "skipped",
                                           "error": f"its ~{area.estimate_s:.0f} s would pass the {budget:.0f} s "
                                                    f"budget at {elapsed:.0f} s: run --only {area.name}"}  # fmt: skip
                _say(f"{area.name}: SKIPPED (budget); run it with --only {area.name}")
            else:
                _say(f"{area.name}: {area.what}")
                ctx = Context(out / area.name, work_root / area.name, args.quick, commit)
                record = run_area(
                    area, ctx, env, timeout_s=max(60.0, min(3 * area.estimate_s, budget - elapsed))
                )
                shutil.rmtree(ctx.work, ignore_errors=True)  # the next area gets the disk and page cache
                doc["targets"] += record.pop("targets")
                doc["areas"][area.name] = record
                _say(_area_line(area.name, record))
            doc["seconds"] = round(time.perf_counter() - t0, 1)
            _write(out / "targets.json", doc)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    if not args.only and not args.quick:
        copy = RESULTS / ("targets.json" if args.suite == "gpu" else "targets_cpu.json")
        if copy.resolve() != (out / "targets.json").resolve():
            _write(copy, doc)
    print(table(doc))
    failed = [n for n, a in doc["areas"].items() if a["status"] == "failed"]
    for name in failed:
        print(f"\nAREA {name} FAILED: {doc['areas'][name]['error']}\n{doc['areas'][name]['log_tail'][-1200:]}",
              file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


def _say(msg: str) -> None:
    print(f"[run.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _area_line(name: str, record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return f"{name}: ok in {record['seconds']:.0f} s"
    return f"{name}: FAILED in {record['seconds']:.0f} s: {record['error']} (log: {name}/log.txt)"


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False, default=str) + "\n")


def table(doc: dict[str, Any]) -> str:
    lines = [f"{doc['suite']} suite, commit {doc['commit']}, {doc['machine']}",
             f"{'area':<10} {'target':<88} {'measured':>12} {'reference':>12} {'ratio':>7} {'goal':>8} met"]  # fmt: skip
    for t in doc["targets"]:
        lines.append(
            f"{t['area']:<10} {t['name'][:88]:<88} {t['measured']:>12,.1f} {t['reference']:>12,.1f} "
            f"{t['ratio']:>7.3f} {t['goal']:>8g} {'yes' if t['met'] else 'NO'}"
        )
    for name, a in doc["areas"].items():
        if a["status"] != "ok":
            lines.append(f"{name:<10} {a['status'].upper()}: {a['error'][:150]}")
    met = sum(t["met"] for t in doc["targets"])
    lines.append(f"{len(doc['targets'])} targets, {met} met; {doc.get('seconds', 0):.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
