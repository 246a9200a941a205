"""F2/F3 for ``gs://`` (issue 20 part 3): without credentials and without a reachable network, convert,
read (open) and verify of a ``gs://`` URL end in one line naming the URL and the fix, within the
remote deadline, with no retry noise and no secret printed.

Real gcsfs and google-auth, in a fresh process with the library's real defaults. No credentials
anywhere (no ``GOOGLE_APPLICATION_CREDENTIALS``, an empty gcloud config folder); the storage endpoint
(gcsfs's ``STORAGE_EMULATOR_HOST``) and the GCE metadata server's credential endpoint
(``GCE_METADATA_HOST``, what gcsfs's "cloud" method asks 5 times) are a closed local port; the GCE
detection address (``GCE_METADATA_IP``) answers 404 at once, as any machine that is not on GCE
does. Before the fix: one attempt took ~50 s (gcsfs's own 6 retries inside it, the metadata
server asked 5 times more), 3 min with an older gcsfs."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3server import free_port

import dlstore.storage.stores as stores

pytest.importorskip("gcsfs")

URL = "gs://dlstore-offline/cache"
SECRET = "Bearer SECRET-gcs-token-3f9a"
OPTIONS = json.dumps({"session_kwargs": {"headers": {"Authorization": SECRET}}})
# The stated deadline offline: RETRIES attempts refused at once, the backoff between them (< 4 s),
# credential discovery, the imports; well under the remote store's per-request DEADLINE_S (30 s). Not
# met before: gcsfs's "cloud" credential method alone asked the metadata server for ~15 s.
DEADLINE_S = 15.0

READ = f"""
import sys
from dlstore import Remote, open_cache
try:
    open_cache({URL!r}, remote=Remote(storage_options={json.loads(OPTIONS)!r}, cache_dir=sys.argv[1]))
except Exception as e:
    print(f"Error: {{e}}")
    sys.exit(1)
"""
CLI = [sys.executable, "-c", "from dlstore.cli import main; main()"]
COMMANDS = {
    "convert": [*CLI, "convert", "demo", URL, "--size", "8", "--storage-options", OPTIONS],
    "info": [*CLI, "info", URL, "--storage-options", OPTIONS],
    "verify": [*CLI, "verify", URL, "--storage-options", OPTIONS],
    "open_cache": [sys.executable, "-c", READ, "mirror"],
}


class NotGce(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def not_gce() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotGce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def offline_env(tmp_path: Path, not_gce: str) -> dict[str, str]:
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused, as with no network
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "GCE_", "CLOUDSDK_", "GCLOUD"))
    }
    for name in ("NO_GCE_CHECK", "STORAGE_EMULATOR_HOST"):
        env.pop(name, None)
    (tmp_path / "home").mkdir(exist_ok=True)
    env.update(
        HOME=str(tmp_path / "home"),
        CLOUDSDK_CONFIG=str(tmp_path / "home" / "gcloud"),  # no `gcloud auth` credentials
        GCE_METADATA_IP=not_gce,  # google-auth's "is this GCE?" ping: no
        GCE_METADATA_HOST=closed,  # the metadata server's credentials, asked by gcsfs's "cloud" method
        STORAGE_EMULATOR_HOST=f"http://{closed}",  # gcsfs's endpoint: every request is refused
    )
    return env


def run_offline(command: str, tmp_path: Path, not_gce: str) -> None:
    t0 = time.monotonic()
    res = subprocess.run(
        COMMANDS[command],
        env=offline_env(tmp_path, not_gce),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    took = time.monotonic() - t0
    out = res.stdout
    lines = out.strip().splitlines()
    assert res.returncode == 1, out
    assert len(lines) == 1, out  # no retry log, no traceback, no warning
    assert lines[0].startswith(f"Error: {URL}"), out
    assert "check that the object store is reachable" in lines[0], out
    # dlstore's bounded loop made every attempt: no backend loop of its own (gcsfs: 6 per request)
    assert f"failed {stores.RETRIES} times" in lines[0], out
    assert "SECRET" not in out, out
    assert took < DEADLINE_S, (took, out)


def test_gs_convert_without_credentials_or_network_is_one_line_within_the_deadline(
    tmp_path: Path, not_gce: str
) -> None:
    run_offline("convert", tmp_path, not_gce)


@pytest.mark.slow  # ~5 s each, the same RemoteStore.call path as convert's
@pytest.mark.parametrize("command", ["info", "verify", "open_cache"])
def test_gs_read_and_verify_without_credentials_or_network_are_one_line(
    tmp_path: Path, not_gce: str, command: str
) -> None:
    run_offline(command, tmp_path, not_gce)


def test_gcsfs_requests_get_time_outs_and_the_users_own_win() -> None:
    opts = stores.deadline_options("gs", {})
    assert opts["requests_timeout"].sock_connect == stores.CONNECT_TIMEOUT_S
    assert opts["requests_timeout"].sock_read == stores.READ_TIMEOUT_S
    assert stores.deadline_options("gs", {"requests_timeout": 99})["requests_timeout"] == 99
