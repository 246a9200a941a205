"""Memory and shared-memory limits, read the way a container sees them.

``available_memory`` takes the smallest of /proc/meminfo's MemAvailable and the cgroup's free room
(v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes - memory.usage_in_bytes``): inside a
container /proc/meminfo shows the host. ``check_shared_memory`` explains a /dev/shm too small for the
batches DataLoader workers hand over (Docker gives 64 MB), which otherwise ends in a bare "Bus error".
"""

from __future__ import annotations

import os
from pathlib import Path

from dlstore.errors import SharedMemoryError

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
SHM = Path("/dev/shm")
_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


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
