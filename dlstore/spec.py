"""The cache manifest ``dlstore.json``: one frozen spec shared by every format."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from dlstore.errors import CacheNotFoundError, SpecError

MANIFEST = "dlstore.json"
LABELS_FILE = "labels.npy"
POSITIONS_FILE = "positions.npy"
SOURCE_RECORD = "sources.npz"
SKIPPED_FILE = "skipped.json"
SPEC_VERSION = 1
RESIZE_POLICIES = ("crop", "pad", "stretch", "shorter")
DECODE_MODES = ("exact", "fast")
CHANNELS = (1, 3)
STORAGE_ORDERS = ("shuffled", "source")  # storage position order: seeded random, or as the source lists


@dataclass(frozen=True)
class ImagePolicy:
    """How every source image becomes one cache entry; recorded so a reader knows what it holds.

    ``crop``: shorter side to ``size`` (antialiased bilinear) then a centred ``size``² crop, the same
    pixels as torchvision ``Resize(size)`` + ``CenterCrop(size)``. ``pad``: longer side to ``size``,
    centred on black. ``stretch``: straight to ``size``². ``shorter``: shorter side to ``size`` keeping the
    aspect ratio (torchvision ``Resize(size, max_size=max_side)``'s output size and pixels), so images
    differ in size (a ragged cache); ``max_side`` caps the longer side. Alpha is composited on ``background``;
    16-bit images are scaled to 8 bits (``v * 255 / 65535``, rounded); EXIF orientation is applied.
    ``decode="exact"`` decodes every image in full (the torchvision pixels); ``"fast"`` lets large JPEGs
    be DCT-scaled while decoding, within a bounded error (see ``dlstore.convert.imageops``).
    """

    size: int
    resize: str = "crop"
    channels: int = 3
    background: tuple[int, int, int] = (255, 255, 255)
    exif_transpose: bool = True
    decode: str = "exact"
    max_side: int | None = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise SpecError(f"size must be a positive number of pixels, got {self.size}")
        if self.resize not in RESIZE_POLICIES:
            raise SpecError(f"resize must be one of {RESIZE_POLICIES}, got {self.resize!r}")
        if self.max_side is not None and (self.resize != "shorter" or self.max_side <= self.size):
            raise SpecError(
                f"max_side {self.max_side} needs resize='shorter' and must exceed size {self.size} "
                "(torchvision Resize's max_size rule)"
            )
        if self.channels not in CHANNELS:
            raise SpecError(f"channels must be 1 or 3, got {self.channels}")
        if self.decode not in DECODE_MODES:
            raise SpecError(f"decode must be one of {DECODE_MODES}, got {self.decode!r}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of every image; for a ragged policy the nominal (size, size, channels)."""
        return (self.size, self.size, self.channels)

    @property
    def ragged(self) -> bool:
        """Images keep their aspect ratio, so they differ in size."""
        return self.resize == "shorter"


@dataclass(frozen=True)
class CacheSpec:
    """Everything a reader must know before touching data; written last, read first."""

    format: str
    n: int
    n_stored: int
    shape: tuple[int, int, int]
    classes: tuple[str, ...]
    image: ImagePolicy
    format_options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    dtype: str = "uint8"
    spec_version: int = SPEC_VERSION
    dlstore_version: str = ""
    created: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @property
    def image_bytes(self) -> int:
        """Bytes of one image; for a ragged cache those of the nominal size² image."""
        h, w, c = self.shape
        return h * w * c

    @property
    def ragged(self) -> bool:
        return self.image.ragged


def parse_relpath(name: str, where: Path) -> str:
    """Reject manifest paths that could reach outside the cache root."""
    p = PurePosixPath(name)
    if not name or "\x00" in name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise SpecError(
            f"{where}: unsafe path {name!r} in manifest; the cache may be tampered with, rebuild it"
        )
    return name


def _require(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    if key not in d or not isinstance(d[key], kind):
        raise SpecError(
            f"{where}: manifest field {key!r} missing or not {kind}; rebuild the cache with `dlstore convert`"
        )
    return d[key]


def parse_spec(d: dict[str, Any], where: Path) -> CacheSpec:
    """Validate a decoded manifest; everything past this point trusts the spec."""
    version = _require(d, "spec_version", int, where)
    if version != SPEC_VERSION:
        raise SpecError(
            f"{where}: manifest version {version}, this dlstore reads {SPEC_VERSION}; "
            "re-run `dlstore convert` with this version"
        )
    shape = tuple(_require(d, "shape", list, where))
    if len(shape) != 3 or not all(isinstance(x, int) and 0 < x <= 1 << 16 for x in shape):
        raise SpecError(f"{where}: bad image shape {shape} in manifest")
    n, n_stored = _require(d, "n", int, where), _require(d, "n_stored", int, where)
    if not 0 <= n <= n_stored < 1 << 40:
        raise SpecError(f"{where}: bad counts n={n} n_stored={n_stored} in manifest")
    if _require(d, "dtype", str, where) != "uint8":
        raise SpecError(f"{where}: dtype {d['dtype']!r} unsupported (only uint8)")
    img = dict(_require(d, "image", dict, where))
    if "draft" in img:  # manifests before --decode: draft=True was DCT scaling from 4x the target
        img["decode"] = "fast" if img.pop("draft") else "exact"
    try:
        policy = ImagePolicy(**{**img, "background": tuple(img.get("background", (255, 255, 255)))})
    except TypeError as e:
        raise SpecError(f"{where}: bad image policy {img}: {e}") from None
    checksums = _require(d, "checksums", dict, where)
    for name in checksums:
        parse_relpath(name, where)
    return CacheSpec(
        format=_require(d, "format", str, where),
        n=n,
        n_stored=n_stored,
        shape=shape,  # type: ignore[arg-type]
        classes=tuple(_require(d, "classes", list, where)),
        image=policy,
        format_options=_require(d, "format_options", dict, where),
        source=_require(d, "source", dict, where),
        checksums=checksums,
        dtype="uint8",
        spec_version=version,
        dlstore_version=d.get("dlstore_version", ""),
        created=d.get("created", ""),
    )


def read_spec(root: Path) -> CacheSpec:
    """Load and validate ``root/dlstore.json``; a missing manifest means an incomplete cache."""
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise CacheNotFoundError(
            f"{root}: no such cache directory; create it with `dlstore convert SOURCE {root} ...`"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CacheNotFoundError(
            f"{root}: no {MANIFEST}, so this is not a complete dlstore cache; "
            f"(re)create it with `dlstore convert SOURCE {root} ... --overwrite`"
        ) from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e}); rebuild the cache") from None
    if not isinstance(d, dict):
        raise SpecError(f"{path}: manifest is not a JSON object; rebuild the cache")
    return parse_spec(d, path)
