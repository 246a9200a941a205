"""Registry of cache formats: a name → (Writer, Reader) and what each declares (``Format.options``,
``Format.traits``), the source of the CLI's ``--format``/``--codec`` choices and of every
format-dependent decision. ``Format.writer_for`` / ``reader_for`` pick a chunked format's layout: pixels
(one (n,H,W,C) array per unit) or payloads (``payload.py``: image codecs, variable-size images)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlstore.errors import SpecError
from dlstore.formats.base import CacheReader, CacheWriter
from dlstore.formats.codecs import JpegCodec
from dlstore.formats.describe import Codec, Option, Traits
from dlstore.formats.npz import NpzPayloadReader, NpzPayloadWriter, NpzReader, NpzWriter
from dlstore.formats.payload import PAYLOAD, image_codec_class
from dlstore.formats.ram import RamReader, RamWriter
from dlstore.formats.zarr_cache import ZarrPayloadReader, ZarrPayloadWriter, ZarrReader, ZarrWriter
from dlstore.spec import CacheSpec

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "Codec",
    "Format",
    "Option",
    "Traits",
    "cli_options",
    "get_format",
    "in_memory_format",
    "register_codec",
]


@dataclass(frozen=True)
class Format:
    name: str
    writer: type[CacheWriter]
    reader: type[CacheReader]
    payload_writer: type[CacheWriter] | None = None
    payload_reader: type[CacheReader] | None = None

    @property
    def ragged_ok(self) -> bool:
        """Can store images of different sizes, and image codecs (the payload layout)."""
        return self.payload_writer is not None

    def codec(self, name: str | None) -> Codec | None:
        """The declared codec called ``name`` (the manifest's and the CLI's one value for it)."""
        codecs = self.writer.codecs
        if codecs is None or name is None:
            return None
        try:
            return codecs[name]
        except KeyError:
            raise SpecError(
                f"the {self.name} format has no codec {name!r}; choose one of {', '.join(codecs.names())}"
            ) from None

    def writer_for(self, options: dict[str, Any], ragged: bool) -> type[CacheWriter]:
        """The writer for validated ``options`` and an image policy; refuses what it cannot store."""
        image_codec = image_codec_class(self.codec(options.get("codec")))
        if not (ragged or image_codec):
            return self.writer
        if self.payload_writer is None:
            others = " or ".join(f.name for f in FORMATS.values() if f.ragged_ok)
            raise SpecError(
                f"the {self.name} format cannot store variable-size images (resize 'shorter'); "
                f"use --format {others}"
            )
        return self.payload_writer

    def reader_for(self, spec: CacheSpec) -> type[CacheReader]:
        if spec.format_options.get("layout") == PAYLOAD and self.payload_reader is not None:
            return self.payload_reader
        return self.reader

    @property
    def traits(self) -> Traits:
        return self.reader.traits

    @property
    def options(self) -> tuple[Option, ...]:
        return self.writer.declared_options()


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("ram", RamWriter, RamReader),
        Format("npz", NpzWriter, NpzReader, NpzPayloadWriter, NpzPayloadReader),
        Format("zarr", ZarrWriter, ZarrReader, ZarrPayloadWriter, ZarrPayloadReader),
    )
}


DEFAULT_FORMAT = "ram"  # fastest to read when it fits in memory; `dlstore bench` says when it does not


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise SpecError(f"unknown cache format {name!r}; choose one of {', '.join(FORMATS)}") from None


def register_codec(format: str, codec: Codec) -> None:
    """Add a codec to a chunked format: it becomes a ``--codec`` choice for that format."""
    codecs = get_format(format).writer.codecs
    if codecs is None:
        raise SpecError(f"the {format} format takes no codec")
    codecs.register(codec)


JPEG = Codec(
    "jpeg",
    "each image a baseline JPEG at --quality (variable size allowed; DecodeLoader decodes on the GPU)",
    0.1,
    JpegCodec,
)
for _fmt in FORMATS.values():
    if _fmt.ragged_ok:
        register_codec(_fmt.name, JPEG)


def in_memory_format() -> str:
    """The format whose caches load into RAM (the one the in-memory fast loaders build)."""
    return next(f.name for f in FORMATS.values() if f.traits.loads_into_ram)


def compressed_gpu_format() -> tuple[str, str] | None:
    """(format, codec) for a cache that stores each image as a JPEG, decoded on the GPU by DecodeLoader:
    the choice when a raw cache does not fit in memory. None when no format registers such a codec."""
    for f in FORMATS.values():
        codecs = f.writer.codecs
        if codecs is not None and JPEG.name in codecs.names():
            return f.name, JPEG.name
    return None


@dataclass(frozen=True)
class CliOption:
    """One writer option as the CLI offers it: every format's choices together, no default (each
    format fills in its own), and a help line saying which format takes what."""

    name: str
    choices: tuple[str, ...]
    help: str
    kind: type
    min: float | None
    max: float | None


def cli_options() -> list[CliOption]:
    """The union of every format's declared options, in declaration order."""
    by_name: dict[str, list[tuple[str, Option]]] = {}
    for f in FORMATS.values():
        for o in f.options:
            by_name.setdefault(o.name, []).append((f.name, o))
    out = []
    for name, decls in by_name.items():
        choices = tuple(dict.fromkeys(c for _, o in decls for c in o.choices))
        per_format = "; ".join(
            f"{fmt}: {'|'.join(o.choices) or o.kind.__name__} (default {o.default})" for fmt, o in decls
        )
        first = decls[0][1]
        out.append(CliOption(name, choices, f"{first.help} {per_format}.", first.kind, first.min, first.max))
    return out
