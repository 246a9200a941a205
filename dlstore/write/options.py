"""``ConvertOptions``: every choice a conversion takes, validated once, here. The choices that shape
the cache (``CACHE_FIELDS``) are recorded in the manifest (``options``) and read back as the same type
(``recorded_options``), so a re-run compares two plans made from two ``ConvertOptions``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dlstore.errors import SpecError
from dlstore.formats import DEFAULT_FORMAT, FORMATS, get_format
from dlstore.spec import STORAGE_ORDERS, CacheSpec, ImagePolicy

DECODE_TIMEOUT_S = 60.0
# What decides the cache's bytes: recorded in the manifest and compared by a re-run.
CACHE_FIELDS = (
    "format",
    "size",
    "resize",
    "channels",
    "decode",
    "max_side",
    "codec",
    "writer_options",
    "storage_order",
    "seed",
    "max_megapixels",
    "pixels",
)


@dataclass(frozen=True)
class ConvertOptions:
    """What ``convert(source, dest, options)`` builds and how.

    ``size``, ``resize``, ``channels``, ``decode``, ``max_side``: the image policy (``ImagePolicy``).
    ``codec`` (None: the format's default) and ``writer_options`` (e.g. ``{"quality": 90}``) go to the
    format's Writer. ``storage_order``/``seed``: the stored order. ``max_megapixels``: the bomb limit
    (None: Pillow's). ``workers``/``scheduler``: the runner (pool, in-process, Dask ``local[:N]``/
    ``tcp://…``). ``strict``/``max_bad``/``decode_timeout``: undecodable files. ``root``/``train``/
    ``demo_images``/``label``: the source. ``storage_options``: fsspec options for a URL DEST (never
    recorded). ``pixels``: "dlstore" (EXIF-upright, 16-bit scaled, alpha composited) or "torchvision"
    (ImageFolder's pixels). ``fields``: ``("NAME=KEY[:KIND[:DTYPE]]", ...)`` or a mapping (``fieldmap``)."""

    size: int
    format: str = DEFAULT_FORMAT
    resize: str = "crop"
    channels: int = 3
    decode: str = "exact"
    max_side: int | None = None
    codec: str | None = None
    writer_options: Mapping[str, Any] = field(default_factory=dict)
    storage_order: str = "shuffled"
    seed: int = 0
    max_megapixels: float | None = None
    workers: int | None = None
    scheduler: str | None = None
    overwrite: bool = False
    strict: bool = False
    max_bad: float = 0.5
    decode_timeout: float = DECODE_TIMEOUT_S
    root: Path | None = None
    train: bool = True
    demo_images: int = 512
    label: str | None = None
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    pixels: str = "dlstore"
    fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.size is None:
            raise SpecError("size is required: ConvertOptions(size=PIXELS)")
        for name, least in (("size", 1), ("seed", 0), ("workers", 1), ("demo_images", 1)):
            value = getattr(self, name)
            whole = value is None or (
                isinstance(value, int) and not isinstance(value, bool) and value >= least
            )
            require(name, value, whole, f"a whole number of at least {least}")
        self.policy  # noqa: B018 - ImagePolicy validates size, resize, channels, decode, max_side
        self.resolved_writer_options  # noqa: B018 - the format validates its codec and options
        order = self.storage_order
        require("storage_order", order, order in STORAGE_ORDERS, f"one of {', '.join(STORAGE_ORDERS)}")
        mp, bad, timeout = self.max_megapixels, self.max_bad, self.decode_timeout
        require(
            "max_megapixels", mp, mp is None or is_number(mp) and mp > 0, "a positive number of megapixels"
        )
        require("max_bad", bad, is_number(bad) and 0 <= bad <= 1, "a fraction between 0 and 1")
        require(
            "decode_timeout",
            timeout,
            is_number(timeout) and timeout >= 0,
            "a number of seconds ≥ 0 (0 = no limit)",
        )
        if self.scheduler is not None:
            from dlstore.write.dask_engine import parse_scheduler

            parse_scheduler(self.scheduler)
        object.__setattr__(self, "writer_options", dict(self.writer_options))
        object.__setattr__(self, "fields", parse_fields(self.fields))
        if self.root is not None:
            object.__setattr__(self, "root", Path(self.root))

    @property
    def policy(self) -> ImagePolicy:
        return ImagePolicy(
            size=self.size,
            resize=self.resize,
            channels=self.channels,
            decode=self.decode,
            max_side=self.max_side,
            pixels=self.pixels,
            exif_transpose=self.pixels != "torchvision",  # ImageFolder's loader ignores EXIF
        )

    @property
    def resolved_writer_options(self) -> dict[str, Any]:
        """The format's declared writer options: these, validated, defaults filled in (codec included)."""
        return parse_writer_options(self.format, self.codec, self.writer_options)

    def record(self) -> dict[str, Any]:
        """The manifest's ``options``: writer options resolved, so a default compares equal to itself."""
        resolved = self.resolved_writer_options
        out = {name: getattr(self, name) for name in CACHE_FIELDS}
        out["codec"] = resolved.pop("codec", None)
        out["writer_options"] = resolved
        return out


def parse_writer_options(fmt: str, codec: str | None, others: Mapping[str, Any]) -> dict[str, Any]:
    """One route for the codec: ``codec=``, never ``writer_options["codec"]``."""
    if "codec" in others:
        raise SpecError("give the codec as ConvertOptions(codec=...), not in writer_options")
    given = dict(others) if codec is None else {**others, "codec": codec}
    taken = {o.name for o in get_format(fmt).options}
    for name, value in given.items():  # an option of another format: name the --format that takes it
        takers = [
            f
            for f, d in FORMATS.items()
            if any(o.name == name and value in (o.choices or [value]) for o in d.options)
        ]
        if name not in taken and takers:
            flag = "--" + name.replace("_", "-")
            raise SpecError(
                f"the {fmt} format does not take {flag}; {flag} {value} needs --format {' or '.join(takers)}"
            )
    return get_format(fmt).writer.parse_options(given)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def require(name: str, value: Any, ok: bool, must: str) -> None:
    if not ok:
        raise SpecError(f"{name} must be {must}, got {value!r}")


def fold_shortcuts(options: ConvertOptions | None, shortcuts: Mapping[str, Any]) -> ConvertOptions:
    """``convert(src, dest, size=64)`` → ``ConvertOptions(size=64)``: options or keywords, not both."""
    known = {f.name for f in fields(ConvertOptions)}
    unknown = sorted(set(shortcuts) - known)
    if unknown:
        raise TypeError(f"convert() got unexpected keyword argument(s) {', '.join(unknown)}")
    if options is not None and shortcuts:
        named = ", ".join(f"{k}=..." for k in sorted(shortcuts))
        raise TypeError(
            f"convert() takes ConvertOptions or keywords, not both; put {named} in the options "
            "(dataclasses.replace(options, ...))"
        )
    if options is not None:
        return options
    if "size" not in shortcuts:
        raise TypeError("convert() needs the options: convert(source, dest, ConvertOptions(size=...))")
    return ConvertOptions(**shortcuts)


# --- reading the manifest back ------------------------------------------------------------------------


def recorded_options(spec: CacheSpec) -> ConvertOptions | None:
    """A cache's options: its ``options`` key, or an older manifest's ``source.plan``; else None."""
    if spec.options:
        return ConvertOptions(**{k: spec.options[k] for k in CACHE_FIELDS if k in spec.options})
    plan = spec.source.get("plan")
    return from_old_plan(plan) if isinstance(plan, dict) and "policy" in plan else None


def from_old_plan(plan: Mapping[str, Any]) -> ConvertOptions:
    """The options an older manifest's plan records (``compress``: npz before ``--codec``)."""
    policy = plan["policy"]
    writer = dict(plan.get("options") or {})
    if "compress" in writer and "codec" not in writer:  # npz before --codec: deflate or stored
        writer["codec"] = "deflate" if writer.pop("compress") else "none"
    writer.pop("compress", None)
    codec = writer.pop("codec", None)
    return ConvertOptions(
        size=policy["size"],
        format=plan["format"],
        resize=policy.get("resize", "crop"),
        channels=policy.get("channels", 3),
        decode=policy.get("decode", "exact"),
        max_side=policy.get("max_side"),
        codec=codec,
        writer_options=writer,
        storage_order=plan.get("storage_order", "shuffled"),
        seed=plan.get("seed", 0),
        max_megapixels=plan.get("max_megapixels"),
    )


def parse_fields(value: Any) -> tuple[str, ...]:
    """``fields`` as its one form, each ``NAME=KEY[:KIND[:DTYPE]]`` checked (SpecError naming it)."""
    from dlstore.errors import SourceError
    from dlstore.write.sources.fieldmap import field_texts

    try:
        return field_texts(value)
    except SourceError as e:
        raise SpecError(str(e)) from None
