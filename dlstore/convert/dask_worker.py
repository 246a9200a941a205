"""The Dask worker of dlstore's own local clusters (``--scheduler local:N``, ``start_local_cluster``).

A module of its own because it imports ``distributed`` at the top: only those worker processes load it
(``python -m dask spec`` imports the class by name), never a plain conversion.
"""

from __future__ import annotations

from typing import Any

import dask
from distributed import Worker

from dlstore.convert.dask_engine import QUIET_CONFIG, warm_decode_forkserver


class ConversionWorker(Worker):
    """A ``distributed.Worker`` that quiets its own monitors (``QUIET_CONFIG``: this process is only
    this worker) and starts its decode processes' fork server as it starts, so the converter is
    imported there while the other workers are still starting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        dask.config.set(QUIET_CONFIG)  # process-wide on purpose, read by the worker as it is built
        warm_decode_forkserver()
        super().__init__(*args, **kwargs)
