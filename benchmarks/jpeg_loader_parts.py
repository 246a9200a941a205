"""Where DecodeLoader's time goes on a GPU: each part alone in the loader's own batch order, the loader
end to end, and whether the batched nvJPEG call lets other Python threads run (a GIL probe).

    python benchmarks/jpeg_loader_parts.py --out OUTDIR [--images 6144] [--size 256]

Run it under ``py-spy record --threads --idle --format raw`` for a per-thread profile of the loader
section. Writes OUTDIR/jpeg_loader_parts.json and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dlstore.convert.conversion import convert
from dlstore.datasets.demo import ensure_demo
from dlstore.machine import usable_cores
from dlstore.read.cache import open_cache
from dlstore.read.gpu_decode import DecodeLoader, as_tensors, decode_on_device
from dlstore.read.loaders import storage_sorted

BATCH = 256


def rate(fn: Any, items: list[Any], passes: int = 2) -> float:
    fn(items[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(passes):
        for it in items:
            fn(it)
    torch.cuda.synchronize()
    return passes * len(items) * BATCH / (time.perf_counter() - t0)


def gil_probe(work: Any, seconds: float = 1.0) -> float:
    """Counter increments per second in a Python thread while ``work`` loops in this thread, relative to
    the same counter with this thread asleep: ~1 when ``work`` releases the GIL, ~0 when it holds it."""

    def count(stop: threading.Event, out: list[int]) -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    def run(busy: bool) -> float:
        stop, out = threading.Event(), []
        t = threading.Thread(target=count, args=(stop, out))
        t0 = time.perf_counter()
        t.start()
        while time.perf_counter() - t0 < seconds:
            work() if busy else time.sleep(0.01)
        stop.set()
        t.join()
        return out[0] / (time.perf_counter() - t0)

    return run(True) / run(False)


def loader_rate(batches: Any, epochs: int = 3) -> float:
    for _ in batches():  # warm
        pass
    torch.cuda.synchronize()
    t0, count = time.perf_counter(), 0
    for _ in range(epochs):
        for x, _y in batches():
            count += len(x)
    torch.cuda.synchronize()
    return count / (time.perf_counter() - t0)


def variants(loader: DecodeLoader, cache: Any, dev: torch.device) -> dict[str, float]:
    """The same batches through other arrangements of the same parts, to see which one serialises."""
    from dlstore.read.gpu_decode import _Pipe

    def main_thread_decode() -> Any:
        order = [storage_sorted(cache, b) for b in torch.utils.data.BatchSampler(loader.sampler, BATCH, True)]

        def read(i: Any) -> Any:
            p, s = cache.read_payloads(i)
            return i, p, s, as_tensors(p)

        reads = _Pipe(iter(order), read, 2, "read")
        try:
            for i, p, s, t in reads:
                imgs, _ = decode_on_device(cache, p, s, cache.positions[i], dev, t)
                yield torch.stack(imgs), torch.from_numpy(cache.labels[i])
        finally:
            reads.close()

    ra4 = DecodeLoader(cache, BATCH, device="cuda", read_ahead=4)
    return {
        "variant_read_ahead_4": loader_rate(lambda: iter(ra4)),
        "variant_main_thread_decode": loader_rate(main_thread_decode),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/jpeg_parts"))
    ap.add_argument("--images", type=int, default=6144)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cores = usable_cores()
    src = ensure_demo(args.work / "demo", n_images=args.images, workers=cores)
    dest = args.work / "jpeg"
    convert(src, dest, format="npz", size=args.size, codec="jpeg", workers=cores)
    cache = open_cache(dest)
    cache.reader.threads = cores
    loader = DecodeLoader(cache, BATCH, device="cuda")
    batches = [storage_sorted(cache, b) for b in torch.utils.data.BatchSampler(loader.sampler, BATCH, True)]
    dev = torch.device("cuda")
    read = [cache.read_payloads(i) for i in batches]
    tensors = [as_tensors(p) for p, _ in read]
    out: dict[str, Any] = {"images": args.images, "size": args.size, "cores": cores, "batch": BATCH}
    out["read_payloads_loader_order"] = rate(lambda i: cache.read_payloads(i), batches)
    out["decode_on_device"] = rate(
        lambda k: decode_on_device(
            cache, read[k][0], read[k][1], cache.positions[batches[k]], dev, tensors[k]
        ),
        list(range(len(batches))),
    )
    from torchvision.io import decode_jpeg

    out["gil_probe_decode_jpeg"] = gil_probe(lambda: decode_jpeg(tensors[0], device="cuda"))
    out["gil_probe_read_payloads"] = gil_probe(lambda: cache.read_payloads(batches[0]))
    for _ in loader:  # warm epoch
        pass
    torch.cuda.synchronize()
    t0, count = time.perf_counter(), 0
    for _ in range(3):
        for x, _y in loader:
            count += len(x)
    torch.cuda.synchronize()
    out["decode_loader"] = count / (time.perf_counter() - t0)
    out.update(variants(loader, cache, dev))
    out["sum_of_parts_prediction"] = 1 / (1 / out["read_payloads_loader_order"] + 1 / out["decode_on_device"])
    out["max_of_parts_prediction"] = min(out["read_payloads_loader_order"], out["decode_on_device"])
    out["environment"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "pid": os.getpid()}
    (args.out / "jpeg_loader_parts.json").write_text(json.dumps(out, indent=1))
    for k, v in out.items():
        if isinstance(v, float):
            print(f"{k:32s} {v:12,.2f}")


if __name__ == "__main__":
    main()
