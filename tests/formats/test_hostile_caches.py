"""E5, E6: a hostile cache costs nothing (issue 20 item 6). Hand-made hostile caches: a real cache
converted, then tampered with as an attacker would (recomputing the manifest's checksums where that
helps them). Opening, reading and verifying each must end in a dlstore error naming the file: never
a symlink followed, a FIFO blocked on, a raw MemoryError/ValueError, or a peak RSS beyond twice the
cache's real size plus 100 MB."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from reliability_helpers import make_tree

from dlstore.checksums import checksum_tree
from dlstore.cli import main
from dlstore.errors import DlstoreError, SpecError
from dlstore.formats.codecs import JpegCodec, PayloadError
from dlstore.read.cache import Remote, open_cache
from dlstore.spec import MANIFEST, manifest_digest
from dlstore.write.conversion import convert
from dlstore.write.verification import verify


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=4)


def cache(src: Path, dest: Path, fmt: str = "npz", **kw: object) -> Path:
    convert(src, dest, format=fmt, size=8, workers=1, **kw)  # type: ignore[arg-type]
    return dest


def manifest(dest: Path) -> dict:
    return json.loads((dest / MANIFEST).read_text())


def write_manifest(dest: Path, doc: dict, rehash: bool = True) -> None:
    """The attacker's manifest; with ``rehash`` its checksums match the tampered bytes."""
    if rehash:
        doc["checksums"] = checksum_tree(dest, (MANIFEST,))
        doc["digest"] = manifest_digest(doc)
    (dest / MANIFEST).write_text(json.dumps(doc))


def refused(dest: Path, match: str) -> None:
    """Open + read all is refused with a dlstore error (never a raw MemoryError/ValueError)."""
    with pytest.raises(DlstoreError, match=match):
        c = open_cache(dest, check_source=False)
        c.read_images(np.arange(len(c)))


def shard(dest: Path) -> Path:
    return next((dest / "shards").iterdir())


# --- E6: what a cache file may be ---------------------------------------------------------------------


def test_a_symlink_to_outside_is_refused_at_open_and_by_verify(src: Path, tmp_path: Path) -> None:
    dest = cache(src, tmp_path / "c")
    outside = tmp_path / "secret.npz"
    shard(dest).rename(outside)  # identical bytes: verify used to say "ok"
    os.symlink(outside, dest / "shards" / "shard-000000.npz")
    refused(dest, "symlink inside the cache")
    result = verify(dest)
    assert not result.ok and "symlink" in result.first_problem


def test_a_symlinked_folder_is_refused(src: Path, tmp_path: Path) -> None:
    dest = cache(src, tmp_path / "c")
    (dest / "shards").rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", dest / "shards")
    refused(dest, "symlink inside the cache")
    assert "symlink" in verify(dest).first_problem


def test_a_symlinked_labels_file_is_never_followed(src: Path, tmp_path: Path) -> None:
    dest = cache(src, tmp_path / "c", fmt="ram")
    (dest / "labels.npy").rename(tmp_path / "labels.npy")
    os.symlink(tmp_path / "labels.npy", dest / "labels.npy")
    refused(dest, "symlink")


@pytest.mark.parametrize("fmt", ["npz", "ram"])
def test_a_fifo_is_refused_without_blocking(src: Path, tmp_path: Path, fmt: str) -> None:
    dest = cache(src, tmp_path / "c", fmt=fmt)
    victim = shard(dest) if fmt == "npz" else dest / "images.npy"
    victim.unlink()
    os.mkfifo(victim)
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            refused(dest, "FIFO")
            assert "FIFO" in verify(dest).first_problem
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        with open(victim, "wb"):  # unblock the reader that hung on the FIFO
            pass
        pytest.fail("opening a cache with a FIFO in it blocked")
    assert outcome == [None], outcome


# --- E5: checksum keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["images.npy@-5+10", "images.npy@abc+10", "images.npy@0+99999999999999999999", "images.npy@0+0"]
)
def test_bad_checksum_keys_are_a_clear_error_in_verify(src: Path, tmp_path: Path, key: str) -> None:
    dest = cache(src, tmp_path / "c", fmt="ram")
    doc = manifest(dest)
    doc["checksums"][key] = "0" * 64
    write_manifest(dest, doc, rehash=False)
    with pytest.raises(SpecError, match="checksum key|byte range|ranges"):
        verify(dest)
    res = CliRunner().invoke(main, ["verify", str(dest)])
    assert res.exit_code == 1 and "Traceback" not in res.output and "rebuild" in res.output


def test_bytes_appended_to_a_small_file_fail_verify_and_open(src: Path, tmp_path: Path) -> None:
    """E6: a small file's checksum key declares its size too (``name@0+size``), so bytes appended are
    refused at open by one size comparison (no read), and by ``verify``."""
    dest = cache(src, tmp_path / "c")
    with open(shard(dest), "ab") as f:
        f.write(b"\0" * 4096)
    result = verify(dest)
    assert not result.ok and str(shard(dest)) in result.first_problem
    refused(dest, "appended")


def test_a_large_file_with_a_forged_tail_fails_verify(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The > 64 MB case, scaled: files checksummed by byte ranges (RANGE_BYTES) and bytes added after
    the last range, which the checksums of the ranges alone did not see."""
    import dlstore.checksums as checksums

    monkeypatch.setattr(checksums, "RANGE_BYTES", 512)
    dest = cache(src, tmp_path / "c", fmt="ram")
    assert any("@" in k for k in manifest(dest)["checksums"])
    with open(dest / "images.npy", "ab") as f:
        f.write(b"forged index" * 10)
    assert "appended" in verify(dest).first_problem
    refused(dest, "appended")


# --- E5: declared numbers against the bytes present ---------------------------------------------------


def test_a_zarr_cache_declaring_65536_squared_images_is_refused_before_allocating(
    src: Path, tmp_path: Path
) -> None:
    dest = cache(src, tmp_path / "c", fmt="zarr")
    doc = manifest(dest)
    doc["shape"] = [65536, 65536, 3]
    doc["image"]["size"] = 65536
    meta_path = dest / "images" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][1:] = [65536, 65536, 3]
    meta["chunk_grid"]["configuration"]["chunk_shape"][1:] = [65536, 65536, 3]
    meta_path.write_text(json.dumps(meta))
    write_manifest(dest, doc)
    refused(dest, "is declared to decode to .* MB, but the whole cache holds")


def zstd_frame_of_zeros(nbytes: int) -> bytes:
    """A valid zstd frame of ``nbytes`` zeros as an attacker writes it: run-length blocks of 128 KB,
    4 bytes each (1.5 GB in 46 KB), the content size declared in the frame header."""
    block = 1 << 17
    out = [b"\x28\xb5\x2f\xfd", bytes([0xE0]), nbytes.to_bytes(8, "little")]  # single segment, 8-byte size
    full, rest = divmod(nbytes, block)
    sizes = [block] * full + ([rest] if rest else [])
    for i, size in enumerate(sizes):
        header = int(i == len(sizes) - 1) | (1 << 1) | (size << 3)  # last flag, RLE block, its size
        out.append(header.to_bytes(3, "little") + b"\0")
    return b"".join(out)


def deflated_zip_of_zeros(path: Path, member: str, head: bytes, zeros: int) -> None:
    """A zip (what np.load reads) whose one deflated member is ``head`` then ``zeros`` zero bytes: 1.4 GB
    in ~1.4 MB, written block by block (a full flush makes every 1 MB block of zeros the same bytes)."""
    import struct
    import zlib

    mb = 1 << 20
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)]
    block = c.compress(bytes(mb)) + c.flush(zlib.Z_FULL_FLUSH)
    full, rest = divmod(zeros, mb)
    parts += [block] * full + [c.compress(bytes(rest)) + c.flush(zlib.Z_FINISH)]
    crc = zlib.crc32(head)
    zero_mb = bytes(mb)
    for _ in range(full):
        crc = zlib.crc32(zero_mb, crc)
    crc = zlib.crc32(bytes(rest), crc)
    data, name, usize = b"".join(parts), member.encode(), len(head) + zeros
    local = struct.pack(
        "<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, 8, 0, 0x21, crc, len(data), usize, len(name), 0
    )
    central = struct.pack(
        "<4s4B4HL2L5H2L",
        b"PK\x01\x02",
        20,
        3,
        20,
        0,
        0,
        8,
        0,
        0x21,
        crc,
        len(data),
        usize,
        len(name),
        0,
        0,
        0,
        0,
        0,
        0,
    )
    offset = len(local) + len(name) + len(data)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(name), offset, 0)
    path.write_bytes(local + name + data + central + name + end)


def test_a_44_kb_zstd_chunk_declaring_1_5_gb_is_refused_before_allocating(src: Path, tmp_path: Path) -> None:
    """Manifest, zarr.json and the chunk's zstd frame agree on 8 images of 7900x7900: 1.5 GB decoded from
    a 46 KB file. Only the bound on what a unit may decode to (twice the cache's bytes + 64 MB) stops it."""
    dest = cache(src, tmp_path / "c", fmt="zarr")
    side, n = 7900, manifest(dest)["n_stored"]
    doc = manifest(dest)
    doc["shape"], doc["image"]["size"] = [side, side, 3], side
    meta_path = dest / "images" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = meta["chunk_grid"]["configuration"]["chunk_shape"] = [n, side, side, 3]
    meta_path.write_text(json.dumps(meta))
    chunk = dest / "images" / "c" / "0" / "0" / "0" / "0"
    chunk.write_bytes(zstd_frame_of_zeros(n * side * side * 3))
    assert chunk.stat().st_size < 50_000
    write_manifest(dest, doc)
    refused(
        dest, rf"{chunk}: a unit of {n} images .* declared to decode to {n * side * side * 3 / 1e6:.1f} MB"
    )
    from numcodecs import Zstd

    small = (1 << 17) * 3 + 5  # the same construction decodes to zeros: a real zstd frame
    assert np.frombuffer(Zstd().decode(zstd_frame_of_zeros(small)), np.uint8).tolist() == [0] * small


def test_a_1_4_mb_deflated_shard_declaring_1_4_gb_is_refused_before_allocating(
    src: Path, tmp_path: Path
) -> None:
    """Manifest and the shard's .npy header agree on 8 images of 7600x7600: 1.4 GB from 1.4 MB."""
    dest = cache(src, tmp_path / "c", codec="deflate")
    side, n = 7600, manifest(dest)["n_stored"]
    doc = manifest(dest)
    doc["shape"], doc["image"]["size"], doc["format_options"]["unit_size"] = [side, side, 3], side, n
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": (n, side, side, 3)}
    )
    deflated_zip_of_zeros(shard(dest), "images.npy", header.getvalue(), n * side * side * 3)
    with zipfile.ZipFile(shard(dest)) as zf:  # a well-formed zip: what np.load would inflate
        assert zf.getinfo("images.npy").file_size > 1.3e9 and shard(dest).stat().st_size < 2e6
        with zf.open("images.npy") as f:
            assert f.read(len(header.getvalue()) + (1 << 20)) == header.getvalue() + bytes(1 << 20)
    write_manifest(dest, doc)
    refused(
        dest,
        rf"{shard(dest)}: a unit of {n} images .* declared to decode to {n * side * side * 3 / 1e6:.1f} MB",
    )


BOMB = 1_500_000_000


def test_a_44_kb_zstd_payload_chunk_declaring_1_5_gb_is_refused(src: Path, tmp_path: Path) -> None:
    """E5: a variable-size (payload) zarr cache whose first chunk is a valid 44 KB zstd frame of 1.5 GB.
    Its index declares a few 8-pixel images: the decompression is bounded by those, and refused past."""
    dest = cache(src, tmp_path / "c", fmt="zarr", resize="shorter")
    chunk = dest / "images" / "c" / "0"
    chunk.write_bytes(zstd_frame_of_zeros(BOMB))
    assert chunk.stat().st_size < 50_000
    write_manifest(dest, manifest(dest))
    refused(dest, rf"{chunk}: chunk 0 does not decode \(declares 1500000000 decoded bytes, its index allows")


def test_a_1_4_mb_deflated_payload_shard_declaring_1_5_gb_is_refused(src: Path, tmp_path: Path) -> None:
    """E5: a deflated payload shard whose ``data`` member (1.4 MB) inflates to 1.5 GB, its .npy header
    saying so; the index members are the real ones. Refused from the header, nothing inflated."""
    dest = cache(src, tmp_path / "c", codec="deflate", resize="shorter")
    path = shard(dest)
    with np.load(path) as z:
        index = {k: z[k] for k in z.files if k != "data"}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (BOMB,)})
    deflated_zip_of_zeros(path, "data.npy", header.getvalue(), BOMB)
    with zipfile.ZipFile(path, "a") as zf:
        for k, arr in index.items():
            buf = io.BytesIO()
            np.save(buf, arr)
            zf.writestr(f"{k}.npy", buf.getvalue())
    assert path.stat().st_size < 2e6
    write_manifest(dest, manifest(dest))
    refused(dest, rf"{path}: shard 0 unreadable .*data.npy declares uint8\(1500000000,\)")


def test_a_payload_shard_whose_data_inflates_past_its_header_is_refused(src: Path, tmp_path: Path) -> None:
    """E5: the header tells the truth for the index, the stream goes on: never read past what it says."""
    dest = cache(src, tmp_path / "c", codec="deflate", resize="shorter")
    path = shard(dest)
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    header = io.BytesIO()
    data = members.pop("data")
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": data.shape}
    )
    deflated_zip_of_zeros(path, "data.npy", header.getvalue(), BOMB // 8)
    with zipfile.ZipFile(path, "a") as zf:
        for k, arr in members.items():
            buf = io.BytesIO()
            np.save(buf, arr)
            zf.writestr(f"{k}.npy", buf.getvalue())
    write_manifest(dest, manifest(dest))
    refused(dest, "more data than its header declares")


def test_a_deflated_shard_declaring_a_huge_array_is_refused(src: Path, tmp_path: Path) -> None:
    """The header inside the zip says 1.4 GB; nothing of that size is allocated."""
    dest = cache(src, tmp_path / "c", codec="deflate")
    path = shard(dest)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": (24, 8, 8, 3 * 100000)}
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("images.npy", header.getvalue() + b"\0" * (1 << 20))
    write_manifest(dest, manifest(dest))
    refused(dest, "declares uint8")


def payload_shard(dest: Path, **members: np.ndarray) -> None:
    path = shard(dest)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(members)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())
    write_manifest(dest, manifest(dest))


def test_a_jpeg_payload_said_to_be_20000_squared_is_refused(src: Path, tmp_path: Path) -> None:
    dest = cache(src, tmp_path / "c", codec="jpeg", resize="shorter")
    with np.load(shard(dest)) as z:
        shapes = z["shapes"].copy()
    shapes[0] = (20000, 20000, 3)  # from a few hundred bytes of JPEG
    payload_shard(dest, shapes=shapes)
    refused(dest, "beyond the policy")


def test_a_forged_manifest_and_index_of_20000_squared_jpegs_is_refused(src: Path, tmp_path: Path) -> None:
    """Manifest and index agree on 20000x20000, but a payload of a few hundred bytes cannot hold it."""
    dest = cache(src, tmp_path / "c", codec="jpeg")
    with np.load(shard(dest)) as z:
        shapes = z["shapes"].copy()
    shapes[:] = (20000, 20000, 3)
    doc = manifest(dest)
    doc["shape"], doc["image"]["size"] = [20000, 20000, 3], 20000
    payload_shard(dest, shapes=shapes)
    write_manifest(dest, doc)
    refused(
        dest, r"1200.0 MB. from \d+ bytes of payload, beyond the .* MB one image of this cache may decode to"
    )


@pytest.mark.parametrize("what", ["nan", "negative", "float"])
def test_nan_or_negative_payload_offsets_are_a_dlstore_error(src: Path, tmp_path: Path, what: str) -> None:
    dest = cache(src, tmp_path / "c", codec="jpeg")
    with np.load(shard(dest)) as z:
        offsets = z["offsets"].copy()
    if what == "negative":
        offsets[3] = -1000
        payload_shard(dest, offsets=offsets)
    else:
        bad = offsets.astype(np.float64)
        bad[3] = np.nan if what == "nan" else 0.5
        payload_shard(dest, offsets=bad)
    refused(dest, "index is inconsistent")


def test_negative_payload_shapes_are_a_dlstore_error(src: Path, tmp_path: Path) -> None:
    dest = cache(src, tmp_path / "c", codec="jpeg")
    with np.load(shard(dest)) as z:
        shapes = z["shapes"].copy()
    shapes[2] = (-8, 8, 3)
    payload_shard(dest, shapes=shapes)
    refused(dest, "index is inconsistent")


def test_pillows_decompression_bomb_error_becomes_a_dlstore_error(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buf, format="JPEG")
    monkeypatch.setenv("DLSTORE_JPEG_DECODER", "pillow")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64x64 is then more than twice the limit
    with pytest.raises(PayloadError, match="DecompressionBombError"):
        JpegCodec(90).decode(buf.getvalue(), (64, 64, 3))


# --- the memory bound -----------------------------------------------------------------------------

RSS_PROBE = """
import json, sys
import numpy as np
from dlstore.errors import DlstoreError
from dlstore.read.cache import Remote, open_cache

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

out = {}
for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from what is resident now
        f.write("5")
    base = status("VmRSS")
    try:
        c = open_cache(path, check_source=False)
        c.read_images(np.arange(len(c)))
        result = "read"
    except DlstoreError as e:
        result = type(e).__name__
    out[path] = {"result": result, "grown": status("VmHWM") - base, "peak": status("VmHWM")}
print(json.dumps(out))
"""


def test_hostile_caches_stay_within_twice_their_size_plus_100_mb(src: Path, tmp_path: Path) -> None:
    """E5: each hostile cache (the payload bombs of zstd and deflate included), read in a fresh process
    after its imports, raises the peak RSS (VmHWM, reset per cache) by at most twice the cache's real
    size plus 100 MB, and the child's own peak RSS, imports included, stays within that too."""
    hostile = {
        "zstd_1_5_gb": test_a_44_kb_zstd_chunk_declaring_1_5_gb_is_refused_before_allocating,
        "deflate_1_4_gb": test_a_1_4_mb_deflated_shard_declaring_1_4_gb_is_refused_before_allocating,
        "jpeg_20000": test_a_forged_manifest_and_index_of_20000_squared_jpegs_is_refused,
        "zarr_65536": test_a_zarr_cache_declaring_65536_squared_images_is_refused_before_allocating,
        "payload_zstd_1_5_gb": test_a_44_kb_zstd_payload_chunk_declaring_1_5_gb_is_refused,
        "payload_deflate_1_5_gb": test_a_1_4_mb_deflated_payload_shard_declaring_1_5_gb_is_refused,
        "payload_deflate_overrun": test_a_payload_shard_whose_data_inflates_past_its_header_is_refused,
    }
    for name, make in hostile.items():
        make(src, tmp_path / name)
    caches = {str(tmp_path / name / "c"): tmp_path / name / "c" for name in hostile}
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, *caches], capture_output=True, text=True, check=True, timeout=300
    )
    doc = json.loads(probe.stdout)
    sizes = {
        path: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        for path, folder in caches.items()
    }
    for path, size in sizes.items():
        assert doc[path]["result"] in ("CacheCorruptError", "SampleReadError"), (path, doc[path])
        assert doc[path]["grown"] <= 2 * size + (100 << 20), (path, doc[path], size)
    # The child's whole peak, imports included. (Not its ru_maxrss: Linux carries the high-water mark of
    # the forking pytest process across exec into the child's.)
    for path, size in sizes.items():
        assert doc[path]["peak"] <= 2 * size + (100 << 20), (path, doc[path], size)


def test_the_decoded_unit_cache_is_bounded_by_the_cache_s_real_size(src: Path, tmp_path: Path) -> None:
    """E5: a reader keeps at most twice the cache's bytes on disk (+ 64 MB) of decoded units, not
    512 MB whatever the cache: a small, highly compressed cache cannot grow a reader by its expansion."""
    from dlstore.formats.base import UNIT_CACHE_OVER_SIZE

    dest = cache(src, tmp_path / "c", codec="deflate")
    on_disk = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file() and p.name != MANIFEST)
    c = open_cache(dest, check_source=False)
    try:
        unit_bytes = int(c.spec.format_options["unit_size"]) * c.spec.image_bytes
        kept = c.reader.max_units * unit_bytes
        assert kept <= max(2 * unit_bytes, 2 * on_disk + UNIT_CACHE_OVER_SIZE) < 512 << 20
    finally:
        c.close()


# --- the same, remotely (moto) --------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from s3server import aws_env, start_server

    from dlstore.storage.stores import RemoteStore

    server = start_server()
    for name, value in aws_env(server).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DLSTORE_SPOOL", str(tmp_path / "spool"))
    try:
        RemoteStore("s3://hostile").fs.mkdir("hostile")
    except FileExistsError:  # moto's in-process backend outlives a server of an earlier test
        pass
    yield RemoteStore
    server.stop()


def upload(store_cls, local: Path, url: str) -> None:  # type: ignore[no-untyped-def]
    store = store_cls(url)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            store.put_file(p, p.relative_to(local).as_posix())


def files_under(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*")} if folder.exists() else set()


@pytest.mark.s3
def test_a_remote_zarr_with_a_disallowed_codec_leaves_nothing_outside_the_chunk_cache(
    s3,
    src: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    import tempfile

    local = cache(src, tmp_path / "c", fmt="zarr")
    meta_path = local / "images" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"].append({"name": "pickle", "configuration": {}})
    meta_path.write_text(json.dumps(meta))
    write_manifest(local, manifest(local))
    upload(s3, local, "s3://hostile/zarr")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    outside = [work, tmp_path / "tmp", tmp_path / "spool", Path.home() / ".cache" / "dlstore"]
    before = [files_under(f) for f in outside]
    with pytest.raises(DlstoreError, match="codec"):
        open_cache("s3://hostile/zarr", remote=Remote(cache_dir=tmp_path / "chunks"))
    after = [files_under(f) for f in outside]
    assert [a - b for a, b in zip(after, before)] == [set()] * len(outside)


@pytest.mark.s3
def test_a_remote_cache_declaring_65536_squared_images_is_refused_at_open(
    s3,
    src: Path,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """E5 remotely: the declared pixels are checked at open against the bytes the manifest's checksums
    declare (each object is checked against its size when fetched), before any unit is fetched."""
    test_a_zarr_cache_declaring_65536_squared_images_is_refused_before_allocating(src, tmp_path / "z")
    upload(s3, tmp_path / "z" / "c", "s3://hostile/huge")
    chunks = tmp_path / "chunks"
    with pytest.raises(DlstoreError, match="is declared to decode to .* MB, but the whole cache holds"):
        open_cache("s3://hostile/huge", check_source=False, remote=Remote(cache_dir=chunks))
    assert not any("images/c" in p for p in files_under(chunks))  # no chunk was fetched


@pytest.mark.s3
def test_a_remote_file_with_a_forged_tail_fails_read_and_verify(
    s3,
    src: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    import dlstore.checksums as checksums

    monkeypatch.setattr(checksums, "RANGE_BYTES", 512)
    local = cache(src, tmp_path / "c", fmt="ram")
    with open(local / "images.npy", "ab") as f:
        f.write(b"forged index" * 10)
    upload(s3, local, "s3://hostile/tail")
    result = verify("s3://hostile/tail")
    assert not result.ok and "appended" in result.first_problem
    with pytest.raises(DlstoreError, match="checksums cover only"):
        c = open_cache("s3://hostile/tail", remote=Remote(cache_dir=tmp_path / "chunks"))
        c.read(np.arange(len(c)))


# --- and real caches that compress very well still read --------------------------------------------


class Flat:
    """A map-style Dataset of real, very compressible images: flat black RGB frames, or MNIST-like
    grey digits (a few bright strokes on black)."""

    def __init__(self, n: int, side: int, digits: bool = False) -> None:
        rng = np.random.default_rng(3)
        self.images = np.zeros((n, side, side, 1 if digits else 3), np.uint8)
        if digits:
            for i in range(n):
                r, c = rng.integers(4, side - 8, 2)
                self.images[i, r : r + 12, c : c + 3] = 255
                self.images[i, r : r + 2, c : c + 8] = 200
        self.targets = [i % 10 for i in range(n)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        img = self.images[i]
        return (img[..., 0] if img.shape[-1] == 1 else img), self.targets[i]


@pytest.mark.parametrize(
    "fmt, codec, data",
    [
        ("npz", "deflate", Flat(300, 192)),  # 33 MB of pixels in ~0.1 MB: a unit of 32 MB, ~1000x
        ("zarr", "zstd", Flat(200, 64)),  # all-black chunks equal zarr's fill value: still written
        ("zarr", "zstd", Flat(600, 28, digits=True)),  # MNIST-like
    ],
    ids=["black-npz-deflate", "black-zarr-zstd", "digits-zarr"],
)
def test_very_compressible_real_caches_still_read(tmp_path: Path, fmt: str, codec: str, data: Flat) -> None:
    side, channels = data.images.shape[1], data.images.shape[3]
    dest = tmp_path / "c"
    convert(data, dest, format=fmt, codec=codec, size=side, channels=channels, workers=1)
    held = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    assert data.images.nbytes > 50 * held or channels == 1, (data.images.nbytes, held)
    c = open_cache(dest, check_source=False)
    try:
        got = c.read(np.arange(len(c)))
        assert np.array_equal(got, data.images) and c.labels.tolist() == data.targets
    finally:
        c.close()
