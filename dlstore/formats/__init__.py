"""Registry of cache formats: a name → (Writer, Reader). The CLI's ``--format`` choices come from here."""

from __future__ import annotations

from dataclasses import dataclass

from dlstore.errors import SpecError
from dlstore.formats.base import CacheReader, CacheWriter
from dlstore.formats.npz import NpzReader, NpzWriter
from dlstore.formats.ram import RamReader, RamWriter
from dlstore.formats.zarr_cache import ZarrReader, ZarrWriter


@dataclass(frozen=True)
class Format:
    name: str
    writer: type[CacheWriter]
    reader: type[CacheReader]


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("ram", RamWriter, RamReader),
        Format("npz", NpzWriter, NpzReader),
        Format("zarr", ZarrWriter, ZarrReader),
    )
}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise SpecError(f"unknown cache format {name!r}; choose one of {', '.join(FORMATS)}") from None
