"""Issue 10: ResNet-18 bf16 @112 from the shorter-128 JPEG cache, the CPU share's read path old vs new.

    python benchmarks/cpuread_hybrid.py --out OUTDIR [--images 8192] [--steps 60] [--repeats 5]

Side by side in one process (configurations rotated per repeat, median): the synthetic-data ceiling, and
``DecodeLoader(cpu_decoders=N)`` with the automatic split and all on the CPU (``--configs``), each with

- ``views``: the previous read path, kept here for the comparison: every payload of the batch becomes a
  memoryview in the loading process (CRC checked there, per image), the CPU share is sized with a
  per-image ``len`` and copied with ``b"".join``;
- ``files``: the current one (``Cache.payload_extents`` + ``CpuDecoders.submit``): the CPU share's
  byte ranges come from the units' indexes with numpy, the decode workers read the payloads from the
  units' files (memory-mapped) and check the CRCs: this process touches no per-image bytes;
- ``copy``: the current one with the bytes copied into the slot by this process, one slice per image
  (what it does for units that are not files, e.g. a remote cache's);
- ``files`` with ``:R``: each batch's CPU share split into R runs instead of one per process (fewer
  messages to and from the workers per batch; the batches read ahead keep the others busy);
- ``:affN``: the decode processes kept off the first N cores (``sched_setaffinity``), which the scheduler
  then leaves to the training process (round G: busy decoders beside the step cost it 14%).

Diagnostics per configuration (so a result can be explained): CPU seconds per batch of the loader's
read-ahead and decode threads (``time.thread_time``), of the training (main) thread, the collector and
the reader's pool threads and the decode processes (``/proc`` schedstat: on-CPU and run-queue wait),
the main thread's wait for the next batch, and the loader's own stats. Writes OUTDIR/cpuread_hybrid.json
and prints a table last. On a machine without CUDA it is a dry run (tiny sizes; torchvision's CPU
decode stands in for nvJPEG; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from jpeg_cache import MEAN, STD, _write_crops, resnet_step  # noqa: E402

from dlstore.convert.conversion import convert  # noqa: E402
from dlstore.errors import CacheCorruptError  # noqa: E402
from dlstore.gpu import RaggedRandomResizedCrop  # noqa: E402
from dlstore.read.cpu_decode import COLUMNS, CpuShare  # noqa: E402
from dlstore.read.gpu_decode import DecodeLoader, as_tensors  # noqa: E402
from dlstore.read.loaders import storage_sorted  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
START = time.perf_counter()
RESULT: dict[str, Any] = {}
CORES = len(os.sched_getaffinity(0))
log, sync = harness.log, harness.sync


class Measured(DecodeLoader):
    """DecodeLoader with the CPU time of its read-ahead and decode threads summed per call."""

    def __init__(self, *args: Any, runs: int = 0, reserve: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.read_cpu = self.decode_cpu = 0.0
        self.reads = self.decodes = 0
        self.runs, self.reserve = runs, reserve
        self.affinity: list[int] = []

    def _start_cpu_decoders(self) -> Any:
        cpu = super()._start_cpu_decoders()
        if self.runs:  # fewer runs (messages) per batch than decode processes
            cpu.runs = self.runs
        if self.reserve:  # the decode processes kept off the first cores, left to this process
            cores = sorted(os.sched_getaffinity(0))
            self.affinity = cores[self.reserve :] or cores  # (a dry run on fewer cores: all of them)
            for p in cpu.procs:
                os.sched_setaffinity(p.pid, self.affinity)
        return cpu

    def _read(self, batch: list[int]) -> Any:
        t0 = time.thread_time()
        try:
            return super()._read(batch)
        finally:
            self.read_cpu += time.thread_time() - t0
            self.reads += 1

    def _decode(self, item: Any, gate: Any = None) -> Any:
        t0 = time.thread_time()
        try:
            return super()._decode(item, gate)
        finally:
            self.decode_cpu += time.thread_time() - t0
            self.decodes += 1


class ViewsLoader(Measured):
    """The read path before ``payload_extents`` (main 414a8d2), for the side-by-side comparison: the
    whole batch read as CRC-checked memoryviews in this process, the CPU share sized and joined from
    them. Its rows go to the workers with CRC -1 (checked here already)."""

    def _read_batch(self, batch: list[int]) -> Any:
        index = storage_sorted(self.cache, batch)
        labels = self.cache.labels[index]
        payloads, shapes = self.cache.read_payloads(index)
        share = self._views_share(payloads, shapes)
        first = share.count if share is not None else 0
        return index, (payloads[first:], as_tensors(payloads[first:]), share), shapes[first:], labels

    def _views_share(self, payloads: list[memoryview], shapes: np.ndarray) -> CpuShare | None:
        cpu = self.cpu
        count = int(round(self.share * len(payloads))) if cpu is not None else 0
        if cpu is None or count == 0:
            return None
        slot = cpu.acquire()
        sizes = np.fromiter((len(p) for p in payloads[:count]), np.int64, count)
        count = cpu.fits(sizes, shapes, count)
        if count == 0:
            cpu.release(slot)
            return None
        payloads, shapes = payloads[:count], np.asarray(shapes[:count], np.int64)
        base = slot * cpu.slot_bytes
        sizes = np.fromiter((len(p) for p in payloads), np.int64, count)
        in_ends = base + np.cumsum(sizes)
        joined = b"".join(payloads)
        cpu.block[base : base + len(joined)] = np.frombuffer(joined, np.uint8)
        table = np.empty((count, COLUMNS), np.int64)
        table[:, 0], table[:, 1] = in_ends - sizes, in_ends
        table[:, 3:6] = shapes
        table[:, 6] = -1
        table[:, 7] = -1
        return cpu.dispatch(slot, table)


class FilesLoader(Measured):
    """The current read path (DecodeLoader's own): the workers read file-backed units' payloads
    themselves and check the CRCs."""


class CopyLoader(Measured):
    """The current read path with every payload copied into the slot by this process (what it does for
    units that are not files, e.g. a remote cache's): the copy's share of the difference."""

    def _submit_cpu_share(self, index: np.ndarray) -> CpuShare | None:
        real = self.cache.payload_extents

        def copied(indices: Any) -> Any:
            extents = real(indices)
            extents.sources = [None] * len(extents.sources)
            return extents

        self.cache.payload_extents = copied  # type: ignore[method-assign]
        try:
            return super()._submit_cpu_share(index)
        finally:
            del self.cache.payload_extents


READS: dict[str, type[Measured]] = {"views": ViewsLoader, "copy": CopyLoader, "files": FilesLoader}


# --- thread and process CPU from /proc ---------------------------------------------------------------


def schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of a task."""
    try:
        with open(path) as f:
            run, wait, _ = f.read().split()
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def snapshot(loader: Measured) -> dict[str, tuple[float, float]]:
    """schedstat of this process's long-lived threads (by name) and of the loader's decode processes."""
    import threading

    out: dict[str, tuple[float, float]] = {}
    for t in threading.enumerate():
        name = "read_pool" if t.name.startswith("dlstore-read_") else t.name
        if t.native_id is None or name not in ("MainThread", "dlstore-cpu-decode", "read_pool"):
            continue
        run, wait = schedstat(f"/proc/self/task/{t.native_id}/schedstat")
        prev = out.get(name, (0.0, 0.0))
        out[name] = (prev[0] + run, prev[1] + wait)
    if loader.cpu is not None:
        stats = [schedstat(f"/proc/{p.pid}/schedstat") for p in loader.cpu.procs]
        out["decode_procs"] = (sum(s[0] for s in stats), sum(s[1] for s in stats))
    return out


def delta(
    after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]], n: int
) -> dict[str, Any]:
    """Per batch: ms on CPU and ms waiting for one, per thread group."""
    out = {}
    for k, (run, wait) in after.items():
        r0, w0 = before.get(k, (0.0, 0.0))
        out[k] = {"cpu_ms": (run - r0) / n * 1e3, "runq_ms": (wait - w0) / n * 1e3}
    return out


class Probe:
    """Counters of one measured stretch of a loader (thread CPU, /proc, stats, waits for batches)."""

    def __init__(self, loader: Measured) -> None:
        self.loader = loader
        self.read_cpu, self.decode_cpu = loader.read_cpu, loader.decode_cpu
        self.reads, self.decodes = loader.reads, loader.decodes
        self.stats = dict(vars(loader.stats))
        self.proc = snapshot(loader)
        self.process = time.process_time()

    def result(self, batches: int, wall: float, next_wait: float) -> dict[str, Any]:
        ld = self.loader
        reads, decodes = max(1, ld.reads - self.reads), max(1, ld.decodes - self.decodes)
        stats = {k: v - self.stats[k] for k, v in vars(ld.stats).items() if isinstance(v, (int, float))}
        n = max(1, stats.get("batches", 0))
        return {
            "batches": batches,
            "read_thread_cpu_ms": (ld.read_cpu - self.read_cpu) / reads * 1e3,
            "decode_thread_cpu_ms": (ld.decode_cpu - self.decode_cpu) / decodes * 1e3,
            "process_cpu_ms": (time.process_time() - self.process) / max(1, batches) * 1e3,
            "threads": delta(snapshot(ld), self.proc, max(1, batches)),
            "read_wall_ms": stats.get("read_seconds", 0.0) / n * 1e3,
            "read_wait_ms": stats.get("read_wait_seconds", 0.0) / n * 1e3,
            "next_wait_ms": next_wait / max(1, batches) * 1e3,
            "wall_ms": wall / max(1, batches) * 1e3,
            "cpu_share_last": ld.stats.cpu_share,
            "share_now": ld.share,
        }


# --- runs --------------------------------------------------------------------------------------------


def alone(loader: Measured, epochs: int) -> dict[str, Any]:
    """img/s iterating the loader without a model (after one warm epoch), with the probe's counters."""
    for _ in loader:
        pass
    sync()
    probe, t0, count, batches, waited = Probe(loader), time.perf_counter(), 0, 0, 0.0
    for _ in range(epochs):
        it = iter(loader)
        while True:
            w0 = time.perf_counter()
            try:
                x, _y = next(it)
            except StopIteration:
                break
            waited += time.perf_counter() - w0
            count, batches = count + len(x), batches + 1
    sync()
    wall = time.perf_counter() - t0
    return {"img_s": count / wall, **probe.result(batches, wall, waited)}


def trained(
    make: Callable[[], Iterator[Any]], step: Callable[..., None], warmup: int, steps: int, batch: int
) -> tuple[float, float]:
    """img/s of ``steps`` training steps (after ``warmup``) and the seconds spent waiting for batches."""
    it, waited = make(), 0.0

    def nxt() -> Any:
        nonlocal it, waited
        w0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            it = make()
            item = next(it)
        waited += time.perf_counter() - w0
        return item

    for _ in range(warmup):
        step(*nxt())
    sync()
    waited, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        step(*nxt())
    sync()
    return steps * batch / (time.perf_counter() - t0), waited


def with_model(
    loader: Measured | None, step: Callable[..., None], args: argparse.Namespace, batch: int, synth: Any
) -> dict[str, Any]:
    if loader is None:
        main_thread = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        (run0, wait0), t0 = schedstat(main_thread), time.perf_counter()
        rate, _ = trained(synth, step, args.warmup, args.steps, batch)
        (run1, wait1), steps = schedstat(main_thread), args.warmup + args.steps
        return {
            "img_s": rate,
            "wall_ms": (time.perf_counter() - t0) / steps * 1e3,
            "threads": {
                "MainThread": {
                    "cpu_ms": (run1 - run0) / steps * 1e3,
                    "runq_ms": (wait1 - wait0) / steps * 1e3,
                }
            },
        }
    probe = Probe(loader)
    t0 = time.perf_counter()
    rate, waited = trained(lambda: iter(loader), step, args.warmup, args.steps, batch)
    steps = args.warmup + args.steps
    return {"img_s": rate, **probe.result(steps, time.perf_counter() - t0, waited)}


# --- data --------------------------------------------------------------------------------------------


def make_cache(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    photos, cache = work / "photos", work / "jpeg_short128"
    t0 = time.perf_counter()
    if not cache.exists():
        step = -(-args.images // CORES)
        jobs = [(a, min(args.images, a + step), str(photos)) for a in range(0, args.images, step)]
        with mp.get_context("fork").Pool(CORES) as pool:
            pool.map(_write_crops, jobs)
        convert(photos, cache, format="npz", size=128, codec="jpeg", resize="shorter", workers=CORES)
    log(f"data: {args.images} photos, jpeg_short128 in {time.perf_counter() - t0:.1f} s")
    return cache, {"images": args.images, "seconds": time.perf_counter() - t0}


def check_corrupt_is_named(cache_path: Path, work: Path, decoders: int) -> dict[str, Any]:
    """A corrupted payload read through the new path on this machine: the named error, not pixels."""
    import shutil

    from dlstore.read.cache import open_cache

    bad = work / "corrupt"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(cache_path, bad)
    cache = open_cache(bad)
    reader, index = cache.reader, 5
    position = int(cache.positions[index])
    unit = reader.payload_unit(position // reader.unit)  # type: ignore[attr-defined]
    j = position % reader.unit  # type: ignore[attr-defined]
    payload = bytes(unit.payload(j))
    path = reader.unit_path(position // reader.unit)  # type: ignore[attr-defined]
    cache.close()
    blob = bytearray(path.read_bytes())
    at = blob.find(payload) + len(payload) // 2
    blob[at : at + 8] = bytes(b ^ 0x5A for b in blob[at : at + 8])
    path.write_bytes(bytes(blob))
    loader = FilesLoader(bad, 64, transform=lambda x: x, device=DEV, cpu_decoders=decoders, cpu_share=1.0)  # type: ignore[arg-type,return-value]
    loader.gpu = True
    try:
        for _ in loader:
            pass
        return {"raised": None}
    except Exception as e:  # noqa: BLE001 - recorded: the named error is the expected outcome
        message = str(e)
        return {
            "raised": type(e).__name__,
            "names_index": f"index {index}" in message,
            "names_chunk": f"chunk {position // reader.unit}" in message,  # type: ignore[attr-defined]
            "corrupt_error": isinstance(e.__cause__, CacheCorruptError),
            "message": message[:300],
        }
    finally:
        loader.close()


# --- main --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    torch.backends.cudnn.benchmark = True
    cache, data = make_cache(args, work)
    batch, res = 512 // args.batch_div, 112
    step = resnet_step("resnet18", 10)
    x = (
        torch.randn(batch, 3, res, res, device=DEV)
        .to(torch.bfloat16)
        .contiguous(memory_format=torch.channels_last)
    )
    y = torch.randint(0, 10, (batch,), device=DEV)

    def synthetic() -> Iterator[Any]:
        while True:
            yield x, y

    rrc = RaggedRandomResizedCrop(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).to(
        DEV
    )
    loaders: dict[str, Measured] = {}
    m = args.cpu_decoders
    for config in args.configs.split(","):
        read, share, *extra = config.split(":")
        fixed = None if share == "auto" else float(share)
        kw = {"reserve" if e.startswith("aff") else "runs": int(e.removeprefix("aff")) for e in extra}
        ld = READS[read](cache, batch, transform=rrc, device=DEV, cpu_decoders=m, cpu_share=fixed, **kw)
        ld.gpu = True  # a CPU dry run: torchvision's CPU decode stands in for nvJPEG
        loaders[
            f"{read}_cpu{m}_{share}" + "".join(f"_{e}" if e.startswith("aff") else f"_r{e}" for e in extra)
        ] = ld
    out = RESULT
    out.update(data=data, batch=batch, batches_per_epoch=len(next(iter(loaders.values()))))
    out["alone"] = {}
    for name, ld in loaders.items():
        out["alone"][name] = alone(ld, args.alone_epochs)
        log(f"alone {name}: {out['alone'][name]['img_s']:,.0f} img/s")
    out["decoder_cores"] = {k: ld.affinity for k, ld in loaders.items() if ld.affinity}
    names = ["synthetic", *loaders]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
    out["runs"] = runs
    for r in range(args.repeats):
        t0 = time.perf_counter()
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(with_model(loaders.get(name), step, args, batch, synthetic))
            log(f"resnet18@112 {name}: {runs[name][-1]['img_s']:,.0f} img/s")
        out["median_img_s"] = {k: float(np.median([v["img_s"] for v in vs])) for k, vs in runs.items()}
        out["stats"] = {k: vars(ld.stats) for k, ld in loaders.items()}
        out["pinned"] = {k: bool(ld.cpu and ld.cpu.pinned) for k, ld in loaders.items()}
        save(out)  # a run cut short by its time limit keeps the repeats done
        spent = time.perf_counter() - START
        if args.deadline_s and spent + 1.2 * (time.perf_counter() - t0) + 8 > args.deadline_s:
            log(f"stopping after {r + 1} repeats: {spent:.0f} s spent of --deadline-s {args.deadline_s}")
            break
    for ld in loaders.values():
        ld.close()
    out["corrupt_payload"] = check_corrupt_is_named(cache, work, 2)
    log(f"corrupt payload through the workers: {out['corrupt_payload']}")
    return out


def save(out: dict[str, Any]) -> None:
    out["seconds"] = time.perf_counter() - START
    Path(out["out_dir"], "cpuread_hybrid.json").write_text(json.dumps(out, indent=1, default=str))


def median_of(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    vals = [
        r["threads"].get(key, {}).get(sub, float("nan")) if sub else r.get(key, float("nan")) for r in rows
    ]
    return float(np.median(vals)) if vals else float("nan")


def table(out: dict[str, Any]) -> str:
    lines = [f"batch {out['batch']}, {out['batches_per_epoch']} batches an epoch"]
    lines.append("loader alone     img/s  read_cpu  dec_cpu  coll_cpu  read_wall  (ms per batch)")
    for name, row in out["alone"].items():
        coll = row["threads"].get("dlstore-cpu-decode", {}).get("cpu_ms", float("nan"))
        lines.append(
            f"{name:20} {row['img_s']:8,.0f} {row['read_thread_cpu_ms']:8.2f} {row['decode_thread_cpu_ms']:8.2f}"
            f" {coll:9.2f} {row['read_wall_ms']:10.2f}"
        )
    med = out.get("median_img_s", {})
    if "synthetic" not in med:
        return "\n".join(lines)
    ceiling = med["synthetic"]
    lines.append(
        "with the model       img/s  of_ceil  read_cpu dec_cpu main_cpu main_runq proc_cpu next_wait coll_cpu workers_cpu"
    )
    for name, rows in out["runs"].items():
        if name == "synthetic" or not rows:
            continue
        lines.append(
            f"{name:20} {med[name]:8,.0f} {med[name] / ceiling:8.3f}"
            f" {median_of(rows, 'read_thread_cpu_ms'):9.2f} {median_of(rows, 'decode_thread_cpu_ms'):7.2f}"
            f" {median_of(rows, 'MainThread', 'cpu_ms'):8.2f} {median_of(rows, 'MainThread', 'runq_ms'):9.2f}"
            f" {median_of(rows, 'process_cpu_ms'):8.2f} {median_of(rows, 'next_wait_ms'):9.2f}"
            f" {median_of(rows, 'dlstore-cpu-decode', 'cpu_ms'):8.2f} {median_of(rows, 'decode_procs', 'cpu_ms'):11.2f}"
        )
    synth = out["runs"]["synthetic"]
    lines.append(
        f"synthetic {ceiling:,.0f} img/s: main thread CPU {median_of(synth, 'MainThread', 'cpu_ms'):.2f} ms per step, "
        f"run queue {median_of(synth, 'MainThread', 'runq_ms'):.2f}, wall {median_of(synth, 'wall_ms'):.2f}"
    )
    lines.append(
        "(ms per batch, medians over repeats: loader threads' CPU, main = training thread, proc = the"
    )
    lines.append(
        " whole process, next_wait = main thread waiting for the next batch, workers = all decode processes)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--images", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--alone-epochs", type=int, default=2)
    ap.add_argument("--cpu-decoders", type=int, default=12)
    ap.add_argument(
        "--configs",
        default="views:auto,views:1.0,files:auto,files:1.0,copy:1.0,files:1.0:4,files:auto:aff4,files:1.0:aff4",
        help="read path (views|copy|files):share (auto or a fraction)[:R runs a batch is split into]"
        "[:affN decode processes kept off the first N cores]",
    )
    ap.add_argument("--batch-div", type=int, default=1, help="smaller batches (CPU dry runs)")
    ap.add_argument("--deadline-s", type=float, default=0, help="fewer repeats to end before this (0: all)")
    args = ap.parse_args()
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "dlstore-cpuread"
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    RESULT.update(
        environment=harness.environment(),
        protocol=vars(args) | {"out": str(args.out), "work": str(work)},
        out_dir=str(args.out),
    )
    run(args, work)
    save(RESULT)
    print(table(RESULT))


if __name__ == "__main__":
    main()
