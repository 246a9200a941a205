"""The analysis on records of known cost: the binding stage, the one sentence that leads, the
recommendations with predicted rates, the cache size read off a transform, ranks."""

from __future__ import annotations

import pytest
from watch_records import raw

from dlstore.bench.watch.analyse import analyse, cache_size


def test_zero_worker_input_bound_loop_gets_more_workers_with_a_predicted_rate() -> None:
    # 30 ms of loader work per batch in the main thread, 5 ms of step: data free the loop runs 5 ms a step
    report = analyse([raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)])
    rep = report["loaders"][0]
    assert rep["steady"]["wait_share"] == pytest.approx(30 / 35)
    assert report["verdict"].startswith(
        "CPU transform (RandomResizedCrop, ToTensor), 80% of the loader's work, binds"
    )
    assert "best fix: 6 DataLoader workers, predicted" in report["verdict"]
    assert rep["model"]["data_free_img_per_s"] == pytest.approx(32 / 0.005)
    assert rep["model"]["prediction_error"] == pytest.approx(0.0, abs=0.02)  # the model reproduces the loop
    assert rep["binding"]["stage"] == "transform"
    first = report["advice"][0]
    assert "num_workers=" in first["command"] and first["gain"] > 1.5
    # 8 cores: workers split the 30 ms; the step (5 ms) binds at 6,400 img/s, within the parts model
    assert first["expected_img_per_s"] <= 32 / 0.005 + 1
    assert len(report["advice"]) <= 5
    assert sorted((a["gain"] or 0 for a in report["advice"]), reverse=True) == [
        a["gain"] or 0 for a in report["advice"]
    ]


def test_a_compute_bound_loop_is_named_compute() -> None:
    report = analyse([raw(wait=0.0001, host=0.020, workers=4, replay_period=0.020, getitem=0.001 / 32)])
    rep = report["loaders"][0]
    assert report["verdict"].startswith("The training step binds")
    assert rep["binding"]["stage"] == "compute"
    assert not any("num_workers" in (a["command"] or "") for a in report["advice"])


def test_cache_advice_reads_the_size_off_the_transform() -> None:
    assert (
        cache_size([{"name": "Resize", "size": [256]}, {"name": "CenterCrop", "size": [224, 224]}])[0] == 256
    )
    assert cache_size([{"name": "CenterCrop", "size": [96, 96]}])[0] == 96
    assert cache_size([{"name": "RandomResizedCrop", "size": [224, 224]}])[0] == 256
    assert cache_size([{"name": "ToTensor"}]) is None
    report = analyse([raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32, cores=1)])
    cache = [
        a
        for a in report["advice"]
        if (a["command"] or "").startswith("dlstore convert /data/train DEST --size 256")
    ]
    assert cache and cache[0]["expected_img_per_s"] > report["loaders"][0]["steady"]["img_per_s"]


def test_rank_zero_reports_the_slowest_rank_beside_the_mean() -> None:
    docs = [raw(wait=0.001, host=0.009, rank=0), raw(wait=0.005, host=0.005, rank=1)]
    for d in docs:
        d["world_size"] = 2
    ranks = analyse(docs)["ranks"]
    assert ranks["ranks"] == 2 and ranks["slowest_rank"] == 1
    assert ranks["wait_share_max"] == pytest.approx(0.5)
    assert ranks["wait_share_mean"] == pytest.approx(0.3)
    assert "slowest (rank 1)" in analyse(docs)["detail"]


def test_no_loader_is_a_note_not_an_error() -> None:
    doc = raw(0.0, 0.0)
    doc["loaders"] = []
    report = analyse([doc])
    assert report["loaders"] == [] and "never iterated" in report["verdict"]


def _cut_run(epoch: int, workers: int, getitem: float, steps: int = 40, start_wait: float = 2.0) -> dict:
    """Steps of 35 ms stopped by --steps in epochs of ``epoch`` batches, the first step waiting
    ``start_wait`` more (the workers starting)."""
    doc = raw(wait=0.030, host=0.005, workers=workers, steps=steps, getitem=getitem)
    doc["config"].update(steps=steps, warmup=2)
    ld = doc["loaders"][0]
    ld["settings"]["batches_per_epoch"] = epoch
    for key in ("t_call", "t_ret", "t_next"):  # every step after the first call comes start_wait later
        ld[key] = [t + (start_wait if i or key != "t_call" else 0.0) for i, t in enumerate(ld[key])]
    return doc


def test_a_steps_run_within_one_epoch_is_predicted_without_epoch_starts() -> None:
    # --steps 40 of 500-batch epochs: the timed steps hold no epoch start, so the model may not charge the
    # first step's 2 s start-up over each 500 batches (it did: 12% under the loop's rate)
    rep = analyse([_cut_run(epoch=500, workers=4, getitem=0.140 / 32)])["loaders"][0]
    assert rep["model"]["prediction_error"] == pytest.approx(0.0, abs=0.02)
    # 40 steps of 60-batch epochs: the re-run with the advised workers has no epoch refill in its timed
    # steps either: 30 ms over 6 workers is the 5 ms step's pace, the main thread's 5.3 ms binds (it was
    # predicted 9% lower, with a refill each 60 batches)
    report = analyse([_cut_run(epoch=60, workers=0, getitem=0.030 / 32)])
    advised = next(a for a in report["advice"] if a.get("workers"))
    assert advised["workers"] == 6
    assert advised["expected_img_per_s"] == pytest.approx(32 / (0.005 + 0.0003), rel=0.01)
    # 160 steps of 60-batch epochs: two starts after the warm-up, each over half the 158 timed steps
    long = analyse([_cut_run(epoch=60, workers=0, getitem=0.030 / 32, steps=160)])
    assert (
        next(a for a in long["advice"] if a.get("workers"))["expected_img_per_s"]
        < advised["expected_img_per_s"]
    )
