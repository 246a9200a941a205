"""A small real bench over demo data with every loader kind and workers 0 and 2, through the CLI."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dlstore.bench.predict import BOTTLENECKS
from dlstore.bench.protocol import STAGES, cycle_window
from dlstore.cli import main

TINY = [
    "--demo-images",
    "40",
    "--batch-size",
    "8",
    "--size",
    "16",
    "--steps",
    "3",
    "--warmup",
    "2",
    "--repeats",
    "1",
    "--stage-steps",
    "2",
]


@pytest.fixture(scope="module")
def env(bench_env: Path) -> Path:
    return bench_env


@pytest.fixture(scope="module")
def result(env: Path) -> tuple[dict[str, Any], Path]:
    out = env / "out"
    res = CliRunner().invoke(
        main,
        ["bench", *TINY, "--workers", "0,2", "--loaders", "raw,ram,npz,zarr", "--out", str(out), "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), out  # stdout holds exactly one JSON document


def test_every_kind_and_worker_count_ran(result: tuple[dict[str, Any], Path]) -> None:
    doc, _ = result
    assert {(r["loader"], r["workers"]) for r in doc["runs"]} == {
        (k, w) for k in ("raw", "ram", "npz", "zarr") for w in (0, 2)
    }
    for r in doc["runs"]:
        assert r["img_per_s"] > 0 and r["predicted_img_per_s"] > 0
        assert r["bottleneck"] in BOTTLENECKS
        assert r["wait"]["sum_over_wall"] >= 0 and r["wait"]["p95_ms"] >= r["wait"]["median_ms"] >= 0
    assert set(doc["cold"]) == {"raw", "ram", "npz", "zarr"}


def test_zero_worker_runs_are_predicted_from_the_loader_probed_around_them(
    result: tuple[dict[str, Any], Path],
) -> None:
    # a loader working in next() is timed alone and beside the step right before and right after its run;
    # the prediction's producer and main-thread terms use those probes, not the parts-phase timing (worker
    # runs have no probe)
    doc, _ = result
    for r in doc["runs"]:
        probe = r["loader_probe"]
        if r["workers"] > 0:
            assert probe is None
            continue
        assert [s["when"] for s in probe["samples"]] == ["before", "after"]
        assert probe["batches"] >= 6 and probe["main_s"] > 0
        assert sum(s["batches"] for s in probe["samples"]) == probe["batches"]
        assert probe["beside_batches"] >= 6 and probe["beside_serial_s"] > 0
        assert r["limits_ms"]["producer"] == pytest.approx(1e3 * probe["period_s"])
        serial = r["budget_ms"]["predicted"]["host_ms"]
        assert serial == pytest.approx(1e3 * probe["beside_serial_s"])
        assert all(ms is not None and ms > 0 for ms in r["cpu_ref_ms"])


def test_json_has_the_keys_other_tools_rely_on(result: tuple[dict[str, Any], Path]) -> None:
    doc, out = result
    assert {
        "schema_version",
        "environment",
        "protocol",
        "stages",
        "runs",
        "verdict",
        "recommendations",
    } <= set(doc)
    for kind, stage in doc["stages"].items():
        assert set(STAGES) <= set(stage), kind
        assert stage["compute"] > 0 and stage["transform"] > 0
        assert stage["h2d"] is None  # CPU run: no device copy
    assert doc["stages"]["ram"]["read"] is None and doc["stages"]["raw"]["read"] > 0  # ram is loaded once
    for r in doc["runs"]:
        assert {"loader", "workers", "img_per_s", "predicted_img_per_s", "bottleneck"} <= set(r)
    assert isinstance(doc["verdict"], str) and doc["verdict"]
    assert isinstance(doc["recommendations"], list) and all(
        isinstance(x, str) for x in doc["recommendations"]
    )
    env = doc["environment"]
    assert env["cpu_count"] and env["start_method"] and env["versions"]["torch"]
    assert json.loads((out / "result.json").read_text())["runs"] == doc["runs"]
    assert (out / "plots.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
    assert set(doc["kinds"]) == {"raw", "ram", "npz", "zarr"} and len(doc["recommendations"]) <= 5
    for r in doc["runs"]:  # every number behind the text stays in the document
        assert r["measured_ms"]["wait_ms"] >= 0 and r["budget_ms"]["predicted"]["period_ms"] > 0
        assert set(r["limits_ms"]) >= {"producer", "main", "device", "cores"}
    for kind, stage in doc["stages"].items():
        assert stage["loader_alone"] and stage["fed_step"], kind
        for fed in stage["fed_step"].values():  # the step fed from a collated batch: its period and host time
            free = fed["samples"][0]["free"]
            assert (
                free["batches"] >= 1
                and free["period_s"] > 0
                and fed["serial_s"] == pytest.approx(free["period_s"])
            )
        for timing in stage["loader_alone"].values():  # the step beside each running loader, per batch
            assert timing["beside_batches"] >= 2 and timing["beside_serial_s"] > 0


def test_protocol_records_what_ran(result: tuple[dict[str, Any], Path]) -> None:
    doc, _ = result
    proto = doc["protocol"]
    # 0 and 2 workers: persistence and prefetch differ per run, so they are recorded per run
    assert {"num_workers", "persistent_workers", "prefetch_factor"} <= set(proto["varies"])
    for r in doc["runs"]:
        s = r["loader_settings"]
        assert s["num_workers"] == r["workers"] and s["persistent_workers"] == (r["workers"] > 0)
        assert s["pin_memory"] == r["pin_memory"] and s["batch_size"] == 8
    assert proto["loader_settings"]["drop_last"] is True and proto["loader_settings"]["shuffle"] is True
    assert proto["optimizer"]["type"] == "Adam" and proto["optimizer"]["lr"] == 1e-3
    assert proto["numerics"]["tf32_matmul"] is False  # a CPU run: what torch had set, read back
    assert proto["transforms"]["raw"]["cpu"]["hflip_p"] is None  # light: no flip anywhere
    assert "ToFloat" in proto["transforms"]["ram"]["device"]["repr"]


def test_csv_rows_match_the_runs(result: tuple[dict[str, Any], Path]) -> None:
    doc, out = result
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    counts = Counter((r["loader"], int(r["workers"]), r["cold"] == "True") for r in rows)
    for run in doc["runs"]:
        assert counts[(run["loader"], run["workers"], False)] == sum(
            len(x["steps"]["index"]) for x in run["raw"]
        )
        warm, timed, _ = cycle_window(40 // 8, run["workers"], 2, 3)  # whole cycles of the loader's delivery
        assert counts[(run["loader"], run["workers"], False)] == warm + timed
    for kind, cold in doc["cold"].items():
        assert counts[(kind, cold["workers"], True)] == cycle_window(40 // 8, cold["workers"], 2, 3)[0]
    assert len(rows) == doc["outputs"]["csv_rows"]
    assert {r["phase"] for r in rows} == {"warmup", "timed", "cold"}


def test_caches_are_reused_and_text_ends_with_a_verdict(
    env: Path, result: tuple[dict[str, Any], Path]
) -> None:
    res = CliRunner().invoke(
        main,
        ["bench", *TINY, "--workers", "0", "--loaders", "ram", "--no-cold", "--out", str(env / "out2")],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert " binds" in res.stdout and "ram" in res.stdout  # the one sentence leads the text
    doc = json.loads((env / "out2" / "result.json").read_text())
    assert doc["loaders"]["ram"]["reused"] is True


def test_an_unwritable_out_fails_first_and_a_full_disk_keeps_the_report(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import dlstore.bench.run as bench_run

    res = CliRunner().invoke(
        main, ["bench", *TINY, "--out", "/proc/no-such-dir/out"]
    )  # nothing created there
    assert res.exit_code == 1 and "--out /proc/no-such-dir/out: cannot write there" in res.output
    assert "[bench] round" not in res.output  # refused before any run

    def full(doc: dict[str, Any], out: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "plots.png"))

    monkeypatch.setattr(bench_run, "write_outputs", full)
    res = CliRunner().invoke(
        main, ["bench", *TINY, "--workers", "0", "--loaders", "ram", "--no-cold", "--out", str(env / "o5")]
    )
    assert res.exit_code == 1
    assert " binds" in res.stdout  # the measurements are still shown
    assert "not all written" in res.output and "No space left on device" in res.output


def test_a_folder_with_broken_files_is_benched_and_they_are_named(env: Path, tmp_path: Path) -> None:
    """A plain ImageFolder loop stops at the first broken file; the bench measures every kind and names them."""
    import numpy as np
    from PIL import Image
    from reliability_helpers import make_tree
    from torchvision.datasets.folder import default_loader

    from dlstore.bench.kinds.raw_source import tolerant_loader

    root = make_tree(tmp_path / "tree", per_class=10)
    good = root / "b" / "img000.jpg"
    (root / "a" / "zero.jpg").write_bytes(b"")
    (root / "b" / "truncated.jpg").write_bytes(good.read_bytes()[:300])
    assert np.array_equal(np.asarray(tolerant_loader(str(good))), np.asarray(default_loader(str(good))))
    blank = tolerant_loader(str(root / "a" / "zero.jpg"))
    assert blank.mode == "RGB" and blank.size == (1, 1)
    with pytest.raises(Image.UnidentifiedImageError):
        default_loader(str(root / "a" / "zero.jpg"))
    res = CliRunner().invoke(
        main,
        [
            "bench", str(root), "--loaders", "raw,ram", "--workers", "0,1", "--batch-size", "4", "--size", "16",
            "--steps", "3", "--warmup", "2", "--repeats", "1", "--stage-steps", "2", "--no-cold",
            "--out", str(tmp_path / "out"),
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    assert {(r["loader"], r["workers"]) for r in doc["runs"]} >= {("raw", 0), ("raw", 1), ("ram", 0)}
    assert any(n.startswith("2 source file(s) could not be read or decoded") for n in doc["notes"])


def test_a_large_source_is_benched_on_one_sample_by_every_kind(env: Path, tmp_path: Path) -> None:
    """--max-images: a seeded sample, the same for the caches and for raw's ImageFolder; the header and the
    document give both counts, and the memory advice uses the whole source."""
    import numpy as np
    import torch
    from reliability_helpers import make_tree

    from dlstore import open_cache
    from dlstore.bench.kinds.context import LoaderContext
    from dlstore.bench.kinds.raw_source import raw_kind
    from dlstore.bench.protocol import BenchConfig
    from dlstore.write.sources import scan_folder

    root = make_tree(tmp_path / "tree", per_class=2, classes=tuple(f"c{i:02d}" for i in range(12)))
    args = ["--loaders", "raw,ram", "--workers", "0", "--batch-size", "1", "--size", "16", "--steps", "3"]
    args += ["--warmup", "2", "--repeats", "1", "--stage-steps", "2", "--no-cold", "--max-images", "8"]
    res = CliRunner().invoke(main, ["bench", str(root), *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    assert (doc["source"]["n_images"], doc["source"]["n_images_total"]) == (8, 24)
    assert "(8 of 24 images, 16px)" in res.stdout and "a random sample of 8" in res.stderr
    cache = open_cache(doc["loaders"]["ram"]["cache"])
    full = scan_folder(root)
    picked = full.subset(np.array([1, 4, 9, 17, 20]))
    assert picked.names == [full.names[i] for i in (1, 4, 9, 17, 20)] and picked.sample.tolist() == [
        1,
        4,
        9,
        17,
        20,
    ]
    assert picked.labels.tolist() == full.labels[[1, 4, 9, 17, 20]].tolist()
    assert picked.fingerprint() != full.fingerprint() and len(cache) == 8  # 8 of 12 classes at most
    ctx = LoaderContext(BenchConfig(), picked, 16, 3, torch.device("cpu"), tmp_path / "caches")
    folder = raw_kind(ctx).new_dataset()
    assert [Path(p).relative_to(root).as_posix() for p, _ in folder.samples] == picked.names  # type: ignore[attr-defined]
    assert [y for _, y in folder.samples] == picked.labels.tolist()  # type: ignore[attr-defined]  # class indices kept


def test_max_megapixels_reaches_the_caches_conversions(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Pillow's limit lowered to stand in for 108 MP photos, the caches skip every 40x40 image; bench
    --max-megapixels takes them in, builds caches of their own and says so in the commands it advises.
    So does --pixels (issue 22 item 4). The folder has one class: a warning and a note name its parent."""
    from PIL import Image
    from reliability_helpers import make_tree

    from dlstore.spec import read_spec

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # forked conversion workers inherit it
    root = make_tree(tmp_path / "tree", per_class=8, classes=("only",), side=40)
    args = ["--loaders", "ram", "--workers", "0", "--batch-size", "1", "--size", "16", "--steps", "3"]
    args += ["--warmup", "2", "--repeats", "1", "--stage-steps", "2", "--no-cold"]
    refused = CliRunner().invoke(main, ["bench", str(root), *args, "--out", str(tmp_path / "a")])
    assert refused.exit_code == 1 and "8 of 8 images could not be decoded" in refused.output
    args += ["--max-megapixels", "0.01", "--pixels", "torchvision"]
    res = CliRunner().invoke(main, ["bench", str(root), *args, "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "b" / "result.json").read_text())
    ram = doc["loaders"]["ram"]
    assert ram["n_images"] == 8 and not ram.get("skipped")
    assert "--max-megapixels 0.01 --pixels torchvision" in ram["apply"]
    assert doc["protocol"]["pixels"] == read_spec(Path(ram["cache"])).image.pixels == "torchvision"
    assert [n for n in doc["notes"] if f"{root}: has 1 class subfolder (only)" in n]
    assert f"its parent {root.resolve().parent}" in " ".join(res.stderr.split())


def test_formats_is_gone_in_favour_of_loaders() -> None:
    res = CliRunner().invoke(main, ["bench", "--formats", "ram"])
    assert res.exit_code == 2 and "--formats" in res.output


def test_usage_errors(env: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["bench", "--loaders", "raw,tiff"]).exit_code == 2
    assert runner.invoke(main, ["bench", "--workers", "a,b"]).exit_code == 2
    res = runner.invoke(
        main, ["bench", *TINY, "--batch-size", "64", "--loaders", "raw", "--out", str(env / "o3")]
    )
    assert res.exit_code == 1 and "batch-size" in res.output
    for option in ("--step", "--model"):  # refused before any cache is built
        res = runner.invoke(main, ["bench", *TINY, option, "no_such_module:fn", "--out", str(env / "o3")])
        assert res.exit_code == 1 and f"{option} no_such_module:fn: cannot import" in res.output
        assert "converting" not in res.output and "parts" not in res.output


def test_a_registered_kind_is_measured_and_a_missing_package_skips(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlstore.bench import kinds as loaders
    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.run import run_bench
    from dlstore.bench.transforms import ToFloat

    def broken(ctx: Any) -> Any:
        raise ImportError("No module named 'zarr'")

    def tensors(ctx: Any) -> loaders.PreparedLoader:  # an extension kind: in-memory uint8 tensors
        import torch

        data = [(torch.zeros(ctx.channels, ctx.size, ctx.size, dtype=torch.uint8), i % 2) for i in range(32)]
        return loaders.PreparedLoader(
            "tensors",
            "list of tensors",
            32,
            [],
            False,
            torch.uint8,
            (ctx.channels, ctx.size, ctx.size),
            lambda: data,
            ToFloat(),
        )

    monkeypatch.setitem(loaders.LOADER_KINDS, "zarr", loaders.LoaderKind("zarr", "", broken))
    monkeypatch.setitem(loaders.LOADER_KINDS, "tensors", loaders.LoaderKind("tensors", "", tensors))
    doc = run_bench(
        BenchConfig(
            loaders=("tensors", "zarr"),
            workers=(0,),
            demo_images=40,
            size=16,
            batch_size=8,
            steps=2,
            warmup=1,
            repeats=1,
            stage_steps=2,
        )
    )
    assert [r["loader"] for r in doc["runs"]] == ["tensors"]
    assert any("zarr: skipped" in n for n in doc["notes"])


def test_fast_path_kinds_are_measured(env: Path) -> None:
    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.run import run_bench

    doc = run_bench(
        BenchConfig(
            loaders=("pinned", "resident"),
            workers=(0, 2),
            demo_images=40,
            size=16,
            batch_size=8,
            steps=2,
            warmup=1,
            repeats=1,
            stage_steps=2,
            transform="gpu-augment",
        )
    )
    # they use no worker processes, so they run once, at 0 workers
    assert sorted((r["loader"], r["workers"]) for r in doc["runs"]) == [("pinned", 0), ("resident", 0)]
    assert all(r["img_per_s"] > 0 for r in doc["runs"])
    # no worker processes: the step is probed beside each around its run (not alone: no work in next()),
    # and the model's host term is that probe
    for r in doc["runs"]:
        probe = r["loader_probe"]
        assert [s["when"] for s in probe["samples"]] == ["before", "after"] and "period_s" not in probe
        assert r["budget_ms"]["predicted"]["host_ms"] == pytest.approx(1e3 * probe["beside_serial_s"])


def test_a_fast_kind_asked_for_cpu_augmentation_says_what_it_ran(env: Path) -> None:
    """Issue 22 item 2: pinned has no workers for the CPU augmentation; it runs GpuAugment, says so where
    it is advised, and its "Apply:" snippet is the code that was measured (the augmentation included)."""
    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.run import run_bench

    config = BenchConfig(
        loaders=("raw", "pinned"),
        workers=(0,),
        demo_images=40,
        size=16,
        batch_size=8,
        steps=2,
        warmup=1,
        repeats=1,
        stage_steps=2,
        transform="augment",
    )
    doc = run_bench(config)
    assert any(n.startswith("pinned ran GpuAugment on the device in place of") for n in doc["notes"])
    said = [r for r in doc["recommendations"] if r.startswith("Use pinned")] + [doc["detail"]]
    if doc["best"]["loader"] == "pinned":
        assert all("in place of the CPU augmentation" in text for text in said)
        assert "GpuAugment(16" in said[0]


def _replay_module() -> Any:
    """benchmarks/replay_predictions.py, loaded as a module (benchmarks/ is not a package)."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "replay_predictions.py"
    spec = importlib.util.spec_from_file_location("replay_predictions", script)
    assert spec and spec.loader
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    return replay


def test_recorded_parts_replay_to_the_recorded_predictions(result: tuple[dict[str, Any], Path]) -> None:
    """benchmarks/replay_predictions.py rebuilds each run's parts from the document alone: with the model
    unchanged it must give back the predictions the run recorded (else replays of GPU runs mean nothing)."""
    replay = _replay_module()
    doc, _ = result
    rows = replay.replay(doc)
    assert len(rows) == len(doc["runs"])
    for row, run in zip(rows, doc["runs"]):
        assert row["predicted"] == pytest.approx(run["predicted_img_per_s"], rel=1e-9)
        assert row["bottleneck"] == run["bottleneck"]


def test_model_variants_replay_the_old_and_new_bases_from_one_run(
    result: tuple[dict[str, Any], Path],
) -> None:
    """bench_batches.py prints the old model (parts phase; probe before only) next to the new one (probes
    before and after) on the same runs: the new basis gives back the recorded prediction, and runs with
    workers (no probes) predict the same under every basis."""
    replay = _replay_module()
    doc, _ = result
    for row, run in zip(replay.variant_errors(doc), doc["runs"]):
        errors = row["errors"]
        assert set(errors) == set(replay.VARIANTS)
        assert errors["probe"] == pytest.approx(run["prediction_error"], rel=1e-9)
        if run["workers"] > 0:
            assert len({round(e, 12) for e in errors.values()}) == 1
        else:  # the before-only pool is the before sample alone
            before = replay.probes_before(run, keep_beside=True)
            assert before["samples"] == [s for s in run["loader_probe"]["samples"] if s["when"] == "before"]


def test_plots_keep_legends_off_the_data_and_say_what_was_run(result: tuple[dict[str, Any], Path]) -> None:
    """Issue 22 item 7, on the figures themselves: the sweep's axis starts at zero, no legend sits inside an
    axes, the title names the transform, the bars use the text's stage names, a CPU run's device row says so."""
    import matplotlib

    matplotlib.use("Agg")
    from dlstore.bench.report import plot_figure, stage_bars, timeline_figure

    doc, _ = result
    fig = plot_figure(doc)
    fig.canvas.draw()
    sweep, parts = fig.axes
    assert sweep.get_ylim()[0] == 0
    assert f"transform {doc['protocol']['transform']}" in sweep.get_title()
    for ax in (sweep, parts):
        legend_box = ax.get_legend().get_window_extent()
        assert not legend_box.overlaps(ax.get_window_extent())  # beside the data, not over it
    assert [t.get_text() for t in parts.get_legend().get_texts()] == list(stage_bars(doc))
    timeline = timeline_figure(doc)
    timeline.canvas.draw()
    for ax in timeline.axes:
        assert "device step\n(no device)" in [t.get_text() for t in ax.get_yticklabels()]
        assert not ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())
        assert not ax.texts  # the phases are named in the legend: no label over a bar or another label
        assert ax.get_xlim() == timeline.axes[0].get_xlim()  # one time scale for every panel


def test_the_parts_bars_leave_out_empty_stages_and_show_a_one_off_read(
    result: tuple[dict[str, Any], Path],
) -> None:
    """Issue 40 item 8: on a CPU run no loader has an h2d copy, so no h2d entry; ram loads once, and that
    read is drawn (apart from the per-epoch reads), not left as a gap."""
    from dlstore.bench.report import ONE_OFF_LABEL, STAGE_LABELS, stage_bars

    doc, _ = result
    bars = stage_bars(doc)
    names = list(doc["stages"])
    assert STAGE_LABELS["h2d"] not in bars and all(doc["stages"][n]["h2d"] is None for n in names)
    assert all(any(v is not None for v in vals) for vals in bars.values())
    once = bars[ONE_OFF_LABEL]
    ram = names.index("ram")
    assert doc["stages"]["ram"]["read"] is None and once[ram] == doc["stages"]["ram"]["read_warm"] > 0
    assert bars[STAGE_LABELS["read"]][ram] is None
    assert [v is None for i, v in enumerate(once) if i != ram] == [True] * (len(names) - 1)
