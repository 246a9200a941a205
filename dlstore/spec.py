"""The cache manifest ``dlstore.json``: one frozen spec shared by every format."""

from __future__ import annotations

import hashlib
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
MAX_UNIT_IMAGES = 1 << 20  # images per unit (shard, chunk, slab) a manifest may declare
RESIZE_POLICIES = ("crop", "pad", "stretch", "shorter")
DECODE_MODES = ("exact", "fast")
# How a file becomes pixels: "dlstore" (upright by EXIF, 16-bit scaled, alpha composited on white) or
# "torchvision" (ImageFolder's default loader, ``PIL.Image.open(f).convert("RGB")``, bit for bit).
PIXEL_POLICIES = ("dlstore", "torchvision")
CHANNELS = (1, 3)
STORAGE_ORDERS = ("shuffled", "source")  # storage position order: seeded random, or as the source lists
# What a named field holds per sample (``FieldSpec.kind``):
#   class:  today's int label (labels.npy), named in the target;
#   values: a fixed-shape numeric array (a multi-hot vector, floats), ``shape`` without the sample axis;
#   boxes:  N x 4 float32 boxes, XYXY in the cache image's pixels (moved with the image);
#   ragged: N x ``shape`` values whose rows belong to the boxes field named by ``follows`` (box labels);
#   mask:   an H x W uint8/uint16 map of class or instance ids, the image's size (moved with it, nearest);
#   json:   a small JSON record (UTF-8 text).
FIELD_KINDS = ("class", "values", "boxes", "ragged", "mask", "json")
FIELD_DTYPES = ("uint8", "uint16", "int32", "int64", "float32", "float64")


@dataclass(frozen=True)
class ImagePolicy:
    """How every source image becomes one cache entry; recorded so a reader knows what it holds.

    ``crop``: shorter side to ``size`` (antialiased bilinear) then a centred ``size``² crop, the same
    pixels as torchvision ``Resize(size)`` + ``CenterCrop(size)``. ``pad``: longer side to ``size``,
    centred on black. ``stretch``: straight to ``size``². ``shorter``: shorter side to ``size`` keeping the
    aspect ratio (torchvision ``Resize(size, max_size=max_side)``'s output size and pixels), so images
    differ in size (a ragged cache); ``max_side`` caps the longer side. ``pixels="dlstore"``: alpha is
    composited on ``background``, 16-bit images are scaled to 8 bits (``v * 255 / 65535``, rounded) and
    EXIF orientation is applied. ``pixels="torchvision"``: the file as ImageFolder's default loader
    takes it (``convert("RGB")``: alpha dropped, no EXIF transpose, 16-bit as Pillow converts it).
    ``decode="exact"`` decodes every image in full (the torchvision pixels); ``"fast"`` lets large JPEGs
    be DCT-scaled while decoding, within a bounded error (see ``dlstore.write.imageops``)."""

    size: int
    resize: str = "crop"
    channels: int = 3
    background: tuple[int, int, int] = (255, 255, 255)
    exif_transpose: bool = True
    decode: str = "exact"
    max_side: int | None = None
    pixels: str = "dlstore"

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
        parse_pixels(self.pixels, self.resize, self.decode)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of every image; for a ragged policy the nominal (size, size, channels)."""
        return (self.size, self.size, self.channels)

    @property
    def ragged(self) -> bool:
        """Images keep their aspect ratio, so they differ in size."""
        return self.resize == "shorter"


def parse_pixels(pixels: str, resize: str, decode: str) -> str:
    """``pixels="torchvision"`` promises stock torchvision's bytes, so it takes only the resize policies
    torchvision has a transform for and the full decode."""
    if pixels not in PIXEL_POLICIES:
        raise SpecError(f"pixels must be one of {PIXEL_POLICIES}, got {pixels!r}")
    if pixels == "torchvision" and resize == "pad":
        raise SpecError(
            "pixels='torchvision' with resize='pad': torchvision has no transform that scales the longer "
            "side and pads to a square, so there are no stock pixels to match; use resize crop, shorter "
            "or stretch, or pixels='dlstore'"
        )
    if pixels == "torchvision" and decode != "exact":
        raise SpecError(
            "pixels='torchvision' with decode='fast': DCT-scaled decoding changes the pixels, and "
            "torchvision decodes in full; use decode='exact'"
        )
    return pixels


@dataclass(frozen=True)
class FieldSpec:
    """One named per-sample field of a cache, as the manifest declares it (``CacheSpec.fields``).

    ``shape``: a ``values`` field's shape, a ``ragged`` field's row shape (``()`` for one number per
    box); ``follows``: the boxes field whose rows a ``ragged`` field's rows are; ``classes``: names of
    the ids it holds, when known; ``dropped``: boxes the conversion dropped (clipped to no area)."""

    kind: str
    dtype: str
    shape: tuple[int, ...] = ()
    follows: str | None = None
    classes: tuple[str, ...] = ()
    dropped: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise SpecError(f"field kind must be one of {FIELD_KINDS}, got {self.kind!r}")
        if self.dtype not in FIELD_DTYPES:
            raise SpecError(f"field dtype must be one of {FIELD_DTYPES}, got {self.dtype!r}")
        if self.kind == "mask" and self.dtype not in ("uint8", "uint16"):
            raise SpecError(f"a mask field holds uint8 or uint16 ids, got {self.dtype}")
        if self.kind == "boxes" and self.dtype not in ("float32", "float64"):
            raise SpecError(f"a boxes field holds float32 XYXY pixels, got {self.dtype}")
        if not all(isinstance(d, int) and 0 < d <= 1 << 16 for d in self.shape):
            raise SpecError(f"field shape {self.shape} must be positive ints")

    @property
    def ragged(self) -> bool:
        """Stored as values + offsets (a number of rows per sample), not one array row per sample."""
        return self.kind in ("boxes", "ragged", "json")

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One stored row: a box is 4 numbers; a JSON record is bytes."""
        return (4,) if self.kind == "boxes" else self.shape


def parse_fields(d: Any, where: Path) -> dict[str, FieldSpec]:
    """The manifest's ``fields`` object → declarations; names are file names inside the cache."""
    if not isinstance(d, dict):
        raise SpecError(f"{where}: manifest field 'fields' is not an object; rebuild the cache")
    out = {}
    for name, decl in d.items():
        if not (isinstance(name, str) and name.isidentifier()) or not isinstance(decl, dict):
            raise SpecError(f"{where}: bad field {name!r} in manifest; rebuild the cache")
        try:
            tuples = {"shape": tuple(decl.get("shape", ())), "classes": tuple(decl.get("classes", ()))}
            out[name] = FieldSpec(**{**decl, **tuples})
        except TypeError as e:
            raise SpecError(f"{where}: bad field {name!r} {decl}: {e}; rebuild the cache") from None
    for name, f in out.items():
        if f.kind == "ragged" and (f.follows not in out or out[f.follows].kind != "boxes"):
            raise SpecError(f"{where}: field {name!r} follows {f.follows!r}, which is no boxes field")
    return out


@dataclass(frozen=True)
class CacheSpec:
    """Everything a reader must know before touching data; written last, read first."""

    format: str
    n: int
    n_stored: int
    shape: tuple[int, int, int]
    classes: tuple[str, ...]
    image: ImagePolicy
    # what the writer derived (unit_size, layout, ...); the user's writer options live in ``options``
    format_options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)
    dtype: str = "uint8"
    spec_version: int = SPEC_VERSION
    dlstore_version: str = ""
    created: str = ""
    # the conversion's choices (``ConvertOptions`` as recorded): format, policy, codec, writer_options…
    options: dict[str, Any] = field(default_factory=dict)
    # named per-sample fields (boxes, masks, ...); a classification cache's manifest has no ``fields`` key
    fields: dict[str, FieldSpec] = field(default_factory=dict)

    def to_json(self) -> str:
        d = json.loads(json.dumps(asdict(self)))  # as a reader will load it
        if not self.fields:
            del d["fields"]
        return json.dumps({**d, "digest": manifest_digest(d)}, indent=1, sort_keys=True)

    @property
    def image_bytes(self) -> int:
        """Bytes of one image; for a ragged cache those of the nominal size² image."""
        h, w, c = self.shape
        return h * w * c

    @property
    def ragged(self) -> bool:
        return self.image.ragged

    @property
    def codec(self) -> str | None:
        """The codec the cache was written with: the one manifest key ``options.codec``. Caches from
        before it kept it in ``format_options`` (``codec``; ``image_codec`` for the payload layout)."""
        if self.options:
            return self.options.get("codec")
        old = self.format_options
        return old.get("codec", old.get("image_codec"))

    @property
    def writer_options(self) -> dict[str, Any]:
        """Every writer option (``codec`` included) as the writer was given it; for an older manifest
        its ``format_options``, which held them beside what the writer derived."""
        if self.options:
            return {"codec": self.options.get("codec"), **self.options.get("writer_options", {})}
        return dict(self.format_options)


def manifest_digest(doc: dict[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON, its own ``digest`` key left out: kept inside it, so
    ``verify`` catches an edit of any field (classes, counts, shapes), source or no source."""
    body = json.dumps({k: v for k, v in doc.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


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
    checksums = parse_checksums(_require(d, "checksums", dict, where), where)
    classes = _require(d, "classes", list, where)
    if not all(isinstance(c, str) for c in classes):
        raise SpecError(f"{where}: class names must be strings; rebuild the cache")
    options = _require(d, "format_options", dict, where)
    recorded = d.get("options", {})
    if not isinstance(recorded, dict) or not isinstance(recorded.get("writer_options", {}), dict):
        raise SpecError(f"{where}: manifest field 'options' is not an object; rebuild the cache")
    unit = options.get("unit_size", 1)
    if not isinstance(unit, int) or isinstance(unit, bool) or not 0 < unit <= MAX_UNIT_IMAGES:
        raise SpecError(
            f"{where}: format_options unit_size {unit!r} is not a count of images between 1 and "
            f"{MAX_UNIT_IMAGES}; rebuild the cache"
        )
    return CacheSpec(
        format=_require(d, "format", str, where),
        n=n,
        n_stored=n_stored,
        shape=shape,  # type: ignore[arg-type]
        classes=tuple(classes),
        image=policy,
        format_options=options,
        source=_require(d, "source", dict, where),
        checksums=checksums,
        dtype="uint8",
        spec_version=version,
        dlstore_version=d.get("dlstore_version", ""),
        created=d.get("created", ""),
        options=recorded,
        fields=parse_fields(d.get("fields", {}), where),
    )


def parse_checksums(checksums: dict[str, Any], where: Path) -> dict[str, str]:
    """Every key a safe relative name with a sane byte range, every value a sha256, each file's
    ranges tiling it from byte 0 (so ``verify`` and the readers can trust the numbers)."""
    from dlstore.checksums import ChecksumKeyError, extents, split_key

    try:
        for key in checksums:
            parse_relpath(split_key(key)[0], where)
        extents(checksums)
    except ChecksumKeyError as e:
        raise SpecError(f"{where}: {e}; the cache may be tampered with, rebuild it") from None
    return checksums


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
        raise no_manifest(root, Path(root)) from None
    return parse_manifest(text, path)


def no_manifest(where: object, folder: Path | None = None) -> CacheNotFoundError:
    """A location without a manifest: a folder of images is a SOURCE to convert (never a DEST to
    overwrite), anything else an unfinished cache to make again."""
    if folder is not None and holds_images(folder):
        return CacheNotFoundError(
            f"{where}: a folder of images, not a dlstore cache; convert it into one first, e.g. "
            f"`dlstore convert {where} cache/{folder.resolve().name} --size 224`"
        )
    if folder is not None and folder.is_dir() and any(folder.iterdir()):  # --overwrite refuses such a DEST
        return CacheNotFoundError(f"{where}: not a dlstore cache (no {MANIFEST}); give a cache's folder")
    return CacheNotFoundError(
        f"{where}: no {MANIFEST}, so this is not a complete dlstore cache; "
        f"(re)create it with `dlstore convert SOURCE {where} ... --overwrite`"
    )


def holds_images(folder: Path) -> bool:
    """Image files in ``folder`` or in its first subfolder (an ImageFolder tree); a glance, not a scan."""
    from dlstore.sourcefiles import IMAGE_EXTENSIONS  # (it imports this module)

    try:
        entries = [e for _, e in zip(range(1000), folder.iterdir())]
        sub = next((e for e in sorted(entries) if e.is_dir()), None)
        entries += [e for _, e in zip(range(1000), sub.iterdir())] if sub is not None else []
    except OSError:
        return False
    return any(e.suffix.lower() in IMAGE_EXTENSIONS for e in entries)


def parse_manifest(text: str | bytes, path: Path) -> CacheSpec:
    """The manifest's text (as read from ``path``) → a validated spec."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not valid JSON ({e}); rebuild the cache") from None
    if not isinstance(d, dict):
        raise SpecError(f"{path}: manifest is not a JSON object; rebuild the cache")
    return parse_spec(d, path)
