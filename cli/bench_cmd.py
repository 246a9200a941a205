"""``dlstore bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dlstore.bench.kinds import LOADER_KINDS  # the registry imports torch only to build a kind
from dlstore.bench.protocol import DEFAULT_LOADERS as KINDS
from dlstore.cli.render import StorePath, emit_json, stderr
from dlstore.cli.shared_options import (
    demo_images_option,
    field_option,
    label_option,
    max_megapixels_option,
    pixels_option,
    root_option,
    size_option,
)


class IntList(click.ParamType):
    name = "N,N,..."

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        from dlstore.bench.protocol import parse_int_list

        try:
            return parse_int_list(str(value))
        except ValueError as e:
            self.fail(f"{value!r}: {e}", param, ctx)


class KindList(click.ParamType):
    name = "KIND,..."

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        from dlstore.bench.protocol import parse_loaders

        try:
            return parse_loaders(str(value), tuple(LOADER_KINDS))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def pick_loaders(loaders: tuple[str, ...] | None, alias: tuple[str, ...] | None) -> tuple[str, ...]:
    """``--formats`` was renamed ``--loaders`` (it takes loader kinds, not storage formats); the old name
    still works, with a warning on stderr."""
    if alias is not None:
        if loaders is not None:
            raise click.UsageError("give --loaders only (--formats is its deprecated old name)")
        click.echo(
            "Warning: --formats is deprecated and will be removed; use --loaders (it takes loader kinds "
            "such as raw and pinned, not storage formats).",
            file=stderr(),
        )
        return alias
    return loaders if loaders is not None else KINDS


# CLI option → the BenchConfig field a budget may cut (plan.cuts_in_order): one the user set stays.
BUDGET_CUTTABLE = {
    "loaders": "loaders",
    "formats_alias": "loaders",
    "workers": "workers",
    "repeats": "repeats",
    "steps": "steps",
    "warmup": "warmup",
    "stage_steps": "stage_steps",
    "cold": "cold",
    "max_images": "max_images",
}


def user_set(ctx: click.Context) -> tuple[str, ...]:
    """The BenchConfig fields whose options the user gave on the command line (the budget keeps them)."""
    given = {
        field
        for param, field in BUDGET_CUTTABLE.items()
        if ctx.get_parameter_source(param) == click.core.ParameterSource.COMMANDLINE
    }
    return tuple(sorted(given))


@click.command("bench")
@click.argument("source", default="demo")
@click.option(
    "--loaders",
    "loaders",
    type=KindList(),
    default=None,
    help=f"Loader kinds to compare, of {', '.join(LOADER_KINDS)}: raw (per-file decode, as torchvision), "
    "one per cache format, the fast paths pinned and resident, and the JPEG cache's GPU and CPU decode "
    f"[default: {','.join(KINDS)}].",
)
@click.option(
    "--formats",
    "formats_alias",
    type=KindList(),
    default=None,
    hidden=True,
    help="Deprecated alias of --loaders.",
)
@click.option(
    "--workers",
    type=IntList(),
    default=None,
    help="DataLoader worker counts to sweep [default: 0 and the 2 largest powers of two ≤ cores].",
)
@size_option(
    "Image side in pixels [default: native for torchvision sets, 32 for demo, 224 for folders (64 on a CPU)].",
)
@pixels_option()
@click.option(
    "--batch-size",
    type=click.IntRange(1, 65536),
    default=None,
    help="[default: what a user picks for the model: 256 for ResNets and 64 for smallcnn on a GPU, 32 on a CPU]",
)
@click.option(
    "--model",
    default="smallcnn",
    show_default=True,
    help="smallcnn, resnet18, resnet50 or MODULE:CALLABLE (a factory taking any of in_channels, image_size, "
    "num_classes).",
)
@click.option(
    "--step",
    "step",
    default=None,
    metavar="MODULE:CALLABLE",
    help="Your own training step, called as CALLABLE(images, labels) with batches on the device after the "
    "device transform; replaces --model's step.",
)
@click.option(
    "--precision",
    type=click.Choice(["bf16", "fp16", "fp32", "tf32"]),
    default=None,
    help="Numerics of the step [default: bf16 autocast on CUDA, fp32 on a CPU].",
)
@click.option(
    "--channels-last/--no-channels-last",
    default=None,
    help="channels_last weights and inputs [default: on for conv nets on CUDA].",
)
@click.option(
    "--compile", "compile_", is_flag=True, help="torch.compile the model (compile time is in warm-up)."
)
@click.option(
    "--transform",
    type=click.Choice(["light", "augment", "gpu-augment"]),
    default="light",
    show_default=True,
    help="light = ToTensor-like; augment = RandomResizedCrop+Rotation(15)+flip on "
    "the CPU; gpu-augment = the same on the device, per sample.",
)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(1, 100),
    default=2,
    show_default=True,
    help="Rounds over all configurations, each in rotated order.",
)
@click.option(
    "--steps", type=click.IntRange(1, 100000), default=16, show_default=True, help="Timed steps per run."
)
@click.option(
    "--warmup",
    type=click.IntRange(1, 100000),
    default=4,
    show_default=True,
    help="Steps before timing (worker start-up included; reported apart).",
)
@click.option(
    "--stage-steps",
    type=click.IntRange(1, 100000),
    default=10,
    show_default=True,
    help="Timed batches when a stage is measured alone.",
)
@click.option(
    "--max-run-seconds",
    type=click.FloatRange(0, min_open=True),
    default=1.0,
    show_default=True,
    help="Stop a run's timed steps after this long (at least 4 steps, whole cycles of the loader).",
)
@click.option(
    "--budget",
    type=click.FloatRange(0, None),
    default=60.0,
    show_default=True,
    help="Seconds the whole bench should take: it calibrates, then plans its runs to fit, cutting only what "
    "you did not set (steps, repeats, worker counts, the sample, default loaders) and printing the plan, "
    "its estimate and the cuts first. 0: no budget.",
)
@click.option(
    "--cold/--no-cold",
    default=True,
    show_default=True,
    help="A cold-cache run per loader kind at the largest worker count.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="torch.profiler trace + operator table per configuration "
    "(separate short runs; throughput never comes from them).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Output folder [default: ./dlstore-bench-YYYYmmdd-HHMMSS].",
)
@click.option(
    "--cache",
    type=StorePath(),
    default=None,
    help="A dlstore cache to use for its format, or the folder to keep the bench's caches in.",
)
@root_option()
@label_option()
@field_option()
@click.option(
    "--max-images",
    type=click.IntRange(0, None),
    default=10_000,
    show_default=True,
    help="Bench a seeded random sample of this many source images when the source is larger (every loader "
    "kind reads the same sample; rates are per image, memory advice uses the whole source). 0: all of it.",
)
@max_megapixels_option(
    "As for convert: the caches take images up to this size [default: Pillow's limit, 89.5]."
)
@demo_images_option(None, "Images in the demo dataset [default: 8 batches, at least 256].")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the result document on stdout (progress on stderr)."
)
def bench_cmd(
    source: str,
    loaders: tuple[str, ...] | None,
    formats_alias: tuple[str, ...] | None,
    workers: tuple[int, ...] | None,
    size: int | None,
    pixels: str,
    batch_size: int | None,
    model: str,
    step: str | None,
    precision: str | None,
    channels_last: bool | None,
    compile_: bool,
    transform: str,
    device: str,
    repeats: int,
    steps: int,
    warmup: int,
    stage_steps: int,
    max_run_seconds: float | None,
    cold: bool,
    profile: bool,
    out: Path | None,
    cache: Path | None,
    root: Path | None,
    label: str | None,
    fields: tuple[str, ...],
    max_images: int,
    max_megapixels: float | None,
    demo_images: int | None,
    as_json: bool,
    budget: float,
) -> None:
    """Measure each input stage alone and end to end, sweep workers, name the bottleneck.

    SOURCE is demo (default), a folder of class subfolders, torchvision:NAME with --root DIR, or any
    SOURCE convert reads (parquet, WebDataset shards, a CSV/JSON-lines list, MODULE:CALLABLE).
    Writes result.json, steps.csv, plots.png and timeline.png under --out.
    """
    from dlstore.bench.calibrate import command_startup_s
    from dlstore.bench.protocol import BenchConfig
    from dlstore.bench.report import default_out_dir, render_text
    from dlstore.bench.run import run_bench

    config = BenchConfig(
        source=source,
        root=root,
        label=label,
        fields=fields,
        loaders=pick_loaders(loaders, formats_alias),
        workers=workers,
        size=size,
        pixels=pixels,
        batch_size=batch_size,
        model=model,
        step=step,
        precision=precision,
        channels_last=channels_last,
        compile=compile_,
        transform=transform,
        device=device,
        repeats=repeats,
        steps=steps,
        warmup=warmup,
        stage_steps=stage_steps,
        max_run_s=max_run_seconds,
        cold=cold,
        profile=profile,
        out=out or default_out_dir(),
        cache=cache,
        demo_images=demo_images,
        max_images=max_images,
        max_megapixels=max_megapixels,
        budget_s=budget or None,
        budget_spent_s=command_startup_s(),  # Python's start and the imports count against the budget
        user_set=user_set(click.get_current_context()),
    )

    def log(msg: str) -> None:
        click.echo(f"[bench] {msg}", file=stderr())

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
