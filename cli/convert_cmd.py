"""``dlstore convert``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dlstore.cli.render import StorePath, emit_json, stderr, storage_options_option
from dlstore.convert.sizes import human_bytes
from dlstore.formats import DEFAULT_FORMAT, FORMATS, cli_options
from dlstore.spec import CHANNELS, DECODE_MODES, RESIZE_POLICIES, STORAGE_ORDERS

F = Callable[..., Any]


def writer_options(command: F) -> F:
    """One click option per writer option any format declares (``--codec`` …), choices from the
    registry; default None so each format fills in its own default."""
    for opt in reversed(cli_options()):
        kind: click.ParamType
        if opt.choices:
            kind = click.Choice(opt.choices)
        elif opt.kind is int:
            kind = click.IntRange(opt.min, opt.max)  # type: ignore[arg-type]
        elif opt.kind is float:
            kind = click.FloatRange(opt.min, opt.max)
        else:
            kind = click.STRING
        flag = f"--{opt.name.replace('_', '-')}"  # shard_mb → --shard-mb
        command = click.option(flag, opt.name, type=kind, default=None, help=opt.help)(command)
    return command


@click.command("convert")
@click.argument("source")
@click.argument("dest", type=StorePath())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(FORMATS)),
    default=DEFAULT_FORMAT,
    show_default=True,
    help="Cache format.",
)
@click.option("--size", type=click.IntRange(1, 8192), required=True, help="Output side in pixels.")
@click.option(
    "--resize",
    type=click.Choice(RESIZE_POLICIES),
    default="crop",
    show_default=True,
    help="crop = torchvision Resize(size)+CenterCrop(size); shorter = Resize(size): aspect ratio kept, "
    "images differ in size (npz/zarr).",
)
@click.option(
    "--max-side",
    type=click.IntRange(2, 65536),
    default=None,
    help="With --resize shorter: cap the longer side (torchvision Resize's max_size).",
)
@click.option(
    "--channels",
    type=click.Choice([str(c) for c in CHANNELS]),
    default="3",
    show_default=True,
    help="3 = RGB, 1 = grey.",
)
@click.option(
    "--decode",
    type=click.Choice(DECODE_MODES),
    default="exact",
    show_default=True,
    help="exact = full decode, torchvision's pixels; fast = DCT-scaled decode of large JPEGs "
    "(several times faster, mean error ≤ about 1 level; see README).",
)
@writer_options
@click.option("--compress", is_flag=True, hidden=True, help="Deprecated: --codec deflate (npz).")
@click.option("--workers", type=click.IntRange(1, 1024), default=None, help="Processes [default: all cores].")
@click.option(
    "--root",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Folder holding torchvision dataset files (for torchvision:NAME).",
)
@click.option(
    "--split",
    type=click.Choice(["train", "test"]),
    default="train",
    show_default=True,
    help="torchvision split.",
)
@click.option(
    "--demo-images",
    type=click.IntRange(1, 1_000_000),
    default=512,
    show_default=True,
    help="Images in the demo dataset.",
)
@click.option("--strict", is_flag=True, help="Stop at the first undecodable image instead of skipping it.")
@click.option(
    "--max-bad",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Abort when more than this fraction of images is undecodable.",
)
@click.option(
    "--decode-timeout",
    type=click.FloatRange(0, None),
    default=60.0,
    show_default=True,
    help="Seconds one image may take to decode before it is skipped as bad (0 = no limit).",
)
@click.option(
    "--max-megapixels",
    type=click.FloatRange(0, None, min_open=True),
    default=None,
    help="Decode images up to this size; larger files are refused as decompression bombs, skipped and "
    "named [default: Pillow's limit, 89.5]. Raise it for very large photographs (e.g. 120 for 108 MP).",
)
@click.option(
    "--storage-order",
    type=click.Choice(STORAGE_ORDERS),
    default="shuffled",
    show_default=True,
    help="shuffled: chunks hold a seeded random mix (fast random-order reads with the chunk sampler).",
)
@click.option(
    "--scheduler",
    default=None,
    metavar="local[:N]|tcp://HOST:PORT",
    help="Run the units as Dask tasks: a local cluster where N processes decode, or a running scheduler "
    "whose workers see SOURCE and DEST (needs dlstore[dask]).",
)
@storage_options_option()
@click.option("--overwrite", is_flag=True, help="Replace an existing cache at DEST (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def convert_cmd(
    source: str,
    dest: Path,
    fmt: str,
    size: int,
    resize: str,
    max_side: int | None,
    channels: str,
    decode: str,
    compress: bool,
    workers: int | None,
    root: Path | None,
    split: str,
    demo_images: int,
    strict: bool,
    max_bad: float,
    decode_timeout: float,
    max_megapixels: float | None,
    storage_order: str,
    scheduler: str | None,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Convert SOURCE into a pre-resized cache at DEST.

    SOURCE is a folder of class subfolders (ImageFolder layout), torchvision:NAME
    (MNIST, FashionMNIST, CIFAR10, CIFAR100; files under --root) or demo.
    """
    from dlstore.convert.conversion import convert

    options = {k: v for k, v in options.items() if v is not None}
    if compress:
        click.echo("warning: --compress is deprecated; use --codec deflate", err=True)
        options.setdefault("codec", "deflate")
    with click.progressbar(length=1, label="converting", file=stderr()) as bar:

        def progress(n: int) -> None:
            bar.length = max(bar.length or 1, bar.pos + n)
            bar.update(n)

        result = convert(
            source,
            dest,
            format=fmt,
            size=size,
            resize=resize,
            channels=int(channels),
            decode=decode,
            options=options,
            max_side=max_side,
            workers=workers,
            overwrite=overwrite,
            root=root,
            train=split == "train",
            demo_images=demo_images,
            strict=strict,
            max_bad=max_bad,
            storage_order=storage_order,
            decode_timeout=decode_timeout,
            max_megapixels=max_megapixels,
            scheduler=scheduler,
            storage_options=storage_options,
            progress=progress,
            log=lambda message: click.echo(f"\nwarning: {message}", err=True),
        )
    if result.up_to_date:
        click.echo(f"{result.dest} is up to date", err=True)
    if as_json:
        emit_json(result.to_dict())
        return
    if result.up_to_date:
        return
    click.echo(
        f"{result.dest}: {result.format}, {result.n} images of {'x'.join(map(str, result.shape))}, "
        f"{len(result.classes)} classes, {human_bytes(result.bytes_on_disk)} on disk"
    )
    click.echo(
        f"{result.seconds:.1f} s, {result.images_per_s:,.0f} images/s with {result.workers} workers"
        + (f", resumed {result.resumed_units} finished units" if result.resumed_units else "")
    )
    if result.n_skipped:
        click.echo(
            f"skipped {result.n_skipped} undecodable images (listed in {result.dest}/skipped.json); "
            f"first: {result.skipped[0]['reason']}"
        )
