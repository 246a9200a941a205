"""The auto split with and without its ShareTuner, on a machine without a GPU: torchvision's CPU
``decode_jpeg`` stands in for nvJPEG inside the same forked call (as in tests/read), beside one CPU decode
process; fixed splits for reference. The loader alone, batch 128, ``EPOCHS`` epochs after a warm one.
A mechanism check on 2 cores, not a GPU figure.

    python cpu_split_stand_in.py CACHE [PAIRS]   # a jpeg_short128 cache (jpeg_cache.py's data section)
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[3])]
import harness  # noqa: E402

torch.set_num_threads(1)
EPOCHS = 6


def rate(cache: str, split: dict[str, float] | None = None, tune: bool = True) -> tuple[float, float]:
    kw = {"split": split} if split else {}
    loader = harness.make_loader(
        cache, 128, "decode", device="cpu", transform=lambda x: x, cpu_decoders=1, **kw
    )
    loader._path.gpu = True  # the CPU decode stands in for nvJPEG; the lanes are set up again at the epoch
    for _ in loader:  # the warm epoch (the lanes and the split made for them)
        pass
    loader._path.split.tune = tune
    t0, count = time.perf_counter(), 0
    for _ in range(EPOCHS):
        for x, _y in loader:
            count += len(x)
    seconds, share = time.perf_counter() - t0, loader.stats.cpu_share
    loader.close()
    return count / seconds, share


def main() -> None:
    cache, pairs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    out: dict[str, list[tuple[float, float]]] = {}
    configs = {
        "tuned": lambda: rate(cache),
        "model_alone": lambda: rate(cache, tune=False),
        "fixed_0.3": lambda: rate(cache, {"cpu": 0.3, "nvjpeg": 0.7}),
        "stand_in_only": lambda: rate(cache, {"cpu": 0.0, "nvjpeg": 1.0}),
    }
    for _ in range(pairs):
        for name, fn in configs.items():
            out.setdefault(name, []).append(fn())
            print(name, f"{out[name][-1][0]:,.0f} img/s, CPU share {out[name][-1][1]:.2f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
