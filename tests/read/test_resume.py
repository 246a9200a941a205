"""Stop and resume anywhere: one global order per epoch for every loader, worker count and rank count,
and a state of a few hundred bytes that continues it (``dlstore.read.order``).

The cache gives every image its own class, so a batch's labels are the ids of its samples."""

from __future__ import annotations

import gc
import itertools
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dlstore import CachedDataset, Loader, convert
from dlstore.formats import FORMATS
from dlstore.read.order import EpochSampler, keeps_state
from dlstore.read.sampler import ChunkSampler
from dlstore.write.sources import ArraySource

PAYLOAD_FORMAT = next(f.name for f in FORMATS.values() if f.ragged_ok)
N, B, WINDOW = 60, 4, 2
VIAS = ["pinned", "resident", "decode"]


@pytest.fixture(scope="module")
def ids_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 JPEG payloads in units of 6, image i of class i: every loader kind reads it."""
    rng = np.random.default_rng(3)
    source = ArraySource(
        description="ids",
        classes=tuple(f"c{i}" for i in range(N)),
        names=[str(i) for i in range(N)],
        labels=np.arange(N),
        kind="test",
        data=rng.integers(0, 256, (N, 8, 8, 3), dtype=np.uint8),
    )
    dest = tmp_path_factory.mktemp("resume") / "jpeg"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(FORMATS[PAYLOAD_FORMAT].payload_writer, "target_unit_bytes", 6 * (192 // 10))
        convert(source, dest, format=PAYLOAD_FORMAT, size=8, resize="stretch", codec="jpeg", workers=1)
    return dest


@pytest.fixture(autouse=True)
def collect_after() -> Any:
    """Abandoned DataLoader iterators (a cycle with their loader) shut their workers down in __del__,
    which waits without the GIL; left to a later GC pass, that can run inside a reader thread's np.load
    header parse and trip CPython 3.11's shared AST depth counter (gh-106905) in another thread."""
    yield
    gc.collect()


def fast_loader(via: str, cache: Path, **kw: Any) -> Loader:
    kw = {"order": "chunk", "window": WINDOW, "seed": 7, "drop_last": True, **kw}
    return Loader(cache, B, device="cpu", via=via, **kw)


def stateful(cache: Path, workers: int, **kw: Any) -> StatefulDataLoader:
    ds = CachedDataset(cache)
    sampler = ChunkSampler(ds, window=WINDOW, seed=7, **kw)
    return StatefulDataLoader(ds, batch_size=B, sampler=sampler, num_workers=workers, drop_last=True)


def ids(batches: Any, k: int | None = None) -> list[list[int]]:
    """Each batch's sample ids, sorted: the fast loaders read a batch in storage order."""
    return [sorted(y.tolist()) for _, y in itertools.islice(batches, k)]


def test_one_order_whatever_the_loader_and_the_workers(ids_cache: Path) -> None:
    sampler = ChunkSampler(CachedDataset(ids_cache), window=WINDOW, seed=7)
    sampler.set_epoch(1)
    expected = np.sort(sampler.sequence(1)[: N // B * B].reshape(-1, B), axis=1).tolist()
    for via in VIAS:
        loader = fast_loader(via, ids_cache)
        loader.set_epoch(1)
        assert ids(loader) == expected, via
    for workers in (0, 2):
        dl = stateful(ids_cache, workers)
        dl.sampler.set_epoch(1)
        assert ids(dl) == expected, workers


@pytest.mark.parametrize("kind", VIAS)
def test_a_loader_resumes_with_the_exact_next_batch(ids_cache: Path, kind: str) -> None:
    whole = ids(fast_loader(kind, ids_cache))
    first = fast_loader(kind, ids_cache)
    if kind == "decode":
        first._path.read_ahead = 3
    it = iter(first)
    seen = ids(it, 5)  # the read-ahead and gather threads have prepared more than five by now
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON
    assert state["consumed"] == 5 * B and state["epoch"] == 0
    resumed = fast_loader(kind, ids_cache)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual set_epoch at the top of the epoch keeps the position
    assert seen + ids(resumed) == whole
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["consumed"] == 0
    again = ids(resumed)  # the next epoch, from its start
    assert sorted(sum(again, [])) != sum(again, []) and len(again) == N // B


def test_stateful_dataloader_with_workers_resumes_through_the_sampler(ids_cache: Path) -> None:
    whole = ids(stateful(ids_cache, 2))
    dl = stateful(ids_cache, 2)
    it = iter(dl)
    seen = ids(it, 6)  # two workers with prefetch_factor 2 have read ahead of the loop
    state = dl.state_dict()
    del it
    resumed = stateful(ids_cache, 2)
    resumed.load_state_dict(state)
    assert seen + ids(resumed) == whole


def consumption(windows: list[list[int]], world: int) -> list[int]:
    """The documented rule, written out with lists (``dlstore.read.rounds``): rounds of ``world``
    windows, each round cut into ``world`` near-equal pieces, listed in turns."""
    out: list[int] = []
    for i in range(0, len(windows), world):
        round_ = sum(windows[i : i + world], [])
        q, rem = divmod(len(round_), world)
        cuts = np.cumsum([0] + [q + (a < rem) for a in range(world)])
        pieces = [round_[cuts[a] : cuts[a + 1]] for a in range(world)]
        out += [p[j] for j in range(q + 1) for p in pieces if j < len(p)]
    return out


def test_two_ranks_resume_on_three_and_continue_the_one_global_sequence(ids_cache: Path) -> None:
    """W=2 for 2 steps (mid-round), saved, W'=3 to the end of the epoch: the two partly read windows
    are finished first, then rounds of 3 windows; every sample of the epoch once."""
    glob = ChunkSampler(CachedDataset(ids_cache), window=WINDOW, seed=7).sequence(0).tolist()
    size = 6 * WINDOW  # units of 6 images, all full: windows of 12
    windows = [glob[i : i + size] for i in range(0, N, size)]
    two = [fast_loader("pinned", ids_cache, num_replicas=2, rank=r) for r in range(2)]
    iters = [iter(x) for x in two]
    steps = [[sorted(next(it)[1].tolist()) for it in iters] for _ in range(2)]
    states = [x.state_dict() for x in two]
    assert states[0] == states[1] and states[0]["consumed"] == 2 * 2 * B
    assert (states[0]["base"], states[0]["width"]) == (0, 2)
    c2 = consumption(windows, 2)
    for s, pair in enumerate(steps):  # rank r took positions r, r+2, ... of C: its own window only
        for r in range(2):
            assert pair[r] == sorted(c2[s * 2 * B + r : (s + 1) * 2 * B : 2])
            assert set(pair[r]) <= set(windows[r])
    three = [fast_loader("resident", ids_cache, num_replicas=3, rank=r) for r in range(3)]
    for x in three:
        x.load_state_dict(states[0])
    rest = [ids(x) for x in three]
    assert len({len(r) for r in rest}) == 1  # equal batch counts on the new world
    c = states[0]["consumed"]
    then = c2[: 2 * size] + consumption(windows[2:], 3)  # the rest of round 0, then rounds of 3
    for s in range(len(rest[0])):
        base = c + s * 3 * B
        for r in range(3):
            assert rest[r][s] == sorted(then[base + r : base + 3 * B : 3])
    taken = sum((sum(step, []) for step in steps), []) + sum(sum(rest, []), [])
    dropped = then[c + len(rest[0]) * 3 * B :]  # drop_last: the epoch's last < 3 x B positions
    assert len(taken) == len(set(taken)) and len(dropped) < 3 * B  # nothing repeated
    assert sorted(taken + dropped) == list(range(N))  # nothing skipped


def test_any_chain_of_world_sizes_reads_each_sample_once_and_a_unit_on_one_rank() -> None:
    """Ranks in lockstep, stopped at random steps and resumed on random world sizes: each sample of
    the epoch once (but the last < W dropped); from the start, each unit is read by one rank."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        n, unit, window = int(rng.integers(1, 300)), int(rng.integers(1, 20)), int(rng.integers(1, 4))
        positions = rng.permutation(n)
        worlds = [int(w) for w in rng.integers(1, 7, 3)]
        state: dict[str, Any] | None = None
        seen: list[int] = []
        for w, stop in zip(worlds, [int(rng.integers(0, 30)), int(rng.integers(0, 30)), None]):
            ranks = [
                EpochSampler(
                    positions, unit, window=window, seed=trial, num_replicas=w, rank=r, drop_last=True
                )
                for r in range(w)
            ]
            for x in ranks:
                if state is not None:
                    x.load_state_dict(json.loads(json.dumps(state)))
            if ranks[0].state_dict()["epoch"] == 0:
                seen += sum(map(list, itertools.islice(zip(*ranks), stop)), [])
            states = [x.state_dict() for x in ranks]
            assert all(st == states[0] for st in states[1:])
            state = states[0]
        assert len(seen) == len(set(seen)) and n - len(seen) < max(worlds), (trial, n, worlds)
    positions = rng.permutation(200 * 16)
    for w in (2, 4, 8):  # 50 windows of 4 units: whole rounds, then the last 2 windows cut in w pieces
        readers: dict[int, set[int]] = {}
        for r in range(w):
            for i in EpochSampler(positions, 16, window=4, seed=3, num_replicas=w, rank=r, drop_last=True):
                readers.setdefault(int(positions[i]) // 16, set()).add(r)
        assert sum(len(v) > 1 for v in readers.values()) <= (8 if w > 2 else 0)


def test_ten_million_samples_a_few_hundred_bytes_and_one_copy_of_the_order() -> None:
    n = 10_000_000
    positions = np.arange(n, dtype=np.int64)
    sampler = EpochSampler(positions, 1024, order="chunk", window=4, seed=1, num_replicas=8, rank=3)
    tracemalloc.start()
    it = iter(sampler)
    first = [next(it) for _ in range(1000)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.5 * n * 4  # the order (int32) once; a second copy or a list would pass 2x
    state = sampler.state_dict()
    assert len(json.dumps(state)) < 300 and state["consumed"] == 1000 * 8
    resumed = EpochSampler(positions, 1024, order="chunk", window=4, seed=1, num_replicas=8, rank=3)
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == next(it) and len(set(first)) == 1000


def test_a_state_of_another_cache_is_refused_and_plain_dataloader_keeps_none(ids_cache: Path) -> None:
    state = EpochSampler(np.arange(10), 1, order="random").state_dict()
    with pytest.raises(ValueError, match="saved for a cache of 10 images"):
        EpochSampler(np.arange(12), 1, order="random").load_state_dict(state)
    assert keeps_state(fast_loader("pinned", ids_cache)) and keeps_state(stateful(ids_cache, 0))
    assert not keeps_state(torch.utils.data.DataLoader(CachedDataset(ids_cache), shuffle=True))
    bad = {**ChunkSampler(np.arange(40), 4, window=2).state_dict(), "base": 99}
    with pytest.raises(ValueError, match="base=99"):
        _load(bad)


def _load(state: dict[str, Any]) -> Any:
    sampler = ChunkSampler(np.arange(40), 4, window=2)
    sampler.load_state_dict(state)
    return next(iter(sampler))


def test_a_version_1_state_counts_in_the_order_itself_and_resumes_on_two_ranks() -> None:
    """Before rounds, ranks took turns in G: a v1 state's ``consumed`` is a prefix of G."""
    positions = np.random.default_rng(1).permutation(100)
    glob = ChunkSampler(positions, 10, window=2, seed=4).sequence(0).tolist()
    now = ChunkSampler(positions, 10, window=2, seed=4).state_dict()
    v1 = {**{k: v for k, v in now.items() if k not in ("base", "width")}, "dlstore_order": 1, "consumed": 33}
    rest = []
    for r in range(2):
        sampler = ChunkSampler(positions, 10, window=2, seed=4, num_replicas=2, rank=r)
        sampler.load_state_dict(v1)
        rest += list(sampler)
    assert sorted(glob[:33] + rest[:67]) == list(range(100)) and len(rest) == 68  # 67 + 1 padding
