"""Running a conversion's units as Dask tasks (``convert(..., scheduler=)``, ``--scheduler``).

The built-in engine is the process pool in ``conversion.py``; this one hands the same units to a
``distributed`` cluster: ``local`` / ``local:N`` starts a ``LocalCluster`` of N single-threaded worker
processes, ``tcp://HOST:PORT`` (or ``tls://``) uses a running scheduler whose workers see SOURCE and
DEST at the same paths. Each task is ``convert_unit``: it decodes and writes its unit into the staging
directory itself, exactly as a pool worker does, and returns only the bad files and digests; the
driver journals each finished unit, so resume, the bad-file budget, the atomic publish and the result
are the built-in engine's. With a URL destination the tasks write their units to the object store
instead (``store_units.convert_unit_to_store``), so no worker needs the driver's spool folder.

One difference: Dask runs tasks in worker threads, where SIGALRM cannot interrupt a decoder, so the
per-file ``decode_timeout`` is not enforced on Dask workers (a truncated or malformed file still fails
fast and is skipped and reported as with the pool).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dlstore.errors import ConvertError, require_extra
from dlstore.machine import usable_cores

_ADDRESS = re.compile(r"^(tcp|tls|inproc|ucx)://\S+$")


@dataclass(frozen=True)
class SchedulerSpec:
    """``local`` with a worker count, or the address of an existing scheduler."""

    local_workers: int | None = None
    address: str | None = None

    def describe(self) -> str:
        return self.address or f"local:{self.local_workers}"


def parse_scheduler(text: str) -> SchedulerSpec:
    """``local`` (one worker per core), ``local:N`` or ``tcp://HOST:PORT``."""
    if text == "local":
        return SchedulerSpec(local_workers=usable_cores())
    if text.startswith("local:"):
        count = text.partition(":")[2]
        if not count.isdigit() or int(count) < 1:
            raise ConvertError(f"--scheduler {text}: expected local:N with N >= 1 worker processes")
        return SchedulerSpec(local_workers=int(count))
    if _ADDRESS.match(text):
        return SchedulerSpec(address=text)
    raise ConvertError(
        f"--scheduler {text!r}: expected local, local:N or a scheduler address such as tcp://HOST:8786"
    )


@contextmanager
def dask_client(spec: SchedulerSpec) -> Iterator[Any]:
    """A connected ``distributed.Client``; a local cluster lives only as long as the conversion."""
    require_extra("distributed", "dask", "--scheduler")
    from distributed import Client, LocalCluster

    if spec.address is not None:
        try:
            client = Client(spec.address, timeout="20s")
        except OSError as e:
            raise ConvertError(
                f"--scheduler {spec.address}: cannot connect ({e}); is the scheduler running?"
            ) from None
        with client:
            yield client
        return
    cluster = LocalCluster(
        n_workers=spec.local_workers,
        threads_per_worker=1,  # decoding is CPU-bound and holds the GIL part of the time: processes
        processes=True,
        dashboard_address=":0",  # a free port: never collide with a running dashboard
    )
    with cluster, Client(cluster) as client:
        yield client


def count_workers(client: Any) -> int:
    return len(client.scheduler_info().get("workers", {}))


def run_on_dask(
    client: Any,
    job: Any,
    todo: list[int],
    unit: Callable[[Any, int], Any],
    record: Callable[[Any], None],
) -> None:
    """Submit every unit, ``record`` each result in the driver as it finishes; on any error the
    remaining tasks are cancelled (unfinished units are not journaled and are redone on resume)."""
    from distributed import as_completed

    shared = client.scatter(job, broadcast=True)  # sent once per worker, not once per task
    futures = [client.submit(unit, shared, k, key=f"dlstore-unit-{k}", pure=False) for k in todo]
    try:
        for fut in as_completed(futures):
            record(fut.result())  # re-raises a task's error (e.g. --strict's ImageDecodeError) here
    except BaseException:
        client.cancel(futures)
        raise


def is_killed_worker(error: BaseException) -> bool:
    """A task whose workers kept dying (killed, out of memory, crashed decoder)."""
    return type(error).__name__ == "KilledWorker"
