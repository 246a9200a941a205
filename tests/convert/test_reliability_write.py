"""RELIABILITY.md section A: writing is atomic, resumable and never half-done.

Real ``kill -9`` at random moments is in benchmarks/kill_resume.py (and the slow test at the end);
here failures are injected in-process at each stage, which is fast and deterministic.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reliability_helpers import FORMAT_NAMES, assert_same_cache, make_tree, read_all, small_units

import dlstore.write.conversion_plan as plan
import dlstore.write.finish as finish
import dlstore.write.staging as staging_mod
from dlstore.errors import CacheNotFoundError, ConvertError, DlstoreError, SampleReadError
from dlstore.formats import FORMATS
from dlstore.read.cache import open_cache
from dlstore.spec import MANIFEST, read_spec
from dlstore.write.conversion import convert
from dlstore.write.verification import verify

REPO = Path(__file__).resolve().parents[2]


class Boom(Exception):
    pass


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("src"), per_class=12)


@pytest.fixture(autouse=True)
def _small_units(monkeypatch: pytest.MonkeyPatch) -> None:
    small_units(monkeypatch, 5)


def conv(tree: Path, dest: Path, fmt: str = "npz", **kw: object) -> finish.ConvertResult:
    kw.setdefault("size", 8)
    kw.setdefault("workers", 1)
    return convert(tree, dest, format=fmt, **kw)  # type: ignore[arg-type]


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.dlstore"))


def fail_unit(monkeypatch: pytest.MonkeyPatch, fmt: str, k_fail: int, exc: BaseException) -> list[int]:
    """Make write_unit raise ``exc`` at unit k_fail; returns the list of units written."""
    written: list[int] = []
    cls = FORMATS[fmt].writer
    real = cls.write_unit

    def write_unit(self, k: int, images: np.ndarray) -> None:  # type: ignore[no-untyped-def]
        if k == k_fail:
            raise exc
        written.append(k)
        real(self, k, images)

    monkeypatch.setattr(cls, "write_unit", write_unit)
    return written


# --- A1/A3: a failure at any stage leaves nothing that opens; the re-run completes ----------------

STAGES = ["create", "unit", "finish", "manifest", "exchange", "cleanup"]


def inject(monkeypatch: pytest.MonkeyPatch, fmt: str, stage: str) -> None:
    if stage == "create":
        monkeypatch.setattr(FORMATS[fmt].writer, "create", lambda self: (_ for _ in ()).throw(Boom()))
    elif stage == "unit":
        fail_unit(monkeypatch, fmt, 2, Boom())
    elif stage == "finish":
        monkeypatch.setattr(FORMATS[fmt].writer, "finish", lambda self, labels: (_ for _ in ()).throw(Boom()))
    elif stage == "manifest":
        real = finish.write_json_durably

        def write(path: Path, text: str) -> None:
            if path.name == MANIFEST:
                path.with_name(MANIFEST + ".tmp1").write_text(text[: len(text) // 2])  # half-written temp
                raise Boom()
            real(path, text)

        monkeypatch.setattr(finish, "write_json_durably", write)
    elif stage == "exchange":
        monkeypatch.setattr(staging_mod.os, "rename", lambda a, b: (_ for _ in ()).throw(Boom()))
        monkeypatch.setattr(staging_mod, "_exchange", lambda a, b: (_ for _ in ()).throw(Boom()))
    elif stage == "cleanup":
        monkeypatch.setattr(staging_mod.Staging, "_clean_up", lambda self: (_ for _ in ()).throw(Boom()))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_failure_at_each_stage_leaves_old_or_nothing_and_rerun_completes(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, stage: str
) -> None:
    ref = tmp_path / "ref"
    conv(tree, ref, fmt)
    dest = tmp_path / "c"
    with monkeypatch.context() as m:
        inject(m, fmt, stage)
        with pytest.raises(Boom):
            conv(tree, dest, fmt)
    if stage == "cleanup":  # published, then killed before tidying up: complete and correct
        assert_same_cache(dest, ref)
    else:
        with pytest.raises(CacheNotFoundError):
            open_cache(dest)
        assert not (dest.parent / f".{dest.name}.dlstore-staging" / MANIFEST).exists() or stage == "exchange"
    result = conv(tree, dest, fmt)  # the same command again
    assert_same_cache(dest, ref)
    assert verify(dest).ok and leftovers(dest) == []
    if stage == "unit":
        assert result.resumed_units == 2


# --- A2: Ctrl-C -----------------------------------------------------------------------------------

SLOW_CLI = """
import signal, sys, time
# A terminal's Ctrl-C: a runner that starts the suite in the background hands its children SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler (that made this test fail on CI).
signal.signal(signal.SIGINT, signal.default_int_handler)
import dlstore.write.imageops as io_
real = io_.decode_file
def slow(path, policy, data=None):
    time.sleep(0.25)  # slow enough that Ctrl-C lands mid-run even on a loaded 2-core machine
    return real(path, policy, data)
io_.decode_file = slow
import dlstore.write.sources.encoded as s; s.decode_file = slow
from dlstore.cli import main
sys.exit(main())
"""


def group_alive(pgid: int) -> list[int]:
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(d.name))
    return alive


def unowned(names: set[str]) -> set[str]:
    """/dev/shm entries no live process maps (others' concurrent runs may create their own)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {
                line.rsplit("/dev/shm/", 1)[1].split(" ")[0]
                for line in maps.read_text().splitlines()
                if "/dev/shm/" in line
            }
        except (OSError, IndexError):
            continue
    return {n for n in names if n not in mapped and (Path("/dev/shm") / n).exists()}


def test_ctrl_c_with_workers_exits_fast_and_resumes(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=60, side=16)
    dest = tmp_path / "c"
    cmd = [
        sys.executable,
        "-c",
        SLOW_CLI,
        "convert",
        str(src),
        str(dest),
        "--format",
        "zarr",
        "--size",
        "256",
        "--workers",
        "2",
    ]
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    done = dest.parent / f".{dest.name}.dlstore-journal" / "done.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (done.exists() and done.read_text().count("\n") >= 2):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    # A hang guard, not a speed claim: a converter that ignores Ctrl-C fails here instead of stalling CI.
    _, err = proc.communicate(timeout=30)
    assert proc.returncode not in (0, None)
    assert "interrupted:" in err and "re-run the same command to resume" in err, err
    k, n = [int(x.replace(",", "")) for x in err.split("interrupted: ")[1].split(" done")[0].split(" of ")]
    assert 0 < k <= n == 120  # k = n only if the machine was too loaded to interrupt earlier
    time.sleep(0.2)
    assert group_alive(proc.pid) == []
    assert unowned(set(os.listdir("/dev/shm")) - shm_before) == set()
    with pytest.raises(CacheNotFoundError):
        open_cache(dest)
    res = subprocess.run(
        [str(Path(sys.executable).with_name("dlstore")), *cmd[3:], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["resumed_units"] >= 2


# --- A4: rebuilding over an existing cache ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_failed_rebuild_keeps_the_old_cache(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    dest = tmp_path / "c"
    conv(tree, dest, fmt, size=8)
    before = read_all(dest)
    with monkeypatch.context() as m:
        fail_unit(m, fmt, 3, Boom())
        with pytest.raises(Boom):
            conv(tree, dest, fmt, size=12, overwrite=True)
    assert verify(dest).ok
    after = read_all(dest)
    assert np.array_equal(before[0], after[0]) and read_spec(dest).shape == (8, 8, 3)
    conv(tree, dest, fmt, size=12, overwrite=True)  # resumes the rebuild, then swaps
    assert read_spec(dest).shape == (12, 12, 3) and verify(dest).ok


# --- A5: disk full ----------------------------------------------------------------------------------


def test_disk_full_in_a_unit_names_space_and_stays_resumable(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "c"
    with monkeypatch.context() as m:
        fail_unit(m, "npz", 3, OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(ConvertError) as e:
            conv(tree, dest, "npz")
    msg = str(e.value)
    assert (
        "disk full" in msg and " is free" in msg and "needs up to" in msg and "re-run the same command" in msg
    )
    assert conv(tree, dest, "npz").resumed_units == 3
    ref = tmp_path / "ref"
    conv(tree, ref, "npz")
    assert_same_cache(dest, ref)


def test_disk_full_writing_the_manifest(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "c"
    real = finish.write_json_durably

    def write(path: Path, text: str) -> None:
        if path.name == MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    with monkeypatch.context() as m:
        m.setattr(finish, "write_json_durably", write)
        with pytest.raises(ConvertError, match="disk full while finishing the cache"):
            conv(tree, dest, "ram")
    assert not dest.exists()
    result = conv(tree, dest, "ram")
    assert result.resumed_units == result.n // 5 + (result.n % 5 > 0) and verify(dest).ok


def test_preflight_warns_before_any_unit(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 1000, 1000))
    real = FORMATS["ram"].writer.write_unit
    monkeypatch.setattr(
        FORMATS["ram"].writer,
        "write_unit",
        lambda self, k, imgs: (events.append("unit"), real(self, k, imgs))[1],
    )
    result = conv(tree, tmp_path / "c", "ram", log=lambda m: events.append("warn: " + m))
    assert events[0].startswith("warn: ") and " is free" in events[0] and "unit" in events[1:]
    assert result.warnings and "needs about" in result.warnings[0]


# --- A6: commit order ------------------------------------------------------------------------------


def test_commit_order_fsync_data_then_manifest_then_rename(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace: list[tuple[str, str]] = []

    def fd_path(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os, name, lambda fd, real=real: (trace.append(("fsync", fd_path(fd))), real(fd))[1]
        )
    for name in ("replace", "rename"):
        real = getattr(os, name)
        monkeypatch.setattr(
            os, name, lambda a, b, real=real, name=name: (trace.append((name, f"{a} -> {b}")), real(a, b))[1]
        )
    dest = tmp_path / "c"
    conv(tree, dest, "npz")
    staging = str(dest.parent / f".{dest.name}.dlstore-staging")
    tmp_fsync = next(i for i, (op, p) in enumerate(trace) if op == "fsync" and "dlstore.json.tmp" in p)
    data_fsyncs = [
        i
        for i, (op, p) in enumerate(trace)
        if op == "fsync" and p.startswith(staging + "/") and ("shards/" in p or p.endswith(".npy"))
    ]
    replace = next(
        i for i, (op, p) in enumerate(trace) if op == "replace" and p.endswith(f"{staging}/{MANIFEST}")
    )
    dir_fsync = next(i for i, (op, p) in enumerate(trace) if i > replace and op == "fsync" and p == staging)
    publish = next(i for i, (op, p) in enumerate(trace) if op == "rename" and p == f"{staging} -> {dest}")
    parent_fsync = next(
        i for i, (op, p) in enumerate(trace) if i > publish and op == "fsync" and p == str(tmp_path)
    )
    assert data_fsyncs and max(data_fsyncs) < tmp_fsync < replace < dir_fsync < publish < parent_fsync


# --- A7: damage after conversion ---------------------------------------------------------------------


def unit_file(dest: Path, fmt: str) -> Path:
    if fmt == "ram":
        return dest / "images.npy"
    if fmt == "npz":
        return sorted((dest / "shards").iterdir())[1]
    return dest / "images" / "c" / "1" / "0" / "0" / "0"


@pytest.mark.parametrize("damage", ["delete", "truncate"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_damaged_unit_is_named_by_verify_and_by_reads(
    tree: Path, tmp_path: Path, fmt: str, damage: str
) -> None:
    dest = tmp_path / "c"
    conv(tree, dest, fmt, storage_order="source")
    f = unit_file(dest, fmt)
    if damage == "delete":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    result = verify(dest)
    assert not result.ok and str(f) in result.first_problem
    with pytest.raises(DlstoreError) as e:  # never zeros
        cache = open_cache(dest, check_source=False)
        cache.read(np.arange(len(cache)))
    assert str(f) in str(e.value)
    if fmt != "ram":
        assert isinstance(e.value, SampleReadError) and "index 5 " in str(e.value)  # unit 1 = indices 5..9


# --- A8: resume redoes only unfinished work, identically --------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_resume_redoes_only_unfinished_units_identically(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    ref = tmp_path / "ref"
    conv(tree, ref, fmt)
    dest = tmp_path / "c"
    with monkeypatch.context() as m:
        fail_unit(m, fmt, 3, Boom())
        with pytest.raises(Boom):
            conv(tree, dest, fmt)
    with monkeypatch.context() as m:
        written = fail_unit(m, fmt, -1, Boom())
        result = conv(tree, dest, fmt)
    n_units = -(-24 // 5)
    assert written == list(range(3, n_units)) and result.resumed_units == 3
    a, b = read_spec(dest).checksums, read_spec(ref).checksums
    assert a == b  # byte-identical files, sources.npz and skipped.json included


# --- A9: resume refused when anything changed -------------------------------------------------------


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"size": 9}, "--size 9 was 8"),
        ({"resize": "pad"}, "--resize pad was crop"),
        ({"codec": "lz4"}, "--codec lz4 was zstd"),
        ({"storage_order": "source"}, "--storage-order source was shuffled"),
    ],
)
def test_resume_refused_when_parameters_changed(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict, expect: str
) -> None:
    dest = tmp_path / "c"
    with monkeypatch.context() as m:
        fail_unit(m, "zarr", 1, Boom())
        with pytest.raises(Boom):
            conv(tree, dest, "zarr")
    with pytest.raises(ConvertError) as e:
        conv(tree, dest, "zarr", **change)
    assert expect in str(e.value) and "--overwrite" in str(e.value)
    conv(tree, dest, "zarr", overwrite=True, **change)  # --overwrite discards the stale staging
    assert open_cache(dest, check_source=False).spec.image.size == change.get("size", 8)


def test_resume_refused_when_sources_or_version_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tree(tmp_path / "src", per_class=8)
    dest = tmp_path / "c"
    with monkeypatch.context() as m:
        fail_unit(m, "ram", 1, Boom())
        with pytest.raises(Boom):
            conv(src, dest, "ram")
    victim = src / "b" / "img003.png"
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(ConvertError) as e:
        conv(src, dest, "ram")
    assert "source files changed" in str(e.value) and "b/img003.png (size/mtime changed" in str(e.value)
    monkeypatch.setattr(plan, "__version__", "99.0.0")
    with pytest.raises(ConvertError, match="dlstore major version 99 was 0"):
        conv(src, dest, "ram")


# --- A10: one converter per destination ---------------------------------------------------------------


def test_second_converter_fails_naming_the_lock_holder(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "c"
    lock = tmp_path / ".c.dlstore-lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
                "print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(ConvertError) as e:
            conv(tree, dest, "ram")
        assert time.monotonic() - t0 < 5
        assert f"pid {holder.pid}" in str(e.value) and str(lock) in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    conv(tree, dest, "ram")  # the holder died: its lock is gone with it


def test_stale_lock_of_a_dead_process_does_not_block(tree: Path, tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / ".c.dlstore-lock").write_text(dead)  # a pid, but no flock held
    conv(tree, tmp_path / "c", "ram")
    assert not (tmp_path / ".c.dlstore-lock").exists()


# --- A11: a reader of the old generation during a rebuild ---------------------------------------------


@pytest.mark.parametrize("in_memory", [False, True])
def test_ram_reader_keeps_reading_the_old_generation(tree: Path, tmp_path: Path, in_memory: bool) -> None:
    dest = tmp_path / "c"
    conv(tree, dest, "ram", size=8)
    reader = open_cache(dest, in_memory=in_memory, check_source=False)
    old = reader.read(np.arange(len(reader)))
    conv(tree, dest, "ram", size=8, resize="pad", overwrite=True)  # new pixels, same shape
    assert not np.array_equal(read_all(dest)[0], old)
    assert np.array_equal(reader.read(np.arange(len(reader))), old)


@pytest.mark.parametrize("fmt", ["npz", "zarr"])
def test_chunked_reader_never_mixes_generations(tree: Path, tmp_path: Path, fmt: str) -> None:
    from dlstore.errors import CacheReplacedError

    dest = tmp_path / "c"
    conv(tree, dest, fmt, size=8)
    reader = open_cache(dest, check_source=False)
    first = reader.read([0])
    conv(tree, dest, fmt, size=8, resize="pad", overwrite=True)
    with pytest.raises(CacheReplacedError, match="rebuilt or removed while open"):
        reader.read(np.arange(len(reader)))
    assert first.shape == (1, 8, 8, 3)


# --- A1 for real: SIGKILL at random moments (small version of benchmarks/kill_resume.py) -------------


@pytest.mark.slow
def test_kill_resume_stress_small() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("kill_resume", REPO / "benchmarks" / "kill_resume.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.main(["--kills", "4", "--images", "120", "--seed", "3"])
    assert doc["total_failures"] == 0, json.dumps(doc, indent=1)
    assert all(f["resumed_ok"] == 4 for f in doc["formats"])
