"""Whole batches decoded by worker processes into a shared-memory ring (``Cache.read_batches``):
same pixels as plain reads, each chunk decoded once in chunk order, errors name the chunk, a lost
worker is recovered from, nothing outlives ``close``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dlstore import Loader, convert, open_cache
from dlstore.errors import SampleReadError
from dlstore.formats.npz import NpzWriter
from dlstore.formats.zarr_cache import ZarrWriter
from dlstore.read.engines.batch_procs import plan_jobs
from dlstore.read.loader import make_sampler
from dlstore.write.sources import ArraySource

UNIT = 7


@pytest.fixture(scope="module")
def zarr_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 random images in chunks of 7 (43 chunks, the last one short)."""
    rng = np.random.default_rng(5)
    n = 300
    src = ArraySource(
        description="t",
        classes=("a", "b", "c"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 3, n),
        kind="test",
        data=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
    )
    dest = tmp_path_factory.mktemp("batches") / "zarr"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ZarrWriter, "choose_unit_size", staticmethod(lambda image_bytes: UNIT))
        convert(src, dest, format="zarr", size=16, resize="stretch", workers=1)
    return dest


@pytest.fixture(scope="module")
def npz_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 random images in shards of 7: the last shard holds 6."""
    rng = np.random.default_rng(6)
    n = 300
    src = ArraySource(
        description="t",
        classes=("a", "b"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 2, n),
        kind="test",
        data=rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
    )
    dest = tmp_path_factory.mktemp("batches") / "npz"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(NpzWriter, "choose_unit_size", staticmethod(lambda image_bytes: UNIT))
        convert(src, dest, format="npz", size=8, resize="stretch", workers=1)
    return dest


def test_a_short_last_shard_is_decoded_by_the_workers_too(npz_cache: Path) -> None:
    batches = index_batches(npz_cache, "chunk")
    cache = open_cache(npz_cache)
    assert cache.reader.unit == UNIT and cache.spec.n_stored % UNIT == 6
    expected = [cache.read(b) for b in batches]
    calls: list[int] = []
    load = cache.reader.load_unit
    cache.reader.load_unit = lambda k: (calls.append(k), load(k))[1]  # type: ignore[method-assign]
    got = [x.copy() for x in cache.read_batches(batches, processes=2)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert calls == []  # no unit failed in a worker and was decoded here instead
    cache.close()


def test_a_program_wide_socket_timeout_leaves_the_workers_decoding(
    npz_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """socket.setdefaulttimeout(...) in the user's program made the worker sockets non-blocking, every
    worker read failed with EAGAIN, and each unit was decoded in the reading process instead."""
    import socket

    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)
    try:
        batches = index_batches(npz_cache, "chunk")
        cache = open_cache(npz_cache)
        expected = [cache.read(b) for b in batches]
        calls: list[int] = []
        load = cache.reader.load_unit
        cache.reader.load_unit = lambda k: (calls.append(k), load(k))[1]  # type: ignore[method-assign]
        got = [x.copy() for x in cache.read_batches(batches, processes=2)]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        assert calls == []
        cache.close()
    finally:
        socket.setdefaulttimeout(before)


def index_batches(root: Path, order: str, size: int = 32) -> list[np.ndarray]:
    cache = open_cache(root)
    idx = list(make_sampler(cache, order, seed=2))
    cache.close()
    return [np.asarray(idx[i : i + size]) for i in range(0, len(idx), size)]


@pytest.mark.parametrize("span", [0, 1, 3, 100])
def test_the_plan_sends_every_row_once_within_the_span(span: int) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.permutation(200)[:n] for n in (32, 32, 17, 32, 5, 32)]
    jobs, pending = plan_jobs(batches, UNIT, span)
    seen = sorted((int(b), int(r)) for j in jobs for b, r in zip(j.batches, j.rows))
    assert seen == sorted((b, r) for b, batch in enumerate(batches) for r in range(len(batch)))
    for j in jobs:
        assert j.hi - j.lo <= span
        for b, r, local in zip(j.batches, j.rows, j.locals_):
            assert batches[b][r] == j.unit * UNIT + local  # the row gets its own image
    assert [j.lo for j in jobs] == sorted(j.lo for j in jobs)  # sent in the order batches need them
    assert pending.tolist() == [sum(b in j.targets for j in jobs) for b in range(len(batches))]


@pytest.mark.parametrize("order, slots", [("chunk", None), ("random", 6)])
def test_batches_decoded_in_processes_match_plain_reads(
    zarr_cache: Path, order: str, slots: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if slots is not None:  # a small ring: a shuffled epoch's chunks span more batches than it holds
        monkeypatch.setattr("dlstore.read.engines.batch_procs.ring_slots", lambda batch_bytes: slots)
    batches = index_batches(zarr_cache, order)
    cache = open_cache(zarr_cache)
    expected = [cache.read(b) for b in batches]
    calls: list[int] = []
    load = cache.reader.load_unit
    cache.reader.load_unit = lambda k: (calls.append(k), load(k))[1]  # type: ignore[method-assign]
    for _ in range(2):  # the workers and the ring serve the next epoch too
        got = [x.copy() for x in cache.read_batches(batches, processes=2)]
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    procs = cache.engines.batch_processes
    assert calls == []  # every chunk was decoded by the workers
    jobs = len(procs._epoch.jobs)
    assert jobs == 43 if slots is None else jobs > 43  # chunk order: each chunk once; else split
    cache.close()
    assert all(p.poll() is not None for p in procs.procs)
    assert not (Path("/dev/shm") / procs.shm.name).exists()


def test_chunk_order_decodes_each_chunk_once() -> None:
    rng = np.random.default_rng(1)
    order = np.concatenate([rng.permutation(np.arange(w, w + 4 * UNIT)) for w in range(0, 280, 4 * UNIT)])
    batches = [order[i : i + 32] for i in range(0, len(order), 32)]
    jobs, _ = plan_jobs(batches, UNIT, span=3)
    assert sorted(j.unit for j in jobs) == list(range(40))


def test_a_damaged_chunk_is_named_and_a_lost_worker_is_recovered_from(
    zarr_cache: Path, tmp_path: Path
) -> None:
    root = tmp_path / "z"
    shutil.copytree(zarr_cache, root)
    chunk = root / "images" / "c" / "1" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    cache = open_cache(root)
    batches = [np.flatnonzero(cache.positions // UNIT == k)[:3] for k in (2, 1, 3)]
    got = cache.read_batches(batches, processes=2)
    assert np.array_equal(next(got), open_cache(zarr_cache).read(batches[0]))
    with pytest.raises(SampleReadError, match=r"images/c/1/0/0/0: chunk 1"):
        next(got)
    procs = cache.engines.batch_processes
    for p in procs.procs:  # every worker gone: the chunks are decoded in this process instead
        p.kill()
        p.wait()
    good = [np.flatnonzero(cache.positions // UNIT == k)[:4] for k in (5, 6)]
    got = [x.copy() for x in cache.read_batches(good, processes=2)]
    expected = open_cache(zarr_cache)
    assert all(np.array_equal(a, expected.read(b)) for a, b in zip(got, good))
    cache.close()


def test_an_epoch_abandoned_mid_way_leaves_the_next_one_correct(zarr_cache: Path) -> None:
    batches = index_batches(zarr_cache, "chunk")
    cache = open_cache(zarr_cache)
    first = cache.read_batches(batches, processes=2)
    next(first)
    first.close()
    got = [x.copy() for x in cache.read_batches(batches, processes=2)]
    assert all(np.array_equal(a, cache.read(b)) for a, b in zip(got, batches))
    cache.close()


def test_pinned_loader_with_decode_processes_yields_the_same_batches(zarr_cache: Path) -> None:
    plain = Loader(zarr_cache, batch_size=32, device="cpu", order="chunk", via="pinned")
    procs = Loader(zarr_cache, batch_size=32, device="cpu", order="chunk", cpu_decoders=2, via="pinned")
    for _ in range(2):
        pairs = list(zip(plain, procs))
        assert len(pairs) == len(plain)
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in pairs)
    workers = procs.cache.engines.batch_processes.procs
    plain.cache.close()
    procs.cache.close()
    assert all(p.poll() is not None for p in workers)


READ_FOREVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may start with SIGINT ignored
from dlstore import open_cache
from dlstore.read.loader import make_sampler, storage_sorted
cache = open_cache(sys.argv[1])
order = list(make_sampler(cache, "chunk", seed=0))
batches = [storage_sorted(cache, order[i : i + 16]) for i in range(0, len(order), 16)]
print(cache.reader.spec.n, flush=True)
while True:
    for _ in cache.read_batches(batches, processes=2):
        print("batch", flush=True)
"""


def test_ctrl_c_while_reading_stops_the_reader_and_its_workers(zarr_cache: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "read_forever.py"
    script.write_text(READ_FOREVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(zarr_cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches the reader and its workers
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    assert proc.stdout.readline().strip() == "batch"  # the workers are up and answering
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # a hang guard, not a speed claim
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert err.count("KeyboardInterrupt") == 1, err  # the reader's; the workers ignore Ctrl-C
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    assert _group_alive(proc.pid) == []


def _group_alive(pgid: int) -> list[int]:
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
