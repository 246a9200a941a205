"""Image codecs of the payload layout (``payload.py``): one (H, W, C) uint8 image ↔ one payload
(``raw`` pixels or ``jpeg``), so a reader decodes only the images it is asked for.

>>> codec = get_codec("jpeg", quality=90)
>>> data = codec.encode(np.zeros((4, 6, 3), np.uint8))
>>> codec.decode(data, (4, 6, 3)).shape
(4, 6, 3)
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

from dlstore import settings
from dlstore.errors import SpecError

DEFAULT_QUALITY = 90
# Images per unit whose encode error is measured (decode + compare) while writing: one in 16, at least
# 2: a mean to about ±0.1 level on photos, cheap next to the encode itself.
ERROR_SAMPLE_EVERY = 16


class PayloadError(ValueError):
    """A payload does not decode to the image its index declares (corrupt or tampered bytes)."""


class ImageCodec(ABC):
    """Encode/decode one image. ``gpu_jpeg``: payloads are baseline JPEG files that nvJPEG (torchvision
    ``decode_jpeg(device="cuda")``) can decode; ``lossy``: decode(encode(x)) may differ from x."""

    name: ClassVar[str]
    gpu_jpeg: ClassVar[bool] = False
    lossy: ClassVar[bool] = False

    def __init__(self, quality: int = DEFAULT_QUALITY) -> None:
        self.quality = quality

    @abstractmethod
    def encode(self, image: np.ndarray) -> bytes: ...

    @abstractmethod
    def decode(self, payload: Any, shape: tuple[int, int, int]) -> np.ndarray:
        """(H, W, C) uint8 from one payload; PayloadError when it is not that image."""

    def decode_into(self, payload: Any, shape: tuple[int, int, int], out: np.ndarray) -> None:
        """Decode into ``out`` (a C-contiguous (H, W, C) uint8 array of ``shape``)."""
        out[...] = self.decode(payload, shape)


class RawCodec(ImageCodec):
    """The pixels themselves (a chunk compressor, if any, applies on top)."""

    name = "raw"

    def encode(self, image: np.ndarray) -> bytes:
        return np.ascontiguousarray(image, dtype=np.uint8).tobytes()

    def decode(self, payload: Any, shape: tuple[int, int, int]) -> np.ndarray:
        arr = np.frombuffer(payload, np.uint8)
        if arr.size != shape[0] * shape[1] * shape[2]:
            raise PayloadError(
                f"holds {arr.size} bytes, its shape {tuple(shape)} needs {int(np.prod(shape))}"
            )
        return arr.reshape(shape).copy()  # writable, and not pinning the unit's buffer

    def decode_into(self, payload: Any, shape: tuple[int, int, int], out: np.ndarray) -> None:
        out[...] = (
            self.decode(payload, shape)
            if len(payload) != out.nbytes
            else np.frombuffer(payload, np.uint8).reshape(out.shape)
        )


def _simplejpeg() -> Any:
    """simplejpeg (``pip install dlstore[jpeg]``) when installed, else None (Pillow decodes). Both bundle
    libjpeg-turbo with the same IDCT and upsampling (identical pixels, tests/formats/test_codecs.py);
    simplejpeg decodes ~1.5-1.8x faster on one core and straight into a caller's buffer, sparing
    threads fresh 200 kB allocations (mmap + page faults per image)."""
    global _SIMPLEJPEG
    if _SIMPLEJPEG is False:
        try:
            import simplejpeg

            _SIMPLEJPEG = simplejpeg
        except ImportError:
            _SIMPLEJPEG = None
    return _SIMPLEJPEG


_SIMPLEJPEG: Any = False
# Set DLSTORE_JPEG_DECODER=pillow to force the fallback (benchmarks compare the two).
JPEG_DECODERS = ("auto", "simplejpeg", "pillow")


class JpegCodec(ImageCodec):
    """Baseline JPEG, 4:2:0 chroma for RGB, at ``quality``; encoded by Pillow, decoded by simplejpeg
    when installed (``dlstore[jpeg]``), by Pillow otherwise (both libjpeg-turbo, identical pixels)."""

    name = "jpeg"
    gpu_jpeg = True
    lossy = True

    def __init__(self, quality: int = DEFAULT_QUALITY) -> None:
        if not 1 <= quality <= 100:
            raise SpecError(f"JPEG quality must be 1..100, got {quality}")
        super().__init__(quality)

    def encode(self, image: np.ndarray) -> bytes:
        from PIL import Image

        pil = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
        buf = io.BytesIO()
        pil.save(buf, format="JPEG", quality=self.quality)
        return buf.getvalue()

    @property
    def decoder(self) -> str:
        """Which library decodes on the CPU: ``simplejpeg`` or ``pillow``."""
        choice = settings.get("DLSTORE_JPEG_DECODER")
        if choice not in JPEG_DECODERS:
            raise SpecError(f"DLSTORE_JPEG_DECODER={choice!r}: choose one of {', '.join(JPEG_DECODERS)}")
        if choice == "pillow" or _simplejpeg() is None:
            if choice == "simplejpeg":
                raise SpecError(
                    "DLSTORE_JPEG_DECODER=simplejpeg but it is not installed: pip install simplejpeg"
                )
            return "pillow"
        return "simplejpeg"

    def decode(self, payload: Any, shape: tuple[int, int, int]) -> np.ndarray:
        out = np.empty(tuple(int(s) for s in shape), np.uint8)
        self.decode_into(payload, shape, out)
        return out

    def decode_into(self, payload: Any, shape: tuple[int, int, int], out: np.ndarray) -> None:
        """Both decoders release the GIL, so reader threads decode in parallel."""
        if tuple(out.shape) != tuple(shape) or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8{tuple(shape)}, got {out.dtype}{out.shape}")
        if self.decoder == "pillow":
            out[...] = self._decode_pillow(payload, shape)
            return
        sj = _simplejpeg()
        try:
            h, w, space, _sub = sj.decode_jpeg_header(payload)
            if (h, w) != tuple(shape[:2]) or (space == "Gray") != (shape[2] == 1):
                raise PayloadError(
                    f"JPEG decodes to {(h, w, 1 if space == 'Gray' else 3)}, its index says {tuple(shape)}"
                )
            sj.decode_jpeg(payload, colorspace="GRAY" if shape[2] == 1 else "RGB", buffer=out, strict=True)
        except ValueError as e:
            if isinstance(e, PayloadError):
                raise
            raise PayloadError(f"JPEG does not decode ({type(e).__name__}: {e})") from None

    def _decode_pillow(self, payload: Any, shape: tuple[int, int, int]) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(payload), formats=("JPEG",)) as img:
                if (img.height, img.width) != tuple(shape[:2]):  # before decoding: the header's size
                    raise PayloadError(
                        f"JPEG header says {img.height}x{img.width}, its index says {tuple(shape)}"
                    )
                img.load()
                arr = np.array(img)  # writable (torch tensors of it need that); asarray is read-only
        except PayloadError:
            raise
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
            # Pillow's bomb guard is an error of this payload like any other: a dlstore error
            raise PayloadError(f"JPEG does not decode ({type(e).__name__}: {e})") from None
        arr = arr[:, :, None] if arr.ndim == 2 else arr
        if arr.shape != tuple(shape):
            raise PayloadError(f"JPEG decodes to {arr.shape}, its index says {tuple(shape)}")
        return arr


CODECS: dict[str, type[ImageCodec]] = {c.name: c for c in (RawCodec, JpegCodec)}


def get_codec(name: str, quality: int = DEFAULT_QUALITY) -> ImageCodec:
    try:
        return CODECS[name](quality)
    except KeyError:
        raise SpecError(f"unknown image codec {name!r}; choose one of {', '.join(CODECS)}") from None


def is_image_codec(impl: Any) -> bool:
    """A declared codec whose ``impl`` is an ImageCodec class encodes each image on its own (payload
    layout); the others compress whole units of pixels."""
    return isinstance(impl, type) and issubclass(impl, ImageCodec)


def quality_option() -> Any:
    from dlstore.formats.describe import Option

    return Option(
        "quality",
        DEFAULT_QUALITY,
        "JPEG quality for --codec jpeg (ignored by other codecs).",
        kind=int,
        min=1,
        max=100,
    )


def error_sample(codec: ImageCodec, image: np.ndarray, payload: bytes) -> tuple[float, int]:
    """(sum of |decoded - original|, number of values) for one image: the encode error of lossy codecs."""
    if not codec.lossy:
        return 0.0, 0
    decoded = codec.decode(payload, image.shape)  # type: ignore[arg-type]
    diff = np.abs(decoded.astype(np.int16) - image.astype(np.int16))
    return float(diff.sum()), int(diff.size)
