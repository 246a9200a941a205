"""RELIABILITY.md sections B (stale caches) and C (bad inputs).

Covered in tests/convert/test_imageops.py and not repeated here: C4 CMYK vs Pillow and alpha on white
(test_cmyk_matches_pillow_rgb, test_alpha_is_composited_on_white, test_palette_transparency_and_grey_channels),
C5 16-bit ramp (test_sixteen_bit_ramp_keeps_256_levels), C6 (test_bilevel_gives_0_and_255),
C7 orientations 1-8 (test_exif_orientation_is_applied), C10's draft use (test_draft_is_used_for_large_jpeg).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from reliability_helpers import image_bytes, make_tree, release_loader, small_units

import dlstore.write.imageops as imageops
from dlstore.cli import main
from dlstore.errors import (
    CacheExistsError,
    CacheNotFoundError,
    ConvertError,
    ImageDecodeError,
    SampleReadError,
    SourceError,
    SpecError,
    StaleCacheError,
    StaleCacheWarning,
)
from dlstore.read.cache import open_cache
from dlstore.read.dataset import CachedDataset
from dlstore.sourcefiles import read_record
from dlstore.spec import ImagePolicy, read_spec
from dlstore.write.conversion import convert
from dlstore.write.imageops import DECODE_ERRORS, decode_file
from dlstore.write.sources import scan_folder
from dlstore.write.verification import skipped_problems, verify

POLICY = ImagePolicy(size=8)


def conv(src: Path, dest: Path, fmt: str = "ram", **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("size", 8)
    kw.setdefault("workers", 1)
    return convert(src, dest, format=fmt, **kw)  # type: ignore[arg-type]


def rgb(seed: int = 0, h: int = 40, w: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# --- B. stale caches ---------------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path]:
    src = make_tree(tmp_path / "src", per_class=4)
    dest = tmp_path / "c"
    conv(src, dest)
    return src, dest


def stale_message(dest: Path) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_cache(dest, check_source=True)
    stale = [str(w.message) for w in caught if issubclass(w.category, StaleCacheWarning)]
    return stale[0] if stale else ""


def test_a_cache_given_as_the_source_is_named_as_one(built: tuple[Path, Path], tmp_path: Path) -> None:
    """`dlstore convert CACHE ...` or `dlstore bench CACHE` read its shards/ as an empty class folder."""
    _src, dest = built
    for args in (["convert", str(dest), str(tmp_path / "again"), "--size", "32"], ["bench", str(dest)]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code != 0 and "a dlstore cache, not images to convert" in r.output, r.output
        assert f"dlstore info {dest}" in r.output and not (tmp_path / "again").exists()


def test_b_fresh_cache_is_not_stale(built: tuple[Path, Path]) -> None:
    assert stale_message(built[1]) == "" and verify(built[1]).ok


@pytest.mark.parametrize(
    "edit,expect",
    [
        ("modify", "a/img001.png (size/mtime changed"),
        ("add", "a/img000b.png (added)"),
        ("remove", "b/img002.jpg (removed)"),
    ],
)
def test_b1_changed_source_warns_on_open_and_fails_verify(
    built: tuple[Path, Path], edit: str, expect: str
) -> None:
    src, dest = built
    if edit == "modify":
        f = src / "a" / "img001.png"
        f.write_bytes(f.read_bytes() + b"\0")
    elif edit == "add":
        shutil.copy(src / "a" / "img001.png", src / "a" / "img000b.png")
    else:
        (src / "b" / "img002.jpg").unlink()
    msg = stale_message(dest)
    assert expect in msg and "stale cache" in msg and "--overwrite" in msg
    with pytest.raises(StaleCacheError, match=expect.split(" (")[0]):
        open_cache(dest, strict=True, check_source=True)
    with pytest.raises(StaleCacheError):
        CachedDataset(dest, strict=True, check_source=True)
    result = verify(dest)
    assert not result.ok and expect in result.first_problem


def test_b1_new_class_folder_warns_label_shift(built: tuple[Path, Path]) -> None:
    src, dest = built
    (src / "0new").mkdir()
    shutil.copy(src / "a" / "img001.png", src / "0new" / "x.png")
    assert "label indices shifted" in stale_message(dest) and "0new" in stale_message(dest)


def test_b2_same_size_restored_mtime_needs_deep_verify(built: tuple[Path, Path]) -> None:
    src, dest = built
    f = src / "b" / "img001.png"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF  # same size
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stale_message(dest) == "" and verify(dest).ok  # documented: only content hashes see this
    deep = verify(dest, deep=True)
    assert not deep.ok and str(f) in deep.first_problem and "content changed" in deep.first_problem
    res = CliRunner().invoke(main, ["verify", str(dest), "--deep"])
    assert res.exit_code == 1 and "img001.png" in res.output


def test_b3_moved_root_is_not_stale(built: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = built
    moved = src.rename(tmp_path / "elsewhere")
    assert stale_message(dest) == ""
    open_cache(dest, strict=True)
    result = verify(dest)
    assert result.ok and "not found" in result.notes[0]
    assert verify(dest, deep=True, source=moved).ok
    assert verify(dest, deep=True, source=moved).sources_hashed == 8
    assert "--source" in verify(dest, deep=True).first_problem
    res = CliRunner().invoke(main, ["verify", str(dest), "--deep", "--source", str(moved)])
    assert res.exit_code == 0 and "8 source files match" in res.output


def test_b3_moved_root_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlstore.formats.ram import RamWriter

    small_units(monkeypatch, 3)
    src = make_tree(tmp_path / "src", per_class=4)
    real = RamWriter.write_unit
    monkeypatch.setattr(
        RamWriter,
        "write_unit",
        lambda self, k, a: (_ for _ in ()).throw(KeyError()) if k == 1 else real(self, k, a),
    )
    with pytest.raises(KeyError):
        conv(src, tmp_path / "c")
    monkeypatch.setattr(RamWriter, "write_unit", real)
    assert (
        conv(src.rename(tmp_path / "moved"), tmp_path / "c").resumed_units == 1
    )  # fingerprint: relative names


# --- C. bad inputs -------------------------------------------------------------------------------------


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


PNG = image_bytes(rgb(), "PNG")
JPEG = image_bytes(rgb(), "JPEG", quality=90)


def png_with_bad_idat_crc() -> bytes:
    i = PNG.index(b"IDAT")
    n = int.from_bytes(PNG[i - 4 : i], "big")
    crc_at = i + 4 + n
    return PNG[:crc_at] + bytes(b ^ 0xFF for b in PNG[crc_at : crc_at + 4]) + PNG[crc_at + 4 :]


@pytest.mark.parametrize(
    "name,data",
    [
        *[(f"jpeg_cut_{p}.jpg", JPEG[: max(1, len(JPEG) * p // 100)]) for p in (1, 50, 99)],
        *[(f"png_cut_{p}.png", PNG[: max(1, len(PNG) * p // 100)]) for p in (1, 50, 99)],
        ("png_bad_crc.png", png_with_bad_idat_crc()),
        ("png_no_iend.png", PNG[:-12]),
        ("empty.jpg", b""),
        ("page.jpg", b"<!DOCTYPE html><html><body>404</body></html>"),
        ("doc.jpg", b"%PDF-1.4\n1 0 obj <<>> endobj\n%%EOF\n"),
        ("text.png", b"just some text\n" * 20),
    ],
)
def test_c1_c2_bad_files_raise_decode_error_naming_the_file(tmp_path: Path, name: str, data: bytes) -> None:
    path = write(tmp_path / name, data)
    with pytest.raises(ImageDecodeError) as e:
        decode_file(path, POLICY)
    assert str(path) in str(e.value)


def test_c1_c2_skip_and_report_in_a_conversion(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=6)
    write(src / "a" / "cut.jpg", JPEG[: len(JPEG) // 2])
    write(src / "a" / "empty.jpg", b"")
    write(src / "b" / "crc.png", png_with_bad_idat_crc())
    write(src / "a" / ".DS_Store", b"\0\0\0\1Bud1")
    write(src / "b" / "Thumbs.db", b"\xd0\xcf\x11\xe0")
    write(src / "b" / ".hidden" / "x.jpg", JPEG)
    write(src / ".git" / "y.jpg", JPEG)
    res = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "c"), "--size", "8", "--workers", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "skipped 3 undecodable images" in res.output
    skipped = json.loads((tmp_path / "c" / "skipped.json").read_text())
    assert sorted(s["path"] for s in skipped) == ["a/cut.jpg", "a/empty.jpg", "b/crc.png"]
    assert all(s["reason"] and s["path"] in s["reason"] for s in skipped)
    spec = read_spec(tmp_path / "c")
    assert (spec.n, spec.n_stored, spec.classes) == (12, 15, ("a", "b"))  # hidden things never listed
    assert verify(tmp_path / "c").ok and skipped_problems(tmp_path / "c", spec) == []
    (tmp_path / "c" / "skipped.json").write_text(json.dumps(skipped[:2]))
    assert "lists 2 skipped images, the manifest says 3" in skipped_problems(tmp_path / "c", spec)[0]


def test_c2_strict_stops_at_the_first_bad_file(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    write(src / "b" / "bad.jpg", b"<html>")
    res = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "c"), "--size", "8", "--strict"])
    assert res.exit_code == 1 and "b/bad.jpg" in res.output and "--strict" in res.output
    with pytest.raises(CacheNotFoundError):
        open_cache(tmp_path / "c")


def test_c3_eps_never_reaches_ghostscript(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import EpsImagePlugin

    opened: list[str] = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append("eps"))
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: opened.append("gs"))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n%%EOF\n"
    for name in ("x.jpg", "x.eps.png", "x.tif"):
        with pytest.raises(ImageDecodeError):
            decode_file(write(tmp_path / name, eps), POLICY)
    assert opened == [] and "EPS" not in imageops.ALLOWED_FORMATS


@pytest.mark.parametrize("mode", ["CMYK", "P", "LA", "RGBA", "L"])
@pytest.mark.parametrize("channels", [1, 3])
def test_c4_modes_become_the_requested_channels(tmp_path: Path, mode: str, channels: int) -> None:
    img = Image.fromarray(rgb()).convert(mode)
    suffix = ".jpg" if mode == "CMYK" else ".png"
    if mode == "P":
        img.info["transparency"] = 0
    path = tmp_path / f"x{suffix}"
    img.save(path, **({"transparency": 0} if mode == "P" else {}))
    out = decode_file(path, ImagePolicy(size=8, channels=channels))
    assert out.shape == (8, 8, channels) and out.dtype == np.uint8


def test_c4_adobe_inverted_cmyk_jpeg(tmp_path: Path) -> None:
    """Pillow writes CMYK JPEGs with the Adobe marker (inverted); decoding must match Pillow's RGB."""
    img = Image.fromarray(rgb()).convert("CMYK")
    path = tmp_path / "cmyk.jpg"
    img.save(path, quality=95)
    with Image.open(path) as ref:
        assert "adobe" in ref.info
        expected = np.asarray(ref.convert("RGB").resize((8, 8), Image.BILINEAR))
    out = decode_file(path, ImagePolicy(size=8, resize="stretch"))
    assert np.abs(out.astype(int) - expected).mean() < 1


def test_c5_sixteen_bit_tiff_keeps_256_levels(tmp_path: Path) -> None:
    ramp = np.tile(np.linspace(0, 65535, 256 * 4).astype(np.uint16), (4, 1))
    path = tmp_path / "ramp.tif"
    Image.fromarray(ramp).save(path)
    out = decode_file(path, ImagePolicy(size=4, resize="stretch", channels=1))
    full = imageops.sixteen_to_eight(Image.fromarray(ramp))
    assert len(np.unique(np.asarray(full))) == 256 and out.dtype == np.uint8


def test_c7_policy_recorded_in_manifest(tmp_path: Path) -> None:
    conv(make_tree(tmp_path / "src", per_class=2), tmp_path / "c")
    image = json.loads((tmp_path / "c" / "dlstore.json").read_text())["image"]
    assert image["exif_transpose"] is True and image["background"] == [255, 255, 255]


def test_c8_animation_reads_only_the_first_frame(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import GifImagePlugin, TiffImagePlugin

    frames = [Image.fromarray(np.full((6, 6, 3), v, np.uint8)) for v in (10, 200, 90)]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:] * 3333)  # 10,000 frames
    frames[0].save(tmp_path / "a.tif", save_all=True, append_images=frames[1:])
    seeks: list[int] = []
    for cls in (GifImagePlugin.GifImageFile, TiffImagePlugin.TiffImageFile):
        real = cls.seek
        monkeypatch.setattr(cls, "seek", lambda self, f, real=real: (seeks.append(f), real(self, f))[1])
    for name in ("a.gif", "a.tif"):
        out = decode_file(tmp_path / name, ImagePolicy(size=6, resize="stretch"))
        assert abs(int(out.mean()) - 10) <= 2
    assert all(f == 0 for f in seeks)  # never walks the other frames


def png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("factor", [1.5, 4.0])
def test_c9_decompression_bombs_rejected_before_decoding(tmp_path: Path, factor: float) -> None:
    side = int((Image.MAX_IMAGE_PIXELS * factor) ** 0.5) + 1
    path = write(tmp_path / "bomb.png", png_claiming(side, side))
    t0 = time.process_time()
    with pytest.raises(ImageDecodeError, match="DecompressionBomb"):
        decode_file(path, POLICY)
    assert Image.MAX_IMAGE_PIXELS is not None and time.process_time() - t0 < 5  # nothing was decoded


@pytest.mark.parametrize("workers", [1, 2])
def test_c9_max_megapixels_lets_large_photographs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Pillow's limit stands in for a 108 MP photo: with it lowered to 1,000 px, 40x50 JPEGs are over it
    and skipped with the hint; --max-megapixels above them converts them (in the workers too), the
    re-run names the changed option, and the caller's own limit is left as it was."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # forked workers inherit it
    root = make_tree(tmp_path / "src", per_class=3, side=40)
    with pytest.raises(ConvertError, match=r"6 of 6 images .*raise the limit with --max-megapixels"):
        conv(root, tmp_path / "a", workers=workers)
    taken = conv(root, tmp_path / "b", workers=workers, max_megapixels=0.01)  # 10,000 px
    assert taken.n_skipped == 0 and taken.n == 6 and Image.MAX_IMAGE_PIXELS == 1000
    with pytest.raises(CacheExistsError, match="--max-megapixels 0.02 was 0.01"):
        conv(root, tmp_path / "b", workers=workers, max_megapixels=0.02)
    with pytest.raises(SpecError, match="max_megapixels"):
        conv(root, tmp_path / "c", max_megapixels=0)


def test_c10_huge_jpeg_decodes_with_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.jpg"
    Image.new("RGB", (9000, 9000), (40, 120, 200)).save(path, quality=85)
    probe = (
        "import resource, sys; from dlstore.write.imageops import decode_file; from dlstore.spec import ImagePolicy;"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "out = decode_file(sys.argv[1], ImagePolicy(size=224));"
        "print(out.shape, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True)
    shape, grew_mb = out.stdout.rsplit(" ", 1)
    assert shape == "(224, 224, 3)" and int(grew_mb) < 60  # a full decode would need 243 MB


def test_c11_short_fuzz_only_expected_errors(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    seeds = [image_bytes(rgb(1), "JPEG", quality=80), image_bytes(rgb(2), "PNG"), image_bytes(rgb(3), "WEBP")]
    outcomes = {"ok": 0, "bad": 0}
    for i in range(120):
        data = bytearray(seeds[i % 3])
        for _ in range(int(rng.integers(1, 6))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            data = data[: int(rng.integers(1, len(data)))]
        path = write(tmp_path / f"f{i}.img", bytes(data))
        try:
            decode_file(path, POLICY)
            outcomes["ok"] += 1
        except ImageDecodeError as e:
            assert isinstance(e.__cause__, DECODE_ERRORS)
            outcomes["bad"] += 1
    assert outcomes["ok"] + outcomes["bad"] == 120  # anything else would have propagated


def test_c11_per_file_timeout_skips_a_hanging_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlstore.write.sources.encoded as sources

    src = make_tree(tmp_path / "src", per_class=4)
    real = sources.decode_file

    def hang_on_one(path: Path, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        if path.name == "img002.jpg" and path.parent.name == "b":
            time.sleep(30)
        return real(path, policy, data)

    monkeypatch.setattr(sources, "decode_file", hang_on_one)
    t0 = time.monotonic()
    result = conv(src, tmp_path / "c", workers=2, decode_timeout=0.5)
    assert time.monotonic() - t0 < 15
    assert [s["path"] for s in result.skipped] == ["b/img002.jpg"]
    assert "took longer than 0.5 s" in result.skipped[0]["reason"]


def test_c11_worker_killed_by_a_crashing_decoder_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlstore.write.sources.encoded as sources

    src = make_tree(tmp_path / "src", per_class=4)
    real = sources.decode_file

    def crash(path: Path, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        if path.name == "img001.png":
            os.kill(os.getpid(), 9)
        return real(path, policy, data)

    monkeypatch.setattr(sources, "decode_file", crash)
    small_units(monkeypatch, 2)
    with pytest.raises(ConvertError, match="worker died .* re-run the same command to resume"):
        conv(src, tmp_path / "c", workers=2)


@pytest.mark.parametrize("fmt", ["npz", "zarr"])
def test_c12_corrupt_unit_in_a_dataloader_worker_names_path_and_index(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_units(monkeypatch, 4)
    conv(make_tree(tmp_path / "src", per_class=8), tmp_path / "c", fmt, storage_order="source")
    bad = (
        sorted((tmp_path / "c" / "shards").iterdir())[2]
        if fmt == "npz"
        else tmp_path / "c" / "images" / "c" / "2" / "0" / "0" / "0"
    )
    bad.write_bytes(b"garbage" * 10)
    loader = torch.utils.data.DataLoader(
        CachedDataset(tmp_path / "c", check_source=False),
        batch_size=16,
        num_workers=2,
        multiprocessing_context="fork",
    )
    with pytest.raises(SampleReadError) as e:
        list(loader)
    msg = str(e.value)
    release_loader(e)
    assert "DataLoader worker process" in msg and str(bad) in msg and "index 8 " in msg


def test_c13_symlink_loops_and_outside_links(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=2)
    outside = make_tree(tmp_path / "outside", per_class=1, classes=("o",))
    (src / "a" / "loop").symlink_to(src / "a")  # a folder loop
    (src / "a" / "up").symlink_to(src)  # reaches the root again
    (src / "a" / "sib").symlink_to(src / "b")  # another class folder: not copied into class a
    (src / "b" / "out").symlink_to(outside / "o")  # a folder outside the root: followed (documented)
    (src / "b" / "self.jpg").symlink_to(src / "b" / "self.jpg")  # a file link loop
    (src / "b" / "dangling.png").symlink_to(tmp_path / "missing.png")
    found = scan_folder(src)
    assert "b/out/img000.jpg" in found.names and len(found.names) == 5
    errors = dict(found.scan_errors)
    assert "b/self.jpg" in errors and "b/dangling.png" in errors


def test_c13_fifo_is_reported_not_read(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=2)
    os.mkfifo(src / "a" / "pipe.jpg")
    found = scan_folder(src)
    assert dict(found.scan_errors)["a/pipe.jpg"].startswith("not a regular file")
    result = conv(src, tmp_path / "c")
    assert "could not be listed" in result.warnings[0]
    assert {
        "index": None,
        "path": "a/pipe.jpg",
        "reason": "not a regular file (FIFO, device or socket)",
    } in json.loads((tmp_path / "c" / "skipped.json").read_text())


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_c14_unreadable_files_and_folders_are_reported(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=3)
    (src / "a" / "img000.jpg").chmod(0)
    sub = src / "b" / "locked"
    sub.mkdir()
    (sub / "x.jpg").write_bytes(JPEG)
    sub.chmod(0)
    try:
        result = conv(src, tmp_path / "c")
        assert [s["path"] for s in result.skipped] == ["a/img000.jpg"]
        assert any("locked" in w for w in result.warnings)
    finally:
        sub.chmod(0o755)


def test_c15_odd_filenames_round_trip(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=1)
    names = [os.fsdecode(b"bad\xff\xfename.png"), "new\nline.png", "l" * 250 + ".png", "ünï cødé.png"]
    for n in names:
        (src / "a" / n).write_bytes(PNG)
    result = conv(src, tmp_path / "c")
    assert result.n == 6 and result.n_skipped == 0
    recorded = set(read_record(tmp_path / "c").names)
    assert {f"a/{n}" for n in names} <= recorded
    assert all((src / r).is_file() for r in recorded)  # the names map back to the very files
    assert verify(tmp_path / "c", deep=True).ok and stale_message(tmp_path / "c") == ""


def test_c16_empty_class_folder_and_sorted_classes(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=2, classes=("zeta", "Alpha", "mid"))
    (src / "empty").mkdir()
    (src / "empty" / "notes.txt").write_text("no images")
    with pytest.raises(SourceError, match="without any image file: empty"):
        conv(src, tmp_path / "c")
    (src / "empty" / "notes.txt").unlink()
    (src / "empty").rmdir()
    conv(src, tmp_path / "c")
    assert read_spec(tmp_path / "c").classes == ("Alpha", "mid", "zeta")
    labels = {n.split("/")[0]: int(lab) for n, _, _, lab in read_record(tmp_path / "c").rows()}
    assert labels == {"Alpha": 0, "mid": 1, "zeta": 2}


def test_c17_all_bad_aborts_and_nothing_is_complete(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(6):
        write(src / "a" / f"{i}.jpg", b"not a jpeg")
    with pytest.raises(ConvertError) as e:
        conv(src, tmp_path / "c", max_bad=1.0)
    assert "6 of 6 images could not be decoded" in str(e.value) and "nothing was marked complete" in str(
        e.value
    )
    with pytest.raises(CacheNotFoundError):
        open_cache(tmp_path / "c")


def test_c17_max_bad_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_units(monkeypatch, 2)
    src = make_tree(tmp_path / "src", per_class=10)  # 20 images
    for i in range(4):
        write(src / "a" / f"img00{i}.jpg", b"broken")  # 4 of 20 bad = 0.2
    assert conv(src, tmp_path / "ok", max_bad=0.2).n_skipped == 4  # at the threshold: kept
    with pytest.raises(
        ConvertError, match=r"more than --max-bad 0.1 .*stopped early|stopped early.*--max-bad 0.1"
    ):
        conv(src, tmp_path / "no", max_bad=0.1)
    with pytest.raises(CacheNotFoundError):
        open_cache(tmp_path / "no")
    res = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "cli"), "--size", "8", "--max-bad", "0"]
    )
    assert res.exit_code == 1 and "--max-bad 0" in res.output
