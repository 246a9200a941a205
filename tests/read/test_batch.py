"""Whole-batch collation and the parallel pin path (dlstore.read.batch)."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from dlstore import CachedDataset, convert
from dlstore.read import batch as batchmod
from dlstore.read.batch import BatchSamples, ImageBatch, Sample, new_batch, pin_parallel
from dlstore.write.options import ConvertOptions


@pytest.fixture(scope="module")
def ram(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("batch") / "ram"
    convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=1))
    return dest


def test_default_collate_hands_the_block_over(ram: Path) -> None:
    ds = CachedDataset(ram)
    samples = ds.__getitems__([4, 0, 2])
    x, y = default_collate(samples)
    assert x.data_ptr() == samples.images.data_ptr()  # no stacking copy
    assert x.shape == (3, 3, 16, 16) and x.dtype == torch.uint8 and y.dtype == torch.int64
    for k, i in enumerate([4, 0, 2]):
        img, lab = ds[i]
        assert torch.equal(x[k], img) and int(y[k]) == lab


def test_regrouped_samples_collate_as_tuples(ram: Path) -> None:
    ds = CachedDataset(ram)
    samples = list(ds.__getitems__([1, 3]))[::-1]  # a user's reordering: no longer one block
    assert all(type(s) is Sample and isinstance(s, tuple) for s in samples)
    x, y = default_collate(samples)
    assert torch.equal(x[0], ds[3][0]) and torch.equal(x[1], ds[1][0]) and y.tolist() == [ds[3][1], ds[1][1]]


def test_custom_collate_sees_plain_samples(ram: Path) -> None:
    ds = CachedDataset(ram)
    got: list[Any] = []

    def collate(batch: Any) -> Any:
        got.extend(batch)
        return torch.stack([img for img, _ in batch])

    x = next(iter(DataLoader(ds, batch_size=4, collate_fn=collate)))
    assert x.shape == (4, 3, 16, 16) and all(isinstance(lab, int) for _, lab in got)
    assert all(type(img) is torch.Tensor and img.shape == (3, 16, 16) for img, _ in got)


def test_image_batch_operations_return_plain_tensors() -> None:
    x = torch.arange(24, dtype=torch.uint8).reshape(1, 2, 3, 4).as_subclass(ImageBatch)
    assert type(x.float()) is torch.Tensor and type(x[0]) is torch.Tensor and type(x + 1) is torch.Tensor


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_worker_batches_arrive_as_image_batches(ram: Path, ctx: str) -> None:
    ds = CachedDataset(ram)
    loader = DataLoader(ds, batch_size=5, num_workers=1, multiprocessing_context=ctx)
    x, y = next(iter(loader))
    assert type(x) is ImageBatch and x.shape == (5, 3, 16, 16)
    assert torch.equal(x.as_subclass(torch.Tensor), torch.stack([ds[i][0] for i in range(5)]))
    assert y.tolist() == [ds[i][1] for i in range(5)]


def test_image_batch_pickles_through_shared_memory() -> None:
    x = new_batch((2, 4, 4, 3), shared=True)
    x.copy_(torch.arange(96, dtype=torch.uint8).reshape(2, 4, 4, 3))
    blob = bytes(ForkingPickler.dumps(x.permute(0, 3, 1, 2).as_subclass(ImageBatch)))
    assert len(blob) < 2048  # a handle, not the pixels
    back = pickle.loads(blob)
    assert type(back) is ImageBatch and torch.equal(back.as_subclass(torch.Tensor), x.permute(0, 3, 1, 2))


def test_new_batch_shared_is_in_a_slot_or_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlstore.read import slots

    assert slots.slot_of(new_batch((2, 3), shared=True)) is not None  # memfd slots on Linux
    monkeypatch.setattr(slots, "enabled", False)
    x = new_batch((2, 3), shared=True)
    assert x.is_shared() and slots.slot_of(x) is None
    assert not new_batch((2, 3), shared=False).is_shared()


def test_new_batch_reuses_a_released_buffer_in_process() -> None:
    """0 workers: a released batch's memory is reused, not a fresh (page-faulting) allocation."""
    x = new_batch((4, 8, 8, 3), shared=False)
    address = x.data_ptr()
    kept = new_batch((4, 8, 8, 3), shared=False)  # x is still alive: another buffer
    assert kept.data_ptr() != address
    del x
    assert new_batch((4, 8, 8, 3), shared=False).data_ptr() == address
    held = [new_batch((4, 8, 8, 3), shared=False) for _ in range(8)]  # beyond the pool: allocated
    assert len({t.data_ptr() for t in held}) == 8
    bigger = new_batch((8, 8, 8, 3), shared=False)  # a larger batch than the slots: still served
    assert bigger.shape == (8, 8, 8, 3)


@pytest.mark.parametrize("shape", [(3, 5, 7, 3), (64, 64, 64, 3)])  # below and above the split size
def test_pin_parallel_copies_every_byte_with_the_same_strides(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.empty_strided
    monkeypatch.setattr(batchmod.torch, "empty_strided", lambda *a, pin_memory=False, **k: real(*a, **k))
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8))
    chw = src.permute(0, 3, 1, 2)
    out = pin_parallel(chw)
    assert out.stride() == chw.stride() and torch.equal(out, chw) and out.data_ptr() != chw.data_ptr()


def test_batch_samples_is_a_sequence_of_samples(ram: Path) -> None:
    s = CachedDataset(ram).__getitems__([0, 1, 2])
    assert isinstance(s, BatchSamples) and len(s) == 3 and len(s[1:]) == 2
    img, lab = s[2]
    assert img.shape == (3, 16, 16) and isinstance(lab, int)


def test_labels_travel_inline_and_arrive_plain() -> None:
    from dlstore.read.batch import InlineTensor

    y = torch.arange(5).as_subclass(InlineTensor)
    back = pickle.loads(bytes(ForkingPickler.dumps(y)))
    assert type(back) is torch.Tensor and back.tolist() == [0, 1, 2, 3, 4] and not back.is_shared()


def test_worker_labels_are_plain_int64(ram: Path) -> None:
    loader = DataLoader(CachedDataset(ram), batch_size=4, num_workers=1)
    _, y = next(iter(loader))
    assert type(y) is torch.Tensor and y.dtype == torch.int64


def test_worker_readers_share_the_cores(ram: Path) -> None:
    import os

    class Probe(CachedDataset):
        def __getitems__(self, indices):  # type: ignore[no-untyped-def]
            samples = super().__getitems__(indices)
            samples.labels[:] = self.cache.reader.threads  # report this worker's reader threads
            return samples

    cores = len(os.sched_getaffinity(0))
    loader = DataLoader(Probe(ram), batch_size=2, num_workers=2)
    _, y = next(iter(loader))
    assert set(y.tolist()) == {max(1, min(4, cores // 2))}
