"""Machine facts as a container sees them: ``usable_cores`` (the affinity mask and the cgroup v1/v2
CPU quota: 2 CPUs of a 64-core host start 2 workers), ``available_memory`` (the least of
MemAvailable and the cgroup's free room: /proc/meminfo shows the host), ``check_shared_memory`` (a
/dev/shm too small for worker batches, else a bare "Bus error"), the CPU model, a device synchronise."""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from dlstore.errors import SharedMemoryError

if TYPE_CHECKING:
    import torch

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")
SHM = Path("/dev/shm")
_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """CPUs the cgroup may use (quota / period), or None without a quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct"):
        quota_us = _read_int(cgroup / folder / "cpu.cfs_quota_us", True)
        period_us = _read_int(cgroup / folder / "cpu.cfs_period_us", True)
        if quota_us is not None and period_us:
            return None if quota_us < 0 else quota_us / period_us
    return None


def affinity_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def usable_cores(cgroup: Path = CGROUP) -> int:
    """Cores this process may run on: the affinity mask, capped by the cgroup quota (rounded up)."""
    cores = affinity_cores()
    quota = cpu_quota(cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronize(device: torch.device) -> None:
    """Wait for a CUDA device's queued work (for timing); nothing to wait for on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _read_int(path: Path, signed: bool = False) -> int | None:
    """A cgroup file's integer; None when unreadable or, unsigned, not digits (v2 writes "max")."""
    try:
        text = path.read_text().strip()
        return int(text) if signed or text.isdigit() else None
    except (OSError, ValueError):
        return None


def cgroup_room(cgroup: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes the cgroup may still allocate, description), or None without a memory limit."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(cgroup / limit_file)
        if limit is not None and limit < _UNLIMITED:
            used = _read_int(cgroup / usage_file) or 0
            return max(0, limit - used), (
                f"cgroup limit {limit / 1e9:.2f} GB in {cgroup / limit_file}, {used / 1e9:.2f} GB in use"
            )
    return None


def meminfo_available(meminfo: Path = MEMINFO) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(cgroup: Path = CGROUP, meminfo: Path = MEMINFO) -> tuple[int | None, str]:
    """The memory this process can still use, and where that number comes from."""
    candidates: list[tuple[int, str]] = []
    room = cgroup_room(cgroup)
    if room is not None:
        candidates.append(room)
    avail = meminfo_available(meminfo)
    if avail is not None:
        candidates.append((avail, f"MemAvailable in {meminfo}"))
    if not candidates:
        return None, "unknown"
    return min(candidates)


def shm_free_bytes(shm: Path = SHM) -> int | None:
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shared_memory(
    batch_bytes: int, num_workers: int, prefetch_factor: int = 2, shm: Path = SHM
) -> None:
    """Raise SharedMemoryError when /dev/shm cannot hold the batches in flight between DataLoader
    workers and the main process (each worker keeps ``prefetch_factor`` batches there)."""
    free = shm_free_bytes(shm)
    need = batch_bytes * max(1, num_workers) * max(1, prefetch_factor)
    if free is None or need <= free:
        return
    raise SharedMemoryError(
        f"{shm} has {free / 1e6:.0f} MB free but {num_workers} DataLoader worker(s) x {prefetch_factor} "
        f"prefetched batch(es) of {batch_bytes / 1e6:.1f} MB need about {need / 1e6:.0f} MB there; "
        "workers would die with 'Bus error'. Fix: run the container with --shm-size=8g (or --ipc=host), "
        "or lower batch_size / num_workers / prefetch_factor"
    )


_SHM_CHECKED_PID = -1


def check_loader_shared_memory(batch_bytes: int, prefetch_factor: int = 2) -> None:
    """Inside a DataLoader worker, once per process: check /dev/shm before the first batch is handed
    over, so a too-small /dev/shm surfaces as this message in the main process, not a Bus error."""
    global _SHM_CHECKED_PID
    if _SHM_CHECKED_PID == os.getpid():
        return
    _SHM_CHECKED_PID = os.getpid()
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None:
        check_shared_memory(batch_bytes, info.num_workers, prefetch_factor)
