"""Which Source class reads a SOURCE argument: each kind declares itself (``claims``) and is
registered (``@register_source``) in ``claim_order``; ``open_source`` asks each in turn. Prefix and
suffix kinds go first; the folder claims any path and is asked last."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dlstore.errors import SourceError
from dlstore.spec import MANIFEST
from dlstore.write.sources.source import Source

_KINDS: list[type[Source]] = []
K = TypeVar("K", bound=type[Source])


@dataclass(frozen=True)
class SourceArgs:
    """What a SOURCE argument comes with besides its text: ``root`` (torchvision's files; a list's
    images), ``train``, ``demo_images``, ``label`` (the target column or key), ``strict`` (a sample the
    listing cannot take stops the open instead of going to ``scan_errors``), ``storage_options``, and
    ``fields`` (--field texts)."""

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


def kind_for(text: str) -> type[Source]:
    for kind in _KINDS:
        if kind.claims(text):
            return kind
    forms = "; ".join(k.form for k in _KINDS if getattr(k, "form", ""))
    raise SourceError(f"{text}: not a SOURCE dlstore can read; give one of: {forms}")


def open_source(source: str | Path, **args: Any) -> Source:
    """Resolve a SOURCE argument through the kind that claims it; ``args``: ``SourceArgs``' fields."""
    text, given = str(source), SourceArgs(**{**args, "fields": tuple(args.get("fields") or ())})
    if (Path(text) / MANIFEST).is_file():
        raise SourceError(
            f"{text}: a dlstore cache, not images to convert: give the folder it was made from "
            f"(`dlstore info {text}` names it), or read it with dlstore.CachedDataset or dlstore.Loader"
        )
    kind = kind_for(text)
    if given.fields and not kind.field_form:  # --field KEY: only for kinds that say what KEY names
        takers = "; ".join(f"{k.form}: KEY is {k.field_form}" for k in _KINDS if k.field_form)
        raise SourceError(
            f"{text}: --field {given.fields[0]!r}: this kind of SOURCE brings no extra keys to take fields from "
            f"(its fields, if any, are its own); --field is for: {takers}"
        )
    return kind.open(text, given)


def local_root(source: str | Path) -> Path | None:
    """The local folder a SOURCE reads images from (DEST must not be inside it), or None."""
    text = str(source)
    return kind_for(text).local_root(text)
