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
    from dlstore.bench.watch.parts import measure_parts

    ds = ImageFolder(tiny_folder, transform=T.Compose([T.RandomRotation(10), T.ToTensor()]))
    loader = DataLoader(ds, batch_size=4)
    parts = measure_parts(loader, next(iter(loader)), cuda=False, budget_s=0.3)
    for key in ("getitem_s", "load_s", "read_s", "decode_s", "transform_s", "collate_s"):
        assert parts[key] is not None and parts[key] > 0, key
    assert parts["collate_batch"] == 4 and "h2d" not in parts


def test_replay_rounds_are_spaced_and_the_rate_is_the_median_round() -> None:
    loader = DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4)  # 10 steps an epoch
    with dlstore.watch(
        replay_at=10, replay_every=10, replay_rounds=3, replay_s=0.0, replay_steps=6, replay_batches=2,
        trial=False, parts=False, warmup=0, quiet=True,
    ) as w:  # fmt: skip
        for _ in range(4):
            for _batch in loader:
                pass
    rep = w.report["loaders"][0]
    rows = rep["rows"]
    starts = [r["step"] for r in rows if r["phase"] == "replay" and rows[r["step"] - 1]["phase"] != "replay"]
    assert rep["steps_observed"] == 40 and len(starts) == 3
    for k, first in enumerate(starts, 1):
        # each round ran inside the call that ended epoch k-1 (at 10, 20, 30 real steps): right before
        # the loop's own code after the epoch (the accuracy study's independent replay runs there)
        assert sum(r["phase"] not in ("replay", "trial") for r in rows[:first]) == 10 * k
        assert rows[first]["epoch"] == k - 1
        end = next(r["step"] for r in rows[first:] if r["phase"] != "replay")
        assert rows[end]["epoch"] == k
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
    from dlstore.bench.watch.config import WatchConfig, WatchError

    with pytest.raises(WatchError, match="positive"):
        WatchConfig(**{field: 0})
