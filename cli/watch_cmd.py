"""``dlstore watch -- python train.py ARGS…``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from dlstore.bench.watch import WatchConfig
from dlstore.cli.render import emit_json
from dlstore.cli.shared_options import Command, config_options, json_option

# The tuning options, under headings of their own in --help (the rest: what a newcomer needs).
SECTIONS = {
    "Replay and in-loop trial (tuning)": (
        *("warmup", "replay", "replay_at", "replay_s", "replay_steps", "replay_rounds", "replay_every"),
        *("trial", "trial_s", "replay_batches"),
    ),
    "Timing the parts (tuning)": ("parts", "parts_budget_s", "event_every", "profile"),
}
POSITIVE, SECONDS = click.IntRange(1), click.FloatRange(0)
# WatchConfig field → its option's help and values; the flag and the default are the field's (config_options).
OPTIONS: dict[str, dict[str, Any]] = {
    "steps": dict(type=POSITIVE, help="Stop the script after N observed steps."),
    "warmup": dict(type=click.IntRange(0), help="First-epoch steps kept apart."),
    "replay": dict(flag="--replay/--no-replay", help="Replay the loop's batches (its rate with data free)."),
    "replay_at": dict(type=POSITIVE, help="Without --steps: replay after this many real steps."),
    "replay_s": dict(type=SECONDS, help="Seconds of replayed steps timed (after a warm-up of theirs)."),
    "replay_steps": dict(type=POSITIVE, help="Replayed steps at most."),
    "replay_rounds": dict(
        type=POSITIVE,
        help="Replay this many times, --replay-every real steps apart; the rate with data free is the median "
        "round's (a machine whose speed drifts between windows).",
    ),
    "replay_every": dict(type=POSITIVE, help="Real steps from one replay round's start to the next's."),
    "trial": dict(
        flag="--trial/--no-trial",
        help="Try the workers advice in the loop (a second DataLoader with the advised workers).",
    ),
    "trial_s": dict(type=SECONDS, help="Seconds of the in-loop trial timed (after its queue filled)."),
    "replay_batches": dict(type=POSITIVE, help="Batches kept to replay."),
    "parts": dict(flag="--parts/--no-parts", help="Time the dataset's parts and the advised loaders alone."),
    "parts_budget_s": dict(
        flag="--parts-budget",
        type=click.FloatRange(0.05, 600),
        help="Seconds for timing the dataset's parts alone, and each advised loader (more workers; a cache, "
        "on synthetic images; the loader --try-cache tries).",
    ),
    "try_cache": dict(
        help="When a dlstore cache is advised: convert a sample of the dataset that way (a temporary folder) "
        "and time the recommended loader with your batch size, beside the prediction."
    ),
    "event_every": dict(
        type=POSITIVE,
        help="Time the device's span with CUDA events on one step in N (1: every step, ~20 µs more each, "
        "and the device's wait between steps in steps.csv).",
    ),
    "profile": dict(help="Write a torch.profiler trace of a few steps to --out."),
}

APPLY_HELP = (
    "Then run the script again with the advised DataLoader settings put into its loader (no edit), and "
    "report the rate measured beside the rate predicted (with --steps, both runs stop after N steps)."
)
COMPARE_HELP = (
    "Compare two runs' watch.json (or --out folders) instead of running a command: settings, rates, wait "
    "share, binding stage."
)
OUT_HELP = "Write watch.json, steps.csv, timeline.png here."
JSON_HELP = "Print one JSON document on stdout (the script's stdout goes to stderr)."


@click.command(
    "watch",
    cls=Command,
    sections=SECTIONS,
    short_help="Run your training script; say what slows it and what to change.",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@config_options(WatchConfig, OPTIONS)
@click.option("--apply", "apply_advice", is_flag=True, help=APPLY_HELP)
@click.option("--compare", nargs=2, type=click.Path(path_type=Path, exists=True), help=COMPARE_HELP)
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), help=OUT_HELP)
@json_option(JSON_HELP)
def watch_cmd(
    command: tuple[str, ...],
    apply_advice: bool,
    compare: tuple[Path, Path] | None,
    out: Path | None,
    as_json: bool,
    **params: Any,
) -> None:
    """Run COMMAND (python train.py ARGS… or python -m pkg.train ARGS…) with every DataLoader iteration
    observed, then say what binds the loop and what to change. The script's exit code is kept."""
    from dlstore.bench.watch.launch import watch_and_apply
    from dlstore.bench.watch.watch_report import apply_text, json_document, text_report, write_outputs

    argv = list(command[1:] if command and command[0] == "--" else command)
    if compare is not None:
        return compare_cmd(compare, argv, as_json)
    if not argv:
        raise click.UsageError("give the command after --, e.g. dlstore watch -- python train.py")
    config = WatchConfig(**params)
    report, second, code = watch_and_apply(argv, config, out, as_json, apply=apply_advice)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        sys.exit(code)
    if out is not None:
        for rep, folder in ((report, out), (second, out / "applied")):
            if rep is not None:
                written = write_outputs(rep, folder)
                click.echo(f"Wrote {', '.join(written.values())}", err=True)
    if as_json:
        emit_json(json_document(report))
    else:
        click.echo(text_report(report))
        if "applied" in report:
            click.echo("\n" + apply_text(report, second))
    sys.exit(code)


def compare_cmd(paths: tuple[Path, Path], argv: list[str], as_json: bool) -> None:
    from dlstore.bench.watch.watch_report import compare, compare_text, load_report

    if argv:
        raise click.UsageError("--compare reads two watch.json files: give no command with it")
    result = compare(load_report(paths[0]), load_report(paths[1]))
    if as_json:
        emit_json(result)
    else:
        click.echo(f"A: {paths[0]}\nB: {paths[1]}\n{compare_text(result)}")
