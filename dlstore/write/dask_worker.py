"""The Dask worker of dlstore's own local clusters (``--scheduler local:N``, ``start_local_cluster``).

A module of its own because it imports ``distributed`` at the top: only those worker processes load it
(``python -m dask spec`` imports the class by name), never a plain conversion.
"""

from __future__ import annotations

import os
from typing import Any

import dask
from distributed import Worker

from dlstore.write.dask_engine import QUIET_CONFIG, warm_decode_forkserver
from dlstore.write.unit_work import arm_parent_death_signal


def die_with_driver(driver_pid: int) -> None:
    """G1: this worker must not outlive the ``dlstore convert`` that started it (kill -9 of the driver
    left it running for seconds, with its decode processes, holding CPU). The parent-death signal
    (SIGKILL) is armed now; a driver that died before that is noticed by the parent pid having changed.
    The worker's fork server and decode processes follow: their parents' ends of their pipes close."""
    arm_parent_death_signal()
    if os.getppid() != driver_pid:
        os._exit(1)


class ConversionWorker(Worker):
    """A ``distributed.Worker`` that quiets its own monitors (``QUIET_CONFIG``: this process is only
    this worker) and starts its decode processes' fork server as it starts, so the converter is
    imported there while the other workers are still starting."""

    def __init__(self, *args: Any, driver_pid: int | None = None, **kwargs: Any) -> None:
        if driver_pid is not None:
            die_with_driver(driver_pid)
        dask.config.set(QUIET_CONFIG)  # process-wide on purpose, read by the worker as it is built
        warm_decode_forkserver()
        super().__init__(*args, **kwargs)
