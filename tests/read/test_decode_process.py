"""DecodeLoader(decode_in="process"): the same batches as decoding in this process, through a child
interpreter and a ring of shared slots (on the CPU here: shared memory; CUDA IPC in tests/gpu)."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from decode_helpers import RandomDraws, WideningBatch, corrupt_payload, ragged_jpeg_cache

from dlstore.errors import DlstoreError, SampleReadError
from dlstore.gpu.ragged import RaggedRandomResizedCrop
from dlstore.read.decode_process import _target_to, _to_host
from dlstore.read.gpu_decode import DecodeLoader


@pytest.fixture(scope="module")
def jpeg_cache(image_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ragged_jpeg_cache(image_tree, tmp_path_factory.mktemp("decode-process"))


def _loader(path: Path, decode_in: str, **kw: object) -> DecodeLoader:
    crop = RaggedRandomResizedCrop(16, generator=torch.Generator().manual_seed(0))
    return DecodeLoader(
        path,
        batch_size=5,
        transform=crop,
        device="cpu",
        drop_last=False,
        order="random",
        seed=3,
        decode_in=decode_in,
        **kw,  # type: ignore[arg-type]
    )


def _epochs(loader: DecodeLoader, epochs: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def test_the_process_yields_the_same_batches_as_this_process(jpeg_cache: Path) -> None:
    """Same order, labels and pixels (the crop's generator travels with the transform), the last short
    batch included, two epochs through one child; an epoch left early, and resumed from its state."""
    here, there = _loader(jpeg_cache, "thread"), _loader(jpeg_cache, "process")
    try:
        expected, got = _epochs(here), _epochs(there)
        assert len(got) == len(expected) and any(x.shape[0] < 5 for x, _ in got)
        for (a, la), (b, lb) in zip(expected, got):
            assert torch.equal(la, lb) and torch.equal(a, b)
        assert there.stats.cpu_images > 0 and there.stats.batches > 0  # the child's stats came back
        child = there._proc[0].proc  # type: ignore[union-attr]
        there.set_epoch(5)
        first = [b[1].clone() for _, b in zip(range(2), there)]  # left after two batches
        state = there.state_dict()
        assert len([y for _, y in there]) == len(there)  # the next epoch, whole, from the same child
        assert there._proc[0].proc is child  # type: ignore[union-attr]
        here.set_epoch(5)
        whole = torch.cat([y for _, y in here])
    finally:
        there.close()
        here.close()
    assert child.poll() is not None  # close() reaps it
    resumed = _loader(jpeg_cache, "process")
    try:
        resumed.load_state_dict(state)
        assert torch.equal(torch.cat([*first, *(y for _, y in resumed)]), whole)
    finally:
        resumed.close()


def test_two_decode_processes_take_batches_in_turn_each_with_its_own_random_numbers(
    jpeg_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches in the loader's order, the CPU decoders shared out, the stats summed; the two processes
    must not crop alike (the transform's generator and torch's RNG, each the same in both before they
    are seeded apart); under torch.manual_seed the draws repeat."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # the children import decode_helpers

    def loader(**kw: object) -> DecodeLoader:
        torch.manual_seed(0)
        transform = RandomDraws(torch.Generator().manual_seed(5))
        return DecodeLoader(jpeg_cache, 4, transform=transform, device="cpu", order="random", seed=3, **kw)  # type: ignore[arg-type]

    def epoch(ld: DecodeLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
        try:
            return [(x, y) for x, y in ld]
        finally:
            ld.close()

    expected = epoch(loader())
    there = loader(decode_in="process", decode_processes=2, cpu_decoders=2)
    first = epoch(there)
    assert [y.tolist() for _, y in first] == [y.tolist() for _, y in expected]
    assert there.stats.batches == len(first)
    for column in range(2):  # batch 0 from one process, batch 1 from the other
        assert not torch.equal(first[0][0][:, column], first[1][0][:, column])
    again = epoch(loader(decode_in="process", decode_processes=2, cpu_decoders=2))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, again))
    with pytest.raises(ValueError, match="decode_processes"):
        loader(decode_in="process", decode_processes=0)


def test_batches_that_change_shape_get_new_slots(jpeg_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # the child imports decode_helpers

    def epoch(decode_in: str) -> list[torch.Tensor]:
        ld = DecodeLoader(
            jpeg_cache, 2, transform=WideningBatch(), device="cpu", order="sequential", decode_in=decode_in
        )
        try:
            return [x.clone() for x, _ in ld]
        finally:
            ld.close()

    here, there = epoch("thread"), epoch("process")
    assert len({x.shape[1] for x in there}) > 2  # the slots were made again more than once
    assert all(torch.equal(a, b) for a, b in zip(here, there)) and len(here) == len(there)


def test_a_corrupt_payload_is_the_readers_error_in_this_process(jpeg_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(jpeg_cache, bad)
    k, unit_file = corrupt_payload(bad, 9)
    loader = _loader(bad, "process")
    try:
        with pytest.raises((SampleReadError, DlstoreError)) as err:
            for _ in loader:
                pass
        assert "index 9 " in str(err.value) and unit_file.name in str(err.value)
        assert loader._proc is not None and loader._proc[0].alive  # the child reported it and lives on
    finally:
        loader.close()


def test_a_killed_decode_process_is_a_clear_error_and_the_next_epoch_starts_another(jpeg_cache: Path) -> None:
    loader = _loader(jpeg_cache, "process")
    try:
        it = iter(loader)
        next(it)
        first = loader._proc[0].proc  # type: ignore[union-attr]
        os.kill(first.pid, signal.SIGKILL)
        with pytest.raises(DlstoreError, match="decode process exited"):
            for _ in it:
                pass
        assert len([y for _, y in loader]) == len(loader)  # a new child, the whole next epoch
        assert loader._proc[0].proc is not first  # type: ignore[union-attr]
    finally:
        loader.close()


def test_what_cannot_go_to_the_process_is_said_with_the_fix(jpeg_cache: Path) -> None:
    loader = DecodeLoader(
        jpeg_cache, batch_size=4, transform=lambda images: images, device="cpu", decode_in="process"
    )
    with pytest.raises(ValueError, match="decode_in='thread'"):
        next(iter(loader))
    loader.close()


def test_targets_cross_by_value_with_their_types() -> None:
    """Boxes and masks keep their tv_tensors type and metadata through the pickled message."""
    from torchvision import tv_tensors

    boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2.0, 5.0, 6.0]]), format="XYXY", canvas_size=(8, 9))
    target = {"labels": torch.arange(3), "boxes": [boxes], "masks": tv_tensors.Mask(torch.ones(2, 4, 4))}
    back = _target_to(pickle.loads(pickle.dumps(_to_host(target))), torch.device("cpu"))
    assert torch.equal(back["labels"], torch.arange(3))
    assert isinstance(back["boxes"][0], tv_tensors.BoundingBoxes)
    assert back["boxes"][0].canvas_size == (8, 9) and back["boxes"][0].format == boxes.format
    assert isinstance(back["masks"], tv_tensors.Mask)
