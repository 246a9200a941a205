#!/usr/bin/env python3
"""Issue 12's remaining checks on the GPU machine in one call, measured vs predicted per run.

Sections (``--sections``, run in the order given; one is skipped when its estimate would pass ``--budget-s``):

- ``batches``: 2,048 JPEGs of 300×240, ResNet-18 @112, gpu-augment, at each ``--batches`` size: raw at
  8 workers, ram at 0 and 4 workers, pinned and resident (the issue's kinds: raw, cached-with-workers,
  pinned, resident);
- ``default``: ``dlstore bench --out …`` as a user runs it (wall time, goal ≤ 60 s);
- ``decode``: the decode-heavy workload (raw, CPU augment at 224, ResNet-18, batch 64, 0 and 4 workers:
  must be named transform-bound), then the 0-worker loop taken apart (``decode_parts``): the loader alone
  and the loop, alternated (other variants: the loop synchronised after each step, the loader with the
  step's host time spent spinning or sleeping), with the hypervisor's steal time;
- ``seeds``: ``benchmarks/seeds.py``'s cached-light part (FashionMNIST-format IDX, SmallCNN, fp32, batch 256);
- ``compute``: the compute-heavy workload (ram, ResNet-50 @224, batch 256, 4 workers: must be named compute);
- ``parquet`` (issue 25, not in the default list): ``dlstore bench PARQUET`` as a user runs it on a parquet
  file in Hugging Face's layout, built from real pictures (``tests/photo_forms.py``: scikit-image's and
  scikit-learn's bundled photographs where installed, matplotlib's sample pictures) as JPEG crops at ImageNet-like sizes, one
  class per picture; records the run and prints its verdict.

Writes ``OUT/bench_batches.json`` after every run (a run cut short still leaves what it measured) and prints
one line per run (measured, predicted, error, bottleneck) plus a summary last, with every run's error under
the old and the new bases of the model side by side (``replay_predictions.VARIANTS``: the same runs, so a
fix and the behaviour before it are compared on one machine state).

GPU machine, from the repository root::

    python3 benchmarks/bench_batches.py --out "$OUT" --work /tmp/bb
    python3 benchmarks/bench_batches.py --sections parquet --budget-s 400 --out "$OUT/sources" --work /tmp/pq
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlstore.bench.protocol import BenchConfig  # noqa: E402

SECTIONS = ("batches", "default", "decode", "seeds", "compute")
OPTIONAL = ("parquet",)  # run only when named in --sections
# Seconds each part took on the H200 (earlier runs), to skip what would not fit in the budget.
ESTIMATE_S = {
    "batch": 15.0,
    "raw": 12.0,
    "compute": 17.0,
    "seeds": 16.0,
    "default": 60.0,
}
TOLERANCE = 0.20

Log = Callable[[str], None]


def write_one(args: tuple[str, int, int]) -> None:
    from dlstore.datasets.demo import make_demo_image

    root, index, classes = args
    label = index % classes
    img = make_demo_image(index, label % 5).convert("RGB").resize((300, 240))
    img.save(Path(root) / f"class{label}" / f"{index:05d}.jpg", quality=90)


def make_jpegs(root: Path, n: int, classes: int = 4) -> Path:
    """``n`` photo-like JPEGs of 300×240 in ``classes`` class folders (generated once)."""
    done = root / ".done"
    if done.is_file():
        return root
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool() as pool:
        pool.map(write_one, [(str(root), i, classes) for i in range(n)], chunksize=16)
    done.write_text("ok\n")
    return root


def trim(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without per-step arrays (kept in steps.csv), so the JSON stays small."""
    out = dict(doc)
    out["runs"] = [{k: v for k, v in r.items() if k != "raw"} for r in doc["runs"]]
    out["cold"] = {k: {kk: vv for kk, vv in c.items() if kk != "raw"} for k, c in doc.get("cold", {}).items()}
    return out


class Recorder:
    """Keeps every result and rewrites the JSON after each one."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.path = out / "bench_batches.json"
        self.doc: dict[str, Any] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": {},
            "skipped": [],
        }
        self.t0 = time.perf_counter()
        import harness

        self.environment = harness.environment()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def put(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.save()

    def save(self) -> None:
        self.doc["elapsed_s"] = self.elapsed()
        self.path.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        (self.path.parent / "targets.json").write_text(
            json.dumps({"environment": self.environment, "targets": targets(self.doc)}, indent=1, default=str)
            + "\n"
        )


def bench(
    name: str, config: BenchConfig, rec: Recorder, log: Log, keep_steps: bool = False
) -> dict[str, Any]:
    """One ``run_bench`` call recorded under ``name``; ``keep_steps`` keeps each repeat's per-step records."""
    from dlstore.bench.run import run_bench

    t0 = time.perf_counter()
    doc = run_bench(config, log=lambda m: log(f"{name}: {m}"))
    rec.doc["runs"][name] = {"wall_s": time.perf_counter() - t0, "doc": doc if keep_steps else trim(doc)}
    rec.save()
    log(f"{name}: {time.perf_counter() - t0:.1f} s")
    print("\n".join(rows(name, doc)), flush=True)  # as it goes: a run cut short still reports
    return doc


def rows(name: str, doc: dict[str, Any]) -> list[str]:
    out = []
    order = list(doc["loaders"])
    for r in sorted(doc["runs"], key=lambda r: (order.index(r["loader"]), r["workers"], not r["pin_memory"])):
        err = r.get("prediction_error")
        flag = "" if err is None or abs(err) <= TOLERANCE else "  MISS"
        out.append(
            f"{name:<14} {doc['protocol']['batch_size']:>5} {r['loader']:<9} {r['workers']:>3} "
            f"{'on' if r['pin_memory'] else 'off':>3} {r['img_per_s']:>9,.0f} {r['predicted_img_per_s'] or 0:>9,.0f} "
            f"{'-' if err is None else f'{100 * err:+.0f}%':>6} {str(r['bottleneck']):<10} "
            f"{host_ms(r)}{flag}"
        )
    return out


def host_ms(run: dict[str, Any]) -> str:
    """The main thread's copy + step calls per batch: measured in the loop / used by the model."""
    b = run.get("budget_ms") or {}
    meas, pred = (b.get("measured") or {}).get("host_ms"), (b.get("predicted") or {}).get("host_ms")
    return "" if meas is None or pred is None else f"{meas:5.1f}/{pred:5.1f}"


def batches_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    jpegs = make_jpegs(args.work / f"jpegs{args.images}", args.images)
    log(f"{args.images} JPEGs ready")
    common = dict(
        source=str(jpegs),
        size=32 if args.smoke else 112,
        model="smallcnn" if args.smoke else "resnet18",
        transform="gpu-augment",
        cache=args.work / "caches",
        cold=False,
        repeats=1,
        max_run_s=None,
        fed_s=args.fed_s,
    )
    for batch in args.batches:
        if (
            rec.elapsed()
            + ESTIMATE_S["batch"] * (1.0 if any(args.cached_workers) else 0.65)  # no worker pools: ~10 s
            + ESTIMATE_S["raw"] * (batch in args.raw_batches)
            > args.budget_s
        ):
            rec.doc["skipped"].append(f"batch {batch}")
            continue
        # ≥ 24 steps of a ~13 ms step: windows of 8–12 steps moved ±25% between runs (round B)
        steps, warmup = (24, 4) if batch >= 256 else (32, 4)
        if batch in args.raw_batches:
            bench(
                f"b{batch}-raw",
                BenchConfig(
                    loaders=("raw",),
                    workers=(8,),
                    batch_size=batch,
                    steps=steps,
                    warmup=warmup,
                    pin_memory="on",
                    **common,
                ),  # type: ignore[arg-type]
                rec,
                log,
            )
        bench(
            f"b{batch}-cached",
            BenchConfig(
                loaders=("ram", "pinned", "resident"),
                workers=args.cached_workers,
                batch_size=batch,
                steps=steps,
                warmup=warmup,
                **common,
            ),  # type: ignore[arg-type]
            rec,
            log,
        )


def decode_config(args: argparse.Namespace, jpegs: Path, workers: tuple[int, ...]) -> BenchConfig:
    return BenchConfig(
        source=str(jpegs),
        loaders=("raw",),
        workers=workers,
        size=32 if args.smoke else 224,
        batch_size=16 if args.smoke else 64,
        model="smallcnn" if args.smoke else "resnet18",
        transform="augment",
        steps=args.decode_steps,
        warmup=2,
        repeats=args.decode_repeats,
        cold=False,
        cache=args.work / "caches",
        max_run_s=None,
        stage_steps=args.decode_stage_steps,
        fed_s=args.fed_s,
    )


def decode_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    jpegs = make_jpegs(args.work / "jpegs384", 384)
    doc = bench("decode-heavy", decode_config(args, jpegs, args.decode_workers), rec, log, keep_steps=True)
    rec.doc.setdefault("verdicts", {})["decode-heavy"] = [r["bottleneck"] for r in doc["runs"]]
    print("\n".join(decode_diagnostics(doc)), flush=True)
    if not args.decode_parts:
        return
    try:
        plan = ("alone", "loop") * args.decode_parts
        rec.put("decode_parts", decode_parts(decode_config(args, jpegs, (0,)), log, plan))
    except Exception as e:  # a diagnostic: keep the rest of the round
        rec.put("decode_parts", {"error": repr(e)})
        log(f"decode_parts failed: {e!r}")
    for line in decode_rows(rec.doc["decode_parts"]):
        print(line, flush=True)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _epochs_ms(steps: dict[str, list[Any]]) -> list[float]:
    """Whole epochs inside the timed steps: the host time from an epoch's first next() to the next one's."""
    ph, ep, t = steps["phase"], steps["epoch"], steps["t_s"]
    starts = [t[i] for i in range(1, len(ep)) if ep[i] != ep[i - 1] and ph[i] == "timed"]
    if ph and ph[0] == "timed":  # no warm-up: the run's first step starts an epoch
        starts.insert(0, t[0])
    return [1e3 * (b - a) for a, b in zip(starts, starts[1:])]


def decode_diagnostics(doc: dict[str, Any]) -> list[str]:
    """Where a decode-heavy prediction goes wrong, per run and repeat: the loader's cost per batch in the
    parts phase (alone; in next() between fed steps), right before the run (probe) and in the run; the step's
    host time beside the loader vs in the run; CPU seconds per batch (the same work: a change is a slower or
    faster machine); a fixed single-core reference (``cpu_reference_s``); whole-epoch times with workers."""
    lines = ["decode diagnostics (ms per batch unless said; ref = cpu_reference_s in ms)"]
    stage = doc["stages"]["raw"]["loader_alone"]
    for r in doc["runs"]:
        key = f"w{r['workers']}-{'pin' if r['pin_memory'] else 'nopin'}"
        a = stage.get(key, {})
        ref_a = 1e3 * (a.get("cpu_ref_s") or float("nan"))
        bn = 1e3 * (a.get("beside_next_s") or float("nan"))
        bs = 1e3 * (a.get("beside_serial_s") or float("nan"))
        e = a.get("epoch_batches") or 0
        head = (
            f"{key}: parts: alone next {1e3 * a.get('main_s', float('nan')):.1f} period {1e3 * a.get('period_s', 0):.1f}"
            f" (epoch {e * 1e3 * a.get('period_s', 0):.0f}, refill {1e3 * (a.get('refill_s') or 0):.0f}),"
            f" cpu/batch {1e3 * a.get('cpu_s', 0):.0f}, beside: next {bn:.1f} step {bs:.1f}, ref {ref_a:.2f};"
            f" predicted {r['predicted_img_per_s'] or 0:,.0f} measured {r['img_per_s']:,.0f} (median of {r['repeats']})"
        )
        lines.append(head)
        for raw in r.get("raw", []):
            st = raw["steps"]
            timed = [i for i, ph in enumerate(st["phase"]) if ph == "timed"]
            wait = _mean([1e3 * st["wait_s"][i] for i in timed])
            step = _mean([1e3 * st["step_s"][i] for i in timed])
            res = raw.get("resources") or {}
            period = 1e3 * raw["timed_s"] / max(1, len(timed))
            cpu = (res.get("process_tree_cpu_cores") or 0) * period
            pr = "".join(probe_text(raw.get(k)) for k in ("loader_probe", "loader_probe_after"))
            lines.append(
                f"  repeat {raw['repeat']} pos {raw['position']}: {raw['img_per_s']:,.0f} img/s, period {period:.1f},"
                f" next {wait:.1f}, step {step:.1f}, cpu/batch {cpu:.0f}, ref {1e3 * (raw.get('cpu_ref_s') or 0):.2f},"
                f" epochs {[round(x) for x in _epochs_ms(st)]}{pr}"
            )
    return lines


def probe_text(probe: dict[str, Any] | None) -> str:
    """One probe of a decode-heavy repeat: next() alone (each batch), the step beside the loader, refs."""
    if not probe:
        return ""
    alone = (
        f" alone {1e3 * probe['main_s']:.1f} [{' '.join(f'{1e3 * x:.0f}' for x in probe.get('next_s', []))}]"
        f" cpu/batch {1e3 * probe['cpu_s']:.0f}"
        if "main_s" in probe
        else ""
    )
    beside = (
        f" beside next {1e3 * probe['beside_next_s']:.1f} step {1e3 * probe['beside_serial_s']:.1f}"
        if "beside_serial_s" in probe
        else ""
    )
    refs = f"ref {1e3 * probe['cpu_ref_s']:.2f}->{1e3 * probe.get('cpu_ref_after_s', float('nan')):.2f}"
    return f"\n    probe {probe.get('when', 'before')}:{alone}{beside} {refs}"


def decode_parts(
    config: BenchConfig, log: Log, args_plan: tuple[str, ...] = ("alone", "loop") * 3
) -> dict[str, Any]:
    """The 0-worker decode-heavy loop taken apart: per batch, the time in ``next()`` (wall and the process's
    CPU), the time in copy + step calls, and the period, for each variant (see the module doc)."""
    import torch

    from dlstore.bench.endtoend import feeder
    from dlstore.bench.kinds import LoaderContext, prepare_loader
    from dlstore.bench.kinds.context import default_size, source_channels
    from dlstore.bench.models import configure_numerics
    from dlstore.bench.monitor import steal_s
    from dlstore.bench.run import bench_cache_root, make_step, resolve_config, resolve_device
    from dlstore.bench.stages import BatchStream, batch_images
    from dlstore.machine import synchronize
    from dlstore.write.sources import open_source

    device = resolve_device(config.device)
    config = resolve_config(config, device)
    assert config.precision is not None
    configure_numerics(device, config.precision)
    source = open_source(config.source, root=config.root, demo_images=config.demo_images or 256)
    size = config.size or default_size(source)
    ctx = LoaderContext(config, source, size, source_channels(source), device, bench_cache_root(), log)
    p = prepare_loader("raw", ctx)
    step = make_step(p, config, size, len(source.classes), device)
    host_s = 0.012  # about the step's host time (ResNet-18 @224, batch 64, bf16: 11–14 ms measured)
    threads = torch.get_num_threads()

    def run(variant: str, pin: bool = True, n: int = 8, warm: int = 2) -> dict[str, Any]:
        loader = p.loader(0, pin, config)
        feed = feeder(p, device, pin)
        stream = BatchStream(loader)
        nxt = calls = 0.0
        try:
            for i in range(warm + n):
                if i == warm:
                    synchronize(device)
                    t0, c0, s0 = time.perf_counter(), time.process_time(), steal_s()
                    nxt = calls = 0.0
                a = time.perf_counter()
                batch = stream.next()
                b = time.perf_counter()
                nxt += b - a
                batch_images(batch)
                if variant.startswith("loop"):
                    x, y = feed(batch)
                    step(x, y)
                    if variant == "loop_sync":
                        synchronize(device)
                elif variant == "alone_spin":
                    end = time.perf_counter() + host_s
                    while time.perf_counter() < end:
                        pass
                elif variant == "alone_sleep":
                    time.sleep(host_s)
                calls += time.perf_counter() - b
            synchronize(device)
            wall, cpu, s1 = time.perf_counter() - t0, time.process_time() - c0, steal_s()
        finally:
            stream.close()
        return {
            "next_ms": 1e3 * nxt / n,
            "calls_ms": 1e3 * calls / n,
            "period_ms": 1e3 * wall / n,
            "cpu_cores": cpu / wall,
            "img_per_s": n * config.batch_size / wall,  # type: ignore[operator]
            "steal_cores": None if s0 is None or s1 is None else (s1 - s0) / wall,
        }

    out: dict[str, Any] = {"threads": threads, "host_s": host_s}
    # Round A (2026-11-30) showed no loop-only slowdown (alone_spin/alone_sleep/loop_sync ≈ loop) but the
    # loader alone drifting 112–136 ms within a minute: alternate the two to measure that spread.
    plan = [(v, True) for v in args_plan]
    for i, (variant, pin) in enumerate(plan):
        key = f"{variant}{'' if pin else '_nopin'}_{i}"
        out[key] = run(variant, pin)
        log(f"decode_parts {key}: {out[key]}")
    return out


def decode_rows(parts: dict[str, Any]) -> list[str]:
    if "error" in parts:
        return [f"decode_parts: {parts['error']}"]
    lines = [
        f"{'decode 0-worker part':<22} {'next ms':>8} {'calls ms':>8} {'period ms':>9} {'cores':>6} {'img/s':>7}"
    ]
    for k, v in parts.items():
        if isinstance(v, dict):
            lines.append(
                f"{k:<22} {v['next_ms']:>8.1f} {v['calls_ms']:>8.1f} {v['period_ms']:>9.1f} "
                f"{v['cpu_cores']:>6.1f} {v['img_per_s']:>7,.0f} {v.get('steal_cores') or 0:.2f}"
            )
    return lines


def compute_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    jpegs = make_jpegs(args.work / "jpegs384", 384)
    doc = bench(
        "compute-heavy",
        BenchConfig(
            source=str(jpegs),
            loaders=("ram",),
            workers=(4,),
            size=32 if args.smoke else 224,
            batch_size=32 if args.smoke else 256,
            model="smallcnn" if args.smoke else "resnet50",
            steps=8,
            warmup=2,
            repeats=1,
            transform="gpu-augment",
            cold=False,
            cache=args.work / "caches",
            max_run_s=None,
        ),
        rec,
        log,
    )
    rec.doc.setdefault("verdicts", {})["compute-heavy"] = [r["bottleneck"] for r in doc["runs"]]
    rec.save()


def seeds_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    """seeds.py's cached-light part as its own process (its own torch settings), smaller than the seeds' full
    protocol so it fits the round: fewer steps, one repeat."""
    out = args.out / "seeds"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parent / "seeds.py"),
        "--out", str(out),
        "--work", str(args.work / "seeds"),
        "--parts", "cached-light",
        "--formats", "ram,npz",
        "--cached-workers", "0,8",
        "--n-train", str(args.seeds_images),
        "--warmup", "10",
        "--steps", "40",
        "--repeats", "1",
        "--budget-s", "60",
    ]  # fmt: skip
    if args.smoke:
        cmd += ["--batch-size", "64", "--warmup", "2", "--steps", "4", "--cached-workers", "0,1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seeds_json = out / "seeds.json"
    rows = json.loads(seeds_json.read_text()).get("table", []) if seeds_json.is_file() else []
    rec.put(
        "seeds",
        {"cmd": " ".join(cmd), "rc": proc.returncode, "wall_s": time.perf_counter() - t0, "table": proc.stdout,
         "rows": rows, "stderr": proc.stderr[-3000:]},
    )  # fmt: skip
    log(f"seeds: rc {proc.returncode}, {time.perf_counter() - t0:.0f} s")
    print(proc.stdout, flush=True)


def default_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    t0 = time.perf_counter()
    work = args.work / "default-run"
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["dlstore", "bench", "--out", str(work / "out")],
        capture_output=True,
        text=True,
        check=False,
        cwd=work,  # not the checkout: PYTHONPATH may hold "" (the cwd), whose dlstore/ lacks cli
    )
    wall = time.perf_counter() - t0
    rec.put(
        "default", {"wall_s": wall, "rc": proc.returncode, "text": proc.stdout, "stderr": proc.stderr[-3000:]}
    )
    (args.out / "default.txt").write_text(proc.stdout + f"\nwall {wall:.1f} s rc={proc.returncode}\n")
    result = work / "out" / "result.json"
    if result.is_file():
        doc = json.loads(result.read_text())
        rec.doc["runs"]["default"] = {"wall_s": wall, "doc": trim(doc)}
        rec.save()
        print("\n".join(rows("default", doc)), flush=True)
    log(f"default: {wall:.1f} s rc={proc.returncode}")


def _photo_rows(start_stop: tuple[int, int]) -> tuple[list[dict[str, Any]], list[int]]:
    """Rows start..stop-1 of the parquet section's source: JPEG crops of the real pictures."""
    import io

    import numpy as np
    from photo_forms import imagenet_crop, real_pictures

    pictures = real_pictures(scikit=True)
    images, labels = [], []
    for i in range(*start_stop):
        rng = np.random.default_rng(i)
        k = i % len(pictures)
        buf = io.BytesIO()
        crop = imagenet_crop(pictures[k][1].convert("RGB"), rng)
        crop.save(buf, "JPEG", quality=int(rng.integers(80, 96)))
        images.append({"bytes": buf.getvalue(), "path": f"{pictures[k][0]}-{i:06d}.jpg"})
        labels.append(k)
    return images, labels


def make_photo_parquet(out: Path, n: int, rows_per_group: int = 500) -> Path:
    """``n`` JPEG crops of the real pictures at ImageNet-like sizes, as Hugging Face ``datasets`` writes
    ``Features({"image": Image(), "label": ClassLabel(names=pictures)})`` (one class per picture)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from photo_forms import real_pictures

    if out.is_file():
        return out
    names = [name for name, _ in real_pictures(scikit=True)]  # loaded before the fork
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())]).with_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}
    )
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    spans = [(a, min(n, a + rows_per_group)) for a in range(0, n, rows_per_group)]
    with pq.ParquetWriter(tmp, schema) as writer, multiprocessing.get_context("fork").Pool() as pool:
        for images, labels in pool.imap(_photo_rows, spans):  # in order: row groups as the rows go
            table = pa.table({"image": pa.array(images, image_type), "label": labels}, schema=schema)
            writer.write_table(table, row_group_size=rows_per_group)
    tmp.rename(out)
    return out


def parquet_section(args: argparse.Namespace, rec: Recorder, log: Log) -> None:
    """``dlstore bench PARQUET`` (issue 25) on a parquet source of real pictures; its verdict recorded."""
    import shutil

    t0 = time.perf_counter()
    n = 64 if args.smoke else args.parquet_images
    source = make_photo_parquet(args.work / f"photos-{n}.parquet", n)
    made_s = time.perf_counter() - t0
    log(f"parquet: {n} photos in {source} ({source.stat().st_size / 1e6:.1f} MB) in {made_s:.1f} s")
    out = args.out / "parquet-bench"
    exe = shutil.which("dlstore")
    cmd = [exe] if exe else [sys.executable, "-c", "from dlstore.cli import main; main()"]
    cmd += ["bench", str(source), "--out", str(out), "--budget", str(args.parquet_budget_s)]
    if args.smoke:
        cmd += ["--size", "32", "--batch-size", "16", "--steps", "2", "--warmup", "1", "--repeats", "1",
                "--stage-steps", "1", "--workers", "0", "--no-cold"]  # fmt: skip
    t1 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=args.work)  # not the checkout
    wall = time.perf_counter() - t1
    result = out / "result.json"
    doc = json.loads(result.read_text()) if result.is_file() else None
    verdict = (doc or {}).get("verdict") or ""  # the text of the bench's verdict
    rec.put(
        "parquet",
        {"cmd": " ".join(cmd), "rc": proc.returncode, "wall_s": wall, "images": n, "make_s": made_s,
         "source_bytes": source.stat().st_size, "source_kind": (doc or {}).get("source", {}).get("kind"),
         "verdict": verdict, "text": proc.stdout, "stderr": proc.stderr[-3000:],
         "doc": trim(doc) if doc else None},
    )  # fmt: skip
    (args.out / "parquet.txt").write_text(proc.stdout + f"\nwall {wall:.1f} s rc={proc.returncode}\n")
    if doc:
        print("\n".join(rows("parquet", doc)), flush=True)
    print(
        f"parquet bench: rc {proc.returncode}, {wall:.1f} s; verdict: {verdict}",
        flush=True,
    )
    log(f"parquet: {wall:.1f} s rc={proc.returncode}")


def prediction_errors(doc: dict[str, Any]) -> dict[str, list[float]]:
    """Every run's (measured − predicted) / predicted, per group: the ResNet runs (sweep, decode-heavy,
    compute-heavy), the seeds' runs, the default run's."""
    groups: dict[str, list[float]] = {"resnet": [], "seeds": [], "default": []}
    for name, res in doc["runs"].items():
        errs = [r["prediction_error"] for r in res["doc"]["runs"] if r.get("prediction_error") is not None]
        groups["default" if name == "default" else "resnet"] += errs
    for row in (doc.get("seeds") or {}).get("rows", []):
        if row.get("predicted"):
            groups["seeds"].append((row["img_per_s"] - row["predicted"]) / row["predicted"])
    return groups


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's goals as target rows (benchmarks/harness.py): the share of runs predicted within ±20%
    (goal: all) per group, and the default run's wall time (goal ≤ 60 s)."""
    import harness

    t = harness.Targets()
    what = {"resnet": "ResNet runs (batch sweep, decode-heavy, compute-heavy)", "seeds": "seeds cached-light runs",
            "default": "default `dlstore bench` runs"}  # fmt: skip
    for group, errs in prediction_errors(doc).items():
        if errs:
            within = sum(abs(e) <= TOLERANCE for e in errs)
            t.add(
                f"bench: {what[group]} predicted within ±20% (share of runs)",
                within,
                len(errs),
                1.0,
                f"errors {100 * min(errs):+.0f}% … {100 * max(errs):+.0f}%",
            )
    if "default" in doc:
        t.add("bench: default `dlstore bench` wall time (s; goal ≤ 60 s)", doc["default"]["wall_s"], 60.0, 1.0,
              f"rc {doc['default']['rc']}", higher=False)  # fmt: skip
    return list(t)


def summary(rec: Recorder) -> list[str]:
    lines = [
        f"{'run':<14} {'batch':>5} {'loader':<9} {'wk':>3} {'pin':>3} {'img/s':>9} {'predicted':>9} {'err':>6} bottleneck"
    ]
    errs = []
    for name, res in rec.doc["runs"].items():
        lines += rows(name, res["doc"])
        errs += [r["prediction_error"] for r in res["doc"]["runs"] if r.get("prediction_error") is not None]
    within = sum(abs(e) <= TOLERANCE for e in errs)
    if errs:
        lines.append(
            f"within ±20%: {within}/{len(errs)} (errors {100 * min(errs):+.0f}% … {100 * max(errs):+.0f}%)"
        )
    if "default" in rec.doc:
        lines.append(
            f"default dlstore bench: {rec.doc['default']['wall_s']:.1f} s, rc {rec.doc['default']['rc']}"
        )
    seeds = prediction_errors(rec.doc)["seeds"]
    if seeds:
        lines.append(
            f"seeds within ±20%: {sum(abs(e) <= TOLERANCE for e in seeds)}/{len(seeds)} "
            f"(errors {100 * min(seeds):+.0f}% … {100 * max(seeds):+.0f}%)"
        )
    if "verdicts" in rec.doc:
        lines.append(f"verdicts: {rec.doc['verdicts']}")
    if "decode-heavy" in rec.doc["runs"]:
        lines += decode_diagnostics(rec.doc["runs"]["decode-heavy"]["doc"])
    lines += variants_table(rec)
    if rec.doc["skipped"]:
        lines.append(f"skipped (budget): {rec.doc['skipped']}")
    lines.append(f"total {rec.elapsed():.0f} s")
    return lines


def model_variants(rec: Recorder) -> dict[str, list[dict[str, Any]]]:
    """Every run's error under the old and the new bases of the model (``replay_predictions.VARIANTS``), from
    the same measurements, and the main thread's step calls per batch: in the run, beside the loader in the
    parts phase, beside it right before / after the run (the probes)."""
    import replay_predictions

    out: dict[str, list[dict[str, Any]]] = {}
    for name, res in rec.doc["runs"].items():
        doc = res["doc"]
        rows_ = replay_predictions.variant_errors(doc)
        for row, run in zip(rows_, doc["runs"]):
            key = f"w{run['workers']}-{'pin' if run['pin_memory'] else 'nopin'}"
            alone = doc["stages"][run["loader"]]["loader_alone"].get(key, {})
            samples = (run.get("loader_probe") or {}).get("samples", [])
            row["host_ms"] = {
                "run": ((run.get("measured_ms") or {}).get("host_ms")),
                "parts": 1e3 * alone["beside_serial_s"] if alone.get("beside_serial_s") else None,
                **{
                    w: [
                        1e3 * p["beside_serial_s"]
                        for p in samples
                        if p.get("when") == w and "beside_serial_s" in p
                    ]
                    for w in ("before", "after")
                },
            }
            row["next_ms"] = {
                "run": (run.get("measured_ms") or {}).get("wait_ms"),
                "parts": 1e3 * alone["main_s"] if run["workers"] == 0 and "main_s" in alone else None,
                **{
                    w: [1e3 * p["main_s"] for p in samples if p.get("when") == w and "main_s" in p]
                    for w in ("before", "after")
                },
            }
        out[name] = rows_
    return out


def variants_table(rec: Recorder) -> list[str]:
    """The old and new model side by side on this round's runs (errors in %), and how many within ±20%."""
    try:
        variants = model_variants(rec)
    except Exception as e:  # a diagnostic: never lose the summary
        return [f"model variants failed: {e!r}"]
    rec.put("model_variants", variants)
    import replay_predictions

    names = list(replay_predictions.VARIANTS)
    lines = [
        "model variants (same runs; errors): "
        + "; ".join(f"{n} = {d}" for n, d in replay_predictions.VARIANTS.items())
    ]
    lines.append(
        f"{'run':<14} {'loader':<9} {'wk':>3} {'pin':>3} "
        + " ".join(f"{n:>13}" for n in names)
        + "  host ms run/parts/before/after"
    )
    count = {n: [0, 0] for n in names}
    for name, rows_ in variants.items():
        for r in rows_:
            errs = r["errors"]
            for n in names:
                if errs[n] is not None:
                    count[n][0] += abs(errs[n]) <= TOLERANCE
                    count[n][1] += 1
            h = r["host_ms"]
            fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            host = f"{fmt(h['run'])}/{fmt(h['parts'])}/{','.join(fmt(v) for v in h['before']) or '-'}/{','.join(fmt(v) for v in h['after']) or '-'}"
            lines.append(
                f"{name:<14} {r['loader']:<9} {r['workers']:>3} {'on' if r['pin_memory'] else 'off':>3} "
                + " ".join(f"{'-' if errs[n] is None else f'{100 * errs[n]:+.0f}%':>13}" for n in names)
                + f"  {host}"
            )
    lines.append("within ±20%: " + ", ".join(f"{n} {c[0]}/{c[1]}" for n, c in count.items()))
    probe_s = {
        name: sum(
            p.get("wall_s", 0.0)
            for r in res["doc"]["runs"]
            for p in (r.get("loader_probe") or {}).get("samples", [])
        )
        for name, res in rec.doc["runs"].items()
    }
    lines.append(
        "seconds in the probes around runs: " + ", ".join(f"{k} {v:.1f}" for k, v in probe_s.items())
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/dlstore-bench-batches"))
    p.add_argument("--sections", default=",".join(SECTIONS), help="Run in this order.")
    p.add_argument("--batches", default="32,128,512", help="Batch sizes of the sweep.")
    p.add_argument("--budget-s", type=float, default=140.0, help="Start no section that would end past this.")
    p.add_argument("--seeds-images", type=int, default=30_000)
    p.add_argument("--images", type=int, default=2048, help="JPEGs for the batch sweep.")
    p.add_argument(
        "--raw-batches", default=None, help="Batch sizes with a raw run (default: all of --batches)."
    )
    p.add_argument(
        "--fed-s", type=float, default=0.4, help="Seconds each fed-step loop is timed (BenchConfig.fed_s)."
    )
    p.add_argument(
        "--decode-parts", type=int, default=3, help="Alone/loop pairs of the 0-worker decode loop."
    )
    p.add_argument("--decode-repeats", type=int, default=1, help="Repeats of the decode-heavy runs.")
    p.add_argument("--decode-steps", type=int, default=8, help="Timed steps of a decode-heavy run (min).")
    p.add_argument("--decode-stage-steps", type=int, default=12, help="Batches of its loader-alone parts.")
    p.add_argument("--decode-workers", default="0,4", help="Worker counts of the decode-heavy runs.")
    p.add_argument(
        "--cached-workers", default="0,4", help="Worker counts of the ram runs of the batch sweep."
    )
    p.add_argument("--smoke", action="store_true", help="Tiny sizes and SmallCNN: a check on a CPU.")
    p.add_argument("--parquet-images", type=int, default=4096, help="Photos in the parquet section's source.")
    p.add_argument("--parquet-budget-s", type=float, default=150.0, help="The parquet bench's --budget.")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.decode_workers = tuple(int(w) for w in args.decode_workers.split(",") if w)
    args.cached_workers = tuple(int(w) for w in args.cached_workers.split(",") if w)
    args.raw_batches = (
        args.batches if args.raw_batches is None else [int(b) for b in args.raw_batches.split(",") if b]
    )
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS) - set(OPTIONAL)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS + OPTIONAL}")
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out, args)

    def log(msg: str) -> None:
        print(f"[{rec.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)

    run = {"batches": batches_section, "decode": decode_section, "compute": compute_section,
           "seeds": seeds_section, "default": default_section, "parquet": parquet_section}  # fmt: skip
    for s in sections:  # in the order given: a round's cap cuts the last ones
        # decode-heavy: ~14 s for its runs, ~3 s per alone/loop pair taken apart after them (H200)
        # and ~9 s per extra repeat
        estimate = (
            14.0 + 9.0 * (args.decode_repeats - 1) + 3.0 * args.decode_parts
            if s == "decode"
            else args.parquet_budget_s + 25.0  # the bench's own budget, the photos and its overrun
            if s == "parquet"
            else ESTIMATE_S.get(s, 0.0)
        )
        if s != "batches" and rec.elapsed() + estimate > args.budget_s:
            rec.doc["skipped"].append(s)
            log(f"{s}: skipped, would pass the {args.budget_s:.0f} s budget")
            continue
        try:
            run[s](args, rec, log)
        except Exception as e:  # keep the other sections' results
            rec.doc.setdefault("errors", {})[s] = repr(e)
            log(f"{s} failed: {e!r}")
    rec.save()
    print("\n".join(summary(rec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
