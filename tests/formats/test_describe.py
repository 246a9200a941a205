"""What formats declare about themselves (options, codecs, traits), and that nothing outside
``dlstore/formats/`` decides by a format's name."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import dlstore
from dlstore import convert, open_cache
from dlstore.errors import SpecError
from dlstore.formats import FORMATS, Codec, cli_options, get_format, in_memory_format, register_codec
from dlstore.formats.zarr_cache import ZarrWriter, chunk_path
from dlstore.write.options import ConvertOptions

PACKAGE = Path(dlstore.__file__).parent
CLI = PACKAGE.parent / "cli"


def format_name_tests(path: Path) -> list[str]:
    """Comparisons (==, !=, in) against a registered format's name, as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(c, ast.Constant) and c.value in FORMATS for c in items):
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_format_name_is_tested_outside_formats() -> None:
    files = [p for p in [*PACKAGE.rglob("*.py"), *CLI.rglob("*.py")] if "formats" not in p.parts]
    assert len(files) > 30
    assert [hit for p in files for hit in format_name_tests(p)] == []


def test_the_name_check_finds_a_name_test(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(spec):\n    return spec.format == 'ram' or spec.format in ('zarr',)\n")
    assert len(format_name_tests(probe)) == 2


def test_options_are_validated_and_defaults_filled() -> None:
    assert get_format("zarr").writer.parse_options({}) == {"codec": "zstd", "quality": 90, "shard_mb": 0.0}
    assert get_format("npz").writer.parse_options({"codec": "deflate"}) == {"codec": "deflate", "quality": 90}
    assert get_format("ram").writer.parse_options({}) == {}
    with pytest.raises(
        SpecError, match="not available for the zarr format; choose one of zstd, lz4, none, jpeg"
    ):
        get_format("zarr").writer.parse_options({"codec": "deflate"})
    with pytest.raises(SpecError, match="ram format does not take --codec; it takes no options"):
        get_format("ram").writer.parse_options({"codec": "zstd"})


def test_traits() -> None:
    assert in_memory_format() == "ram"
    assert [n for n, f in FORMATS.items() if f.traits.unit_grouped] == ["npz", "zarr"]
    assert all(f.traits.fork_safe for f in FORMATS.values())


def test_a_registered_codec_becomes_a_cli_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    codecs = get_format("zarr").writer.codecs
    monkeypatch.setattr(codecs, "codecs", dict(codecs.codecs))  # undone after the test
    register_codec("zarr", Codec("fancy", "a test codec", 0.5))
    (codec,) = [o for o in cli_options() if o.name == "codec"]
    assert "fancy" in codec.choices and "zarr: zstd|lz4|none|jpeg|fancy" in codec.help
    with pytest.raises(SpecError, match="takes no codec"):
        register_codec("ram", Codec("fancy", "a test codec"))


def test_codec_none_is_not_counted_as_compressed(tmp_path: Path) -> None:
    for fmt, codec, ratio in [("zarr", "none", 1.0), ("zarr", "zstd", 0.8), ("npz", "none", 1.0)]:
        cls = get_format(fmt).writer
        writer = cls(tmp_path, 10, (8, 8, 3), cls.parse_options({"codec": codec}))
        assert writer.size_ratio == ratio, (fmt, codec)


def test_zarr_write_unit_is_durable_by_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = ZarrWriter(tmp_path, 8, (4, 4, 3), ZarrWriter.parse_options({}))
    writer.create()
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    writer.write_unit(0, np.ones((writer.unit_size, 4, 4, 3), np.uint8))
    assert str(chunk_path(tmp_path, 0)) in synced


def test_chunked_readers_refuse_in_memory(image_tree: Path, tmp_path: Path) -> None:
    convert(image_tree, tmp_path / "z", ConvertOptions(format="zarr", size=8, workers=1))
    with pytest.raises(SpecError, match="cannot be loaded into memory.*without in_memory"):
        open_cache(tmp_path / "z", in_memory=True)


def test_old_npz_manifest_with_compress_still_opens(image_tree: Path, tmp_path: Path) -> None:
    """Caches written before ``--codec`` applied to npz recorded ``compress`` instead."""
    dest = tmp_path / "n"
    convert(image_tree, dest, ConvertOptions(format="npz", size=8, workers=1, codec="deflate"))
    manifest = dest / "dlstore.json"
    doc = json.loads(manifest.read_text())
    assert doc["options"]["codec"] == "deflate" and "codec" not in doc["format_options"]  # one key
    doc["format_options"] = {"compress": True, "unit_size": doc["format_options"]["unit_size"]}
    del doc["options"]
    manifest.write_text(json.dumps(doc))
    cache = open_cache(dest, check_source=False)
    assert cache.read(np.arange(len(cache))).shape == (len(cache), 8, 8, 3)


def test_cli_codec_choices_and_no_compress_flag(image_tree: Path, tmp_path: Path) -> None:
    from dlstore.cli import main

    def run(*args: object) -> object:
        return CliRunner().invoke(
            main, ["convert", str(image_tree), *map(str, args), "--size", "8", "--workers", "1"]
        )

    res = run(tmp_path / "a", "--format", "ram", "--codec", "zstd")
    assert res.exit_code == 1 and "ram format does not take --codec" in res.output
    res = run(tmp_path / "b", "--format", "zarr", "--codec", "deflate")
    assert res.exit_code == 1 and "choose one of zstd, lz4, none" in res.output
    res = run(tmp_path / "c", "--format", "npz", "--compress")  # a warning alias for a round: gone
    assert res.exit_code == 2 and "No such option '--compress'" in res.output
    assert run(tmp_path / "c", "--format", "npz", "--codec", "deflate").exit_code == 0
    assert open_cache(tmp_path / "c").spec.codec == "deflate"
