"""A decoding ``Loader`` whose batches are split with CPU decode workers, on a machine without a GPU: the
"device" is the CPU and torchvision's CPU decode stands in for nvJPEG (tests/read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlstore import Loader, open_cache
from dlstore.read.decode.lanes import decode_on_device
from dlstore.read.loader import storage_sorted


def cpu_split_loader(
    path: Path,
    share: float | None,
    batch: int = 4,
    order: str = "sequential",
    read_ahead: int | None = None,
    **kw: object,
) -> Loader:
    """Batches of ``batch`` (the last one short) as lists of decoded tensors, ``share`` of each decoded by
    2 CPU worker processes (None: the automatic split)."""
    split = kw.pop("split", None if share is None else {"cpu": share})
    loader = Loader(
        path,
        batch,
        device="cpu",
        via="decode",
        transform=lambda images: images,
        order=order,
        drop_last=False,
        cpu_decoders=2,
        split=split,
        **kw,  # type: ignore[arg-type]
    )
    loader._path.gpu = True  # torchvision's CPU decode_jpeg stands in for nvJPEG
    if read_ahead is not None:
        loader._path.read_ahead = read_ahead
    return loader


def split_reference(cache: Any, seen: int, n: int, cpu_fraction: float) -> list[torch.Tensor]:
    """The ``n`` images of a sequential split loader's batch starting at sample ``seen``, decoded apart:
    its first ``cpu_fraction`` by the cache's own CPU reader, the rest by ``decode_on_device`` on the CPU
    (the loader's order within a batch: the CPU share first)."""
    index = storage_sorted(cache, list(range(seen, seen + n)))
    first = int(round(cpu_fraction * len(index)))
    payloads, shapes = cache.read_payloads(index)
    rest, _ = decode_on_device(
        cache, payloads[first:], shapes[first:], cache.positions[index[first:]], torch.device("cpu")
    )
    return [torch.from_numpy(a).permute(2, 0, 1) for a in cache.read_images(index[:first])] + rest


def corrupt_payload(path: Path, index: int) -> tuple[int, Path]:
    """Change one value of one image's JPEG quantisation table in its unit file, so the payload still
    decodes, to wrong pixels: only its CRC tells. Returns (its chunk, the file)."""
    cache = open_cache(path)
    reader: Any = cache.reader
    position = int(cache.positions[index])
    k, j = divmod(position, reader.unit)
    payload = bytes(reader.payload_unit(k).payload(j))
    unit_file = reader.unit_path(k)
    cache.close()
    blob = bytearray(unit_file.read_bytes())
    at = blob.find(payload) + payload.find(b"\xff\xdb") + 4 + 1 + 10  # marker, length, Pq/Tq, 11th value
    blob[at] = blob[at] + 1 if blob[at] < 128 else blob[at] - 1
    unit_file.write_bytes(bytes(blob))
    return k, unit_file


class RandomDraws:
    """A transform whose batch is two random numbers per image, one from ``generator`` and one from
    torch's RNG, to see which random streams a decode process draws from."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.rand(len(images), generator=self.generator), torch.rand(len(images))], 1)


def ragged_jpeg_cache(image_tree: Path, tmp: Path) -> Path:
    """The JPEG ``--resize shorter`` cache (24 px, a ragged format) of ``image_tree`` under ``tmp``."""
    from dlstore import convert
    from dlstore.formats import FORMATS
    from dlstore.write.options import ConvertOptions

    fmt = next(f.name for f in FORMATS.values() if f.ragged_ok)
    dest = tmp / "c"
    convert(image_tree, dest, ConvertOptions(format=fmt, size=24, resize="shorter", codec="jpeg", workers=2))
    return dest


class WideningBatch:
    """A transform whose batch (n, 2 + calls // 3) of its images' first pixels grows every third call: a
    decode process must make its result slots again."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        width = 2 + self.calls // 3
        self.calls += 1
        first = torch.stack([img.reshape(-1)[:1].float() for img in images])
        return first.expand(len(images), width).contiguous()
