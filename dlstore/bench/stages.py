"""Each stage measured alone: storage read (cold and warm), Dataset + transform across worker counts,
host→device copy (pinned vs pageable), and the training step on synthetic on-device batches."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dlstore.bench.protocol import StageResult
from dlstore.errors import DlstoreError
from dlstore.machine import synchronize

EVICTED_MAX_RESIDENT = 0.05  # at most 5% of the pages still cached counts as evicted
COLD_WARM_RATIO = 0.67  # without mincore: cold must be this much slower than warm to count as evicted
READ_CHUNK = 1 << 20
MIN_BATCHES = 4  # a loader-alone measurement cut short by time still counts at least this many


# --- page-cache residency and eviction ------------------------------------------------------------------


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        c = ctypes
        libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def resident_pages(path: Path) -> tuple[int, int] | None:
    """(resident, total) pages of a file in the page cache, via mmap + mincore (mapping without touching
    faults nothing in); None if unavailable."""
    if _LIBC is None or not hasattr(mmap, "PROT_READ"):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(v & 1 for v in bytes(vec)), pages
        finally:
            _LIBC.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def resident_fraction(paths: Sequence[Path]) -> float | None:
    resident = total = 0
    for p in paths:
        r = resident_pages(p)
        if r is None:
            return None
        resident, total = resident + r[0], total + r[1]
    return resident / total if total else 0.0


def evict_files(paths: Sequence[Path]) -> dict[str, Any]:
    """Drop each file from the page cache (fsync first: dirty pages stay) and check it took with mincore
    (``worked`` None when residency cannot be read; mapped or tmpfs pages stay: False)."""
    before = resident_fraction(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # read-only file systems: nothing dirty to flush anyway
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    after = resident_fraction(paths)
    return {
        "files": len(paths),
        "resident_before": before,
        "resident_after": after,
        "worked": None if after is None else after <= EVICTED_MAX_RESIDENT,
        "method": "posix_fadvise+mincore",
    }


def eviction_worked(resident_after: float | None, cold_s: float, warm_s: float) -> bool:
    """mincore's answer when there is one, else: the cold pass must be clearly slower than the warm one."""
    if resident_after is not None:
        return resident_after <= EVICTED_MAX_RESIDENT
    return warm_s < COLD_WARM_RATIO * cold_s


def read_files(paths: Sequence[Path]) -> int:
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def pick_files(paths: Sequence[Path], max_bytes: int) -> list[Path]:
    """An evenly spread subset of at most ``max_bytes`` (all files when they fit)."""
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    if total <= max_bytes or not paths:
        return list(paths)
    keep = max(1, int(len(paths) * max_bytes / total))
    step = len(paths) / keep
    return [paths[int(i * step)] for i in range(keep)]


def measure_read(
    loader: str,
    files: Sequence[Path],
    n_images: int,
    max_bytes: int = 256 << 20,
    evict: Callable[[Sequence[Path]], dict[str, Any]] = evict_files,
) -> StageResult:
    """Read the loader's files cold (after eviction) then warm; rates in MB/s and images/s."""
    if not files:
        return StageResult("read", loader, None, label="no files")
    picked = pick_files(files, max_bytes)
    total_bytes = sum(p.stat().st_size for p in files)
    bytes_per_image = total_bytes / max(1, n_images)
    eviction = evict(picked)
    t0 = time.perf_counter()
    nbytes = read_files(picked)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_files(picked)
    warm_s = time.perf_counter() - t0
    worked = eviction_worked(eviction.get("resident_after"), cold_s, warm_s)
    eviction = {
        **eviction,
        "worked": worked,
        "judged_by": "mincore" if eviction.get("resident_after") is not None else "timing",
        "cold_s": cold_s,
        "warm_s": warm_s,
    }
    images = nbytes / bytes_per_image if bytes_per_image else 0
    detail = {
        "bytes": nbytes,
        "files": len(picked),
        "files_total": len(files),
        "bytes_total": total_bytes,
        "bytes_per_image": bytes_per_image,
        "cold_mb_per_s": nbytes / cold_s / 1e6 if cold_s > 0 else None,
        "warm_mb_per_s": nbytes / warm_s / 1e6 if warm_s > 0 else None,
        "cold_img_per_s": images / cold_s if cold_s > 0 else None,
        "warm_img_per_s": images / warm_s if warm_s > 0 else None,
        "eviction": eviction,
    }
    return StageResult(
        "read", loader, detail["warm_img_per_s"], warm_s, int(images), label="warm", detail=detail
    )


# --- iterating a loader -------------------------------------------------------------------------------


class BatchStream:
    """``next()`` over epochs of a re-iterable loader (a new epoch starts where the last one ended)."""

    def __init__(self, loader: Iterable) -> None:
        if hasattr(loader, "__len__") and len(loader) == 0:  # type: ignore[arg-type]
            raise DlstoreError(
                "the loader yields no batch: the dataset is smaller than --batch-size "
                "(batches drop the last partial one); lower --batch-size"
            )
        self.loader = loader
        self.epoch = 0
        self.it = iter(loader)

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.it = iter(self.loader)
            return next(self.it)

    def worker_pids(self) -> list[int]:
        workers = getattr(self.it, "_workers", None) or []
        return [w.pid for w in workers if getattr(w, "pid", None)]

    def close(self) -> None:
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.it = iter(())


def batch_images(batch: Any) -> int:
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(x.shape[0]) if hasattr(x, "shape") else len(x)


def measure_loader(
    loader: Iterable,
    warmup: int,
    steps: int,
    device: torch.device,
    max_s: float | None = None,
    cycle: int = 1,
    beside: Callable[[], float] | None = None,
    beside_s: float = 0.0,
) -> dict[str, Any]:
    """The loader alone (no copy, no step) over ``warmup`` then ``steps`` batches: its period per batch, the
    main thread's share (wall time in ``next()`` when it works in the caller, else the thread's CPU time
    there: waiting for workers costs it nothing) and the CPU it burns. ``beside``: then, on the same running
    loader, the step fed a fixed batch per batch (``beside_serial_s``) for ``steps`` and ``beside_s``."""
    from dlstore.bench.monitor import process_cpu_s

    in_caller = works_in_caller(loader)
    t0 = time.perf_counter()
    stream = BatchStream(loader)
    try:
        for _ in range(warmup):
            stream.next()
        startup = time.perf_counter() - t0
        synchronize(device)
        cpu_ref = cpu_reference_s()
        pids = [os.getpid(), *stream.worker_pids()]
        cpu0 = [process_cpu_s(p) for p in pids]
        wall_next = cpu_next = 0.0
        images = 0
        t1 = time.perf_counter()
        done = 0
        refills: list[float] = []
        for i in range(steps):
            if max_s is not None and i >= MIN_BATCHES and i % cycle == 0 and time.perf_counter() - t1 > max_s:
                break  # enough for a rate; stop on a cycle boundary
            a, c, epoch = time.perf_counter(), time.thread_time(), stream.epoch
            images += batch_images(stream.next())
            if stream.epoch != epoch:  # this next() restarted the loader: drain, refill, first batch
                refills.append(time.perf_counter() - a)
            done += 1
            cpu_next += time.thread_time() - c
            wall_next += time.perf_counter() - a
        synchronize(device)
        seconds = time.perf_counter() - t1
        cpu1 = [process_cpu_s(p) for p in pids]
        beside_times, beside_next = _beside(stream, beside, steps, beside_s, device) if beside else ([], [])
    finally:
        stream.close()
    cpu = sum(b - a for a, b in zip(cpu0, cpu1) if a is not None and b is not None)
    return {
        "period_s": seconds / done,
        "main_s": (wall_next if in_caller else cpu_next) / done,
        "cpu_s": cpu / done,
        "img_per_s": images / seconds if seconds > 0 else float("inf"),
        "in_caller": in_caller,
        "refill_s": statistics.median(refills) if refills else None,
        "epoch_batches": len(loader) if hasattr(loader, "__len__") else None,  # type: ignore[arg-type]
        "warmup_batches": warmup,
        "batches": done,
        "startup_s": startup,
        "processes": len(pids),
        "beside_serial_s": statistics.fmean(beside_times) if beside_times else None,
        "beside_batches": len(beside_times),
        # diagnostics: next() between those steps (the loader's cost interleaved with the step) and the
        # machine's single-core speed when the loader was timed (``cpu_reference_s``)
        "beside_next_s": statistics.fmean(beside_next) if beside_next else None,
        "cpu_ref_s": cpu_ref,
    }


def works_in_caller(loader: Iterable) -> bool:
    """The loader does its work in ``next()`` on the main thread (a DataLoader with 0 workers)."""
    return getattr(loader, "num_workers", None) == 0


def probe_loader(
    loader: Iterable,
    min_batches: int,
    min_s: float,
    device: torch.device,
    beside: Callable[[Any], float] | None = None,
    alone: bool = True,
    beside_first: bool = False,
) -> dict[str, Any]:
    """A loader without worker processes, right next to a run on it (the machine drifts within seconds):
    ``alone``, its wall time in ``next()`` and CPU per batch; ``beside``, the copy + step on a fixed batch
    after each of its batches. ``beside_first`` mirrors the order, so a linear drift weighs both alike."""
    t0 = time.perf_counter()
    stream = BatchStream(loader)
    out: dict[str, Any] = {
        "cpu_ref_s": cpu_reference_s(),
        "order": "beside-alone" if beside_first else "alone-beside",
    }
    try:
        first = stream.next()  # warm-up; kept as the beside pass's fixed batch
        passes = [p for p in ("alone", "beside") if (p == "alone" and alone) or (p == "beside" and beside)]
        for name in reversed(passes) if beside_first else passes:
            if name == "alone":
                out.update(_probe_alone(stream, min_batches, min_s))
            else:
                assert beside is not None
                times, nexts = _beside(stream, lambda: beside(first), min_batches, min_s, device, warmup=1)
                out.update(
                    beside_serial_s=statistics.fmean(times),
                    beside_batches=len(times),
                    beside_next_s=statistics.fmean(nexts),
                )
    finally:
        stream.close()
    out["cpu_ref_after_s"] = cpu_reference_s()
    out["wall_s"] = time.perf_counter() - t0  # what the probe adds to the bench's time
    return out


def _probe_alone(stream: BatchStream, min_batches: int, min_s: float) -> dict[str, Any]:
    from dlstore.bench.monitor import process_cpu_s

    pid = os.getpid()
    nexts: list[float] = []
    c0, t0 = process_cpu_s(pid), time.perf_counter()
    while len(nexts) < min_batches or time.perf_counter() - t0 < min_s:
        a = time.perf_counter()
        stream.next()
        nexts.append(time.perf_counter() - a)
    seconds = time.perf_counter() - t0
    c1 = process_cpu_s(pid)
    done = len(nexts)
    return {
        "period_s": seconds / done,
        "main_s": seconds / done,
        "cpu_s": (c1 - c0) / done if c0 is not None and c1 is not None else 0.0,
        "batches": done,
        "next_s": nexts,  # diagnostics: drift within the probe
    }


CPU_REFERENCE_N = 100_000


def cpu_reference_s(n: int = CPU_REFERENCE_N) -> float:
    """Seconds of a fixed single-threaded Python loop (~5 ms), recorded beside each timing: a diagnostic of
    the machine's drift between a part and its run (the model does not use it)."""
    a = time.perf_counter()
    acc = 0
    for i in range(n):
        acc += i * i
    return time.perf_counter() - a


BESIDE_WARMUP = 3  # the step's first calls (cudnn autotuning on a new shape) are not its cost
BESIDE_MAX = 200


def _beside(
    stream: BatchStream,
    work: Callable[[], float],
    steps: int,
    seconds: float,
    device: torch.device,
    warmup: int = BESIDE_WARMUP,
) -> tuple[list[float], list[float]]:
    """``work``'s seconds after each of the loader's next batches, and each of those ``next()``'s."""
    times: list[float] = []
    nexts: list[float] = []
    t0 = time.perf_counter()
    for i in range(warmup + BESIDE_MAX):
        if i >= warmup + steps and time.perf_counter() - t0 >= seconds:
            break
        if i == warmup:
            synchronize(device)
            t0 = time.perf_counter()
        a = time.perf_counter()
        stream.next()
        took_next = time.perf_counter() - a
        took = work()
        if i >= warmup:
            times.append(took)
            nexts.append(took_next)
    synchronize(device)
    return times, nexts


def measure_fed(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    batch: tuple[torch.Tensor, torch.Tensor],
    move: Callable[[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    warmup: int,
    steps: int,
    delay_s: float = 0.0,
) -> dict[str, Any]:
    """The step fed from an already-collated batch through the loop's copy (``move``), with ``delay_s`` of
    busy wait between steps: with none, the period copy + step sustain with data free; with a delay longer
    than the device's step, period − delay is the main thread's own serial cost per batch."""
    events: list[tuple[Any, Any]] = []
    host = spun = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            synchronize(device)
            t1 = time.perf_counter()
            host = spun = 0.0
        if delay_s:
            spun += _spin(delay_s)
        a = time.perf_counter()
        x, y = move(batch)
        if device.type == "cuda" and i >= warmup:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            step(x, y)
            ev[1].record()
            events.append(ev)
        else:
            step(x, y)
        host += time.perf_counter() - a
    synchronize(device)
    seconds = time.perf_counter() - t1
    device_s = sum(a.elapsed_time(b) for a, b in events) / 1e3 / steps if events else None
    return {
        "period_s": seconds / steps,
        "host_s": host / steps,
        "serial_s": (seconds - spun) / steps,
        "delay_s": spun / steps,
        "device_s": device_s,
        "batches": steps,
    }


def _spin(seconds: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass
    return time.perf_counter() - t0


# --- host → device ------------------------------------------------------------------------------------


def measure_h2d(
    loader: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, steps: int
) -> StageResult:
    """Copy one batch of the loader's shape and dtype, pinned and pageable; images/s for each."""
    if device.type == "cpu":
        return StageResult("h2d", loader, None, label="no device copy: the step runs on the CPU")
    batch = int(shape[0])
    pageable = torch.randint(0, 255, tuple(shape), dtype=torch.uint8).to(dtype)
    pinned = pageable.pin_memory()
    rates = {}
    for name, src in (("pinned", pinned), ("pageable", pageable)):
        for _ in range(2):
            src.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            src.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        rates[name] = batch * steps / (time.perf_counter() - t0)
    nbytes = pageable.numel() * pageable.element_size()
    detail = {
        "pinned_img_per_s": rates["pinned"],
        "pageable_img_per_s": rates["pageable"],
        "pinned_gb_per_s": rates["pinned"] * nbytes / batch / 1e9,
        "pageable_gb_per_s": rates["pageable"] * nbytes / batch / 1e9,
        "batch_bytes": nbytes,
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
    }
    return StageResult("h2d", loader, rates["pinned"], label="pinned", images=batch * steps, detail=detail)


# --- compute ------------------------------------------------------------------------------------------


def synthetic_batch(
    shape: Sequence[int], dtype: torch.dtype, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype == torch.uint8:
        x = torch.randint(0, 256, tuple(shape), dtype=torch.uint8, device=device)
    else:
        x = torch.rand(tuple(shape), dtype=dtype, device=device)
    return x, torch.randint(0, num_classes, (int(shape[0]),), device=device)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu (no GPU used: the training step runs on the CPU)"


def measure_compute(
    loader: str,
    step: Callable[[torch.Tensor, torch.Tensor], None],
    shape: Sequence[int],
    dtype: torch.dtype,
    num_classes: int,
    device: torch.device,
    warmup: int,
    steps: int,
) -> StageResult:
    """The training step alone on a batch already on the device; warm-up first (cudnn tunes per shape)."""
    x, y = synthetic_batch(shape, dtype, num_classes, device)
    for _ in range(max(1, warmup)):
        step(x, y)
    synchronize(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(steps):
        step(x, y)
    if device.type == "cuda":
        end.record()
    synchronize(device)
    seconds = time.perf_counter() - t0
    detail: dict[str, Any] = {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "host_s": seconds,
        "threads": torch.get_num_threads(),
        "warmup_batches": max(1, warmup),
    }
    if device.type == "cuda":
        detail["cuda_event_s"] = start.elapsed_time(end) / 1e3
    images = int(shape[0]) * steps
    return StageResult(
        "compute", loader, images / seconds, seconds, images, label=device_label(device), detail=detail
    )
