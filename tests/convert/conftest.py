"""Fixtures of the write side's tests against a real S3-compatible server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import dlstore.storage.stores as stores


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A moto S3 server (its own per test module), reached through the standard AWS environment, with
    a spool folder of its own and short retries."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from s3server import aws_env, start_server

    server = start_server()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in aws_env(server).items():
            mp.setenv(name, value)
        mp.setenv("DLSTORE_SPOOL", str(tmp_path_factory.mktemp("spool")))
        mp.setattr(stores, "RETRIES", 2)
        mp.setattr(stores, "BACKOFF_S", 0.01)
        yield server
    server.stop()
