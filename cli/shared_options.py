"""Click options that more than one command takes, each declared once (``convert`` and ``bench``:
``--size``, ``--root``, ``--label``, ``--max-megapixels``, ``--demo-images``; and the writer options every format
declares, ``--codec`` …, from the registry). A command passes only what differs for it: its range,
default and help line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from dlstore.formats import cli_options

F = Callable[..., Any]


class Command(click.Command):
    """A command whose ``--help`` lists the options a newcomer needs first, then the rest under the
    headings of ``sections`` (heading → parameter names), in that order."""

    def __init__(self, *args: Any, sections: dict[str, tuple[str, ...]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        heading = {name: title for title, names in self.sections.items() for name in names}
        rows: dict[str, list[tuple[str, str]]] = {"Options": [], **{title: [] for title in self.sections}}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                rows[heading.get(param.name or "", "Options")].append(record)
        for title, records in rows.items():
            with formatter.section(title):
                formatter.write_dl(records)


def config_options(config: type, table: dict[str, dict[str, Any]]) -> Callable[[F], F]:
    """One option per field the table names, generated from the config dataclass: the flag is the field's
    name (``max_images`` → ``--max-images``) unless the table gives ``flag``, the default is the field's
    unless it gives ``default``; the table adds the help and the values taken. A bool field is a flag."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}

    def decorate(command: F) -> F:
        for name, spec in reversed(list(table.items())):
            spec = {"default": defaults[name], **spec}
            flag = spec.pop("flag", "--" + name.replace("_", "-"))
            if isinstance(spec["default"], bool) and "/" not in flag:
                spec["is_flag"] = True
            spec.setdefault("show_default", spec["default"] not in (None, False))
            command = click.option(flag, name, **spec)(command)
        return command

    return decorate


MAX_MEGAPIXELS_HELP = (
    "Decode images up to this size; larger files are refused as decompression bombs, skipped and named "
    "[default: Pillow's limit, 89.5]. Raise it for very large photographs (e.g. 120 for 108 MP)."
)


# The largest --size convert and bench take: one limit for both (a cache the bench cannot bench at
# its own size would be a trap). 8192² RGB is 200 MB per image.
MAX_SIZE = 8192


def json_option(help: str) -> Callable[[F], F]:
    """``--json``: stdout carries exactly one JSON document (``help`` says which)."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def size_option(help: str, required: bool = False) -> Callable[[F], F]:
    # No explicit default: click 8.3+ counts ``default=None`` as a value given for a required option.
    return click.option("--size", type=click.IntRange(1, MAX_SIZE), required=required, help=help)


PIXELS_HELP = (
    "dlstore = upright by EXIF orientation, 16-bit scaled to 8 bits, alpha composited on white; "
    "torchvision = stock ImageFolder + Resize/CenterCrop bit for bit (PIL's convert('RGB'): no EXIF "
    "rotation, alpha dropped; not with --resize pad or --decode fast)."
)


def pixels_option() -> Callable[[F], F]:
    from dlstore.spec import PIXEL_POLICIES

    return click.option(
        "--pixels", type=click.Choice(PIXEL_POLICIES), default="dlstore", show_default=True, help=PIXELS_HELP
    )


def root_option() -> Callable[[F], F]:
    return click.option(
        "--root",
        type=click.Path(path_type=Path, file_okay=False),
        default=None,
        help="Folder holding torchvision dataset files (for torchvision:NAME), or the images a CSV/JSON-lines "
        "list names [default: the list's folder].",
    )


def label_option() -> Callable[[F], F]:
    return click.option(
        "--label",
        default=None,
        metavar="COLUMN",
        help="The class label of each sample: a parquet or list column [default: label], a WebDataset member "
        "extension or .json field [default: cls], a Dataset item's dict key [default: label].",
    )


def field_option() -> Callable[[F], F]:
    return click.option(
        "--field",
        "fields",
        multiple=True,
        metavar="NAME=KEY[:KIND[:DTYPE]]",
        help="Store a sample's extra column or key as the field NAME (repeatable): KEY is a parquet column, "
        "a WebDataset member extension or .json key, a Dataset item's dict key; KIND values|boxes|ragged|"
        "mask|json [default: from the first value]. See docs/fields.md.",
    )


def max_megapixels_option(help: str = MAX_MEGAPIXELS_HELP) -> Callable[[F], F]:
    return click.option(
        "--max-megapixels", type=click.FloatRange(0, None, min_open=True), default=None, help=help
    )


def demo_images_option(default: int | None, help: str) -> Callable[[F], F]:
    return click.option(
        "--demo-images",
        type=click.IntRange(1, 1_000_000),
        default=default,
        show_default=default is not None,
        help=help,
    )


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


def given_writer_options(params: dict[str, Any]) -> dict[str, Any]:
    """Take the writer options out of a command's parameters: those given (the format fills in the rest)."""
    taken = {opt.name: params.pop(opt.name, None) for opt in cli_options()}
    return {name: value for name, value in taken.items() if value is not None}
