"""Which Source class reads a SOURCE argument: every kind declares itself (``claims(text)``) and is
registered here in claim order; ``open_source`` asks each in turn and tests no names itself.

A new kind is one module in this package that subclasses ``Source`` (or a kind of it), defines
``claims`` and ``open`` and decorates the class with ``@register_source``; ``sources/__init__.py``
imports the module. ``claim_order`` decides who is asked first (lower first): a kind recognised by a
prefix or suffix goes before the folder, which claims any path and is asked last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dlstore.errors import SourceError
from dlstore.write.sources.source import Source

_KINDS: list[type[Source]] = []
K = TypeVar("K", bound=type[Source])


@dataclass(frozen=True)
class SourceArgs:
    """What a SOURCE argument comes with besides its text: ``root`` (torchvision's files; a file list's
    image folder), ``train`` (torchvision's split), ``demo_images``, ``label`` (the target column or
    field, for the kinds that have columns), ``strict`` (a sample the listing cannot take - a row
    without a label - stops the open, named, instead of being listed in ``scan_errors``)."""

    root: Path | None = None
    train: bool = True
    demo_images: int = 512
    label: str | None = None
    strict: bool = False
    storage_options: dict[str, Any] | None = field(default=None, repr=False)  # for URL sources
    fields: tuple[str, ...] = ()  # --field NAME=KEY[:KIND[:DTYPE]] texts (``fieldmap``)


def register_source(cls: K) -> K:
    """Class decorator: add a Source kind to the registry (kept sorted by ``claim_order``)."""
    if cls not in _KINDS:
        _KINDS.append(cls)
        _KINDS.sort(key=lambda k: k.claim_order)
    return cls


def source_kinds() -> tuple[type[Source], ...]:
    """The registered kinds, in the order they are asked."""
    return tuple(_KINDS)


def kind_for(text: str) -> type[Source]:
    for kind in _KINDS:
        if kind.claims(text):
            return kind
    forms = "; ".join(k.form for k in _KINDS if getattr(k, "form", ""))
    raise SourceError(f"{text}: not a SOURCE dlstore can read; give one of: {forms}")


def open_source(
    source: str | Path,
    root: Path | None = None,
    train: bool = True,
    demo_images: int = 512,
    label: str | None = None,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    fields: tuple[str, ...] = (),
) -> Source:
    """Resolve a SOURCE argument through the kind that claims it (``SourceArgs`` lists the rest)."""
    text = str(source)
    kind = kind_for(text)
    check_fields_taken(kind, text, fields)
    return kind.open(
        text, SourceArgs(root, train, demo_images, label, strict, storage_options, tuple(fields))
    )


def check_fields_taken(kind: type[Source], text: str, fields: tuple[str, ...]) -> None:
    """``--field`` only for the kinds that declare what its KEY names (``field_form``)."""
    if fields and not kind.field_form:
        takers = "; ".join(f"{k.form}: KEY is {k.field_form}" for k in _KINDS if k.field_form)
        raise SourceError(
            f"{text}: --field {fields[0]!r}: this kind of SOURCE brings no extra keys to take fields from "
            f"(its fields, if any, are its own); --field is for: {takers}"
        )


def local_root(source: str | Path) -> Path | None:
    """The local folder a SOURCE argument reads images from, where a cache must not be written
    (``check_dest_outside_source``); None for kinds with no such folder."""
    text = str(source)
    return kind_for(text).local_root(text)
