"""DecodeLoader's read-ahead gate, on any machine (no GPU): the device decode call is replaced by a
GIL-free sleep with a few GIL hand-overs around it (the stream sync, stack, label copy of the real
path), and each read holds the GIL for a set time (the reader's per-image Python). Without the gate
the reader runs as soon as the decode thread takes a batch, so each hand-over of the decode thread can
wait for the reader's Python; with it the reader runs while the decode call is outside the GIL.

    python benchmarks/jpeg_gate_sim.py --cache JPEG_CACHE [--read-gil-ms 0,0.5,1.5] [--decode-ms 7]

Prints ms per batch for the gated loader (the default) and round D's ungated one, both decode modes.
A model of the mechanism, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from jpeg_cache import UngatedLoader
from jpeg_cache import busy_python as busy

import dlstore.read.gpu_decode as gd
from dlstore.read.gpu_decode import DecodeLoader


def run(cache: str, cls: type[DecodeLoader], mode: str, read_gil: float, decode: float, epochs: int) -> float:
    """ms per batch over ``epochs`` epochs after a warm one."""
    img = torch.zeros(3, 4, 4, dtype=torch.uint8)

    def fake_decode(*args: Any, launching: Any = None, **kw: Any) -> tuple[list[torch.Tensor], int]:
        for _ in range(3):
            time.sleep(0)  # GIL hand-overs before the call (stream sync, ...)
        if launching is not None:
            launching()
        time.sleep(decode)  # the device call, outside the GIL
        for _ in range(3):
            time.sleep(0)  # and after it (stack, label copy, event)
        return [img] * len(args[1]), 0

    gd.decode_on_device = fake_decode  # type: ignore[assignment]
    loader = cls(cache, 128, device="cpu", decode_in=mode)
    loader.gpu = True
    read = loader._read

    def gil_read(batch: list[int]) -> Any:
        busy(read_gil)
        return read(batch)

    loader._read = gil_read  # type: ignore[method-assign]
    for _ in loader:
        pass
    t0, batches = time.perf_counter(), 0
    for _ in range(epochs):
        batches += sum(1 for _ in loader)
    return 1e3 * (time.perf_counter() - t0) / batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True, help="a JPEG payload cache (e.g. jpeg_cache.py's jpeg256)")
    ap.add_argument("--read-gil-ms", default="0,0.5,1.5")
    ap.add_argument("--decode-ms", type=float, default=7.0)
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    real = gd.decode_on_device
    print(f"{'read holds GIL ms':>18} {'mode':>7} {'gated ms/batch':>15} {'ungated ms/batch':>17}")
    try:
        for r in (float(v) for v in args.read_gil_ms.split(",")):
            for mode in ("thread", "stream"):
                g, u = (
                    run(args.cache, cls, mode, r / 1e3, args.decode_ms / 1e3, args.epochs)
                    for cls in (DecodeLoader, UngatedLoader)
                )
                print(f"{r:18.2f} {mode:>7} {g:15.2f} {u:17.2f}")
    finally:
        gd.decode_on_device = real  # type: ignore[assignment]


if __name__ == "__main__":
    main()
