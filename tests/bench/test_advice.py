"""The one advice engine (``dlstore.bench.advice``) as bench and watch use it: the snippet reproduces the
user's transform (or names what it cannot), the convert command is read off the datasets people use
(torchvision, timm, a DatasetFolder subclass, a Hugging Face table, a list of paths, a module's Dataset),
predictions hold over short epochs, a compute-bound recording is named compute, and the report leads
with one plain sentence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from torch.utils.data import Dataset, IterableDataset
from torchvision.datasets import DatasetFolder, ImageFolder
from watch_records import raw, recorded

from dlstore.bench import advice as rules
from dlstore.bench.predict import FedTiming, LoaderTiming, LoopParts, compose, over_epochs
from dlstore.bench.watch.analyse import analyse
from dlstore.bench.watch.describe_loop import convert_source, dataset_info, transform_steps
from dlstore.bench.watch.watch_report import text_report

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN = T.Compose(
    [
        T.RandomResizedCrop(176, scale=(0.35, 1.0), ratio=(0.8, 1.25)),
        T.RandomHorizontalFlip(p=0.3),
        T.ToTensor(),
        T.ConvertImageDtype(torch.bfloat16),
        T.Normalize(MEAN, STD),
    ]
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(root / c / f"{i}.jpg")
    return root


# -- the snippet is the measured code -------------------------------------------------------------------


def test_gpu_augment_reproduces_normalize_crop_flip_and_dtype() -> None:
    kw, missing = rules.gpu_augment(transform_steps(TRAIN), 201)
    assert kw == {
        "size": 176,
        "scale": (0.35, 1.0),
        "ratio": (0.8, 1.25),
        "hflip_p": 0.3,
        "out_dtype": "torch.bfloat16",
        "mean": MEAN,
        "std": STD,
    }
    assert missing == []
    code = rules.augment_code(kw)
    assert code.startswith("dlstore.gpu.GpuAugment(176, scale=(0.35, 1.0)") and f"mean={MEAN}" in code
    # the snippet builds: the same module the probe and --try-cache time
    from dlstore.bench.watch.probes import augment_kwargs
    from dlstore.gpu import GpuAugment

    aug = GpuAugment(**augment_kwargs({"augment": kw}))
    out = aug(torch.zeros(2, 3, 201, 201, dtype=torch.uint8))
    assert out.shape == (2, 3, 176, 176) and out.dtype == torch.bfloat16
    assert out[0, 0, 0, 0].item() == pytest.approx(-MEAN[0] / STD[0], rel=1e-2)  # Normalize kept


def test_what_gpu_augment_cannot_do_is_named() -> None:
    tf = T.Compose([T.Resize(256), T.RandomCrop(224), T.ColorJitter(0.4), T.ToTensor()])
    kw, missing = rules.gpu_augment(transform_steps(tf), 256)
    assert missing == ["RandomCrop", "ColorJitter"] and kw["scale"] == (1.0, 1.0) and kw["hflip_p"] == 0.0


def test_cache_advice_keeps_normalize_and_says_what_the_centre_crop_hides(folder: Path) -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32, cuda=True)
    ds = dataset_info(ImageFolder(str(folder), transform=TRAIN))
    doc["loaders"][0]["dataset"] = ds
    cache = next(a for a in analyse([doc])["advice"] if a.get("cache"))
    assert f"dlstore convert {folder} DEST --size 201 --format ram" in cache["command"]
    assert f"mean={MEAN}, std={STD}" in cache["command"] and "scale=(0.35, 1.0)" in cache["command"]
    assert "RandomResizedCrop no longer sees the image's borders" in cache["text"]
    assert f"dlstore convert {folder} DEST --size 201 --resize shorter --format npz" in cache["text"]
    assert cache["cache"]["augment"]["hflip_p"] == 0.3


# -- datasets beyond ImageFolder --------------------------------------------------------------------------


class Plain(DatasetFolder):
    """A DatasetFolder subclass of one's own."""

    def __init__(self, root: str) -> None:
        super().__init__(root, loader=lambda p: Image.open(p), extensions=(".jpg",))


class Listed(Dataset):
    def __init__(self, paths: list[str]) -> None:
        self.paths, self.labels = paths, [i % 2 for i in range(len(paths))]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        return Image.open(self.paths[i]), self.labels[i]


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from ()


def test_convert_sources_read_off_the_datasets_people_use(folder: Path) -> None:
    assert convert_source(ImageFolder(str(folder)))["source"] == str(folder)
    assert convert_source(Plain(str(folder))) == {"source": str(folder), "extra": "", "root": str(folder)}
    # a list of paths: a CSV written from the dataset itself, then the CSV form of convert
    paths = sorted(str(p) for p in folder.rglob("*.jpg"))
    got = convert_source(Listed(paths))
    assert got["source"] == "files.csv" and "ds.paths" in got["prepare"] and "ds.labels" in got["prepare"]
    ds = Listed(paths)  # the prepare line runs as printed, and dlstore reads the file it writes
    import os

    here = os.getcwd()
    os.chdir(folder)
    try:
        exec(got["prepare"], {"ds": ds})
        from dlstore.write.sources import open_source

        assert len(open_source("files.csv")) == 6
    finally:
        os.chdir(here)
    assert "IterableDataset" in convert_source(Stream())["why"]
    # a Dataset of a module that names no files: MODULE:CALLABLE
    got = convert_source(Listed.__new__(Listed))
    assert got["source"] == f"{__name__}:CALLABLE" and "transform=None" in got["why_callable"]


def test_timm_image_dataset_gives_its_folder(folder: Path) -> None:
    timm_data = pytest.importorskip("timm.data")
    ds = timm_data.ImageDataset(str(folder), transform=timm_data.create_transform(224, is_training=True))
    info = dataset_info(ds)
    assert info["convert"]["source"] == str(folder) and info["image_folder"]
    # timm's own transform: its crop, flip and Normalize (tensors) reproduced, its ColorJitter named
    kw, missing = rules.gpu_augment(info["transforms"], 256)
    assert kw == {"size": 224, "scale": (0.08, 1.0), "ratio": (0.75, 1.3333), "hflip_p": 0.5, "mean": MEAN,
                  "std": STD}  # fmt: skip
    assert missing == ["ColorJitter"]


def test_a_hugging_face_table_with_an_image_column_goes_through_parquet() -> None:
    Image_, ClassLabel = type("Image", (), {}), type("ClassLabel", (), {})
    hf = type("Dataset", (), {"__module__": "datasets.arrow_dataset", "to_parquet": lambda self, p: None})()
    hf.features = {"img": Image_(), "fine": ClassLabel()}
    got = convert_source(hf)
    assert got == {
        "source": "train.parquet",
        "extra": " --label fine",
        "prepare": "ds.to_parquet('train.parquet')",
    }
    hf.features = {"text": object()}
    assert "no Image column" in convert_source(hf)["why"]


def test_a_dataset_whose_attributes_raise_gets_no_cache_advice_and_no_error() -> None:
    class Odd(Dataset):
        @property
        def samples(self) -> list[str]:
            raise RuntimeError("not loaded yet")

        def __len__(self) -> int:
            return 4

    info = dataset_info(Odd())
    assert info["convert"] == {"why": "reading Odd's files failed (RuntimeError: not loaded yet)"}


def test_a_dataset_defined_in_the_script_says_why_there_is_no_cache_advice() -> None:
    local = type("Mine", (Dataset,), {"__module__": "__main__", "__len__": lambda s: 64})()
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    doc["loaders"][0]["dataset"]["convert"] = convert_source(local)
    report = analyse([doc])
    assert not any(a.get("cache") for a in report["advice"])
    assert any(n.startswith("No cache advice: Mine is defined in the script itself") for n in report["notes"])


# -- predictions for the epoch the script has --------------------------------------------------------------


def test_a_whole_epoch_in_flight_pays_its_start_each_epoch() -> None:
    # 16 workers build a 32-image batch in 80 ms each (5 ms a batch together); the step takes 4 ms
    loader = LoaderTiming(0.005, 0.0002, 0.080, in_caller=False)
    fed = FedTiming(0.004, 0.001)
    long = compose(LoopParts(32, 16, loader, fed, cores=64)).period_s
    assert long == pytest.approx(0.005)
    # 32-batch epochs on a CPU step (nothing runs during a refill): each starts empty, its first 16 batches come after one build (80 ms), the next 16
    # one build later; the loop consumes the first 16 at 4 ms each meanwhile: 160 ms + 16 × 4 ms... the
    # parts model: refill 80 + max(32 × 4, 31 × steady + 4) = 80 + 128 → 6.5 ms a batch, not 5
    short = LoopParts(32, 16, over_epochs(loader, 16, 32), fed, cores=64, step_on_host=True)
    assert compose(short).period_s == pytest.approx((0.080 + 32 * 0.004) / 32)
    # a worker start-up each epoch (workers not persistent) adds to it
    started = LoopParts(32, 16, over_epochs(loader, 16, 32, startup_s=0.1), fed, cores=64, step_on_host=True)
    assert compose(started).period_s == pytest.approx((0.180 + 32 * 0.004) / 32)
    assert over_epochs(loader, 16, None) is loader
    # a device slower than the main thread (6 ms vs 1.2): the host's lead over 31 steps (4.8 ms each)
    # hides the 80 ms refill
    gpu = LoopParts(32, 16, over_epochs(loader, 16, 32), FedTiming(0.006, 0.001, 0.006), cores=64)
    assert compose(gpu).period_s == pytest.approx(0.006)


def test_the_workers_advice_counts_the_scripts_short_epochs() -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    long = next(a for a in analyse([doc])["advice"] if a.get("workers"))
    doc["loaders"][0]["settings"]["batches_per_epoch"] = 8
    short = next(a for a in analyse([doc])["advice"] if a.get("workers"))
    assert short["expected_img_per_s"] < 0.9 * long["expected_img_per_s"]
    assert "over epochs of 8 batches each starting with an empty queue" in short["text"]


# -- the verdict and the sentence that leads -----------------------------------------------------------


def test_a_recorded_compute_bound_loop_is_named_compute() -> None:
    """ResNet-50 on the H200 (benchmarks/results/watch_h200): the loop 3,465 img/s, with data free 3,589."""
    report = analyse([recorded("resnet50_h200")])
    rep = report["loaders"][0]
    assert rep["binding"]["stage"] == "compute"
    # its 16-batch epochs each start with an empty queue (p95 wait 79 ms), hidden behind the steps the host
    # launched ahead of the device: the prediction for the loop as it runs holds
    assert abs(rep["model"]["prediction_error"]) < 0.05
    assert report["verdict"].startswith("The training step binds: the loop runs 3,465 img/s")
    assert not any("num_workers" in (a["command"] or "") for a in report["advice"])
    first = text_report(report).splitlines()[0]
    assert first == report["verdict"] and "input-bound" not in text_report(report)


def test_the_report_leads_with_one_sentence_and_counts_in_good_english() -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    report = analyse([doc])
    text = text_report(report)
    lead = text.splitlines()[0]
    assert lead == report["verdict"] and lead.count(". ") == 0 and lead.endswith(".")
    assert lead.startswith("CPU transform (RandomResizedCrop, ToTensor), 80% of the loader's work, binds: ")
    assert "waits for data 86% of the time" in lead and "best fix: 6 DataLoader workers, predicted" in lead
    for jargon in ("parts model", "TF's profiler", "256/224", "input-bound"):
        assert jargon not in text
    # one worker, one epoch: singular nouns and verbs
    doc = raw(wait=0.030, host=0.005, workers=1, replay_period=0.005, getitem=0.030 / 32)
    text = text_report(analyse([doc]))
    assert "1 worker reaches" in text and "over 1 epoch," in text and "1 epochs" not in text
    assert rules.plural(1, "image") == "1 image" and rules.plural(8, "batch", "batches") == "8 batches"


def test_untried_predictions_are_marked_with_how_to_try_them() -> None:
    doc = raw(wait=0.030, host=0.005, replay_period=0.005, getitem=0.030 / 32)
    doc["loaders"][0]["tried"] = {
        "pause_at": 100,
        "replay": False,
        "trial": False,
        "why": "the run ended after 14 real steps, before watch's pause at step 100",
        "how": "run the script longer",
    }
    report = analyse([doc])
    line = next(r for r in report["recommendations"] if "num_workers" in r)
    assert line.endswith(
        "(Not tried: the run ended after 14 real steps, before watch's pause at step 100; run the script longer)"
    )
