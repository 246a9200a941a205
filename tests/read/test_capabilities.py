"""Reader capabilities are declared (``Traits`` and the reader base class's attributes), never probed:
no module outside ``dlstore/formats/`` asks a reader ``hasattr``/``getattr``, and each declaration
says what its reader really does."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import dlstore
from dlstore import convert, open_cache
from dlstore.formats import FORMATS
from dlstore.formats.base import CacheReader, ChunkedReader
from dlstore.formats.payload import PayloadReader

PACKAGE = Path(dlstore.__file__).parent


def reader_probes(path: Path) -> list[str]:
    """``hasattr(x.reader, ...)`` / ``getattr(reader, ...)`` calls: a first argument that names a reader."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
        ):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "reader" in target.lower():
                out.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_nothing_outside_formats_probes_a_reader() -> None:
    probes = [p for path in PACKAGE.rglob("*.py") if "formats" not in path.parts for p in reader_probes(path)]
    assert probes == []


def test_every_reader_class_declares_what_it_can_do() -> None:
    for fmt in FORMATS.values():
        for cls in filter(None, (fmt.reader, fmt.payload_reader)):
            traits = cls.traits
            assert traits.payloads == issubclass(cls, PayloadReader), cls.__name__
            # unit arrays: a chunked reader whose units decode to pixels (the payload layout's do not)
            assert traits.unit_arrays == (issubclass(cls, ChunkedReader) and not traits.payloads), (
                cls.__name__
            )
            assert traits.unit_grouped == issubclass(cls, ChunkedReader), cls.__name__


@pytest.mark.parametrize("codec", [None, "jpeg"])
def test_declared_attributes_match_the_cache(image_tree: Path, tmp_path: Path, codec: str | None) -> None:
    fmt = next(f.name for f in FORMATS.values() if f.ragged_ok)
    extra = {"codec": codec} if codec else {}
    convert(image_tree, tmp_path / "c", format=fmt, size=16, workers=1, **extra)
    cache = open_cache(tmp_path / "c")
    reader: CacheReader = cache.reader
    assert reader.gpu_jpeg is (codec == "jpeg") and reader.traits.payloads is (codec == "jpeg")
    assert reader.unit == int(cache.spec.format_options["unit_size"]) and reader.max_units >= 1
    images = cache.read_images(np.arange(3))  # either layout, one call
    assert all(np.array_equal(a, b) for a, b in zip(images, cache.read(np.arange(3))))
    if codec is None:
        with pytest.raises(ValueError, match="--codec jpeg or --resize shorter"):
            cache.read_payloads(np.arange(3))
