"""Object sizes for a remote cache: requests and bytes per request in one epoch, against a local S3
server (moto), for npz shards of several sizes, zarr's chunks, and zarr v3 sharded arrays (``--shard-mb``:
chunks of ``--chunk-kb`` inside shard objects).

    python benchmarks/s3_objects.py --out OUTDIR [--images 2048] [--size 96] [--shard-mb 1,4,16,32]
        [--zarr-shard-mb 4,16,32] [--chunk-kb 256,1024]

For each layout: convert the same demo images to ``s3://bench/<layout>``, then read one epoch in
``ChunkSampler`` order (batches of 256) through ``open_cache(URL, cache_dir=<empty>)`` and count the
GET requests and bytes the store made (cold epoch), then a second epoch from a cache opened afresh on
the same local chunk cache (warm: local disk and decode, no decoded chunk kept from the first epoch).
Writes OUTDIR/s3_objects.json and prints a table. moto on localhost has none of S3's per-request
latency (tens of ms to the first byte), so the request count, not the seconds, is the result to keep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3server import aws_env, start_server  # noqa: E402

from dlstore.convert.conversion import convert  # noqa: E402
from dlstore.convert.sources import scan_folder  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.formats.npz import NpzWriter  # noqa: E402
from dlstore.formats.zarr_cache import ZarrWriter  # noqa: E402
from dlstore.read.cache import open_cache  # noqa: E402
from dlstore.read.loaders import make_sampler  # noqa: E402
from dlstore.storage.stores import RemoteStore  # noqa: E402

GET_USD_PER_1000 = 0.0004  # S3 Standard GET, us-east-1
S3_GETS_PER_S_PER_PREFIX = 5500


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--shard-mb", default="1,4,16,32", help="npz shard sizes ('' for none)")
    p.add_argument("--zarr-shard-mb", default="4,16,32", help="zarr shard sizes ('' for none)")
    p.add_argument("--chunk-kb", default="256,1024", help="zarr chunk sizes inside the shards")
    return p.parse_args()


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def epoch(url: str, mirror: Path) -> dict[str, Any]:
    cache = open_cache(url, cache_dir=mirror)
    sampler = make_sampler(cache, "chunk", seed=0)
    order = np.fromiter(iter(sampler), np.int64)
    out: dict[str, Any] = {}
    for name in ("cold", "warm"):
        if name == "warm":  # a fresh reader (no decoded chunks kept) on the now-full local mirror
            cache.close()
            cache = open_cache(url, cache_dir=mirror)
        store = cache.mirror.store
        r0, b0, t0 = store.requests, store.bytes, time.perf_counter()
        for i in range(0, len(order), 256):
            cache.read(np.sort(order[i : i + 256]))
        gets, nbytes = store.requests - r0, store.bytes - b0
        seconds = time.perf_counter() - t0
        out[name] = {
            "requests": gets,
            "bytes": nbytes,
            "bytes_per_request": nbytes / gets if gets else 0,
            "seconds": seconds,
            "images_per_s": len(order) / seconds,
        }
    return out


def layout(
    src: Any,
    args: argparse.Namespace,
    fmt: str,
    shard_mb: float | None,
    work: Path,
    chunk_kb: float | None = None,
) -> dict[str, Any]:
    image_bytes = args.size * args.size * 3
    options: dict[str, Any] = {}
    if fmt == "npz" and shard_mb is not None:
        images = max(1, int(shard_mb * 2**20 // image_bytes))
        NpzWriter.choose_unit_size = staticmethod(lambda image_bytes: images)  # type: ignore[method-assign]
    if fmt == "zarr":
        chunk = max(1, int((chunk_kb or 1024) * 1024 // image_bytes))
        ZarrWriter.choose_unit_size = staticmethod(lambda image_bytes: chunk)  # type: ignore[method-assign]
        if shard_mb is not None:
            options["shard_mb"] = shard_mb
    name = f"{fmt}-{shard_mb}mb" if shard_mb is not None else fmt
    if chunk_kb is not None:
        name += f"-{chunk_kb:g}kb"
    url = f"s3://bench/{name}"
    convert(src, url, format=fmt, size=args.size, workers=2, options=options)
    sizes = RemoteStore(url).sizes()
    doc = {"layout": name, "objects": len(sizes), "total_bytes": sum(sizes.values())}
    doc.update(epoch(url, work / f"mirror-{name}"))
    cold = doc["cold"]["requests"]
    doc["s3_usd_per_1000_epochs"] = cold * GET_USD_PER_1000
    doc["s3_min_seconds_at_request_limit"] = cold / S3_GETS_PER_S_PER_PREFIX
    return doc


def main() -> None:
    args = parse_args()
    server = start_server()
    os.environ.update(aws_env(server))
    work = Path(tempfile.mkdtemp(prefix="s3-objects-"))
    os.environ["DLSTORE_SPOOL"] = str(work / "spool")
    try:
        RemoteStore("s3://bench").fs.mkdir("bench")
        src = scan_folder(ensure_demo(work / "demo", n_images=args.images))
        rows = [layout(src, args, "npz", mb, work) for mb in floats(args.shard_mb)]
        rows.append(layout(src, args, "zarr", None, work, 1024))
        for kb in floats(args.chunk_kb):
            rows += [layout(src, args, "zarr", mb, work, kb) for mb in floats(args.zarr_shard_mb)]
    finally:
        server.stop()
    doc = {
        "what": f"{args.images} images {args.size}px, one epoch, ChunkSampler, batches of 256",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "s3_objects.json").write_text(json.dumps(doc, indent=1))
    print(
        f"{'layout':<22}{'objects':>8}{'cold GETs':>10}{'MB/GET':>8}{'cold img/s':>11}"
        f"{'warm GETs':>10}{'warm img/s':>11}"
    )
    for r in rows:
        mb = r["cold"]["bytes_per_request"] / 2**20
        print(
            f"{r['layout']:<22}{r['objects']:>8}{r['cold']['requests']:>10}{mb:>8.2f}"
            f"{r['cold']['images_per_s']:>11.0f}{r['warm']['requests']:>10}{r['warm']['images_per_s']:>11.0f}"
        )


if __name__ == "__main__":
    main()
