"""``dlstore watch`` through click's CliRunner on real small scripts (each runs in a child Python)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dlstore.cli import main

FAST = ["--parts-budget", "0.3"]


def watch(args: list[str], command: list[str]) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["watch", *FAST, "--json", *args, "--", *command])
    assert result.stdout.strip().startswith("{"), result.output  # stdout: the one JSON document only
    return result.exit_code, json.loads(result.stdout)


def primary(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["loaders"] if r["index"] == doc["primary"])


def test_zero_workers_slow_transform_is_named_input_bound(
    scripts: dict[str, Path], tiny_folder: Path, tmp_path: Path
) -> None:
    hand = tmp_path / "hand.json"
    code, doc = watch(
        ["--no-replay", "--warmup", "2"],
        ["python", str(scripts["small_cnn"]), str(tiny_folder), "0", "0.008", str(hand)],
    )
    assert code == 0 and doc["status"] == "completed"
    rep = primary(doc)
    assert rep["settings"]["num_workers"] == 0 and rep["images_per_batch"] == 8
    assert rep["dataset"]["image_folder"] and rep["dataset"]["root"] == str(tiny_folder)
    assert [t["name"] for t in rep["dataset"]["transforms"]][:2] == ["RandomResizedCrop", "RandomRotation"]
    assert rep["steps_observed"] == 6 and rep["steps_replayed"] == 0  # 48 images / 8, drop_last
    steady = rep["steady"]
    assert steady["wait_share"] >= 0.20 and doc["verdict"].startswith("CPU transform (RandomResizedCrop")
    assert rep["binding"]["stage"] == "transform" and rep["binding"]["part"] == "transform"
    # the script's own timing of next(): watch's Σwait (every step it saw) against it
    own = json.loads(hand.read_text())
    seen = sum(p["wait_mean_s"] * p["steps"] for p in rep["phases"].values())
    assert len(own["waits"]) == rep["steps_observed"]
    assert seen == pytest.approx(sum(own["waits"]), rel=0.25, abs=0.01)
    workers = [a for a in doc["advice"] if "num_workers=" in (a["command"] or "")]
    # idle cores: more workers may be advised, with its predicted rate above now (on a loaded 2-core machine
    # the workers timed alone can show no gain once each 6-batch epoch's empty start is counted)
    assert all(a["expected_img_per_s"] > steady["img_per_s"] for a in workers)


def test_two_workers_replay_and_outputs(scripts: dict[str, Path], tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, doc = watch(
        [
            "--warmup",
            "2",
            "--replay-at",
            "4",
            "--replay-steps",
            "6",
            "--replay-batches",
            "2",
            "--out",
            str(out),
        ],
        ["python", str(scripts["small_cnn"]), str(tiny_folder), "2", "0.001", str(tmp_path / "h.json"), "2"],
    )
    assert code == 0
    rep = primary(doc)
    assert rep["settings"]["num_workers"] == 2 and rep["epochs"] == 2
    # 2 epochs of 6 batches; the replay (half an epoch at most on so short a run) in real steps' places
    assert rep["steps_replayed"] == 4 and rep["steps_observed"] + rep["stand_in_steps"] == 12
    assert len(json.loads((tmp_path / "h.json").read_text())["waits"]) == 12  # the script's own count
    assert "replay" in rep["phases"] and rep["model"]["data_free_img_per_s"] > 0
    assert any("repeated batches" in n for n in doc["notes"])
    assert rep["resources"]["workers_rss_mb_max"] is None or rep["resources"]["workers_rss_mb_max"] > 0
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and sum(r["phase"] == "replay" for r in rows) == 4
    assert json.loads((out / "watch.json").read_text())["loaders"][0]["rows"]
    png = out / "timeline.png"
    try:
        import matplotlib  # noqa: F401

        assert png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not png.exists()


def test_a_script_that_raises_keeps_its_exit_code(scripts: dict[str, Path]) -> None:
    code, doc = watch([], ["python", str(scripts["raises"])])
    assert code == 1 and doc["exit_code"] == 1 and doc["status"] == "error"
    assert "boom at step 9" in doc["error"]
    rep = primary(doc)
    assert rep["steps_observed"] + rep["stand_in_steps"] == 10  # batches 0..9 were handed over


def test_a_script_without_a_dataloader_gets_a_clear_note(scripts: dict[str, Path]) -> None:
    code, doc = watch([], ["python", str(scripts["no_loader"])])
    assert code == 3 and doc["loaders"] == []
    assert "never iterated a torch.utils.data.DataLoader" in doc["verdict"]


def test_steps_stops_the_script_after_the_replay(scripts: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "ended"
    code, doc = watch(["--steps", "12", "--replay-steps", "5"], ["python", str(scripts["long"]), str(marker)])
    assert code == 0 and doc["status"] == "stopped"
    rep = primary(doc)
    assert rep["steps_observed"] == 12 and rep["steps_replayed"] == 5
    assert not marker.exists()


def test_replay_rounds_from_the_command_line(scripts: dict[str, Path], tmp_path: Path) -> None:
    args = [
        "--steps",
        "12",
        "--replay-steps",
        "5",
        "--replay-rounds",
        "2",
        "--replay-every",
        "4",
        "--no-trial",
    ]
    code, doc = watch(args, ["python", str(scripts["long"]), str(tmp_path / "ended")])
    rep = primary(doc)
    assert code == 0 and rep["steps_observed"] == 16 and rep["steps_replayed"] == 10
    assert len(rep["phases"]["replay"]["rounds"]) == 2


def test_module_form_runs_as_python_dash_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "trainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import sys, torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "assert __name__ == '__main__' and sys.argv[1:] == ['--lr', '0.1'], (__name__, sys.argv)\n"
        "for (x,) in DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=4):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    code, doc = watch(["--no-replay"], [sys.executable, "-m", "trainpkg.train", "--lr", "0.1"])
    assert code == 0 and primary(doc)["steps_observed"] == 8


@pytest.mark.parametrize(
    "command, message",
    [
        (["torchrun", "train.py"], "put watch inside it"),
        (["python", "-c", "print(1)"], "-c is not supported"),
        (["python", "missing_script.py"], "no such script"),
        (["make", "train"], "expected python"),
    ],
)
def test_commands_it_cannot_run_fail_clearly(command: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["watch", "--", *command])
    assert result.exit_code == 1 and message in result.output


def test_each_rank_records_and_rank_zero_reports(
    scripts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ddp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # rank 1 first: it records and prints nothing
    other = CliRunner().invoke(
        main,
        ["watch", *FAST, "--json", "--no-replay", "--out", str(out), "--", "python", str(scripts["raises"])],
    )
    assert other.exit_code == 1 and other.stdout == ""
    assert (out / "ranks" / "watch-rank1.json").exists()
    monkeypatch.setenv("RANK", "0")
    code, doc = watch(
        ["--no-replay", "--steps", "30", "--out", str(out)],
        ["python", str(scripts["long"]), str(tmp_path / "m")],
    )
    assert code == 0 and doc["world_size"] == 2 and doc["status"] == "stopped"
    assert doc["ranks"]["ranks"] == 2 and {r["rank"] for r in doc["ranks"]["per_rank"]} == {0, 1}
    assert doc["ranks"]["wait_share_max"] >= doc["ranks"]["wait_share_mean"]


def test_options_come_from_the_watch_config_fields_with_its_defaults() -> None:
    import dataclasses
    import inspect

    from dlstore.bench.watch import WatchConfig

    cmd = main.commands["watch"]
    fields = {f.name: f.default for f in dataclasses.fields(WatchConfig)}
    own = {"command", "apply_advice", "compare", "out", "as_json"}
    for param in cmd.params:
        assert param.name in own or param.default == fields[param.name], param.name
    assert len(inspect.signature(cmd.callback).parameters) <= 6  # nothing re-listed
    flags = {flag for p in cmd.params for flag in (*p.opts, *p.secondary_opts)}
    assert {"--no-replay", "--no-trial", "--no-parts", "--parts-budget", "--try-cache"} <= flags
