"""The IDX format of MNIST / FashionMNIST (big-endian: magic ``0x00 0x00 <dtype code> <ndim>``, ``ndim``
uint32 sizes, the data in C order), and a synthetic stand-in (``write_fashion_mnist_like``) for the
torchvision loaders on machines without internet access. Only numpy (no torch)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dlstore.durable import durable_file

__all__ = ["read_idx", "synthetic_mnist_arrays", "write_fashion_mnist_like", "write_idx"]

# IDX dtype codes -> big-endian numpy dtypes, per the format's specification.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_UINT8_CODE = 0x08
_HEADER_DIM = np.dtype(">u4")

StrPath = str | os.PathLike[str]


def write_idx(path: StrPath, array: np.ndarray) -> None:
    """Write a uint8 array of ndim 1 (labels, magic 0x801) or 3 (images, 0x803)."""
    array = np.asarray(array)
    if array.dtype != np.uint8:
        raise ValueError(f"{path}: write_idx supports uint8 only, got {array.dtype}")
    if array.ndim not in (1, 3):
        raise ValueError(f"{path}: write_idx supports ndim 1 or 3, got shape {array.shape}")
    magic = (_UINT8_CODE << 8) | array.ndim
    header = np.array((magic, *array.shape), dtype=_HEADER_DIM).tobytes()
    # Readers (and crashed writers) never see a truncated file under the final name.
    with durable_file(Path(path)) as f:
        f.write(header)
        f.write(np.ascontiguousarray(array).tobytes())


def read_idx(path: StrPath) -> np.ndarray:
    """An IDX file as a native-endian array; ``ValueError`` naming ``path`` on a bad magic number, an
    unknown dtype code, or a size that disagrees with the declared dimensions."""
    with open(path, "rb") as f:
        found = os.fstat(f.fileno()).st_size
        head = f.read(4)
        dtype, ndim = _parse_magic(path, head, found)
        header_len = 4 + 4 * ndim
        dim_bytes = f.read(4 * ndim)
        if len(dim_bytes) != 4 * ndim:
            raise ValueError(
                f"{path}: IDX header truncated: expected at least {header_len} bytes, found {found}"
            )
        dims = tuple(int(d) for d in np.frombuffer(dim_bytes, dtype=_HEADER_DIM))
        count = int(np.prod(dims, dtype=np.int64))
        expected = header_len + count * dtype.itemsize
        if found != expected:
            raise ValueError(
                f"{path}: IDX size mismatch for dims {dims} ({dtype.name}): "
                f"expected {expected} bytes, found {found}"
            )
        # fromfile: one copy into a writable array (torch.from_numpy warns on read-only buffers)
        body = np.fromfile(f, dtype=dtype, count=count)
    if body.size != count:  # file shrank between fstat and read
        raise ValueError(f"{path}: IDX data truncated while reading: expected {count} items, got {body.size}")
    # Native byte order for multi-byte dtypes (no-op copy-free for uint8).
    return body.reshape(dims).astype(dtype.newbyteorder("="), copy=False)


def _parse_magic(path: StrPath, data: bytes, file_size: int) -> tuple[np.dtype, int]:
    """Validate the 4-byte magic; return the element dtype and number of dims."""
    if len(data) < 4:
        raise ValueError(f"{path}: not an IDX file: expected at least 4 bytes, found {file_size}")
    if data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: bad IDX magic 0x{data[:4].hex()}: first two bytes must be zero")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02x} (magic 0x{data[:4].hex()})")
    if ndim == 0:
        raise ValueError(f"{path}: IDX magic 0x{data[:4].hex()} declares 0 dimensions")
    return _IDX_DTYPES[code], ndim


_SIDE = 28
_N_CLASSES = 10


def write_fashion_mnist_like(
    root: Path, n_train: int, n_test: int, seed: int = 0, name: str = "FashionMNIST"
) -> Path:
    """Synthetic 28x28 grey 10-class data as ``root/<name>/raw/*-ubyte`` (deterministic in ``seed``);
    returns ``root`` for ``torchvision.datasets.<name>(root, ...)`` (``name``: ``FashionMNIST``, ``MNIST``…)."""
    raw = Path(root) / name / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    # Same file names as the real (decompressed) MNIST / FashionMNIST downloads.
    for split, (prefix, n) in enumerate((("train", n_train), ("t10k", n_test))):
        rng = np.random.default_rng((seed, split))
        images, labels = synthetic_mnist_arrays(rng, n)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return Path(root)


def synthetic_mnist_arrays(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (uint8, n x 28 x 28) and balanced shuffled labels (uint8, n)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    labels = rng.permutation(np.arange(n) % _N_CLASSES).astype(np.uint8)
    images = np.zeros((n, _SIDE, _SIDE), dtype=np.float32)
    # one broadcast per class, not a Python loop per image (60k images in ~1.5 s)
    for cls in range(_N_CLASSES):
        (sel,) = np.nonzero(labels == cls)
        if sel.size:
            images[sel] = _class_shapes(rng, cls, sel.size)
    images *= rng.uniform(0.6, 1.0, size=(n, 1, 1)).astype(np.float32)  # contrast
    # float32 ziggurat: the noise is the largest draw, float64 would double its cost.
    images += rng.standard_normal(images.shape, dtype=np.float32) * np.float32(0.08)
    return np.clip(np.round(images * 255), 0, 255).astype(np.uint8), labels


def _class_shapes(rng: np.random.Generator, cls: int, k: int) -> np.ndarray:
    """``k`` float images in [0, 1] of the shape for class ``cls``, jittered."""
    coords = np.arange(_SIDE, dtype=np.float32)
    y, x = coords[None, :, None], coords[None, None, :]
    cy = (13.5 + rng.uniform(-3, 3, size=(k, 1, 1))).astype(np.float32)
    cx = (13.5 + rng.uniform(-3, 3, size=(k, 1, 1))).astype(np.float32)
    r = rng.uniform(5.0, 9.0, size=(k, 1, 1)).astype(np.float32)
    t = rng.uniform(1.5, 3.0, size=(k, 1, 1)).astype(np.float32)  # stroke half-width
    dy, dx = y - cy, x - cx
    dist = np.sqrt(dy * dy + dx * dx)
    box = np.maximum(np.abs(dx), np.abs(dy))  # Chebyshev distance: squares
    # Lambdas so that only the requested class's mask is computed.
    shapes = {
        0: lambda: (np.abs(dy) < t) & (np.abs(dx) < r),  # horizontal bar
        1: lambda: (np.abs(dx) < t) & (np.abs(dy) < r),  # vertical bar
        2: lambda: dist < r,  # filled disc
        3: lambda: np.abs(dist - r) < t,  # ring
        4: lambda: (box < r) & (box > r - t),  # square outline (hole always open)
        5: lambda: box < r,  # filled square
        6: lambda: ((np.abs(dy) < t) | (np.abs(dx) < t)) & (box < r),  # plus
        7: lambda: ((np.abs(dx - dy) < 1.4 * t) | (np.abs(dx + dy) < 1.4 * t)) & (dist < r),  # X
        8: lambda: (np.abs(dy) < r) & (np.abs(dx) < (dy + r) / 2),  # triangle
        9: lambda: (np.hypot(dx - r / 2, dy) < t + 1) | (np.hypot(dx + r / 2, dy) < t + 1),  # two dots
    }
    return shapes[cls]().astype(np.float32)
