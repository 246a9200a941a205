"""Worker interpreters over a shared block (``dlstore.read.engines.workers``): the name leaves /dev/shm as soon
as every worker has mapped the block, and a worker that cannot start is an error naming its module."""

from __future__ import annotations

from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dlstore.errors import DlstoreError
from dlstore.read.engines.workers import Workers, shutdown

HELLO = {"size": 4096, "codec": "jpeg", "quality": 90}  # what dlstore.read.decode.cpu_lane's workers expect


def test_the_block_has_no_name_once_the_workers_have_mapped_it() -> None:
    w = Workers("dlstore.read.decode.cpu_lane", 2, 4096, HELLO)
    try:
        assert not (Path("/dev/shm") / w.shm.name.lstrip("/")).exists()  # kill -9 now leaves nothing
        assert all(p.poll() is None for p in w.procs)  # and the workers are still there, serving
        w.shm.buf[:4] = b"abcd"  # the parent's mapping outlives the name
        assert bytes(w.shm.buf[:4]) == b"abcd"
    finally:
        shutdown(w.shm, w.conns, w.procs)
    assert all(p.poll() is not None for p in w.procs)


def test_a_worker_that_cannot_start_is_named_and_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[shared_memory.SharedMemory] = []

    def record(*args: Any, **kwargs: Any) -> shared_memory.SharedMemory:
        made.append(shared_memory.SharedMemory(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("dlstore.read.engines.workers.shared_memory", SimpleNamespace(SharedMemory=record))
    with pytest.raises(
        DlstoreError, match=r"dlstore\.no_such_module: a worker process exited while starting"
    ):
        Workers("dlstore.no_such_module", 2, 4096, HELLO)
    assert len(made) == 1 and not (Path("/dev/shm") / made[0].name.lstrip("/")).exists()
