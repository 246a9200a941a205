"""H3: the manifest covers itself; E4: `verify --deep` never opens a file outside the source root."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree

import dlstore.write.verification as verification
from dlstore.checksums import checksum_tree
from dlstore.cli import main
from dlstore.read.cache import open_cache
from dlstore.sourcefiles import read_record
from dlstore.spec import MANIFEST, SOURCE_RECORD, manifest_digest
from dlstore.write.conversion import convert
from dlstore.write.verification import verify

FORMATS = ("ram", "npz", "zarr")


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small cache per format, its source folder gone afterwards."""
    top = tmp_path_factory.mktemp("h3")
    src = make_tree(top / "src", per_class=3, classes=("cat", "dog", "eel"))
    out = {fmt: top / fmt for fmt in FORMATS}
    for fmt, dest in out.items():
        convert(src, dest, format=fmt, size=8, workers=1)
    shutil.rmtree(src)
    return out


def edit(doc: dict[str, Any], what: str) -> None:
    if what == "classes":
        doc["classes"] = doc["classes"][::-1]
    elif what == "n":
        doc["n"] -= 1
    elif what == "shape":
        doc["shape"], doc["image"]["size"] = [9, 9, 3], 9
    elif what == "unit_size":
        doc["format_options"]["unit_size"] += 1
    elif what == "source":
        doc["source"]["root"] = "/somewhere/else"
    elif what == "policy":
        doc["image"]["resize"] = "stretch"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("what", ["classes", "n", "shape", "unit_size", "source", "policy"])
def test_h3_any_edit_of_the_manifest_fails_verify_with_the_source_gone(
    caches: dict[str, Path], tmp_path: Path, fmt: str, what: str
) -> None:
    """H3: an edited field (the class names reversed, a count, the shape, ...) is caught by `verify`,
    with the source folder gone (before: the cache opened and verify said ok)."""
    dest = tmp_path / "c"
    shutil.copytree(caches[fmt], dest)
    assert verify(dest).ok
    doc = json.loads((dest / MANIFEST).read_text())
    assert doc["digest"] == manifest_digest(doc)
    edit(doc, what)
    (dest / MANIFEST).write_text(json.dumps(doc, indent=1))
    result = verify(dest, deep=True)  # deep: the source is not opened as an edited manifest says
    assert not result.ok and "edited since conversion" in result.first_problem
    assert len(result.problems) == 1 and result.sources_hashed == 0, result.problems
    res = CliRunner().invoke(main, ["verify", str(dest)])
    assert res.exit_code != 0 and "edited since conversion" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("fmt", FORMATS)
def test_h3_a_manifest_without_a_digest_still_opens_and_verifies(
    caches: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    """H3: caches written before the digest (no ``digest`` key) open, read and verify as before; a
    re-serialised manifest (other indentation, key order) keeps its digest."""
    dest = tmp_path / "c"
    shutil.copytree(caches[fmt], dest)
    doc = json.loads((dest / MANIFEST).read_text())
    (dest / MANIFEST).write_text(json.dumps(dict(reversed(list(doc.items())))))
    assert verify(dest).ok
    del doc["digest"]
    (dest / MANIFEST).write_text(json.dumps(doc))
    assert verify(dest).ok
    cache = open_cache(dest, check_source=False)
    assert cache.read(np.arange(len(cache))).shape == (9, 8, 8, 3) and list(cache.spec.classes) == [
        "cat",
        "dog",
        "eel",
    ]


# --- E4: deep verify stays inside the source root ----------------------------------------------------


def forge_record(dest: Path, names: dict[int, str]) -> None:
    """The attacker's source record, the manifest's checksums and digest recomputed to match."""
    record = read_record(dest)
    assert record is not None
    for i, name in names.items():
        record.names[i] = name
    record.save(dest / SOURCE_RECORD)
    doc = json.loads((dest / MANIFEST).read_text())
    doc["checksums"] = checksum_tree(dest, (MANIFEST,))
    doc["digest"] = manifest_digest(doc)
    (dest / MANIFEST).write_text(json.dumps(doc))


def test_e4_deep_verify_never_opens_a_record_name_outside_the_source_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E4: source records named ``../secret-outside.bin``, an absolute path, a link out of the root and
    a path through a linked folder to a non-image are refused by name; nothing outside is opened."""
    src = make_tree(tmp_path / "src", per_class=3)
    secret = tmp_path / "secret-outside.bin"
    secret.write_bytes(b"the user's secret")
    (src / "a" / "evil").symlink_to(secret)  # a link out, a name the conversion never reads
    (src / "b" / "up").symlink_to(tmp_path)  # a linked folder: followed by scans, for images only
    dest = tmp_path / "c"
    convert(src, dest, size=8, workers=1)
    assert verify(dest, deep=True).ok
    forge_record(
        dest, {0: "../secret-outside.bin", 1: str(secret), 2: "a/evil", 3: "b/up/secret-outside.bin"}
    )
    opened: list[Path] = []
    real = verification.file_sha256
    monkeypatch.setattr(verification, "file_sha256", lambda p: opened.append(Path(p)) or real(p))
    result = verify(dest, deep=True)
    outside = [p for p in result.problems if "outside the source root" in p]
    assert len(outside) == 4 and "'../secret-outside.bin'" in outside[0], result.problems
    assert len(opened) == 2 and all(p.resolve() != secret.resolve() for p in opened)  # the 2 true names
    res = CliRunner().invoke(main, ["verify", str(dest), "--deep"])
    assert res.exit_code != 0 and "secret-outside.bin" in res.output and "Traceback" not in res.output


def test_e4_deep_verify_still_follows_the_folder_links_the_conversion_followed(tmp_path: Path) -> None:
    """E4: a class folder linked from outside the root (documented: scans follow it) is still hashed."""
    src = make_tree(tmp_path / "src", per_class=2)
    outside = make_tree(tmp_path / "outside", per_class=2, classes=("o",))
    (src / "b" / "more").symlink_to(outside / "o")
    dest = tmp_path / "c"
    convert(src, dest, size=8, workers=1)
    result = verify(dest, deep=True)
    assert result.ok and result.sources_hashed == 6, result.problems


@pytest.mark.s3
def test_h3_an_edited_remote_manifest_fails_verify(
    caches: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """H3 over a network: a cache on a moto S3 server this test starts verifies ok, then its manifest's
    classes are reversed in place on the store, and `verify s3://…` names the edit."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from s3server import aws_env, start_server

    from dlstore.storage.stores import RemoteStore

    server = start_server()
    try:
        for name, value in aws_env(server).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("DLSTORE_SPOOL", str(tmp_path / "spool"))
        try:
            RemoteStore("s3://h3-manifest").fs.mkdir("h3-manifest")
        except FileExistsError:  # moto's in-process backend outlives a server of an earlier test
            pass
        store = RemoteStore("s3://h3-manifest/c")
        for p in sorted(caches["npz"].rglob("*")):
            if p.is_file():
                store.put_file(p, p.relative_to(caches["npz"]).as_posix())
        assert verify("s3://h3-manifest/c").ok
        doc = json.loads(store.get_bytes(MANIFEST))
        edit(doc, "classes")
        store.put_bytes(json.dumps(doc).encode(), MANIFEST)
        result = verify("s3://h3-manifest/c")
        assert not result.ok and "edited since conversion" in result.first_problem
        assert "s3://h3-manifest/c" in result.first_problem
    finally:
        server.stop()
