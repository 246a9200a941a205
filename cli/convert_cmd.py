"""``dlstore convert``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import click

from dlstore.cli.render import StorePath, emit_json, storage_options_option
from dlstore.cli.shared_options import (
    Command,
    config_options,
    demo_images_option,
    field_option,
    given_writer_options,
    json_option,
    label_option,
    max_megapixels_option,
    pixels_option,
    root_option,
    size_option,
    writer_options,
)
from dlstore.formats import FORMATS, cli_options
from dlstore.spec import CHANNELS, DECODE_MODES, RESIZE_POLICIES, STORAGE_ORDERS
from dlstore.write.options import ConvertOptions
from dlstore.write.sizes import count, human_bytes

IMAGES = "The images"
SOURCE = "The source"
BAD = "Undecodable images"
RUN = "Where and how it runs"
# ConvertOptions field → its option's help and values; the flag and the default are the field's.
OPTIONS: dict[str, dict[str, Any]] = {
    "format": dict(type=click.Choice(list(FORMATS)), help="Cache format."),
    "workers": dict(type=click.IntRange(1, 1024), help="Processes [default: all cores]."),
    "overwrite": dict(help="Replace an existing cache at DEST (atomically)."),
    "resize": dict(
        type=click.Choice(RESIZE_POLICIES),
        help="crop = torchvision Resize(size)+CenterCrop(size); shorter = Resize(size): aspect ratio kept, "
        "images differ in size (npz/zarr).",
    ),
    "max_side": dict(
        type=click.IntRange(2, 65536), help="With --resize shorter: cap the longer side (Resize's max_size)."
    ),
    "channels": dict(type=click.Choice(CHANNELS), help="3 = RGB, 1 = grey."),
    "decode": dict(
        type=click.Choice(DECODE_MODES),
        help="exact = full decode, torchvision's pixels; fast = DCT-scaled decode of large JPEGs "
        "(several times faster, mean error ≤ about 1 level; see docs/formats.md).",
    ),
    "strict": dict(help="Stop at the first undecodable image instead of skipping it."),
    "max_bad": dict(
        type=click.FloatRange(0, 1), help="Abort when more than this fraction of images is undecodable."
    ),
    "decode_timeout": dict(
        type=click.FloatRange(0, None),
        help="Seconds one image may take to decode before it is skipped as bad (0 = no limit).",
    ),
    "storage_order": dict(
        type=click.Choice(STORAGE_ORDERS),
        help="shuffled: chunks hold a seeded random mix (fast random-order reads with the chunk sampler).",
    ),
    "scheduler": dict(
        metavar="local[:N]|tcp://HOST:PORT",
        help="Run the units as Dask tasks: a local cluster where N processes decode, or a running "
        "scheduler whose workers see SOURCE and DEST (needs dlstore[dask]).",
    ),
}
SECTIONS = {
    IMAGES: ("resize", "max_side", "channels", "decode", "pixels", "max_megapixels"),
    "Format options": tuple(o.name for o in cli_options()),
    SOURCE: ("root", "label", "fields", "split", "demo_images"),
    BAD: ("strict", "max_bad", "decode_timeout"),
    RUN: ("storage_order", "scheduler", "storage_options"),
}


@click.command(
    "convert", cls=Command, sections=SECTIONS, short_help="Convert SOURCE into a pre-resized cache at DEST."
)
@click.argument("source")
@click.argument("dest", type=StorePath())
@size_option("Output side in pixels.", required=True)
@config_options(ConvertOptions, OPTIONS)
@json_option("Print one JSON document on stdout.")
@pixels_option()
@max_megapixels_option()
@writer_options
@root_option()
@label_option()
@field_option()
@click.option(
    "--split",
    type=click.Choice(["train", "test"]),
    default="train",
    show_default=True,
    help="torchvision split.",
)
@demo_images_option(512, "Images in the demo dataset.")
@storage_options_option()
def convert_cmd(source: str, dest: Any, as_json: bool, **params: Any) -> None:
    """Convert SOURCE into a pre-resized cache at DEST.

    SOURCE is a folder of class subfolders (ImageFolder layout), torchvision:NAME
    (MNIST, FashionMNIST, CIFAR10, CIFAR100; files under --root), demo, a parquet file, folder or
    glob (Hugging Face layout), WebDataset shards ('shards-{000000..000009}.tar', local or s3://),
    a CSV/JSON-lines list of path,label (images under --root) or MODULE:CALLABLE returning a
    map-style Dataset.
    """
    from dlstore.write.conversion import convert

    with ExitStack() as bars:
        result = convert(
            source,
            dest,
            convert_options(params),
            progress=progress_bars(bars),
            log=lambda message: click.echo(f"\nwarning: {message}", err=True),
        )
    render(result, as_json)


def progress_bars(stack: ExitStack) -> Callable[[Any], None]:
    """A click progress bar on stderr per stage ``convert`` reports, closed by ``stack``."""
    bars: dict[str, Any] = {}

    def show(event: Any) -> None:
        if event.stage not in bars:
            stack.close()  # the previous stage's bar
            in_bytes = event.unit == "bytes"
            bars[event.stage] = stack.enter_context(
                click.progressbar(
                    length=max(event.total, 1),
                    label={"images": "converting", "upload": "uploading"}.get(event.stage, event.stage),
                    file=sys.stderr,
                    show_pos=not in_bytes,
                    item_show_func=lambda e: (
                        f"{human_bytes(e.done)} of {human_bytes(e.total)}" if e and in_bytes else None
                    ),
                )
            )
        bars[event.stage].update(event.done - bars[event.stage].pos, current_item=event)

    return show


def convert_options(params: dict[str, Any]) -> Any:
    """The flags → one ``ConvertOptions`` (``--split`` → ``train``, ``codec`` + ``writer_options``)."""
    writer = given_writer_options(params)
    return ConvertOptions(
        **{k: v for k, v in params.items() if k != "split"},
        train=params["split"] == "train",
        codec=writer.pop("codec", None),
        writer_options=writer,
    )


def render(result: Any, as_json: bool) -> None:
    if result.up_to_date:
        click.echo(f"{result.dest} is up to date", err=True)
    elif result.resumed_upload:
        click.echo(
            f"{result.dest}: resumed an interrupted upload ({result.resumed_upload} objects were already "
            "staged); the cache is complete",
            err=True,
        )
    if as_json:
        emit_json(result.to_dict())
        return
    if result.up_to_date:
        return
    click.echo(
        f"{result.dest}: {result.format}, {result.n} images of {'x'.join(map(str, result.shape))}, "
        f"{count(len(result.classes), 'class', 'classes')}, {human_bytes(result.bytes_on_disk)} on disk"
    )
    if result.workers:  # 0: nothing was converted this time (an upload resumed from a finished spool)
        click.echo(
            f"{result.seconds:.1f} s, {result.images_per_s:,.0f} images/s with {count(result.workers, 'worker')}"
            + (f" ({result.workers_reason})" if result.workers_reason else "")
            + (f"; {result.resumed_images:,} images were already converted" if result.resumed_images else "")
        )
    if result.n_skipped:
        click.echo(
            f"skipped {result.n_skipped} undecodable images (listed in {result.dest}/skipped.json); "
            f"first: {result.skipped[0]['reason']}"
        )
