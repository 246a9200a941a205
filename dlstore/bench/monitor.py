"""What a run used: CPU (system-wide and the process tree), worker memory (RSS, PSS where readable) and
/dev/shm. Linux /proc; missing data is None. No nvidia-smi sampling: its NVML queries contend with kernel
launches; the device's busy share comes from the loop's CUDA events instead."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from dlstore.machine import available_memory

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def system_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def steal_s() -> float | None:
    """CPU seconds the hypervisor gave other guests (/proc/stat's steal): fewer cores than shown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return float(fields[8]) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of one process in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (float(rest[11]) + float(rest[12])) / _TICKS


def memory_kb(pid: int) -> dict[str, int | None]:
    """Rss, Pss and shared kB from smaps_rollup, else VmRSS from status."""
    out: dict[str, int | None] = {"rss_kb": None, "pss_kb": None, "shared_kb": None}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[f"{key.lower()}_kb"] = int(value.split()[0])
                elif key in ("Shared_Clean", "Shared_Dirty"):
                    out["shared_kb"] = (out["shared_kb"] or 0) + int(value.split()[0])
        return out
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_kb"] = int(line.split()[1])
    except OSError:
        pass
    return out


def shm_usage() -> dict[str, int] | None:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return {"used_bytes": usage.used, "free_bytes": usage.free, "total_bytes": usage.total}


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def mem_available_bytes() -> int | None:
    """Memory this process can still use, cgroup limits included (see dlstore.machine)."""
    return available_memory()[0]


class ResourceMonitor:
    """``start(worker_pids)`` at the beginning of the timed steps, ``stop()`` at their end."""

    def start(self, worker_pids: Sequence[int]) -> None:
        self.pids = [os.getpid(), *worker_pids]
        self.t0 = time.perf_counter()
        self.sys0 = system_cpu()
        self.steal0 = steal_s()
        self.cpu0 = [process_cpu_s(p) for p in self.pids]

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        sys1 = system_cpu()
        steal1 = steal_s()
        cpu1 = [process_cpu_s(p) for p in self.pids]
        used = [b - a for a, b in zip(self.cpu0, cpu1) if a is not None and b is not None]
        mems = [memory_kb(p) for p in self.pids[1:]]
        system = _percent(self.sys0, sys1)
        tree = sum(used) / wall if wall > 0 and used else None
        busy = None if system is None else system * (os.cpu_count() or 1) / 100
        return {
            "wall_s": wall,
            "system_cpu_percent": system,
            # cores busy with other processes (other users, other jobs): a sign of noisy numbers
            "other_cpu_cores": None if busy is None or tree is None else max(0.0, busy - tree),
            "process_tree_cpu_cores": tree,
            "steal_cores": None
            if steal1 is None or self.steal0 is None or wall <= 0
            else (steal1 - self.steal0) / wall,
            "main_cpu_cores": used[0] / wall if wall > 0 and used else None,
            "main_rss_mb": _mb(memory_kb(os.getpid())["rss_kb"]),
            "workers": len(mems),
            "workers_rss_mb": _sum_mb(m["rss_kb"] for m in mems),
            "workers_pss_mb": _sum_mb(m["pss_kb"] for m in mems),
            "shm": shm_usage(),
        }


def _percent(a: tuple[float, float] | None, b: tuple[float, float] | None) -> float | None:
    if a is None or b is None or b[1] <= a[1]:
        return None
    return 100.0 * (b[0] - a[0]) / (b[1] - a[1])


def _mb(kb: int | None) -> float | None:
    return None if kb is None else kb / 1024


def _sum_mb(values: Any) -> float | None:
    vals = list(values)
    if not vals or any(v is None for v in vals):
        return None
    return sum(vals) / 1024
