"""Every command and the Python example in README.md and docs/*.md run as written (on small demo data)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlstore.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]
# A training script of the user's kind, for the README's `dlstore watch -- python train.py`.
TRAIN_PY = """
import torch
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.rand(96, 3, 8, 8), torch.randint(0, 2, (96,)))
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    for x, y in DataLoader(data, batch_size=8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def blocks(lang: str) -> list[str]:
    return [b for page in PAGES for b in re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)]


def test_readme_is_short_and_starts_where_a_user_starts() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    assert any("make demo" in line for line in lines[:40])
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", README.read_text()):
        assert (README.parent / link).exists(), link


def test_readme_watch_command_runs_on_a_training_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (command,) = [
        line[2:] for block in blocks("watch") for line in block.splitlines() if line.startswith("$ ")
    ]
    args = shlex.split(command)
    assert args[:2] == ["dlstore", "watch"]
    result = CliRunner().invoke(main, args[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_readme_commands_and_example_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLSTORE_DEMO_DIR", str(tmp_path / "demo"))
    monkeypatch.setenv("DLSTORE_BENCH_CACHE", str(tmp_path / "bench-cache"))
    commands = [
        line[2:] for block in blocks("console") for line in block.splitlines() if line.startswith("$ ")
    ]
    assert any(c.startswith("dlstore convert") for c in commands) and any(
        c.startswith("dlstore bench") for c in commands
    )
    for command in commands:
        args = shlex.split(command)
        assert args[0] == "dlstore"
        result = CliRunner().invoke(main, args[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{command}\n{result.output}"
    assert (tmp_path / "bench-out" / "result.json").is_file()
    (example,) = blocks("python")
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    (pattern,) = blocks("python checkpoint")
    import torch

    namespace["model"] = torch.nn.Linear(2, 2)
    fresh = namespace["Loader"]("cache/zarr", batch_size=32, device="cpu").state_dict()
    torch.save({"loader": fresh}, "ckpt.pt")
    exec(compile(pattern, str(README), "exec"), namespace)
    assert torch.load("ckpt.pt")["loader"]["epoch"] == 2  # two epochs done, the next is the third
    torch.save({"loader": {**fresh, "epoch": 1, "consumed": 64}}, "ckpt.pt")  # stopped in the second
    exec(compile(pattern, str(README), "exec"), namespace)
    assert torch.load("ckpt.pt")["loader"]["epoch"] == 2 and namespace["epoch"] == 1  # it ran the rest


@pytest.mark.s3
def test_readme_scale_commands_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Scale section: Dask conversion, torchrun DDP on CPU (gloo), a cache on a local S3 server."""
    pytest.importorskip("moto.server")
    from s3server import aws_env, start_server

    from dlstore.storage.stores import RemoteStore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLSTORE_DEMO_DIR", str(tmp_path / "demo"))
    monkeypatch.setenv("DLSTORE_SPOOL", str(tmp_path / "spool"))
    (tmp_path / "benchmarks").symlink_to(README.parent / "benchmarks")
    server = start_server()
    try:
        for name, value in aws_env(server).items():
            monkeypatch.setenv(name, value)
        commands = [line[2:] for line in blocks("scale")[0].splitlines() if line.startswith("$ ")]
        buckets = {c.split("s3://")[1].split("/")[0] for c in commands if "s3://" in c}
        for bucket in buckets:  # the README assumes the bucket exists
            RemoteStore(f"s3://{bucket}").fs.mkdir(bucket)
        assert len(commands) >= 3 and any("--scheduler" in c for c in commands)
        for command in commands:
            run_scale_command(shlex.split(command))
    finally:
        server.stop()


def run_scale_command(args: list[str]) -> None:
    if args[0] == "dlstore":
        result = CliRunner().invoke(main, args[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{shlex.join(args)}\n{result.output}"
        return
    assert args[0] == "torchrun", args
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_make_targets_named_in_readme_exist() -> None:
    makefile = (README.parent / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", blocks("sh")[0], flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def fields_data(root: Path) -> None:
    """What docs/fields.md converts: a tiny COCO set and a VOC-style pair of folders."""
    import json

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "coco" / "images").mkdir(parents=True)
    for d in ("JPEGImages", "SegmentationClass"):
        (root / "voc" / d).mkdir(parents=True)
    images, anns = [], []
    for i in range(4):
        w, h = 80 + 10 * i, 70
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
            root / "coco" / "images" / f"{i}.jpg"
        )
        images.append({"id": i, "file_name": f"{i}.jpg", "width": w, "height": h})
        poly = [10, 10, 60, 12, 40, 60]
        anns.append(
            {"id": i, "image_id": i, "category_id": 1, "bbox": [10, 10, 50, 50], "segmentation": [poly]}
        )
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
            root / "voc" / "JPEGImages" / f"{i}.jpg"
        )
        Image.fromarray((rng.integers(0, 3, (h, w))).astype(np.uint8)).save(
            root / "voc" / "SegmentationClass" / f"{i}.png"
        )
    doc = {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]}
    (root / "coco" / "ann.json").write_text(json.dumps(doc))
    fields_parquet(root / "photos.parquet", root / "coco" / "images", root / "voc" / "SegmentationClass")


def fields_parquet(out: Path, images: Path, masks: Path) -> None:
    """docs/fields.md's `--field` example: images, PNG masks, boxes, their labels and tags as columns."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rows = []
    for i in range(4):
        with Image.open(images / f"{i}.jpg") as img:
            w, h = img.size
        mask = Image.open(masks / f"{i}.png").resize((w, h))
        buf = io.BytesIO()
        mask.save(buf, "PNG")
        rows.append((images / f"{i}.jpg", buf.getvalue(), [[4.0, 5.0, w / 2, h / 2]], [1], [i % 2, 1]))
    table = pa.table(
        {
            "image": pa.array([p.read_bytes() for p, *_ in rows], pa.binary()),
            "seg": pa.array([r[1] for r in rows], pa.binary()),
            "objects": pa.array([r[2] for r in rows], pa.list_(pa.list_(pa.float64()))),
            "object_labels": pa.array([r[3] for r in rows], pa.list_(pa.int64())),
            "tags": pa.array([r[4] for r in rows], pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, out)


def test_fields_page_commands_and_example_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fields_data(tmp_path)
    commands = [
        line[2:] for block in blocks("fields") for line in block.splitlines() if line.startswith("$ ")
    ]
    assert len(commands) >= 3
    for command in commands:
        args = shlex.split(command)
        assert args[0] == "dlstore"
        result = CliRunner().invoke(main, args[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{command}\n{result.output}"
    (example,) = blocks("fields-python")
    exec(compile(example, "docs/fields.md", "exec"), {})


def test_readme_source_forms_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SOURCE form's line, on the same photographs written in that form (tests/photo_forms.py)."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("webdataset")
    from photo_forms import make_photo_folder, write_csv, write_hf_parquet, write_shards

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = make_photo_folder(Path("photos"), 8)
    write_hf_parquet(root, Path("photos.parquet"))
    write_shards(root, Path("shards"), per_shard=4)
    write_csv(root, Path("list.csv"))
    Path("mydata.py").write_text(
        "from photo_forms import PhotoDataset\n\ndef photos():\n    return PhotoDataset('photos')\n"
    )
    commands = [
        line[2:] for block in blocks("sources") for line in block.splitlines() if line.startswith("$ ")
    ]
    assert len(commands) == 5
    for command in commands:
        args = shlex.split(command, comments=True)
        result = CliRunner().invoke(main, [*args[1:], "--workers", "1"], catch_exceptions=False)
        assert result.exit_code == 0, f"{command}\n{result.output}"
        assert "8 images" in result.output, result.output
