"""``dlstore bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dlstore.bench.kinds import LOADER_KINDS  # the registry imports torch only to build a kind
from dlstore.bench.protocol import DEFAULT_LOADERS as KINDS
from dlstore.bench.protocol import BenchConfig, parse_int_list, parse_loaders
from dlstore.cli.render import StorePath, emit_json
from dlstore.cli.shared_options import (
    Command,
    config_options,
    demo_images_option,
    field_option,
    json_option,
    label_option,
    max_megapixels_option,
    pixels_option,
    root_option,
    size_option,
)


class ParsedList(click.ParamType):
    """A comma-separated list, read by the library's parser (whose error names the bad item)."""

    def __init__(self, name: str, parse: Any) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return value if isinstance(value, tuple) else self.parse(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


# The options a budget may cut (plan.cuts_in_order), as BenchConfig fields: one the user set stays.
BUDGET_CUTTABLE = ("loaders", "workers", "repeats", "steps", "warmup", "stage_steps", "cold", "max_images")


def user_set(ctx: click.Context) -> tuple[str, ...]:
    """The BenchConfig fields whose options the user gave on the command line (the budget keeps them)."""
    given = {
        p for p in BUDGET_CUTTABLE if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE
    }
    return tuple(sorted(given))


SOURCE = "The source"
STEP = "The training step"
TIMING = "Timing (tuning)"
# BenchConfig field → its option's help and values; the flag and the default are the field's (config_options).
OPTIONS: dict[str, dict[str, Any]] = {
    "loaders": dict(
        type=ParsedList("KIND,...", lambda text: parse_loaders(text, tuple(LOADER_KINDS))),
        default=None,
        help=f"Loader kinds to compare, of {', '.join(LOADER_KINDS)}: raw (per-file decode, as torchvision), "
        "one per cache format, the fast paths pinned and resident, and the JPEG cache's GPU and CPU decode "
        f"[default: {','.join(KINDS)}].",
    ),
    "workers": dict(
        type=ParsedList("N,N,...", parse_int_list),
        help="DataLoader worker counts to sweep [default: 0 and the 2 largest powers of two ≤ cores].",
    ),
    "batch_size": dict(
        type=click.IntRange(1, 65536),
        help="[default: what a user picks for the model: 256 for ResNets and 64 for smallcnn on a GPU, "
        "32 on a CPU]",
    ),
    "model": dict(
        help="smallcnn, resnet18, resnet50 or MODULE:CALLABLE (a factory taking any of in_channels, "
        "image_size, num_classes)."
    ),
    "transform": dict(
        type=click.Choice(["light", "augment", "gpu-augment"]),
        help="light = ToTensor-like; augment = RandomResizedCrop+Rotation(15)+flip on the CPU; "
        "gpu-augment = the same on the device, per sample.",
    ),
    "budget_s": dict(
        flag="--budget",
        type=click.FloatRange(0, None),
        default=60.0,
        help="Seconds the whole bench should take: it calibrates, then plans its runs to fit, cutting only "
        "what you did not set (steps, repeats, worker counts, the sample, default loaders) and printing "
        "the plan, its estimate and the cuts first. 0: no budget.",
    ),
    "out": dict(
        type=click.Path(path_type=Path, file_okay=False),
        help="Output folder [default: ./dlstore-bench-YYYYmmdd-HHMMSS].",
    ),
    "cache": dict(
        type=StorePath(),
        help="A dlstore cache to use for its format, or the folder to keep the bench's caches in.",
    ),
    "step": dict(
        metavar="MODULE:CALLABLE",
        help="Your own training step, called as CALLABLE(images, labels) with batches on the device after "
        "the device transform; replaces --model's step.",
    ),
    "precision": dict(
        type=click.Choice(["bf16", "fp16", "fp32", "tf32"]),
        help="Numerics of the step [default: bf16 autocast on CUDA, fp32 on a CPU].",
    ),
    "channels_last": dict(
        flag="--channels-last/--no-channels-last",
        help="channels_last weights and inputs [default: on for conv nets on CUDA].",
    ),
    "compile": dict(help="torch.compile the model (compile time is in warm-up)."),
    "device": dict(type=click.Choice(["auto", "cuda", "cpu"])),
    "repeats": dict(
        type=click.IntRange(1, 100), help="Rounds over all configurations, each in rotated order."
    ),
    "steps": dict(type=click.IntRange(1, 100000), help="Timed steps per run."),
    "warmup": dict(
        type=click.IntRange(1, 100000),
        help="Steps before timing (worker start-up included; reported apart).",
    ),
    "stage_steps": dict(type=click.IntRange(1, 100000), help="Timed batches when a stage is measured alone."),
    "max_run_s": dict(
        flag="--max-run-seconds",
        type=click.FloatRange(0, min_open=True),
        help="Stop a run's timed steps after this long (at least 4 steps, whole cycles of the loader).",
    ),
    "cold": dict(
        flag="--cold/--no-cold", help="A cold-cache run per loader kind at the largest worker count."
    ),
    "max_images": dict(
        type=click.IntRange(0, None),
        help="Bench a seeded random sample of this many source images when the source is larger (every "
        "loader kind reads the same sample; rates are per image, memory advice uses the whole source). 0: all.",
    ),
    "profile": dict(
        help="torch.profiler trace + operator table per configuration (separate short runs; throughput "
        "never comes from them)."
    ),
}
SECTIONS = {
    STEP: ("step", "precision", "channels_last", "compile", "device"),
    SOURCE: ("root", "label", "fields", "pixels", "max_megapixels", "demo_images"),
    TIMING: ("repeats", "steps", "warmup", "stage_steps", "max_run_s", "cold", "max_images", "profile"),
}


@click.command(
    "bench",
    cls=Command,
    sections=SECTIONS,
    short_help="Measure each input stage, name the bottleneck, rank the fixes.",
)
@click.argument("source", default="demo")
@config_options(BenchConfig, OPTIONS)
@size_option(
    "Image side in pixels [default: native for torchvision sets, 32 for demo, 224 for folders (64 on a CPU)].",
)
@root_option()
@label_option()
@field_option()
@pixels_option()
@max_megapixels_option(
    "As for convert: the caches take images up to this size [default: Pillow's limit, 89.5]."
)
@demo_images_option(None, "Images in the demo dataset [default: 8 batches, at least 256].")
@json_option("Print the result document on stdout (progress on stderr).")
def bench_cmd(as_json: bool, **params: Any) -> None:
    """Measure each input stage alone and end to end, sweep workers, name the bottleneck.

    SOURCE is demo (default), a folder of class subfolders, torchvision:NAME with --root DIR, or any
    SOURCE convert reads (parquet, WebDataset shards, a CSV/JSON-lines list, MODULE:CALLABLE).
    Writes result.json, steps.csv, plots.png and timeline.png under --out.
    """
    from dlstore.bench.calibrate import command_startup_s
    from dlstore.bench.report import default_out_dir, render_text
    from dlstore.bench.run import run_bench

    params["loaders"] = params["loaders"] or KINDS
    params["out"] = params["out"] or default_out_dir()
    params["budget_s"] = params["budget_s"] or None
    config = BenchConfig(
        **params,
        budget_spent_s=command_startup_s(),  # Python's start and the imports count against the budget
        user_set=user_set(click.get_current_context()),
    )

    def log(msg: str) -> None:
        click.echo(f"[bench] {msg}", err=True)

    doc = run_bench(config, log=log)
    unwritten = doc.get("outputs_error")
    if not unwritten:
        log(f"wrote {', '.join(str(v) for k, v in doc.get('outputs', {}).items() if k != 'csv_rows')}")
    if as_json:
        emit_json(doc)
    else:
        click.echo(render_text(doc))
    if unwritten:
        raise click.ClickException(
            f"the results above were not all written under --out ({unwritten}); "
            "free space there or choose another --out, and run again"
        )
