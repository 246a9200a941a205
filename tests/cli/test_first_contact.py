"""Issue 22 item 6, the small things: the worker count says why, one ``--size`` limit, every loader
kind in ``bench --help``, a one-class folder warned about (convert and bench)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_helpers import make_tree, small_units

from dlstore.bench.kinds import LOADER_KINDS
from dlstore.cli import main
from dlstore.cli.shared_options import MAX_SIZE


def run(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("fc") / "src", per_class=4, side=12)  # 8 images, 2 classes


def test_fewer_workers_than_asked_say_why_in_json_and_text(tree: Path, tmp_path: Path) -> None:
    res = run("convert", tree, tmp_path / "j", "--size", "8", "--workers", "2", "--json")
    doc = json.loads(res.stdout)
    assert doc["workers"] == 1  # 8 images are one unit: one worker writes it
    assert doc["workers_reason"].startswith("only 1 unit of work, fewer than the 2 workers asked for")
    text = run("convert", tree, tmp_path / "t", "--size", "8", "--workers", "2").stdout
    assert f"with 1 worker ({doc['workers_reason']})" in text


def test_as_many_workers_as_asked_say_so(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_units(monkeypatch, 2)  # 4 units
    doc = json.loads(run("convert", tree, tmp_path / "c", "--size", "8", "--workers", "2", "--json").stdout)
    assert doc["workers"] == 2 and doc["workers_reason"] == "as asked (--workers)"


@pytest.mark.parametrize("command", ["convert", "bench"])
def test_one_size_limit_for_convert_and_bench(command: str, tree: Path, tmp_path: Path) -> None:
    res = run(command, tree, *(["DEST"] if command == "convert" else []), "--size", MAX_SIZE + 1)
    assert res.exit_code == 2 and f"1<=x<={MAX_SIZE}" in res.output
    assert f"1<=x<={MAX_SIZE}" in run(command, "--help").output.replace("\n", "").replace(" ", "")


def test_bench_help_lists_every_registered_kind() -> None:
    text = " ".join(run("bench", "--help").output.split())
    assert {"jpeg-gpu", "jpeg-cpu"} <= set(LOADER_KINDS)
    for kind in LOADER_KINDS:
        assert f"{kind}," in text or f"{kind}:" in text, kind


def test_a_one_class_folder_is_warned_about_naming_the_parent(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data" / "train", per_class=3, classes=("cats",), side=12)
    res = run("convert", root, tmp_path / "c", "--size", "8")
    assert res.exit_code == 0
    warning = " ".join(res.stderr.split())
    assert f"{root}: has 1 class subfolder (cats)" in warning
    assert f"its parent {root.resolve().parent}" in warning
