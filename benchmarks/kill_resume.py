"""Kill a real ``dlstore convert`` with SIGKILL at random moments, then check and resume.

For every format: one uninterrupted reference conversion, then ``--kills`` rounds. Each round starts
``dlstore convert`` (2 workers) in its own process group, SIGKILLs the whole group after a random
delay in [0, 1.1 x reference time], and checks that DEST either refuses to open (CacheNotFoundError)
or opens complete with exactly the reference pixels and labels (or, in rebuild rounds where DEST held
an older cache, exactly that old cache). Then it re-runs the same command and checks the result equals
the reference, verifies, and that nothing is left next to DEST. Every other round is a rebuild
(``--overwrite`` over an existing cache), where DEST must never be absent.

    python benchmarks/kill_resume.py --kills 20 --out benchmarks/results/kill_resume.json

``--loop``: the same for a training loop. Kill -9 a real DDP training loop at random steps, resume it
from its last checkpoint, and check that the samples it trained on are exactly the uninterrupted run's.

Each loader kind trains a linear model under DDP (gloo, 2 ranks on the CPU, one process each, started
with torch.multiprocessing) on a JPEG cache whose image i is of class i, so a batch's labels are its
sample ids:

- ``cached``: ``CachedDataset`` + ``ChunkSampler`` under torchdata's ``StatefulDataLoader``, 2 workers;
- ``pinned``, ``resident``, ``decode``: ``dlstore.Loader``'s three paths (``via=``) on the CPU.

The loop runs by steps across epoch boundaries; every ``--every`` steps rank 0 writes a checkpoint
(model, optimizer, step, every rank's loader state) by temp file and rename. Each rank logs every step's
sample ids. For each kind: one uninterrupted reference run, then a chain of ``--kills`` runs, each
resumed from the last checkpoint and SIGKILLed (the whole process group: ranks and DataLoader workers)
at a random step and a random moment within it, then one run to the end. It checks that every batch any
run logged at step s equals the reference's step s (so the final sequence does too), and compares the
final weights. The elastic check (``--elastic 3``, on ``pinned`` and ``resident``) kills a 2-rank run
and resumes it on 3 ranks: every step must be the next W x B positions of the one epoch order.
``--kills 0`` runs only the elastic check.

    python benchmarks/kill_resume.py --loop --kills 20 --out benchmarks/results/kill_train.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when a test loads this file

from dlstore import open_cache, verify  # noqa: E402
from dlstore.errors import CacheNotFoundError  # noqa: E402

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


# --- a training loop killed (--loop) ---------------------------------------------------------------

KINDS = ("cached", "pinned", "resident", "decode")


# --- the training run (one process per rank) ------------------------------------------------------------


def make_loader(kind: str, cache: Path, batch: int, rank: int, world: int) -> Any:
    import harness

    from dlstore import CachedDataset
    from dlstore.read import ChunkSampler

    if kind == "cached":
        from torchdata.stateful_dataloader import StatefulDataLoader

        ds = CachedDataset(cache)
        sampler = ChunkSampler(ds, window=2, seed=5, num_replicas=world, rank=rank)
        return StatefulDataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2, drop_last=True)
    order = {"order": "chunk", "window": 2, "seed": 5, "num_replicas": world, "rank": rank}
    return harness.make_loader(cache, batch, kind, device="cpu", **order)


def endless(loader: Any) -> Any:
    while True:  # each pass is the next epoch (a resumed one continues the epoch it stopped in)
        yield from loader


def train(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    n = int(json.loads((args.cache / "dlstore.json").read_text())["n"])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3 * 8 * 8, n))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_loader(args.kind, args.cache, args.batch, rank, args.world)
    ckpt = args.run / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loaders"][rank % len(state["loaders"])])
        step = state["step"]
    log = open(args.run / f"rank{rank}.jsonl", "a")
    batches = endless(loader)
    while step < args.steps:
        at = loader.state_dict() if args.kind != "cached" else {}  # where this batch starts (global)
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x.float().flatten(1) / 255), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        line = {"attempt": args.attempt, "step": step, "ids": sorted(y.tolist()), "world": args.world}
        line.update({k: at[k] for k in ("epoch", "consumed", "base", "width") if k in at})
        log.write(json.dumps(line) + "\n")
        log.flush()
        step += 1
        time.sleep(args.step_sleep)
        if step % args.every == 0:
            states = [None] * args.world
            dist.all_gather_object(states, loader.state_dict())
            if rank == 0:
                doc = {"step": step, "model": model.module.state_dict(), "optimizer": opt.state_dict()}
                tmp = ckpt.with_name(f".checkpoint.{os.getpid()}")
                torch.save({**doc, "loaders": states}, tmp)
                os.replace(tmp, ckpt)
            dist.barrier()
    if rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        (args.run / "final.json").write_text(json.dumps({"weights": weights.double().sum().item()}))
    dist.destroy_process_group()


def child(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(train, args=(args, port), nprocs=args.world, start_method="fork")


# --- the harness ------------------------------------------------------------------------------------------


def make_cache(root: Path, n: int) -> Path:
    from dlstore import convert
    from dlstore.formats import FORMATS
    from dlstore.write.sources import ArraySource

    payload = next(f for f in FORMATS.values() if f.ragged_ok)
    payload.payload_writer.target_unit_bytes = 8 * (192 // 10)  # units of ~8 images: many units
    rng = np.random.default_rng(0)
    source = ArraySource(
        description="ids",
        classes=tuple(f"c{i}" for i in range(n)),
        names=[str(i) for i in range(n)],
        labels=np.arange(n),
        kind="kill_train",
        data=rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
    )
    dest = root / "cache"
    convert(source, dest, format=payload.name, size=8, resize="stretch", codec="jpeg", workers=1)
    return dest


def launch(args: argparse.Namespace, kind: str, run: Path, attempt: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        __file__,
        "--loop",
        "--child",
        "--kind",
        kind,
        "--cache",
        str(args.cache),
        "--run",
        str(run),
    ]
    cmd += ["--attempt", str(attempt), "--steps", str(args.steps), "--every", str(args.every)]
    cmd += ["--batch", str(args.batch), "--step-sleep", str(args.step_sleep), "--world", str(args.world)]
    err = open(run / f"stderr.{attempt}", "wb")
    return subprocess.Popen(cmd, stdout=err, stderr=err, start_new_session=True)


def logged(run: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> every complete line it logged, over all attempts."""
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(run.glob("rank*.jsonl")):
        lines = []
        for line in f.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written when the kill came
                pass
        out[int(f.stem[4:])] = lines
    return out


def last_step(run: Path, attempt: int) -> int:
    steps = [r["step"] for lines in logged(run).values() for r in lines if r["attempt"] == attempt]
    return max(steps, default=-1)


def checkpoint_step(run: Path) -> int:
    import torch

    ckpt = run / "checkpoint.pt"
    return int(torch.load(ckpt, weights_only=False)["step"]) if ckpt.exists() else 0


def kill_at(proc: subprocess.Popen[bytes], run: Path, attempt: int, target: int, jitter: float) -> bool:
    """SIGKILL the group once the run has logged step ``target`` and ``jitter`` s more; False when it
    finished first."""
    while proc.poll() is None and last_step(run, attempt) < target:
        time.sleep(0.02)
    if proc.poll() is None:
        time.sleep(jitter)
    finished = proc.poll() is not None
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()
    return not finished


def run_to_end(args: argparse.Namespace, kind: str, run: Path, attempt: int) -> None:
    proc = launch(args, kind, run, attempt)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(
            f"{kind} attempt {attempt} failed: {(run / f'stderr.{attempt}').read_text()[-2000:]}"
        )


def compare(run: Path, ref: dict[int, dict[int, list[int]]]) -> dict[str, Any]:
    lines = logged(run)
    wrong = [(r, x["step"]) for r, xs in lines.items() for x in xs if ref[r].get(x["step"]) != x["ids"]]
    final = {r: {x["step"]: x["ids"] for x in xs} for r, xs in lines.items()}
    complete = all(sorted(final[r]) == sorted(ref[r]) for r in ref)
    return {"wrong_batches": len(wrong), "first_wrong": wrong[:3], "complete": complete}


def run_kind(args: argparse.Namespace, kind: str, work: Path, rng: random.Random) -> dict[str, Any]:
    ref_run = work / f"{kind}-ref"
    ref_run.mkdir()
    t0 = time.perf_counter()
    run_to_end(args, kind, ref_run, 0)
    ref_s = time.perf_counter() - t0
    ref = {r: {x["step"]: x["ids"] for x in xs} for r, xs in logged(ref_run).items()}
    kills: list[dict[str, Any]] = []
    results = []
    chain = 0
    while sum(k["killed"] for k in kills) < args.kills:  # chains of kills, each resumed to the end
        run = work / f"{kind}-{chain}"
        run.mkdir()
        for attempt in range(args.steps):
            start = checkpoint_step(run)
            if start >= args.steps or sum(k["killed"] for k in kills) >= args.kills:
                break
            # a random step within the next two checkpoint intervals, a random moment within it
            target = min(args.steps - 1, start + rng.randrange(2 * args.every))
            proc = launch(args, kind, run, attempt)
            killed = kill_at(proc, run, attempt, target, rng.uniform(0, args.step_sleep * 1.5))
            kills.append(
                {"chain": chain, "resumed_from_step": start, "kill_after_step": target, "killed": killed}
            )
            if not killed:
                break
        if not (run / "final.json").exists():
            run_to_end(args, kind, run, args.steps + 1)
        results.append(compare(run, ref))
        chain += 1
    result = {
        "wrong_batches": sum(r["wrong_batches"] for r in results),
        "first_wrong": [w for r in results for w in r["first_wrong"]][:3],
        "complete": all(r["complete"] for r in results),
    }
    ref_w = json.loads((ref_run / "final.json").read_text())["weights"]
    weights = [json.loads((work / f"{kind}-{c}" / "final.json").read_text())["weights"] for c in range(chain)]
    return {
        "kind": kind,
        "reference_s": round(ref_s, 1),
        "kills": sum(k["killed"] for k in kills),
        "chains": chain,
        "batches_logged": sum(len(v) for c in range(chain) for v in logged(work / f"{kind}-{c}").values()),
        **result,
        "weights_equal": all(w == ref_w for w in weights),
        "ok": result["wrong_batches"] == 0 and result["complete"],
        "chain": kills,
    }


def elastic(args: argparse.Namespace, kind: str, work: Path, rng: random.Random) -> dict[str, Any]:
    """Train on ``--world`` ranks, SIGKILL at a random step, resume on ``--elastic`` ranks to the end;
    every step's batches (all ranks together) must be the positions [consumed, consumed + W*B) of the
    consumption order its logged state names (``dlstore.read.rounds``: the epoch order read a window
    per rank), each epoch's positions must follow on without a gap, and each epoch must read every
    sample once (but for the last < W*B that drop_last leaves)."""
    from dlstore.read import EpochSampler

    run = work / f"{kind}-elastic"
    run.mkdir()
    target = rng.randrange(args.every, args.steps - args.every)
    killed = kill_at(launch(args, kind, run, 0), run, 0, target, rng.uniform(0, args.step_sleep))
    resumed_from = checkpoint_step(run)
    resume = argparse.Namespace(**{**vars(args), "world": args.elastic})
    run_to_end(resume, kind, run, 1)
    lines = logged(run)
    final = {}  # (step) -> {rank: line}, the last attempt's
    for rank, xs in lines.items():
        for x in xs:
            final.setdefault(x["step"], {})[rank] = x
    from dlstore import open_cache

    cache = open_cache(args.cache)
    sampler = EpochSampler(cache.positions, cache.reader.unit, order="chunk", window=2, seed=5)
    wrong, gaps, expected_at, read = [], 0, {}, {}
    keys = ("epoch", "consumed", "base", "width")
    for step in sorted(final):
        ranks = final[step]
        head = next(iter(ranks.values()))
        world, epoch, c = head["world"], head["epoch"], head["consumed"]
        if len(ranks) != world or any(
            [x[k] for k in keys] != [head[k] for k in keys] for x in ranks.values()
        ):
            wrong.append(step)
            continue
        state = {**sampler.state_dict(), **{k: head[k] for k in keys}}
        expect = []
        for r in range(world):
            one = EpochSampler(cache.positions, cache.reader.unit, order="chunk", window=2, seed=5,
                               num_replicas=world, rank=r, drop_last=True)  # fmt: skip
            one.load_state_dict(state)
            expect += list(itertools.islice(one, args.batch))
        got = sorted(i for x in ranks.values() for i in x["ids"])
        if got != sorted(expect):
            wrong.append(step)
        gaps += expected_at.get(epoch, 0) != c
        expected_at[epoch] = c + world * args.batch
        read.setdefault(epoch, []).extend(got)
    n = len(cache.positions)
    complete = [e for e in read if e + 1 in read]  # epochs the run read to their end
    once = all(
        len(read[e]) == len(set(read[e])) and n - len(read[e]) < args.batch * max(args.world, args.elastic)
        for e in complete
    )
    return {
        "kind": kind,
        "ranks": f"{args.world} -> {args.elastic}",
        "killed": killed,
        "resumed_from_step": resumed_from,
        "steps_checked": len(final),
        "wrong_steps": wrong[:5],
        "gaps_or_repeats": gaps,
        "epochs_each_sample_once": len(complete) if once else -1,
        "ok": killed and not wrong and gaps == 0 and once and bool(complete),
    }


def main_loop(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description="kill -9 a DDP training loop, resume, compare the samples")
    ap.add_argument("--kills", type=int, default=20, help="kills per loader kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60, help="steps of the whole run (several epochs)")
    ap.add_argument("--every", type=int, default=4, help="a checkpoint every k steps")
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--elastic", type=int, default=3, help="ranks of the resumed run in the elastic check (0: skip)"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="pinned", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kill_train_") as tmp:
        args.cache = make_cache(Path(tmp), args.images)
        results = []
        for kind in args.kinds.split(",") if args.kills else []:
            results.append(run_kind(args, kind, Path(tmp), rng))
            r = results[-1]
            print(
                f"{kind}: {r['kills']} kills, wrong batches {r['wrong_batches']}, ok={r['ok']}",
                file=sys.stderr,
            )
        elastic_results = [
            elastic(args, kind, Path(tmp), rng)
            for kind in ("pinned", "resident")
            if args.elastic and kind in args.kinds
        ]
        for e in elastic_results:
            print(f"elastic {e['kind']} {e['ranks']}: ok={e['ok']}", file=sys.stderr)
    doc = {
        "elastic": elastic_results,
        "command": "python benchmarks/kill_resume.py --loop "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}, Python {platform.python_version()}",
        "images": args.images,
        "batch_per_rank": args.batch,
        "ranks": args.world,
        "steps": args.steps,
        "epochs": round(args.steps * args.batch * args.world / args.images, 2),
        "checkpoint_every": args.every,
        "seconds": round(time.perf_counter() - t0, 1),
        "total_kills": sum(r["kills"] for r in results),
        "failures": sum(not r["ok"] for r in results) + sum(not e["ok"] for e in elastic_results),
        "kinds": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if "--loop" in argv:
        return main_loop([a for a in argv if a != "--loop"])
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
    doc = main()
    sys.exit(1 if doc.get("total_failures") or doc.get("failures") else 0)
