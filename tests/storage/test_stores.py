"""Cache paths with a URL scheme no backend serves are refused, never turned into a local folder
named ``http:``; s3:// and gs:// are remote caches (tests/read/test_remote.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from dlstore import CachedDataset, convert, open_cache, verify
from dlstore.cli import main
from dlstore.errors import UnsupportedStoreError
from dlstore.storage.stores import parse_store_path
from dlstore.write.options import ConvertOptions

URLS = ["http://host/x", "https://host/x", "az://c/p", "ftp:/host/p"]


@pytest.mark.parametrize("url", URLS)
def test_library_entry_points_refuse_urls(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: convert("demo", url, ConvertOptions(size=8)),
        lambda: open_cache(url),
        lambda: CachedDataset(url),
        lambda: verify(url),
    ):
        with pytest.raises(UnsupportedStoreError, match="not supported"):
            call()
    assert list(tmp_path.iterdir()) == []  # no local folder named "s3:" or "http:"


@pytest.mark.parametrize(
    "command", [["convert", "demo", "{url}", "--size", "8"], ["info", "{url}"], ["verify", "{url}"]]
)
def test_cli_refuses_urls_with_a_clear_message(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = [a.format(url="https://host/prefix") for a in command]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "https://host/prefix" in res.output and "not supported" in res.output
    assert list(tmp_path.iterdir()) == []


def test_local_paths_and_file_urls_are_local() -> None:
    assert parse_store_path("cache/x") == Path("cache/x")
    assert parse_store_path(Path("/tmp/c")) == Path("/tmp/c")
    assert parse_store_path("file:///tmp/c") == Path("/tmp/c")
    assert parse_store_path("C:/data/c") == Path("C:/data/c")  # a drive letter is not a scheme


def test_object_store_urls_stay_urls() -> None:
    assert parse_store_path("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert parse_store_path("s3:/bucket/prefix") == "s3://bucket/prefix"  # what pathlib makes of a URL
    assert parse_store_path("gs://b/c") == "gs://b/c"
