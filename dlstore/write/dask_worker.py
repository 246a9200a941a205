"""The Dask worker of dlstore's own local clusters (``--scheduler local:N``): a module of its own
because it imports ``distributed`` at the top, so only those worker processes load it."""

from __future__ import annotations

import os
from typing import Any

import dask
from distributed import Worker

from dlstore.write.dask_engine import QUIET_CONFIG, warm_decode_forkserver
from dlstore.write.unit_work import arm_parent_death_signal


class ConversionWorker(Worker):
    """A quiet ``distributed.Worker`` that dies with its driver and warms its decode fork server."""

    def __init__(self, *args: Any, driver_pid: int | None = None, **kwargs: Any) -> None:
        if driver_pid is not None:
            # Not outliving ``dlstore convert`` (kill -9 included): the parent-death signal, and a
            # driver already gone is seen by the parent pid having changed. The decode processes
            # follow when their parents' pipe ends close.
            arm_parent_death_signal()
            if os.getppid() != driver_pid:
                os._exit(1)
        dask.config.set(QUIET_CONFIG)  # process-wide on purpose, read by the worker as it is built
        warm_decode_forkserver()
        super().__init__(*args, **kwargs)
