"""``ConvertOptions``: validated once at the boundary; the manifest records it under one key and gives
the same type back; the codec has one route (one field, one manifest key, one reader of that key);
caches written before it (the previous manifest layout) still open and re-run."""

from __future__ import annotations

import inspect
import json
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_helpers import make_tree

from dlstore import ConvertOptions, convert, open_cache
from dlstore.errors import CacheExistsError, DlstoreError
from dlstore.spec import MANIFEST, read_spec
from dlstore.write.options import recorded_options


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=3)


def test_convert_is_one_options_object_and_two_hooks() -> None:
    from dlstore.write.conversion import convert as function

    params = inspect.signature(function).parameters
    assert len(params) <= 6
    assert list(params)[:3] == ["source", "dest", "options"]
    assert "unit_store" not in params and "compress" not in params


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"size": 0}, "size must be"),
        ({"size": 8, "resize": "zoom"}, "resize must be one of"),
        ({"size": 8, "channels": 2}, "channels must be 1 or 3"),
        ({"size": 8, "format": "tar"}, "unknown cache format 'tar'"),
        ({"size": 8, "format": "ram", "codec": "zstd"}, "ram format does not take --codec"),
        ({"size": 8, "format": "zarr", "codec": "deflate"}, "choose one of zstd, lz4, none"),
        ({"size": 8, "format": "zarr", "writer_options": {"quality": 101}}, "--quality"),
        ({"size": 8, "format": "zarr", "writer_options": {"codec": "lz4"}}, "codec=..."),
        ({"size": 8, "storage_order": "random"}, "storage_order must be one of"),
        ({"size": 8, "max_megapixels": 0}, "max_megapixels must be a positive"),
        ({"size": 8, "max_bad": 2}, "max_bad must be a fraction"),
        ({"size": 8, "workers": 0}, "workers must be a whole number"),
        ({"size": 8, "scheduler": "yarn"}, "--scheduler 'yarn'"),
    ],
)
def test_options_are_validated_when_made(given: dict[str, Any], message: str) -> None:
    with pytest.raises(DlstoreError, match=message):
        ConvertOptions(**given)


def test_options_are_frozen_and_hide_credentials() -> None:
    options = ConvertOptions(size=8, storage_options={"secret": "s3cr3t"})
    with pytest.raises(FrozenInstanceError):
        options.size = 16  # type: ignore[misc]
    assert "s3cr3t" not in repr(options)


def test_keyword_shortcuts_fold_into_the_same_options(src: Path, tmp_path: Path) -> None:
    by_object = convert(src, tmp_path / "a", ConvertOptions(size=8, format="npz", workers=1))
    by_keywords = convert(src, tmp_path / "b", size=8, format="npz", workers=1)
    assert read_spec(tmp_path / "a").options == read_spec(tmp_path / "b").options
    assert by_object.n == by_keywords.n
    with pytest.raises(TypeError, match="unexpected keyword.*compress"):
        convert(src, tmp_path / "c", size=8, compress=True)
    with pytest.raises(TypeError, match=r"ConvertOptions or keywords, not both; put workers=\.\.\."):
        convert(src, tmp_path / "d", ConvertOptions(size=8), workers=1)


@pytest.mark.parametrize(
    ("fmt", "codec", "others"),
    [("zarr", "lz4", {}), ("npz", "deflate", {}), ("zarr", "jpeg", {"quality": 80}), ("ram", None, {})],
)
def test_the_manifest_records_the_options_and_reads_back_the_same_type(
    src: Path, tmp_path: Path, fmt: str, codec: str | None, others: dict[str, Any]
) -> None:
    options = ConvertOptions(size=8, format=fmt, codec=codec, writer_options=others, seed=3, workers=1)
    convert(src, tmp_path / "c", options)
    spec = read_spec(tmp_path / "c")
    back = recorded_options(spec)
    assert isinstance(back, ConvertOptions)
    assert back.record() == options.record() and back.seed == 3 and back.format == fmt
    # The codec and every writer option under one key each; the writer's own facts apart.
    doc = json.loads((tmp_path / "c" / MANIFEST).read_text())
    text = json.dumps(doc)
    assert text.count('"codec"') == 1 and "image_codec" not in text
    assert doc["options"]["codec"] == (codec if fmt != "ram" else None)
    assert not set(doc["format_options"]) & {"codec", "quality", "shard_mb"}
    assert spec.codec == doc["options"]["codec"]


def test_the_payload_reader_decodes_by_the_one_codec_key(src: Path, tmp_path: Path) -> None:
    """The JPEG reader learns the codec from ``options.codec``: change only that key and the reader
    (through the registry) decodes the payloads as raw pixels, which their CRCs then refuse."""
    convert(src, tmp_path / "j", ConvertOptions(size=8, format="npz", codec="jpeg", workers=1))
    cache = open_cache(tmp_path / "j", check_source=False)
    assert cache.payload_reader.image_codec.name == "jpeg"
    manifest = tmp_path / "j" / MANIFEST
    doc = json.loads(manifest.read_text())
    doc["options"]["codec"] = "none"
    manifest.write_text(json.dumps(doc))
    assert open_cache(tmp_path / "j", check_source=False).payload_reader.image_codec.name == "raw"


def old_layout(dest: Path) -> None:
    """Rewrite DEST's manifest as the previous main wrote it: the writer options in ``format_options``
    (``image_codec`` beside ``codec`` for the payload layout), the plan under ``source.plan``."""
    manifest = dest / MANIFEST
    doc = json.loads(manifest.read_text())
    opts = doc.pop("options")
    writer = {"codec": opts["codec"], **opts["writer_options"]} if opts["codec"] else {}
    doc["format_options"] = {**writer, **doc["format_options"]}
    if doc["format_options"].get("layout") == "payload":
        doc["format_options"]["image_codec"] = "jpeg" if opts["codec"] == "jpeg" else "raw"
    policy = {**doc["image"]}
    plan = {
        "storage_order": opts["storage_order"],
        "seed": opts["seed"],
        "format": opts["format"],
        "policy": policy,
        "options": writer,
        "n": doc["n_stored"],
        "unit_size": doc["format_options"]["unit_size"],
        "fingerprint": doc["source"]["fingerprint"],
        "dlstore": doc["dlstore_version"].split(".")[0],
    }
    doc["source"]["plan"] = plan
    manifest.write_text(json.dumps(doc, indent=1, sort_keys=True))


@pytest.mark.parametrize(("fmt", "codec"), [("ram", None), ("zarr", "zstd"), ("npz", "jpeg")])
def test_a_cache_of_the_previous_layout_opens_and_reruns_up_to_date(
    src: Path, tmp_path: Path, fmt: str, codec: str | None
) -> None:
    options = ConvertOptions(size=8, format=fmt, codec=codec, workers=1)
    convert(src, tmp_path / "new", options)
    convert(src, tmp_path / "old", options)
    old_layout(tmp_path / "old")
    new, old = open_cache(tmp_path / "new"), open_cache(tmp_path / "old")
    assert old.spec.codec == codec
    idx = np.arange(len(new))
    np.testing.assert_array_equal(old.read(idx), new.read(idx))
    assert recorded_options(old.spec).record() == options.record()  # type: ignore[union-attr]
    assert convert(src, tmp_path / "old", options).up_to_date
    with pytest.raises(CacheExistsError, match="--size 16 was 8.*--overwrite"):
        convert(src, tmp_path / "old", ConvertOptions(size=16, format=fmt, codec=codec, workers=1))


def test_a_cache_that_recorded_no_options_is_refused_naming_the_fix(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "c", size=8, workers=1)
    old_layout(tmp_path / "c")
    manifest = tmp_path / "c" / MANIFEST
    doc = json.loads(manifest.read_text())
    del doc["source"]["plan"]  # the oldest caches recorded no plan at all
    manifest.write_text(json.dumps(doc))
    assert open_cache(tmp_path / "c").spec.n > 0  # still opens
    with pytest.raises(CacheExistsError, match="did not record its options; pass --overwrite"):
        convert(src, tmp_path / "c", size=8, workers=1)
    assert not convert(src, tmp_path / "c", size=8, workers=1, overwrite=True).up_to_date


def test_policy_of_the_options_is_the_manifests_image_policy(src: Path, tmp_path: Path) -> None:
    options = ConvertOptions(size=8, resize="pad", channels=1, format="npz", workers=1)
    convert(src, tmp_path / "c", options)
    assert asdict(read_spec(tmp_path / "c").image) == asdict(options.policy)


def test_a_run_staged_by_the_previous_layout_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted conversion journaled its plan as the previous main did (``policy`` and the writer
    ``options`` at the top): the same command resumes it instead of refusing a "changed" plan."""
    from dlstore.formats import FORMATS

    src = make_tree(tmp_path / "src", per_class=6)
    monkeypatch.setattr(FORMATS["npz"].writer, "choose_unit_size", staticmethod(lambda image_bytes: 3))
    real = FORMATS["npz"].writer.write_unit

    def dying(self: Any, k: int, images: Any) -> None:
        if k == 2:
            raise KeyboardInterrupt
        real(self, k, images)

    options = ConvertOptions(size=8, format="npz", codec="deflate", workers=1)
    with monkeypatch.context() as m:
        m.setattr(FORMATS["npz"].writer, "write_unit", dying)
        with pytest.raises(Exception, match="interrupted"):
            convert(src, tmp_path / "c", options)
    journal = tmp_path / ".c.dlstore-journal" / "plan.json"
    plan = json.loads(journal.read_text())
    opts = plan["options"]
    old = {
        "storage_order": opts["storage_order"],
        "seed": opts["seed"],
        "format": "npz",
        "policy": asdict(options.policy),
        "options": {"codec": opts["codec"], **opts["writer_options"]},
        "n": plan["n"],
        "unit_size": plan["unit_size"],
        "fingerprint": plan["fingerprint"],
        "dlstore": plan["dlstore"],
    }
    journal.write_text(json.dumps(old))
    result = convert(src, tmp_path / "c", options)
    assert result.resumed_units == 2 and result.n == 12
