"""``dlstore watch -- python train.py ARGS…``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dlstore.cli.render import emit_json, stderr
from dlstore.cli.shared_options import Command, json_option

# The tuning options, under headings of their own in --help (the rest: what a newcomer needs).
SECTIONS = {
    "Replay and in-loop trial (tuning)": (
        "warmup",
        "no_replay",
        "replay_at",
        "replay_s",
        "replay_steps",
        "replay_rounds",
        "replay_every",
        "no_trial",
        "trial_s",
        "replay_batches",
    ),
    "Timing the parts (tuning)": ("no_parts", "parts_budget", "event_every", "profile"),
}


@click.command(
    "watch",
    cls=Command,
    sections=SECTIONS,
    short_help="Run your training script; say what slows it and what to change.",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--steps", type=click.IntRange(1), default=None, help="Stop the script after N observed steps.")
@click.option(
    "--apply",
    "apply_advice",
    is_flag=True,
    help="Then run the script again with the advised DataLoader settings put into its loader (no edit), "
    "and report the rate measured beside the rate predicted (with --steps, both runs stop after N steps).",
)
@click.option(
    "--compare",
    nargs=2,
    type=click.Path(path_type=Path, exists=True),
    default=None,
    help="Compare two runs' watch.json (or --out folders) instead of running a command: settings, rates, "
    "wait share, binding stage.",
)
@click.option(
    "--warmup", type=click.IntRange(0), default=5, show_default=True, help="First-epoch steps kept apart."
)
@click.option(
    "--no-replay", "no_replay", is_flag=True, help="Do not replay the loop's batches (rate with data free)."
)
@click.option(
    "--replay-at",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Without --steps: replay after this many real steps.",
)
@click.option(
    "--replay-s",
    type=click.FloatRange(0),
    default=1.5,
    show_default=True,
    help="Seconds of replayed steps timed (after a warm-up of theirs).",
)
@click.option(
    "--replay-steps", type=click.IntRange(1), default=2000, show_default=True, help="Replayed steps at most."
)
@click.option(
    "--replay-rounds",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Replay this many times, --replay-every real steps apart; the rate with data free is the median "
    "round's (a machine whose speed drifts between windows).",
)
@click.option(
    "--replay-every",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Real steps from one replay round's start to the next's.",
)
@click.option(
    "--no-trial",
    "no_trial",
    is_flag=True,
    help="Do not try the workers advice in the loop (a second DataLoader with the advised workers).",
)
@click.option(
    "--trial-s",
    type=click.FloatRange(0),
    default=1.5,
    show_default=True,
    help="Seconds of the in-loop trial timed (after its queue filled).",
)
@click.option(
    "--replay-batches", type=click.IntRange(1), default=4, show_default=True, help="Batches kept to replay."
)
@click.option(
    "--no-parts",
    "no_parts",
    is_flag=True,
    help="Skip timing the dataset's parts and the advised loaders alone at the end.",
)
@click.option(
    "--parts-budget",
    type=click.FloatRange(0.05, 600),
    default=3.0,
    show_default=True,
    help="Seconds for timing the dataset's parts alone, and each advised loader (more workers; a cache, on "
    "synthetic images; the loader --try-cache tries).",
)
@click.option(
    "--try-cache",
    "try_cache",
    is_flag=True,
    help="When a dlstore cache is advised: convert a sample of the dataset that way (a temporary folder) "
    "and time the recommended loader with your batch size, beside the prediction.",
)
@click.option(
    "--event-every",
    type=click.IntRange(1),
    default=8,
    show_default=True,
    help="Time the device's span with CUDA events on one step in N (1: every step, ~20 µs more each, "
    "and the device's wait between steps in steps.csv).",
)
@click.option("--profile", is_flag=True, help="Write a torch.profiler trace of a few steps to --out.")
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Write watch.json, steps.csv, timeline.png here.",
)
@json_option("Print one JSON document on stdout (the script's stdout goes to stderr).")
def watch_cmd(
    command: tuple[str, ...],
    steps: int | None,
    apply_advice: bool,
    compare: tuple[Path, Path] | None,
    warmup: int,
    no_replay: bool,
    replay_at: int,
    replay_s: float,
    replay_steps: int,
    replay_rounds: int,
    replay_every: int,
    no_trial: bool,
    trial_s: float,
    replay_batches: int,
    no_parts: bool,
    parts_budget: float,
    try_cache: bool,
    event_every: int,
    profile: bool,
    out: Path | None,
    as_json: bool,
) -> None:
    """Run COMMAND (python train.py ARGS… or python -m pkg.train ARGS…) with every DataLoader iteration
    observed, then say what binds the loop and what to change. The script's exit code is kept."""
    from dlstore.bench.watch.apply import apply_text, watch_and_apply
    from dlstore.bench.watch.config import WatchConfig
    from dlstore.bench.watch.report import json_document, text_report, write_outputs
    from dlstore.bench.watch.run import run_watch

    config = WatchConfig(
        steps=steps,
        warmup=warmup,
        replay=not no_replay,
        replay_at=replay_at,
        replay_steps=replay_steps,
        replay_s=replay_s,
        replay_rounds=replay_rounds,
        replay_every=replay_every,
        trial=not no_trial,
        trial_s=trial_s,
        replay_batches=replay_batches,
        parts=not no_parts,
        parts_budget_s=parts_budget,
        profile=profile,
        try_cache=try_cache,
        event_every=event_every,
    )
    argv = list(command[1:] if command and command[0] == "--" else command)
    if compare is not None:
        return compare_cmd(compare, argv, as_json)
    if not argv:
        raise click.UsageError("give the command after --, e.g. dlstore watch -- python train.py")
    second = None
    if apply_advice:
        report, second, code = watch_and_apply(argv, config, out=out, script_stdout_to_stderr=as_json)
    else:
        report, code = run_watch(argv, config, out=out, script_stdout_to_stderr=as_json)
    if report is None:  # a rank other than 0 under torchrun: rank 0 reports
        sys.exit(code)
    if out is not None:
        for rep, folder in ((report, out), (second, out / "applied")):
            if rep is not None:
                written = write_outputs(rep, folder)
                click.echo(f"Wrote {', '.join(written.values())}", file=stderr())
    if as_json:
        emit_json(json_document(report))
    else:
        click.echo(text_report(report))
        if "applied" in report:
            click.echo("\n" + apply_text(report, second))
    sys.exit(code)


def compare_cmd(paths: tuple[Path, Path], argv: list[str], as_json: bool) -> None:
    from dlstore.bench.watch.compare import compare, compare_text, load_report

    if argv:
        raise click.UsageError("--compare reads two watch.json files: give no command with it")
    result = compare(load_report(paths[0]), load_report(paths[1]))
    if as_json:
        emit_json(result)
    else:
        click.echo(f"A: {paths[0]}\nB: {paths[1]}\n{compare_text(result)}")
