"""Every command and the Python example in README.md and docs/*.md run as written (on small demo data)."""

from __future__ import annotations

import json
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
RUN = ("python", "sh")  # the fences that run; another language (text, json) is not code
# A fence's info after the language: "no-test: WHY" leaves the block out (kept rare; the reason is read).
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", flags=re.S | re.M)
# A training script of the user's kind, for `dlstore watch -- python train.py`.
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


def fences(page: Path) -> list[tuple[str, str, str]]:
    """(language, the rest of the fence's info, code) of every fenced block on the page."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in FENCE.finditer(page.read_text())]


def runnable(page: Path) -> list[tuple[str, str]]:
    return [
        (lang, code) for lang, info, code in fences(page) if lang in RUN and not info.startswith("no-test:")
    ]


def test_every_fence_is_code_that_runs_or_says_why_not() -> None:
    skipped = []
    for page in PAGES:
        for lang, info, _ in fences(page):
            assert lang in (*RUN, "text", "json"), f"{page.name}: a ```{lang} block (use sh or python)"
            if info:
                assert info.startswith("no-test: ") and len(info) > 20, f"{page.name}: ```{lang} {info}"
                skipped.append(page.name)
    assert len(skipped) <= 2, skipped


def test_readme_starts_where_a_user_starts() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150
    first = "\n".join(lines[:40])
    # the first screen quotes the recorded GPU run of the journey: watch, --apply, the cache as printed
    run = json.loads(
        (README.parent / "benchmarks/results/watch_gpu_scripts/h100_imagenet/gpu_scripts.json").read_text()
    )
    case = run["cases"]["imagenet"]
    figures = [case["watch"]["applied"]["measured_img_per_s"], case["cache"]["measured_img_per_s"]]
    assert "dlstore watch -- python train.py" in first and "--apply" in first
    assert all(f"{v:,.0f}" in first for v in figures), figures
    assert text.index("dlstore watch") < text.index("dlstore convert photos/") < text.index("make demo")
    assert 'CachedDataset("cache/photos", transform=' in text
    assert "from dlstore import ConvertOptions, convert, verify" in text
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (README.parent / link).exists(), link


def shell_lines(code: str) -> list[str]:
    """The commands of a shell block: comments dropped, continued lines joined."""
    text = code.replace("\\\n", " ")
    return [line for line in (shlex.join(shlex.split(x, comments=True)) for x in text.splitlines()) if line]


def run_shell(line: str) -> None:
    args = shlex.split(line)
    if args[0] == "dlstore":  # in this process: fast, and a failure shows click's own output
        result = CliRunner().invoke(main, args[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{line}\n{result.output}"
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if args[0] == "torchrun":  # ranks on the CPU (gloo): CI has no GPU
        line = shlex.join([sys.executable, "-m", "torch.distributed.run", *args[1:]])
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(line, shell=True, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def run_page(page: Path) -> None:
    """Every block of the page in order, in the current folder, as a reader following the page would."""
    for lang, code in runnable(page):
        if lang == "sh":
            for line in shell_lines(code):
                run_shell(line)
        else:
            exec(compile(code, str(page), "exec"), {"__name__": "__main__"})


def world_for(page: Path, root: Path) -> dict[str, str]:
    """What the page's blocks expect to find in the folder they run in; the environment they run with."""
    from photo_forms import make_photo_folder, write_csv, write_hf_parquet, write_shards

    env = {"DLSTORE_DEMO_DIR": str(root / ".demo"), "DLSTORE_BENCH_CACHE": str(root / ".bench-cache")}
    (root / "train.py").write_text(TRAIN_PY)
    if page.name in ("README.md", "sources.md"):
        make_photo_folder(root / "photos", 12)
    if page.name == "sources.md":
        pytest.importorskip("pyarrow")
        pytest.importorskip("webdataset")
        write_hf_parquet(root / "photos", root / "photos.parquet")
        write_shards(root / "photos", root / "shards", per_shard=6)
        write_csv(root / "photos", root / "list.csv")
        (root / "mydata.py").write_text(
            "from photo_forms import PhotoDataset\n\ndef photos():\n    return PhotoDataset('photos')\n"
        )
    if page.name == "fields.md":
        fields_data(root)
    return env


@pytest.mark.parametrize(
    "page", [p for p in PAGES if runnable(p) and p.name != "scale.md"], ids=lambda p: p.name
)
def test_every_block_of_the_page_runs_as_written(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # MODULE:CALLABLE sources import from here
    for key, value in world_for(page, tmp_path).items():
        monkeypatch.setenv(key, value)
    run_page(page)


def test_the_readme_checkpoint_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as written twice: the second run finds ckpt.pt at the end of epoch 2 and does nothing more;
    stopped mid-epoch, it runs only the rest."""
    import torch

    monkeypatch.chdir(tmp_path)
    from photo_forms import make_photo_folder

    make_photo_folder(tmp_path / "photos", 12)
    assert CliRunner().invoke(main, ["convert", "photos/", "cache/photos", "--size", "256"]).exit_code == 0
    (code,) = [code for lang, code in runnable(README) if lang == "python" and "ckpt.pt" in code]
    exec(compile(code, "README.md", "exec"), {})
    done = torch.load("ckpt.pt")["loader"]
    assert done["epoch"] == 2 and done["consumed"] == 0  # two epochs done, the next is the third
    torch.save({**torch.load("ckpt.pt"), "loader": {**done, "epoch": 1, "consumed": 4}}, "ckpt.pt")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert torch.load("ckpt.pt")["loader"]["epoch"] == 2 and namespace["epoch"] == 1  # it ran the rest


@pytest.mark.s3
def test_scale_page_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/scale.md: Dask conversion, torchrun DDP on CPU (gloo), caches on a local S3 server."""
    pytest.importorskip("moto.server")
    from s3server import aws_env, start_server

    from dlstore.storage.stores import RemoteStore

    page = README.parent / "docs" / "scale.md"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLSTORE_SPOOL", str(tmp_path / "spool"))
    (tmp_path / "benchmarks").symlink_to(README.parent / "benchmarks")
    server = start_server()
    try:
        for key, value in {**world_for(page, tmp_path), **aws_env(server)}.items():
            monkeypatch.setenv(key, value)
        code = "".join(code for lang, code in runnable(page) if lang == "sh")
        for bucket in {c.split("s3://")[1].split("/")[0] for c in shell_lines(code) if "s3://" in c}:
            RemoteStore(f"s3://{bucket}").fs.mkdir(bucket)  # the page assumes the bucket exists
        run_page(page)
    finally:
        server.stop()


def test_make_targets_named_in_readme_exist() -> None:
    makefile = (README.parent / "Makefile").read_text()
    named = re.findall(r"^make (\w+)", README.read_text(), flags=re.M)
    assert {"demo", "test"} <= set(named)
    for target in named:
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


def test_make_demo_benches_the_cache_it_made_from_the_same_images_with_pip_quiet(tmp_path: Path) -> None:
    done = subprocess.run(
        ["make", "-n", "-B", "demo", f"VENV={tmp_path / 'venv'}"],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [shlex.split(line) for line in done.stdout.splitlines() if line.strip()]
    pips = [args for args in lines if "pip" in args]
    assert len(pips) == 3 and all("-q" in args for args in pips)

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    dlstore = [args for args in lines if args[0].endswith("/bin/dlstore")]
    (convert,) = [a for a in dlstore if a[1] == "convert"]
    (bench,) = [a for a in dlstore if a[1] == "bench"]
    assert convert[2] == bench[2] == "demo"
    for name in ("--size", "--demo-images"):
        assert flag(convert, name) == flag(bench, name)
    assert flag(bench, "--cache") == convert[3]
