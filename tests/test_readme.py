"""Every command and the Python example in README.md run as written (on small demo data)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlstore.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


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
    exec(compile(example, str(README), "exec"), {})


def test_make_targets_named_in_readme_exist() -> None:
    makefile = (README.parent / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", blocks("sh")[0], flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target
    assert "make test" in (README.parent / ".ci" / "run").read_text()
