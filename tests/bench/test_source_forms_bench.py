"""``dlstore bench SOURCE`` on every SOURCE form (issue 25): the ``raw`` kind reads each form the way
its users do (pyarrow row groups, tar members, PIL from the listed paths, the Dataset itself)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from photo_forms import PhotoDataset, make_photo_folder, write_csv, write_hf_parquet, write_shards

from dlstore.bench.kinds import LoaderContext, prepare_loader
from dlstore.bench.protocol import BenchConfig
from dlstore.cli import main
from dlstore.write.sources import DatasetSource, open_source

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")

N = 16
TINY = ["--batch-size", "8", "--size", "16", "--steps", "2", "--warmup", "1", "--repeats", "1"]
TINY += ["--stage-steps", "1", "--workers", "0", "--no-cold", "--budget", "1"]
KINDS = {"parquet": "parquet", "webdataset": "webdataset", "csv": "filelist", "dataset": "dataset"}


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """name → the SOURCE argument and its options, as typed on the command line."""
    tmp = tmp_path_factory.mktemp("bench_forms")
    root = make_photo_folder(tmp / "photos", N)
    return {
        "parquet": [str(write_hf_parquet(root, tmp / "photos.parquet"))],
        "webdataset": [write_shards(root, tmp / "shards", per_shard=6)],
        "csv": [str(write_csv(root, tmp / "list.csv")), "--root", str(root)],
        "folder": [str(root)],
        "dataset": ["photo_forms:tiny_photo_dataset"],
    }


def test_raw_kind_reads_every_form_with_its_labels(forms: dict[str, list[str]], tmp_path: Path) -> None:
    root = Path(forms["folder"][0])
    sources: dict[str, Any] = {
        name: open_source(args[0], root=Path(args[2]) if len(args) > 2 else None)
        for name, args in forms.items()
    }
    sources["dataset"] = DatasetSource.of(PhotoDataset(root))
    for name, source in sources.items():
        ctx = LoaderContext(BenchConfig(source=name), source, 16, 3, torch.device("cpu"), tmp_path)
        prepared = prepare_loader("raw", ctx)
        ds = prepared.dataset
        assert len(ds) == N, name
        for i in (0, 5, N - 1):
            image, label = ds[i]
            assert tuple(image.shape) == (3, 16, 16) and label == int(source.labels[i]), name


# One small CLI run per form in the default suite: the raw kind reads the form as its users do and the
# run ends in a verdict; on parquet the ram kind also converts from it (the other forms' conversions are
# tests/convert/test_source_forms.py's). About 1.5 s a form after the first here.
@pytest.mark.parametrize(
    ("form", "loaders"), [("parquet", "raw,ram"), ("webdataset", "raw"), ("csv", "raw"), ("dataset", "raw")]
)
def test_bench_runs_on_a_source_form(
    forms: dict[str, list[str]], tmp_path: Path, form: str, loaders: str
) -> None:
    res = CliRunner().invoke(
        main, ["bench", *forms[form], *TINY, "--loaders", loaders, "--out", str(tmp_path / "out"), "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["source"]["kind"], doc["source"]["n_images"], doc["source"]["classes"]) == (KINDS[form], N, 3)
    assert {r["loader"] for r in doc["runs"]} == set(loaders.split(","))
    assert all(r["img_per_s"] > 0 for r in doc["runs"]) and "raw" in doc["verdict"]
