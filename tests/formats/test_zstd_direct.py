"""The direct zstd decoder (one context per thread) against numcodecs, and its refusals."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from numcodecs.zstd import Zstd

from dlstore.formats.zstd_direct import direct_zstd_decoder


@pytest.fixture(scope="module")
def decoder():  # type: ignore[no-untyped-def]
    d = direct_zstd_decoder()
    if d is None:
        pytest.skip("no zstd library with ZSTD_decompressDCtx could be loaded")
    return d


def frames() -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for level in (1, 3, 9):
        a = (np.cumsum(rng.integers(-2, 3, (3, 40, 40, 3)), axis=2) % 256).astype(np.uint8)
        out.append((bytes(Zstd(level=level).encode(a)), a))
    return out


def test_matches_numcodecs_in_threads(decoder) -> None:  # type: ignore[no-untyped-def]
    cases = frames() * 20

    def one(case: tuple[bytes, np.ndarray]) -> bool:
        raw, a = case
        out = np.empty_like(a)
        decoder.decode(memoryview(bytearray(raw)), out=out)
        return bool(np.array_equal(out, a)) and np.array_equal(
            np.frombuffer(Zstd().decode(raw), np.uint8), a.reshape(-1)
        )

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(one, cases))


def test_refuses_wrong_sizes_and_garbage(decoder) -> None:  # type: ignore[no-untyped-def]
    raw, a = frames()[0]
    with pytest.raises(RuntimeError, match="zstd"):
        decoder.decode(raw, out=np.empty(a.size - 1, np.uint8))  # too small: zstd reports it
    with pytest.raises(ValueError, match="expected"):
        decoder.decode(raw, out=np.empty(a.size + 7, np.uint8))  # larger than the frame
    with pytest.raises(RuntimeError, match="zstd"):
        decoder.decode(b"\x28\xb5\x2f\xfd" + b"\x00" * 40, out=np.empty(a.size, np.uint8))
    with pytest.raises(ValueError, match="writable"):
        decoder.decode(raw, out=np.empty(a.size, np.uint8)[::-1])
