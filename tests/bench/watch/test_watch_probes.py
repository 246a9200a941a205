"""The recommendations' predicted rates from advised loaders timed alone (``probes``): the arithmetic on
fake measured parts (the H200's shapes: a 0-worker augment loop, 16 workers sharing 16 cores, a cache
with GpuAugment whose launch and device time the gather-only model left out), and the probes run for
real on the CPU (a loader rebuilt with 2 workers, a synthetic RAM cache read by the advised loader)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader, Dataset
from watch_records import raw

from dlstore.bench.watch.analyse import HANDOVER_S, analyse
from dlstore.bench.watch.probes import probe_cache, probe_workers

B = 32
WAIT, HOST = 0.030, 0.005  # a 0-worker loop: 30 ms of loader work in next(), 5 ms of step


def input_bound(cuda: bool = False, cores: int = 16, **probes: Any) -> dict[str, Any]:
    doc = raw(wait=WAIT, host=HOST, replay_period=HOST, getitem=WAIT / B, cores=cores, cuda=cuda)
    ld = doc["loaders"][0]
    ld["settings"]["batches_per_epoch"] = None  # no epoch ends: the loader alone (epochs: test_watch_analyse)
    if cuda:  # the step's device span: 1 ms of its 5 (a launch-bound step)
        ld["device_s"] = [0.001] * len(ld["t_call"])
    ld["probes"] = probes
    return doc


def advice_of(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return next(a for a in analyse([doc])["advice"] if a.get(key))


def serial_of(doc: dict[str, Any]) -> float:
    """The main thread's own cost per step the analysis takes: the smaller of the steady and replayed
    host times (here the replay's, 10 µs short of 5 ms)."""
    return analyse([doc])["loaders"][0]["model"]["limits_ms"]["main"] / 1e3 - WAIT


def test_workers_prediction_without_a_probe_assumes_a_core_per_worker() -> None:
    doc = input_bound()
    a = advice_of(doc, "workers")
    assert a["workers"] == 6  # 30 ms / 6 = 5 ms, the step: the fewest within 5% of the best
    # the main thread binds: a worker's hand-over (0.3 ms, not measured at 0 workers) + the step's host time
    assert a["expected_img_per_s"] == pytest.approx(B / (HANDOVER_S + serial_of(doc)), rel=1e-6)
    assert "modelled" in a["text"]


def test_workers_prediction_from_the_loader_timed_at_n_workers() -> None:
    # at 6 workers the loader alone took 7.5 ms a batch (not 30 / 6 = 5: the workers contend), its main
    # thread 0.3 ms of CPU in next(), the workers 45 ms of CPU a batch
    probe = {"n": 6, "workers": 6, "period_s": 0.0075, "main_s": 0.0003, "workers_cpu_s": 0.045}
    probe["loader_img_per_s"] = B / probe["period_s"]
    doc = input_bound(workers=probe)
    a = advice_of(doc, "workers")
    serial = serial_of(doc)
    # the parts model: the largest of the producer (7.5), main (0.3 + serial), device (5), cores
    # ((45 + 0.3 + serial) / 16)
    period = max(0.0075, 0.0003 + serial, HOST, (0.045 + 0.0003 + serial) / 16)
    assert period == pytest.approx(0.0075)
    assert a["expected_img_per_s"] == pytest.approx(B / period, rel=1e-6)
    assert "the loader alone at 6 workers" in a["text"]
    # on 4 cores the same workers' CPU binds: (60.3 ms + the step) / 4
    doc = input_bound(cores=4, workers={**probe, "n": 4})
    a = advice_of(doc, "workers")
    assert a["workers"] == 4
    assert a["expected_img_per_s"] == pytest.approx(B / ((0.045 + 0.0003 + serial_of(doc)) / 4), rel=1e-6)


def test_a_probe_of_another_worker_count_is_not_used() -> None:
    probe = {"n": 3, "workers": 3, "period_s": 0.5, "main_s": 0.0003, "workers_cpu_s": 1.0}
    a = advice_of(input_bound(workers={**probe, "loader_img_per_s": 64.0}), "workers")
    assert a["workers"] == 6 and "modelled" in a["text"]


def test_a_probe_showing_no_gain_drops_the_workers_advice() -> None:
    slow = {"n": 6, "workers": 6, "period_s": 0.040, "main_s": 0.0003, "workers_cpu_s": 0.3}
    advice = analyse([input_bound(workers={**slow, "loader_img_per_s": B / 0.040})])["advice"]
    assert not any(a.get("workers") for a in advice)


def test_cache_with_gpu_augment_adds_the_loaders_next_and_the_augmentation() -> None:
    doc = input_bound(cuda=True)
    modelled = advice_of(doc, "cache")
    assert modelled["cache"]["gpu"] and "GPU augmentation's cost not included" in modelled["text"]
    # timed on synthetic images: next() + GpuAugment's launch 3 ms per batch in the caller, the
    # augmentation 2 ms on the device (H200: 3.04 ms and 2.15 ms at batch 256, 32 px)
    probe = {"workers": 0, "period_s": 0.003, "main_s": 0.003, "augment_device_s": 0.002, "images": 64}
    doc = input_bound(cuda=True, cache={**probe, "loader_img_per_s": B / 0.003})
    a = advice_of(doc, "cache")
    serial = serial_of(doc)
    # serial at 0 workers: next() and the launch, then the step's own host time; the device (1 + 2 ms)
    # stays under it
    assert a["expected_img_per_s"] == pytest.approx(B / (0.003 + serial), rel=1e-6)
    assert a["expected_img_per_s"] < modelled["expected_img_per_s"]
    assert "timed on 64 synthetic images" in a["text"]


def test_cache_augmentation_on_a_device_bound_step_adds_its_device_time() -> None:
    doc = input_bound(cuda=True)
    ld = doc["loaders"][0]
    ld["device_s"] = [0.0049] * len(ld["t_call"])  # the step's device span nearly all of its 5 ms
    probe = {"workers": 0, "period_s": 0.0005, "main_s": 0.0005, "augment_device_s": 0.002, "images": 64}
    ld["probes"] = {"cache": {**probe, "loader_img_per_s": B / 0.0005}}
    a = advice_of(doc, "cache")
    # the device: 4.9 + 2 ms > the host's 0.5 ms + 5 ms
    assert a["expected_img_per_s"] == pytest.approx(B / 0.0069, rel=0.01)


class Slow(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.transform = T.Compose([T.RandomResizedCrop(8), T.PILToTensor()])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 8, 8), i % 7, dtype=torch.uint8), i % 2


def test_probe_workers_times_the_loop_loader_rebuilt_with_n_workers() -> None:
    loop = DataLoader(Slow(64), batch_size=8, shuffle=True, drop_last=True)
    got = probe_workers(loop, 2, 8, cuda=False, budget_s=0.2)
    assert got["n"] == got["workers"] == 2 and got["batches_timed"] >= 3
    assert got["period_s"] > 0 and got["main_s"] >= 0 and got["workers_cpu_s"] >= 0
    assert got["loader_img_per_s"] == pytest.approx(8 / got["period_s"])


def test_probe_cache_reads_a_synthetic_cache_of_the_advised_shape() -> None:
    loop = DataLoader(Slow(64), batch_size=8, shuffle=True, drop_last=True)
    plan = {"size": 9, "channels": 3, "format": "ram", "in_memory": True, "jpeg": False, "gpu": False}
    got = probe_cache(loop, {**plan, "crop": 8, "degrees": 0.0, "batch": 8}, 8, cuda=False, budget_s=0.2)
    assert got["synthetic"] and got["images"] == 16 and got["workers"] == 0
    assert got["batches_timed"] >= 3 and got["main_s"] > 0
    assert "skipped" in probe_cache(loop, {**plan, "jpeg": True}, 8, cuda=False, budget_s=0.2)


class CallsItsTransform(Dataset):
    """A Dataset that calls ``self.transform`` unconditionally (not torchvision's ``if transform``)."""

    def __init__(self) -> None:
        self.transform = T.PILToTensor()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        return self.transform(Image.new("RGB", (8, 8), (i, 0, 0))), i % 2


def test_parts_of_a_dataset_whose_transform_cannot_be_left_out() -> None:
    from dlstore.bench.watch.loop_parts import measure_parts

    loop = DataLoader(CallsItsTransform(), batch_size=4)
    got = measure_parts(loop, next(iter(loop)), cuda=False, budget_s=0.1)
    assert "skipped" not in got and got["getitem_s"] > 0 and got["collate_s"] is not None
    assert "load_s" not in got  # no split: __getitem__ whole
    assert isinstance(loop.dataset.transform, T.PILToTensor)  # put back


def test_a_device_busy_through_the_replay_names_compute_not_the_host() -> None:
    # replayed steps of 20 ms whose device span covers them: the host's 20 ms is its wait for the device,
    # and the workers' hand-over tips the main term over the device's
    doc = raw(wait=0.0001, host=0.020, workers=4, replay_period=0.020, getitem=0.001 / 32, cuda=True)
    ld = doc["loaders"][0]
    ld["device_s"] = [0.0199] * len(ld["t_call"])
    rep = analyse([doc])["loaders"][0]
    assert rep["model"]["bottleneck"] == "host"  # the parts model's tie
    assert rep["binding"]["stage"] == "compute"
