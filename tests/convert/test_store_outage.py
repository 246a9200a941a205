"""F3: a first conversion to ``s3://`` interrupted by an object-store outage (a real moto server killed
-9 mid-publish, then restarted empty, as a server without persistence comes back) ends in one dlstore
line, never ``FileNotFoundError: The specified key does not exist``, and the same command then
resumes to a complete cache; a listing gone stale between LIST and GET is listed again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import make_tree, read_all

import dlstore.storage.stores as stores
from dlstore.errors import DlstoreError
from dlstore.read.cache import Remote, open_cache
from dlstore.storage.stores import RemoteStore
from dlstore.write.conversion import convert

pytestmark = pytest.mark.s3
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

SERVER = """
import logging, sys, time
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
time.sleep(3600)
"""
URL = "s3://outage/data"


class Server:
    """A moto server in a process of its own, on a fixed port: killed and started again."""

    def __init__(self) -> None:
        from s3server import free_port

        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(self.port)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "up"
        RemoteStore("s3://outage").fs.mkdir("outage")  # a fresh server has no bucket

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Server]:
    s = Server()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s.port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "DLSTORE_SPOOL": str(tmp_path / "spool"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(stores, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(stores, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(stores, "DEADLINE_S", 2.0)
    monkeypatch.setattr(stores, "BACKOFF_S", 0.05)
    s.start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=6)


def conv(tree: Path, dest: str | Path) -> Any:
    return convert(tree, dest, format="npz", size=8, workers=1, storage_order="source")


def kill_at(monkeypatch: pytest.MonkeyPatch, server: Server, verb: str, nth: int) -> list[str]:
    """Kill the server just before the ``nth`` request of kind ``verb`` (GET, PUT, COPY, LIST...)."""
    seen: list[str] = []
    real = RemoteStore.call

    def call(self: RemoteStore, what: str, rel: str, fn: Any) -> Any:
        seen.append(what)
        if what == verb and seen.count(verb) == nth:
            server.kill()
        return real(self, what, rel, fn)

    monkeypatch.setattr(RemoteStore, "call", call)
    return seen


def interrupted_then_resumed(
    tree: Path, tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch, verb: str, nth: int
) -> None:
    with monkeypatch.context() as m:
        seen = kill_at(m, server, verb, nth)
        try:
            conv(tree, URL)
        except DlstoreError as e:
            msg = str(e)
            assert "\n" not in msg and "re-run" in msg or "retry" in msg, msg
        else:
            assert seen.count(verb) < nth, "the server was killed but the conversion succeeded"
    server.start()  # back, empty: what the first run staged is gone
    result = conv(tree, URL)
    assert result.n == 12
    c = open_cache(URL, check_source=False, remote=Remote(cache_dir=tmp_path / f"chunks-{verb}-{nth}"))
    try:
        remote = c.read(np.arange(len(c))), c.labels.copy()
    finally:
        c.close()
    ref = tmp_path / f"ref-{verb}-{nth}"
    conv(tree, ref)
    local = read_all(ref)
    assert np.array_equal(remote[0], local[0]) and np.array_equal(remote[1], local[1])
    server.kill()
    server.start()


@pytest.mark.slow
def test_an_outage_mid_publish_is_one_line_and_the_rerun_resumes(
    tree: Path, tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F3: the server dies at the first COPY (all staged, nothing published), comes back empty."""
    interrupted_then_resumed(tree, tmp_path, server, monkeypatch, "COPY", 1)


def test_a_staged_manifest_gone_between_list_and_get_is_listed_again(
    tree: Path, tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F3: the raw "The specified key does not exist" came from reading an object a listing had just
    shown (another publish finished meanwhile, or the store lost it): the survey lists again."""
    with monkeypatch.context() as m:
        kill_at(m, server, "COPY", 1)
        with pytest.raises(DlstoreError):
            conv(tree, URL)  # leaves a staged manifest under .dlstore-staging/
    server.start()
    with monkeypatch.context() as m:  # a staged manifest on the new server, removed right after LIST
        store = RemoteStore(URL)
        store.put_bytes(b"{}", ".dlstore-staging/0123/dlstore.json")
        real = RemoteStore.sizes
        vanished: list[str] = []

        def sizes(self: RemoteStore, prefix: str = "") -> dict[str, int]:
            found = real(self, prefix)
            if prefix == "" and not vanished:
                vanished.append(".dlstore-staging/0123/dlstore.json")
                store.delete(vanished)
            return found

        m.setattr(RemoteStore, "sizes", sizes)
        assert conv(tree, URL).n == 12
    assert vanished


@pytest.mark.slow
@pytest.mark.parametrize(("verb", "nth"), [("LIST", 1), ("PUT", 2), ("PUT", 5), ("COPY", 3), ("DELETE", 1)])
def test_outages_at_every_stage_of_a_first_publish(
    tree: Path, tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch, verb: str, nth: int
) -> None:
    """F3 sweep: the server killed before the nth request of each kind of a first conversion."""
    interrupted_then_resumed(tree, tmp_path, server, monkeypatch, verb, nth)
