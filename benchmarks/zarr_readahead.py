"""zarr zstd-3 256 px random batches (ChunkSampler) through dlstore's reader vs numcodecs' decode of the
same chunks, side by side in one run (issue 13's zarr row).

    python benchmarks/zarr_readahead.py --out OUTDIR [--images 8192] [--repeats 3] [--work DIR]

Ceilings: numcodecs ``Zstd.decode(raw, out=buf)`` of every chunk (bytes already in memory) in 1 and in
all threads. Reader configurations (rotated over the repeats, cold unit cache each time, one epoch of
256-image batches in ChunkSampler order): ``sync`` reads each batch with nothing decoded ahead;
``aheadD`` calls ``cache.prefetch`` on the next D batches before each read (what PinnedLoader does with
D=1). Also the per-chunk cost of the reader's own path on one thread (file read + checks + decode)
against the bare decode. Writes OUTDIR/zarr_readahead.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Targets, convert_cache, environment, log  # noqa: E402
from slowpaths import chunk_files, decode_rate, py_spy, summarize_profile  # noqa: E402

from dlstore import open_cache  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402
from dlstore.read.loaders import PinnedLoader, make_sampler, storage_sorted  # noqa: E402
from dlstore.write.sources import scan_folder  # noqa: E402

CORES = len(os.sched_getaffinity(0))
B = 256


def reader_rate(
    root: Path, depth: int, threads: int, processes: int = 0, epochs: int = 2
) -> tuple[float, float]:
    """(img/s over `epochs` epochs, seconds of the untimed first epoch) of whole batches read in
    ChunkSampler order, prefetching `depth` batches ahead, decoding ahead in `processes` worker
    processes (0: threads). The first epoch carries the start-up (threads, worker processes)."""
    cache = open_cache(root)  # cold unit cache each time
    cache.reader.threads = threads
    cache.decode_processes = processes
    order = list(make_sampler(cache, "chunk", seed=0))
    batches = [storage_sorted(cache, order[i : i + B]) for i in range(0, len(order) - B + 1, B)]
    buf = np.empty((B, *cache.spec.shape), np.uint8)

    stages = {"prefetch_s": 0.0, "read_s": 0.0}

    def epoch() -> None:
        cache.reader.clear_units()  # every unit decoded again: the last epoch's are not reused
        for i, idx in enumerate(batches):
            t0 = time.perf_counter()
            if depth:
                ahead = batches[i + 1 : i + 1 + depth]
                if ahead:
                    cache.prefetch(np.concatenate(ahead))
            t1 = time.perf_counter()
            cache.read(idx, out=buf)
            stages["prefetch_s"] += t1 - t0
            stages["read_s"] += time.perf_counter() - t1

    t0 = time.perf_counter()
    epoch()
    first = time.perf_counter() - t0
    stages.update(prefetch_s=0.0, read_s=0.0)
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch()
    rate = epochs * len(batches) * B / max(1e-9, time.perf_counter() - t0)
    t0 = time.perf_counter()
    cache.close()
    stages["close_s"] = time.perf_counter() - t0
    LAST_STAGES.clear()
    LAST_STAGES.update(stages)
    return rate, first


def run_config(root: Path, depth: int, threads: int, processes: int, epochs: int) -> tuple[float, float]:
    if depth < 0:
        return batches_rate(root, processes, depth == -2, epochs=epochs)
    return reader_rate(root, depth, threads, processes, epochs=epochs)


LAST_STAGES: dict[str, float] = {}  # seconds per stage of the last run's timed epochs


def batches_rate(root: Path, processes: int, copy: bool, epochs: int = 2) -> tuple[float, float]:
    """Like reader_rate, through ``Cache.read_batches``: `processes` workers decode each chunk once
    and copy its images straight into the batches (shared memory). With `copy`, each batch is also
    copied into one buffer of the caller (what a caller keeping the batch would pay)."""
    cache = open_cache(root)
    order = list(make_sampler(cache, "chunk", seed=0))
    batches = [storage_sorted(cache, order[i : i + B]) for i in range(0, len(order) - B + 1, B)]
    buf = np.empty((B, *cache.spec.shape), np.uint8)
    waits = {"wait_s": 0.0, "copy_s": 0.0}

    def epoch() -> None:
        t0 = time.perf_counter()
        for x in cache.read_batches(batches, processes=processes):
            t1 = time.perf_counter()
            waits["wait_s"] += t1 - t0
            if copy:
                np.copyto(buf, x)
            t0 = time.perf_counter()
            waits["copy_s"] += t0 - t1

    t0 = time.perf_counter()
    epoch()
    first = time.perf_counter() - t0
    waits.update(wait_s=0.0, copy_s=0.0)
    t0 = time.perf_counter()
    for _ in range(epochs):
        epoch()
    rate = epochs * len(batches) * B / max(1e-9, time.perf_counter() - t0)
    t0 = time.perf_counter()
    cache.close()
    waits["close_s"] = time.perf_counter() - t0  # stopping the workers, freeing the ring
    LAST_STAGES.clear()
    LAST_STAGES.update(waits)
    return rate, first


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loader_rate(root: Path, processes: int, epochs: int = 2) -> dict[str, float]:
    """PinnedLoader (batch 256, ChunkSampler order, images to the GPU) with `processes` decode
    processes: img/s over `epochs` timed epochs after an untimed one (start-up)."""
    loader = PinnedLoader(root, batch_size=B, device=DEVICE, order="chunk", decode_processes=processes)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    first = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    for _ in range(epochs):
        loader.cache.reader.clear_units()
        for x, _y in loader:
            n += len(x)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t0)
    loader.cache.close()
    return {"img_s": rate, "first_epoch_s": first}


def parse_config(item: str) -> tuple[int, int, int]:
    """depth:threads[:processes], C = all cores; ``B:P`` = read_batches with P processes (``Bc:P``:
    and a copy of each batch), coded as depth -1 (-2), threads 0."""
    if item.startswith("B"):
        p = item.split(":")[1]
        return -2 if item.startswith("Bc") else -1, 0, CORES if p == "C" else int(p)
    d, t, p = (item.split(":") + ["", ""])[:3]
    return int(d), CORES if t in ("", "C") else int(t), 0 if p == "" else CORES if p == "C" else int(p)


def config_name(d: int, t: int, p: int) -> str:
    if d < 0:
        return f"batches_{p}proc" + ("_copy" if d == -2 else "")
    return f"{'sync' if d == 0 else f'ahead{d}'}_{t}t" + (f"_{p}proc" if p else "")


PROFILE_LOOP = """
import sys
sys.path[:0] = {paths!r}
from pathlib import Path
from zarr_readahead import run_config
print("ready", flush=True)
run_config(Path({root!r}), {depth}, {threads}, {processes}, epochs=1000)
"""


def profile(
    root: Path, depth: int, threads: int, processes: int, out_dir: Path, work: Path
) -> dict[str, Any]:
    """py-spy (native frames, idle threads, 200 Hz, 3 s) of the reader loop in one configuration."""
    exe = py_spy()
    if exe is None:
        return {"error": "py-spy not found"}
    here = str(Path(__file__).resolve().parent)
    script = work / "profile_loop.py"
    paths = [here, str(Path(here).parent)]
    code = PROFILE_LOOP.format(paths=paths, root=str(root), depth=depth, threads=threads, processes=processes)
    script.write_text(code)
    raw = out_dir / f"pyspy_zarr_{config_name(depth, threads, processes)}.txt"
    loop = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert loop.stdout is not None
        if loop.stdout.readline().strip() != "ready":
            return {"error": "the profiled loop did not start"}
        time.sleep(1.5)  # past the start-up (threads, decode processes) and the first decodes
        cmd = [exe, "record", "--pid", str(loop.pid), "--native", "--idle", "--threads", "--rate", "200"]
        cmd += ["--subprocesses"] if processes else []
        cmd += ["--duration", "3", "--format", "raw", "--output", str(raw)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        loop.kill()
        loop.wait()
    if not raw.is_file():
        return {"error": f"py-spy rc {proc.returncode}: {proc.stderr[-800:]}"}
    return summarize_profile(raw)


def per_chunk_cost(root: Path, raws: list[bytes], n: int = 200) -> dict[str, float]:
    """µs per chunk on one thread: the reader's load_unit (open/read/close, header check, decode into a
    pooled buffer) vs numcodecs' decode of the same bytes already in memory into one buffer."""
    from numcodecs.zstd import Zstd

    cache = open_cache(root)
    reader: Any = cache.reader
    n = min(n, len(raws))
    out = np.empty((reader.unit, *cache.spec.shape), np.uint8)
    nc = Zstd()
    t0 = time.perf_counter()
    for r in raws[:n]:
        nc.decode(r, out=out)
    bare = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for k in range(n):
        reader.recycle([reader.load_unit(k)])
    path = (time.perf_counter() - t0) / n
    reader.map_chunks = True  # what a decode worker does: decode from a mapping of the chunk file
    t0 = time.perf_counter()
    for k in range(n):
        reader.decode_unit_into(k, out)
    mapped = (time.perf_counter() - t0) / n
    cache.close()
    return {
        "bare_decode_us": bare * 1e6,
        "reader_load_unit_us": path * 1e6,
        "overhead_us": (path - bare) * 1e6,
        "reader_mapped_decode_us": mapped * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--images", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="0:C,2:C,2:C:C", help="depth:threads[:processes] (C = all cores)")
    ap.add_argument("--loader", default="", help="PinnedLoader runs: decode_processes values, e.g. 0,16")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per run, after an untimed one")
    ap.add_argument("--profile", default="", help="depth:threads of one configuration to py-spy (3 s)")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dlstore-zra-"))
    res: dict[str, Any] = {"command": "python3 " + " ".join(sys.argv), "commit": args.commit, "cores": CORES}
    try:
        import numcodecs
        import zarr

        res["versions"] = {"python": sys.version.split()[0], "numpy": np.__version__}
        res["versions"].update(zarr=zarr.__version__, numcodecs=numcodecs.__version__)
    except ImportError:
        pass
    save = lambda: (args.out / "zarr_readahead.json").write_text(json.dumps(res, indent=1))  # noqa: E731

    t0 = time.perf_counter()
    demo = ensure_demo(work / "demo", n_images=args.images)
    root = work / "zarr256"
    if not (root / "images").exists():
        convert_cache(
            scan_folder(demo), root, format="zarr", size=256, workers=CORES, overwrite=True, codec="zstd"
        )
    res["data_s"] = time.perf_counter() - t0
    log(f"data ready in {res['data_s']:.1f} s")

    from numcodecs.zstd import Zstd

    probe = open_cache(root)
    unit, shape = probe.reader.unit, (probe.reader.unit, *probe.spec.shape)
    probe.close()
    raws = [f.read_bytes() for f in chunk_files(root)]
    res.update(chunks=len(raws), unit_images=unit, chunk_bytes_mean=float(np.mean([len(r) for r in raws])))
    nc = Zstd()
    ceil = {
        f"numcodecs_{t}_threads": decode_rate(lambda r, o: nc.decode(r, out=o), raws, unit, shape, t)
        for t in sorted({1, CORES})
    }
    res["ceiling_img_s"] = ceil
    log(f"ceilings {ceil}")
    save()
    res["per_chunk_1_thread"] = per_chunk_cost(root, raws)
    log(f"per chunk {res['per_chunk_1_thread']}")
    save()

    cfgs: dict[str, tuple[int, int, int]] = {}
    # Suffixes: "!" shared memory not prefaulted; "~" decode workers read chunk files (not mapped).
    switches: dict[str, dict[str, str]] = {}
    for item in args.configs.split(","):
        d, t, p = parse_config(item.rstrip("!~"))
        flags = item[len(item.rstrip("!~")) :]
        name = config_name(d, t, p) + ("_nofault" if "!" in flags else "") + ("_read" if "~" in flags else "")
        cfgs[name] = (d, t, p)
        switches[name] = {"DLSTORE_PREFAULT": "0" if "!" in flags else "1"}
        switches[name]["DLSTORE_MAP_CHUNKS"] = "0" if "~" in flags else "1"
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    firsts: dict[str, list[float]] = {k: [] for k in cfgs}
    stages: dict[str, list[dict[str, float]]] = {}
    reader_rate(root, 0, CORES, epochs=0)  # warm: page cache, imports
    for _ in range(args.repeats):
        for name, (d, t, p) in cfgs.items():
            os.environ.update(switches[name])  # read by the decode workers too
            rate, first = run_config(root, d, t, p, epochs=args.epochs)
            runs[name].append(rate)
            firsts[name].append(first)
            stages.setdefault(name, []).append(dict(LAST_STAGES))
            log(f"  {name}: {rate:,.0f} img/s (first epoch, with start-up: {first:.2f} s) {LAST_STAGES}")
            res["reader_img_s"] = {
                k: {
                    "runs": v,
                    "median": float(np.median(v)),
                    "first_epoch_s": firsts[k],
                    "stages_s": stages[k],
                }
                for k, v in runs.items()
                if v
            }
            save()
    for procs in [int(x) for x in args.loader.split(",") if x != ""]:
        res.setdefault("pinned_loader_img_s", {})[f"{procs}proc"] = loader_rate(root, procs)
        log(
            f"  PinnedLoader to {DEVICE}, decode_processes={procs}: {res['pinned_loader_img_s'][f'{procs}proc']}"
        )
        save()
    if args.profile:
        res["profile"] = profile(root, *parse_config(args.profile), args.out, work)
        log(f"profile: {res['profile'].get('share', res['profile'])}")
        save()
    top = ceil[f"numcodecs_{CORES}_threads"]
    res["ratio_to_ceiling"] = {k: v["median"] / top for k, v in res["reader_img_s"].items()}
    save()
    targets = Targets()
    chosen = f"batches_{CORES}proc"  # the row: named up front, not the best of the runs
    if chosen in res["reader_img_s"]:
        targets.add(
            f"zarr zstd-3 256px ChunkSampler batches, Cache.read_batches with {CORES} decode processes "
            f"vs numcodecs decode of the same chunks in {CORES} threads",
            res["reader_img_s"][chosen]["median"],
            top,
            0.8,
            note=f"median of {len(res['reader_img_s'][chosen]['runs'])} runs of {args.epochs} epochs",
        )
    env = environment(commit=args.commit)
    (args.out / "targets.json").write_text(json.dumps({"environment": env, "targets": targets}, indent=1))
    print(f"\nzarr zstd-3 256px, {CORES} cores, {len(raws)} chunks of {unit} images")
    print(f"{'configuration':40} {'img/s':>10} {'ratio':>6}")
    for k, v in ceil.items():
        print(f"{k:40} {v:>10,.0f} {v / top:>6.3f}")
    for k, v in res["reader_img_s"].items():
        print(f"{'reader ' + k:40} {v['median']:>10,.0f} {v['median'] / top:>6.3f}")
    for k, v in res.get("pinned_loader_img_s", {}).items():
        print(f"{'PinnedLoader to ' + DEVICE + ' ' + k:40} {v['img_s']:>10,.0f} {v['img_s'] / top:>6.3f}")
    pc = res["per_chunk_1_thread"]
    print(
        f"per chunk, 1 thread: bare decode {pc['bare_decode_us']:.0f} us, reader {pc['reader_load_unit_us']:.0f} us, "
        f"mapped {pc['reader_mapped_decode_us']:.0f} us"
    )
    if targets:
        print(targets.table(60))


if __name__ == "__main__":
    main()
