"""The library form: ``with dlstore.watch(...) as w`` and ``loader = dlstore.watch(loader)``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import ImageFolder

import dlstore


def test_with_block_stops_at_steps_after_the_replay() -> None:
    loader = DataLoader(TensorDataset(torch.randn(400, 3)), batch_size=4)
    seen = 0
    with dlstore.watch(steps=15, replay_steps=4, replay_batches=2, parts=False, quiet=True) as w:
        for _ in range(10):
            for _batch in loader:
                seen += 1
    assert seen == 19  # 15 real + 4 replayed, then the block ended cleanly
    rep = w.report["loaders"][0]
    assert w.report["status"] == "stopped"
    assert rep["steps_observed"] == 15 and rep["steps_replayed"] == 4
    assert DataLoader.__iter__.__name__ == "__iter__" and iter(loader).__class__.__name__ != "WatchedIterator"


def test_with_block_keeps_the_exception() -> None:
    loader = DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4)
    with pytest.raises(ValueError, match="in the loop"):
        with dlstore.watch(parts=False, quiet=True) as w:
            for i, _ in enumerate(loader):
                if i == 3:
                    raise ValueError("in the loop")
    assert w.report["status"] == "error" and w.report["loaders"][0]["steps_observed"] == 4


def test_loader_form_is_the_same_loader_watched(tiny_folder: Path) -> None:
    ds = ImageFolder(tiny_folder, transform=T.Compose([T.Resize(20), T.CenterCrop(16), T.ToTensor()]))
    loader = dlstore.watch(DataLoader(ds, batch_size=6, num_workers=2), replay=False, quiet=True)
    assert isinstance(loader, DataLoader) and len(loader) == 8 and loader.dataset is ds
    batches = [x.shape[0] for x, _ in loader]
    assert batches == [6] * 8
    report = loader._dlstore_watch.finish()
    rep = report["loaders"][0]
    assert rep["steps_observed"] == 8 and rep["settings"]["num_workers"] == 2
    parts = report["loaders"][0]["dataset"]
    assert parts["root"] == str(tiny_folder) and "CenterCrop" in parts["transform"]


def test_parts_split_read_decode_transform(tiny_folder: Path) -> None:
    from dlstore.bench.watch.loop_parts import measure_parts

    ds = ImageFolder(tiny_folder, transform=T.Compose([T.RandomRotation(10), T.ToTensor()]))
    loader = DataLoader(ds, batch_size=4)
    parts = measure_parts(loader, next(iter(loader)), cuda=False, budget_s=0.3)
    for key in ("getitem_s", "load_s", "read_s", "decode_s", "transform_s", "collate_s"):
        assert parts[key] is not None and parts[key] > 0, key
    assert parts["collate_batch"] == 4 and "h2d" not in parts


def test_replay_rounds_are_spaced_take_real_batches_places_and_the_rate_is_the_median_round() -> None:
    loader = DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4)  # 10 steps an epoch
    with dlstore.watch(
        replay_at=5, replay_every=8, replay_rounds=3, replay_s=0.0, replay_steps=6, replay_batches=2,
        trial=False, parts=False, warmup=0, quiet=True,
    ) as w:  # fmt: skip
        counts = [sum(1 for _ in loader) for _ in range(5)]
    assert counts == [10] * 5  # every epoch as long as unwatched: the replayed steps took real ones' places
    rep = w.report["loaders"][0]
    rows = rep["rows"]
    starts = [r["step"] for r in rows if r["phase"] == "replay" and rows[r["step"] - 1]["phase"] != "replay"]
    assert len(starts) == 3 and len(rows) == 50
    assert rep["stand_in_steps"] == rep["steps_replayed"] == 50 - rep["steps_observed"] > 0
    for k, first in enumerate(starts):
        assert sum(r["phase"] not in ("replay", "trial") for r in rows[:first]) == 5 + 8 * k
    assert rep["tried"]["replay"] is True and rep["tried"]["why"] is None
    rounds = rep["phases"]["replay"]["rounds"]
    assert len(rounds) == 3
    assert rep["phases"]["replay"]["period_s"] == sorted(r["period_s"] for r in rounds)[1]
    assert "the median of 3 rounds" in w.report["detail"]


def test_steps_stops_after_the_last_replay_round() -> None:
    loader = DataLoader(TensorDataset(torch.randn(400, 3)), batch_size=4)
    with dlstore.watch(
        steps=15, replay_rounds=2, replay_every=5, replay_s=0.0, replay_steps=4, replay_batches=2,
        trial=False, parts=False, quiet=True,
    ) as w:  # fmt: skip
        for _batch in loader:
            pass
    rep = w.report["loaders"][0]
    assert w.report["status"] == "stopped"
    assert rep["steps_observed"] == 20 and len(rep["phases"]["replay"]["rounds"]) == 2


@pytest.mark.parametrize("field", ["replay_rounds", "replay_every"])
def test_replay_rounds_and_spacing_must_be_positive(field: str) -> None:
    from dlstore.bench.watch import WatchConfig, WatchError

    with pytest.raises(WatchError, match="positive"):
        WatchConfig(**{field: 0})


@pytest.mark.parametrize("workers", [0, 2])
def test_stand_ins_take_real_batches_places_and_the_sampler_order_is_kept(workers: int) -> None:
    """Each epoch yields len(loader) batches under watch; its real ones are the unwatched epoch's first
    ones, in the order the sampler (reseeded by set_epoch) gave them; the stand-ins took the rest's places
    (with persistent workers, the epoch left unfinished is reset by the next one's iter())."""
    from torch.utils.data.distributed import DistributedSampler

    ds = TensorDataset(torch.arange(60))

    def run() -> tuple[list[list[list[int]]], int]:
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(
            ds, batch_size=4, sampler=sampler, num_workers=workers, persistent_workers=workers > 0
        )
        epochs = []
        for e in range(3):
            sampler.set_epoch(e)
            epochs.append([b[0].tolist() for b in loader])
        if loader._iterator is not None:  # persistent workers: stopped now, while their queues work (watch
            loader._iterator._shutdown_workers()  # holds them in a cycle the collector frees queues-first)
        return epochs, len(loader)

    plain, n = run()
    with dlstore.watch(
        warmup=1, replay_s=0.01, replay_warmup_s=0.0, trial=False, parts=False, quiet=True
    ) as w:
        watched, n_watched = run()
    assert n_watched == n == 15 and [len(e) for e in watched] == [15] * 3
    rep = w.report["loaders"][0]
    assert rep["stand_in_steps"] > 0
    for e in range(3):
        phases = [r["phase"] for r in rep["rows"] if r["epoch"] == e]
        assert len(phases) == 15
        real = [b for b, p in zip(watched[e], phases) if p not in ("replay", "trial")]
        assert real == plain[e][: len(real)]


def test_a_run_shorter_than_the_pause_says_the_replay_and_trial_were_not_tried() -> None:
    loader = DataLoader(TensorDataset(torch.randn(12, 3)), batch_size=4)  # 3 steps an epoch, 6 in all
    with dlstore.watch(parts=False, quiet=True) as w:
        for _ in range(2):
            for _batch in loader:
                pass
    rep = w.report["loaders"][0]
    assert rep["stand_in_steps"] == 0
    tried = rep["tried"]
    assert tried["replay"] is False and tried["trial"] is False and tried["pause_at"] == 9
    assert "after 6 real steps, before watch's pause at step 9" in tried["why"]
    assert "run the script longer" in tried["how"]


def test_the_steady_rate_is_the_loops_own_over_the_same_steps_epoch_starts_apart() -> None:
    """A short run of a fast loop: a later epoch's first step (its workers started anew) is summarised
    apart (``start``), and the steady figure is the loop's own rate over the steps it rests on."""
    import time

    loader = DataLoader(TensorDataset(torch.randn(56, 3, 8, 8)), batch_size=8, num_workers=2)  # 7 an epoch
    ends: list[float] = []
    with dlstore.watch(replay=False, trial=False, parts=False, quiet=True) as w:
        for _ in range(2):
            for (x,) in loader:
                torch.nn.functional.avg_pool2d(x, 2).sum()
                ends.append(time.perf_counter())  # the step's end: where the loop's own clock ticks
    rep = w.report["loaders"][0]
    phases = rep["phases"]
    assert phases["start"]["steps"] == 1 and phases["real"]["steps"] == 14 - 5 - 1
    rows = rep["rows"]
    assert [r["step"] for r in rows if r["epoch_first"] and r["epoch"] == 1] == [7]
    steady = [r["step"] for r in rows if r["phase"] == "real" and not r["epoch_first"]]
    own = sum(ends[i] - ends[i - 1] for i in steady) / len(steady)  # the loop's own period, same steps
    assert phases["real"]["period_s"] == pytest.approx(own, rel=0.1)


def test_an_epoch_whose_length_changes_keeps_it_under_stand_ins() -> None:
    """A batch sampler with more batches each epoch (bucketing does this): each epoch's own length holds."""

    class Growing:
        def __init__(self) -> None:
            self.epoch = 0

        def __len__(self) -> int:
            return 10 + 5 * self.epoch

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([[i] for i in range(len(self))])

    sampler = Growing()
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_sampler=sampler)
    counts = []
    with dlstore.watch(
        warmup=1, replay_rounds=2, replay_every=8, replay_s=0.0, replay_warmup_s=0.0, trial=False, parts=False,
        quiet=True,
    ) as w:  # fmt: skip
        for e in range(3):
            sampler.epoch = e
            counts.append(sum(1 for _ in loader))
    assert counts == [10, 15, 20]
    rows = w.report["loaders"][0]["rows"]
    assert any(r["phase"] == "replay" and r["epoch"] == 1 for r in rows)  # stand-ins in the longer epoch


def test_a_loader_without_length_gets_no_stand_ins_and_steps_still_stops_it() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.arange(1000).split(1))

    seen = 0
    with dlstore.watch(steps=12, parts=False, quiet=True) as w:
        for _ in DataLoader(Stream(), batch_size=4):
            seen += 1
    rep = w.report["loaders"][0]
    assert w.report["status"] == "stopped" and seen == 12 and rep["stand_in_steps"] == 0
    assert rep["tried"]["replay"] is False and "no len()" in rep["tried"]["why"]
