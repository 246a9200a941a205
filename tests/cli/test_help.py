"""Help with order (issue 40 item 6): the few options a newcomer needs first, the tuning ones under
headings; whole command summaries; bench's and convert's options generated from their config objects."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from click.testing import CliRunner

from dlstore.bench.protocol import BenchConfig
from dlstore.cli import main
from dlstore.write.options import ConvertOptions


def help_of(*command: str) -> str:
    res = CliRunner().invoke(main, [*command, "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    return res.output


def sections(text: str) -> dict[str, list[str]]:
    """Heading → the option flags listed under it."""
    out: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            heading = line[:-1]
            out[heading] = []
        elif heading and (m := re.match(r"^  (--[\w-]+|-h)", line)):
            out[heading].append(m.group(1))
    return out


def test_command_summaries_are_whole_sentences() -> None:
    text = help_of()
    summaries = text.split("Commands:\n")[1].splitlines()
    assert {line.split()[0] for line in summaries} == {"bench", "convert", "info", "verify", "watch"}
    for line in summaries:
        assert line.rstrip().endswith(".") and not line.rstrip().endswith("..."), line


@pytest.mark.parametrize(
    ("command", "first", "tuning"),
    [
        (
            "bench",
            {"--loaders", "--workers", "--size", "--out"},
            {"--stage-steps", "--max-run-seconds", "--cold"},
        ),
        (
            "convert",
            {"--size", "--format", "--workers", "--overwrite"},
            {"--decode-timeout", "--codec", "--scheduler"},
        ),
        (
            "watch",
            {"--steps", "--out", "--json"},
            {"--replay-at", "--replay-rounds", "--trial-s", "--event-every"},
        ),
    ],
)
def test_a_newcomer_sees_the_few_options_first_and_tuning_under_headings(
    command: str, first: set[str], tuning: set[str]
) -> None:
    found = sections(help_of(command))
    assert list(found)[0] == "Options", list(found)  # the newcomer's options come first
    assert first <= set(found["Options"]) and len(found["Options"]) <= 12, found["Options"]
    assert not tuning & set(found["Options"])
    later = {flag for heading, flags in found.items() if heading != "Options" for flag in flags}
    assert tuning <= later


@pytest.mark.parametrize(("command", "config"), [("bench", BenchConfig), ("convert", ConvertOptions)])
def test_options_come_from_the_config_fields_with_its_defaults(command: str, config: type) -> None:
    cmd = main.commands[command]
    fields = {f.name: f.default for f in dataclasses.fields(config)}
    own = {
        "as_json",
        "split",
        "source",
        "dest",
        "codec",
        "quality",
        "shard_mb",
    }  # not fields
    for param in cmd.params:
        assert param.name in fields or param.name in own, param.name
    differ = {"loaders", "out", "budget_s", "size", "demo_images", "fields"}  # the CLI's own defaults
    for param in cmd.params:
        if param.name in fields and param.name not in differ:
            assert param.default == fields[param.name], param.name
    assert len(inspect.signature(cmd.callback).parameters) <= 5  # nothing re-listed
