"""RELIABILITY.md sections D (concurrency and memory) and E (security).

Also covered elsewhere: D1 fork/spawn epochs and D2 small pickles per format in tests/read/test_dataset.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_helpers import FORMAT_NAMES, make_tree, read_all, release_loader

import dlstore.machine as resources
from dlstore.errors import CacheCorruptError, CacheTooLargeError, DlstoreError, SharedMemoryError, SpecError
from dlstore.read.cache import open_cache
from dlstore.read.dataset import CachedDataset
from dlstore.spec import parse_relpath
from dlstore.write.conversion import convert
from dlstore.write.options import ConvertOptions
from dlstore.write.verification import verify

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("rt")
    src = make_tree(base / "src", per_class=10)
    out = {}
    for fmt in FORMAT_NAMES:
        out[fmt] = base / fmt
        convert(src, out[fmt], ConvertOptions(format=fmt, size=16, workers=1))
    return out


def epoch(ds: CachedDataset, ctx: str, workers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers, multiprocessing_context=ctx)
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


# --- D1-D3 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_d1_fork_after_the_parent_read(caches: dict[str, Path], fmt: str) -> None:
    ds = CachedDataset(caches[fmt])
    parent = ds.read_batch(list(range(len(ds))))[0]  # handles opened before the fork
    x, y = epoch(ds, "fork")
    assert torch.equal(x, parent) and y.tolist() == ds.targets


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_d1_spawn_and_forkserver_after_the_parent_read(caches: dict[str, Path], fmt: str, ctx: str) -> None:
    ds = CachedDataset(caches[fmt])
    parent = ds.read_batch(list(range(len(ds))))[0]
    x, _ = epoch(ds, ctx)
    assert torch.equal(x, parent)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("in_memory", [False, True])
def test_d2_d3_pickle_is_small_and_handles_are_per_process(
    caches: dict[str, Path], fmt: str, in_memory: bool
) -> None:
    ds = CachedDataset(caches[fmt], in_memory=in_memory and fmt == "ram")
    ds.read_batch([0, 1])
    blob = pickle.dumps(ds)
    assert len(blob) < 8000
    clone = pickle.loads(blob)
    assert clone._cache is None  # opened lazily in the process that reads
    assert torch.equal(clone.read_batch([3])[0], ds.read_batch([3])[0])


def private_dirty_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return sum(int(m) for m in re.findall(r"^Private_Dirty:\s+(\d+) kB", text, re.M))


def test_d4_ram_cache_is_not_copied_into_forked_workers(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", per_class=100, side=16)
    convert(src, tmp_path / "c", ConvertOptions(format="ram", size=160, workers=2))  # 200 x 77 KB = 15 MB
    ds = CachedDataset(tmp_path / "c", in_memory=True)
    cache_kb = ds.cache.reader.array.nbytes // 1024
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: read every image in batches, report private memory growth
        torch.set_num_threads(1)  # as DataLoader workers do: OpenMP pools do not survive fork
        before = private_dirty_kb()
        for i in range(0, len(ds), 16):
            ds.read_batch(list(range(i, min(len(ds), i + 16))))
        os.write(w, str(private_dirty_kb() - before).encode())
        os._exit(0)
    os.close(w)
    grew_kb = int(os.read(r, 64))
    os.waitpid(pid, 0)
    assert grew_kb < cache_kb / 2, (grew_kb, cache_kb)


# --- D5 /dev/shm ---------------------------------------------------------------------------------------


def test_d5_small_dev_shm_is_explained(caches: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "shm_free_bytes", lambda shm=resources.SHM: 64 << 10)
    with pytest.raises(SharedMemoryError) as e:
        resources.check_shared_memory(batch_bytes=1 << 20, num_workers=2)
    msg = str(e.value)
    assert "/dev/shm has 0 MB free" in msg and "--shm-size" in msg and "--ipc=host" in msg
    monkeypatch.setattr(resources, "shm_free_bytes", lambda shm=resources.SHM: 1024)
    ds = CachedDataset(caches["npz"])
    with pytest.raises(SharedMemoryError, match="--shm-size") as e:  # raised in a worker, shown in the main
        epoch(ds, "fork")
    release_loader(e)
    monkeypatch.setattr(resources, "shm_free_bytes", lambda shm=resources.SHM: 1 << 40)
    resources.check_shared_memory(batch_bytes=1 << 20, num_workers=2)


# --- D6 memory limit -------------------------------------------------------------------------------------


def test_d6_cgroup_and_meminfo_are_read(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000000\n")
    (v2 / "memory.current").write_text("400000000\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 99999999 kB\nMemAvailable: 50000000 kB\n")
    avail, where = resources.available_memory(v2, meminfo)
    assert avail == 600_000_000 and "memory.max" in where
    (v2 / "memory.max").write_text("max\n")
    assert resources.available_memory(v2, meminfo) == (50_000_000 * 1024, f"MemAvailable in {meminfo}")
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("500000000\n")
    assert resources.available_memory(tmp_path / "v1", meminfo)[0] == 1_500_000_000


def test_d6_ram_cache_larger_than_memory_is_refused_unless_mapped(
    caches: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        resources, "available_memory", lambda *a: (1000, "cgroup limit in /sys/fs/cgroup/memory.max")
    )
    need = read_all(caches["ram"])[0].nbytes
    with pytest.raises(CacheTooLargeError) as e:
        open_cache(caches["ram"], in_memory=True)
    msg = str(e.value)
    assert f"{need / 1e9:.2f} GB" in msg and "0.00 GB is available" in msg and "memory.max" in msg
    assert "without in_memory" in msg
    with pytest.raises(CacheTooLargeError):
        CachedDataset(caches["ram"], in_memory=True)
    assert len(CachedDataset(caches["ram"]).read_batch([0, 1])[0]) == 2  # memory-mapped: fine


# --- D7 killed worker ------------------------------------------------------------------------------------


# A SIGKILLed worker leaves DataLoader's queue feeder thread failing on a closed pipe; pytest reports that
# as a thread or unraisable exception whenever it is collected, which is torch's noise, not this test's.
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning", "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)
def test_d7_killed_worker_is_reported_without_hanging(caches: dict[str, Path]) -> None:
    parent = os.getpid()

    def die_in_worker(x: torch.Tensor) -> torch.Tensor:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return x

    ds = CachedDataset(caches["ram"], transform=die_in_worker)
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"DataLoader worker \(pid.*(exited unexpectedly|killed by signal)"
    ):
        epoch(ds, "fork")
    assert time.monotonic() - t0 < 30


# --- E security --------------------------------------------------------------------------------------------


def python_sources() -> list[Path]:
    return sorted(p for d in ("dlstore", "cli") for p in (REPO / d).rglob("*.py"))


def test_e1_e2_no_pickle_loading_anywhere() -> None:
    for path in python_sources():
        text = path.read_text()
        for call in re.findall(r"np\.load\([^)]*\)", text):
            assert "allow_pickle=False" in call, f"{path}: {call}"
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        assert not re.search(r"^\s*(import pickle|from pickle)|pickle\.loads?\(", text, re.M), path


def test_e1_object_array_payloads_fail_with_a_dlstore_error(caches: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    cache = tmp_path / "npz"
    shutil.copytree(caches["npz"], cache)
    shard = sorted((cache / "shards").iterdir())[0]
    np.savez(shard, images=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(DlstoreError, match=r"shard \d+ unreadable"):
        open_cache(cache, check_source=False).read([0])
    np.save(cache / "labels.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(CacheCorruptError, match="labels.npy"):
        open_cache(cache, check_source=False)


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda m: m["codecs"].append({"name": "pickle"}), "not allowed"),
        (
            lambda m: m.update(codecs=[{"name": "bytes"}, {"name": "zstd"}, {"name": "numcodecs.pickle"}]),
            "not allowed",
        ),
        (lambda m: m.update(codecs=[{"name": "numcodecs.pickle"}]), "must start with 'bytes'"),
        # the manifest's codec (zstd) decides the decoder; a zarr.json that disagrees is refused
        (
            lambda m: m.update(codecs=[m["codecs"][0], {"name": "blosc", "configuration": {}}]),
            "manifest's codec",
        ),
        (lambda m: m.update(codecs=m["codecs"][:1]), "compresses chunks with nothing"),
        (lambda m: m.update(data_type="object"), "manifest says uint8"),
        (lambda m: m.update(shape=[10**15, 16, 16, 3]), "manifest says uint8"),
        (lambda m: m["chunk_grid"]["configuration"].update(chunk_shape=[10**9, 16, 16, 3]), "chunk shape"),
        (lambda m: m.update(storage_transformers=[{"name": "x"}]), "storage transformers"),
    ],
)
def test_e3_zarr_metadata_refused_before_any_chunk_is_read(
    caches: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutate, expect
) -> None:
    import shutil

    from dlstore.formats import zarr_cache

    cache = tmp_path / "z"
    shutil.copytree(caches["zarr"], cache)
    meta_path = cache / "images" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    mutate(meta)
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"chunk {self} read"))
    with pytest.raises(SpecError, match=expect):
        open_cache(cache, check_source=False)
    assert zarr_cache  # imported for the reader under test


@pytest.mark.parametrize(
    "name", ["../outside.npy", "/etc/passwd", "a/../../x", "nul\x00.npy", "a\\..\\b", ""]
)
def test_e4_unsafe_manifest_paths_are_rejected(caches: dict[str, Path], tmp_path: Path, name: str) -> None:
    import shutil

    with pytest.raises(SpecError, match="unsafe path"):
        parse_relpath(name, tmp_path / "dlstore.json")
    cache = tmp_path / "c"
    shutil.copytree(caches["ram"], cache)
    manifest = json.loads((cache / "dlstore.json").read_text())
    manifest["checksums"][name] = "0" * 64
    (cache / "dlstore.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="unsafe path"):
        verify(cache)
    with pytest.raises(SpecError):
        open_cache(cache)
