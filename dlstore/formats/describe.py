"""What a format declares about itself (its Writer's options, codecs, traits): everything outside
``dlstore/formats/`` decides through these, never by testing a format's name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlstore.errors import SpecError


@dataclass(frozen=True)
class Codec:
    """One way a chunked format stores a unit's pixels. ``size_ratio``: a rough stored/raw ratio (the
    disk-space warning); ``impl``: what the owning Writer calls (zarr: compressors; npz: a numpy save)."""

    name: str
    help: str
    size_ratio: float = 1.0
    impl: Any = None


@dataclass(frozen=True)
class Option:
    """One Writer option: its manifest key (the CLI flag ``--name``), default, and ``choices`` or else
    any ``kind`` value within [``min``, ``max``]."""

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    kind: type = str
    min: float | None = None
    max: float | None = None

    @property
    def flag(self) -> str:
        """The CLI flag: ``shard_mb`` → ``--shard-mb``."""
        return "--" + self.name.replace("_", "-")

    def parse(self, value: Any, fmt: str) -> Any:
        """The validated value, or SpecError naming the format, the option, what is allowed."""
        if self.choices:
            if value not in self.choices:
                raise SpecError(
                    f"{self.flag} {value!r} is not available for the {fmt} format; "
                    f"choose one of {', '.join(self.choices)}"
                )
            return value
        try:
            parsed = self.kind(value)
        except (TypeError, ValueError):
            raise SpecError(
                f"{self.flag} for the {fmt} format must be a {self.kind.__name__}, got {value!r}"
            ) from None
        if (self.min is not None and parsed < self.min) or (self.max is not None and parsed > self.max):
            raise SpecError(
                f"{self.flag} for the {fmt} format must be in [{self.min}, {self.max}], got {value}"
            )
        return parsed


@dataclass(frozen=True)
class Traits:
    """What readers of a format can do, so callers ask the format instead of testing its name.

    loads_into_ram: ``in_memory=True`` holds the cache in one array (checked against free memory first).
    unit_grouped: units of many images decoded whole: batches group by unit (the ChunkSampler pays off).
    fork_safe: a reader opened before a fork may be used by the child as it is.
    opens_files_per_read: a cache swapped underneath is detected after each read (a memory map taken
      at open keeps reading its own generation instead).
    unit_arrays: a unit decodes whole into one (unit, H, W, C) array (``load_unit``, ``decode_unit_into``),
      so worker processes can decode units for the reader (``dlstore.read.engines``).
    payloads: per-image encoded payloads with an index: the reader is a ``PayloadReader``.
    """

    loads_into_ram: bool
    unit_grouped: bool
    fork_safe: bool
    opens_files_per_read: bool
    unit_arrays: bool = False
    payloads: bool = False


class CodecTable:
    """The codecs one format accepts (its ``--codec`` choices) and its default. Another module may
    ``register`` a codec (with the ``impl`` the format's Writer expects); the CLI picks it up."""

    def __init__(self, default: str, *codecs: Codec) -> None:
        self.default = default
        self.codecs = {c.name: c for c in codecs}

    def register(self, codec: Codec) -> None:
        self.codecs[codec.name] = codec

    def __getitem__(self, name: str) -> Codec:
        return self.codecs[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.codecs)


def parse_options(declared: tuple[Option, ...], given: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """Every declared option, validated, defaults filled in; an option the format does not take is an
    error (``--codec`` for a ram cache would otherwise be silently ignored)."""
    known = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = ", ".join(o.flag for o in declared) or "no options"
        flag = "--" + unknown[0].replace("_", "-")
        raise SpecError(f"the {fmt} format does not take {flag}; it takes {takes}")
    return {o.name: o.parse(given.get(o.name, o.default), fmt) for o in declared}
