"""F2, F3: an object-store fault ends in one line naming the object, the store and the fix, within a
stated deadline, never a traceback, a hang or a secret (issue 20 item 3). Against a real moto server:
one run in a process of its own, so that it can be stopped (SIGSTOP) mid-read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree
from s3server import free_port

import dlstore.storage.stores as stores
from dlstore import Remote, convert, open_cache
from dlstore.cli import main
from dlstore.errors import SampleReadError
from dlstore.storage.stores import RemoteAccessError, RemoteStore, RemoteStoreError

pytestmark = pytest.mark.s3
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

SECRET = "not-a-real-secret-9d2e"
SERVER = """
import logging, sys, time
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A moto server in its own process, the AWS environment pointing at it, one bucket."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "DLSTORE_SPOOL": str(tmp_path / "spool"),
    }.items():
        monkeypatch.setenv(name, value)
    RemoteStore("s3://faults").fs.mkdir("faults")
    try:
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def _short_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same mechanism as the defaults (30 s deadline, 10 s read time-out), scaled down."""
    monkeypatch.setattr(stores, "CONNECT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(stores, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(stores, "DEADLINE_S", 3.0)
    monkeypatch.setattr(stores, "BACKOFF_S", 0.05)


def small_remote_cache(tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dlstore.formats.npz.NpzWriter.choose_unit_size", staticmethod(lambda b: 4))
    convert(
        make_tree(tmp_path / "src", per_class=6), url, format="npz", size=8, workers=1, storage_order="source"
    )


def test_a_stopped_server_ends_a_read_within_its_deadline_naming_the_object(
    server: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "s3://faults/stopped"
    small_remote_cache(tmp_path, url, monkeypatch)
    cache = open_cache(url, remote=Remote(cache_dir=tmp_path / "mirror"))
    cache.read([0])  # unit 0 fetched while the server answers
    os.kill(server.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(SampleReadError) as e:
        cache.read([len(cache) - 1])  # another unit: a GET the stopped server never answers
    took = time.monotonic() - t0
    # Bound: DEADLINE_S + READ_TIMEOUT_S (+ connect) for the one GET; never botocore's minutes.
    assert took < stores.DEADLINE_S + stores.READ_TIMEOUT_S + stores.CONNECT_TIMEOUT_S + 3, took
    assert isinstance(e.value.__cause__, RemoteStoreError)
    assert f"{url}/shards/shard-" in str(e.value) and "failed" in str(e.value)
    assert "\n" not in str(e.value) and SECRET not in str(e.value)
    os.kill(server.pid, signal.SIGCONT)
    assert cache.read([len(cache) - 1]).shape == (1, 8, 8, 3)  # the server is back: so is the read


def test_a_missing_bucket_is_one_line_naming_it(server: subprocess.Popen[str], tmp_path: Path) -> None:
    with pytest.raises(RemoteStoreError, match=r"the bucket 'no-such-bucket' does not exist"):
        open_cache("s3://no-such-bucket/c", remote=Remote(cache_dir=tmp_path))
    res = CliRunner().invoke(main, ["verify", "s3://no-such-bucket/c"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "bucket 'no-such-bucket' does not exist" in res.output


def test_no_credentials_fail_at_once_in_one_line(
    server: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    t0 = time.monotonic()
    with pytest.raises(RemoteAccessError) as e:
        open_cache("s3://faults/c", remote=Remote(cache_dir=tmp_path))
    assert time.monotonic() - t0 < 10
    assert "s3://faults/c" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


class DenyingFs:
    """What s3fs raises for a key the server refuses (403): PermissionError("Forbidden")."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kw: Any) -> Any:
            raise PermissionError("Forbidden")

        return refuse


@pytest.mark.parametrize("command", ["info", "verify", "convert"])
def test_refused_credentials_end_in_one_line_without_the_secret(
    server: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    url = "s3://faults/denied"
    small_remote_cache(tmp_path, url, monkeypatch)
    monkeypatch.setattr(RemoteStore, "fs", property(lambda self: DenyingFs()))
    monkeypatch.setattr(RemoteStore, "key", lambda self, rel: f"faults/denied/{rel}")
    args = {
        "info": ["info", url],
        "verify": ["verify", url],
        "convert": ["convert", str(tmp_path / "src"), url, "--size", "8", "--overwrite", "--workers", "1"],
    }[command]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and SECRET not in res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and url in error[0] and "AWS_ACCESS_KEY_ID" in error[0], res.output


def test_every_s3_request_gets_timeouts_and_one_botocore_attempt() -> None:
    opts = stores.deadline_options("s3", {"config_kwargs": {"read_timeout": 99}})
    assert opts["config_kwargs"]["read_timeout"] == 99  # the user's own setting wins
    assert opts["config_kwargs"]["connect_timeout"] == stores.CONNECT_TIMEOUT_S
    assert opts["config_kwargs"]["retries"] == {"max_attempts": 1, "mode": "standard"}
    assert np.isfinite(stores.DEADLINE_S + stores.READ_TIMEOUT_S)


@pytest.mark.slow  # ~5 s; the default suite has the same path with an injected 403 (DenyingFs) above
def test_wrong_credentials_on_a_real_server_end_in_one_line_without_the_secret(tmp_path: Path) -> None:
    """F3 against a real server that checks credentials (moto with IAM authentication on: keys it does
    not know get 403 "InvalidAccessKeyId"), not an injected PermissionError: convert, info and verify
    each end in one line naming the URL and the fix, with no traceback and no secret."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}  # every request is authenticated
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        aws = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "AKIAWRONGKEY",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "DLSTORE_SPOOL": str(tmp_path / "spool"),
        }
        src = make_tree(tmp_path / "src", per_class=2)
        url = "s3://faults/wrong"
        for args in (
            ["info", url],
            ["verify", url],
            ["convert", str(src), url, "--size", "8", "--workers", "1"],
        ):
            res = CliRunner().invoke(main, args, env=aws)
            assert res.exit_code == 1, res.output
            assert "Traceback" not in res.output and SECRET not in res.output, res.output
            lines = [line for line in res.output.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith(f"Error: {url}"), res.output
            assert "access denied" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0], res.output
    finally:
        proc.kill()
        proc.wait()
