"""Issue 20 item 5: a finished conversion to ``s3://…`` re-run with the same command is "up to date" and
exits 0, as a local one; another plan is refused naming the first difference and the URL; a resumed
upload that finished says so in one line. Against a real S3-compatible server (moto's server mode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree

from dlstore import ConvertOptions, Remote, convert, open_cache
from dlstore.cli import main
from dlstore.errors import CacheExistsError
from dlstore.spec import MANIFEST
from dlstore.storage.stores import RemoteStore
from dlstore.write.sources import open_source

pytestmark = pytest.mark.s3
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

BUCKET = "rerun"


@pytest.fixture(scope="module")
def bucket(server: Any) -> str:
    RemoteStore(f"s3://{BUCKET}").fs.mkdir(BUCKET)
    return BUCKET


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", per_class=4)


_count = iter(range(1000))


@pytest.fixture
def url(bucket: str) -> str:
    return f"s3://{BUCKET}/c{next(_count)}"


OPTIONS = ConvertOptions(size=8, format="npz", workers=1)


def objects(url: str) -> dict[str, bytes]:
    store = RemoteStore(url)
    return {rel: store.get_bytes(rel) for rel in store.sizes()}


def cli(*args: object) -> Any:
    return CliRunner().invoke(main, ["convert", *map(str, args)])


def test_the_same_command_is_up_to_date_and_writes_nothing(
    tree: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = convert(tree, url, OPTIONS)
    before = objects(url)
    writes: list[str] = []
    for name in ("put_bytes", "put_file", "copy", "delete"):
        monkeypatch.setattr(RemoteStore, name, lambda self, *a, _n=name: writes.append(_n))
    again = convert(tree, url, OPTIONS)
    assert again.up_to_date and not first.up_to_date and writes == []
    assert (again.dest, again.n, again.classes, again.shape) == (url, first.n, first.classes, first.shape)
    monkeypatch.undo()
    assert objects(url) == before


def test_the_cli_says_up_to_date_and_exits_0(tree: Path, url: str) -> None:
    args = (tree, url, "--size", "8", "--format", "npz", "--workers", "1")
    assert cli(*args).exit_code == 0
    res = cli(*args)
    assert res.exit_code == 0, res.output
    assert f"{url} is up to date" in res.stderr and "already holds" not in res.output
    doc = json.loads(cli(*args, "--json").stdout)
    assert doc["up_to_date"] is True and doc["dest"] == url


def test_other_options_are_refused_naming_the_difference_and_the_url(tree: Path, url: str) -> None:
    convert(tree, url, OPTIONS)
    before = objects(url)
    with pytest.raises(CacheExistsError, match="built with other options") as e:
        convert(tree, url, ConvertOptions(size=16, format="npz", workers=1))
    assert url in str(e.value) and "--size 16 was 8" in str(e.value) and "--overwrite" in str(e.value)
    res = cli(tree, url, "--size", "8", "--format", "npz", "--codec", "deflate")
    assert res.exit_code == 1 and "--codec deflate was none" in res.output and "Traceback" not in res.output
    assert objects(url) == before
    rebuilt = convert(tree, url, ConvertOptions(size=16, format="npz", workers=1, overwrite=True))
    assert not rebuilt.up_to_date and open_cache(
        url, remote=Remote(cache_dir=tree.parent / "m")
    ).spec.shape == (16, 16, 3)


def test_a_changed_source_is_refused_naming_the_first_changed_file(tree: Path, url: str) -> None:
    convert(tree, url, OPTIONS)
    victim = tree / "b" / "img001.png"
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(CacheExistsError, match="source changed") as e:
        convert(tree, url, OPTIONS)
    assert url in str(e.value) and "b/img001.png" in str(e.value)


def test_a_resumed_upload_that_finished_says_so_in_one_line(
    tree: Path, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    put = RemoteStore.put_file
    calls: list[str] = []

    def dying_put(self: RemoteStore, src: Path, rel: str) -> None:
        calls.append(rel)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed mid-upload, after the spool was complete
        put(self, src, rel)

    monkeypatch.setattr(RemoteStore, "put_file", dying_put)
    with pytest.raises(KeyboardInterrupt):
        convert(tree, url, OPTIONS)
    monkeypatch.setattr(RemoteStore, "put_file", put)
    assert MANIFEST not in RemoteStore(url).sizes()
    res = cli(tree, url, "--size", "8", "--format", "npz", "--workers", "1")
    assert res.exit_code == 0, res.output
    lines = [
        line
        for line in res.stderr.splitlines()
        if line.strip() and not line.startswith(("converting", "uploading"))
    ]
    assert len(lines) == 1 and "resumed an interrupted upload" in lines[0] and url in lines[0]
    assert "warning" not in res.output and "up to date" not in res.output
    assert open_cache(url, remote=Remote(cache_dir=tree.parent / "m")).spec.n == len(open_source(tree))
    res = cli(tree, url, "--size", "8", "--format", "npz", "--workers", "1")
    assert res.exit_code == 0 and f"{url} is up to date" in res.stderr
