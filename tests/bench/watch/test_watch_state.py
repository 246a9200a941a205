"""The bench and watch say when a loader in use keeps no state to resume from (issue 24 item 4)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import dlstore
from dlstore.bench.kinds.context import loader_settings as bench_settings
from dlstore.bench.verdict import state_notes
from dlstore.bench.watch.describe_loop import loader_settings as watch_settings
from dlstore.read.order import STATELESS_NOTE


def test_watch_notes_a_plain_dataloader_keeps_no_state() -> None:
    loader = DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4, shuffle=True)
    with dlstore.watch(replay=False, parts=False, quiet=True) as w:
        for _ in loader:
            pass
    assert STATELESS_NOTE in w.report["loaders"][0]["notes"]
    stateful = StatefulDataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4, shuffle=True)
    assert watch_settings(stateful)["keeps_state"] and not watch_settings(loader)["keeps_state"]


def test_bench_notes_the_kinds_that_keep_no_state() -> None:
    plain = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4, shuffle=True)
    assert bench_settings(plain)["keeps_state"] is False
    runs = [
        {"loader": "raw", "loader_settings": bench_settings(plain)},
        {"loader": "pinned", "loader_settings": {"keeps_state": True}},
        {"loader": "raw", "loader_settings": bench_settings(plain)},
    ]
    assert state_notes(runs) == [f"raw: {STATELESS_NOTE}"]
    assert state_notes(runs[1:2]) == []
