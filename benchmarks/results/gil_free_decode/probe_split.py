"""Issue 38, prepared for the next device call (not yet run): where the auto split of nvJPEG + CPU decoders
goes, against fixed splits. ResNet-18 bf16 @112 bs512 from jpeg_short128 (4,096 skimage crops), then the
loader alone; the auto split with and without its ShareTuner. Carry simplejpeg (``device-wheels
simplejpeg==1.8.2``, installed with zarr): without it the CPU decoders run Pillow. Logs every split's
counts and the model's rates, every lane sample (images, busy), and each nvJPEG call's launch /
done-callback / result times.

    python3 benchmarks/results/gil_free_decode/probe_split.py OUT_DIR WORK_DIR   # from the repository root
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = ["benchmarks", "."]
import harness  # noqa: E402
import jpeg_cache  # noqa: E402

from dlstore.gpu import RaggedRandomResizedCrop  # noqa: E402
from dlstore.read.decode import lanes  # noqa: E402

OUT, WORK = Path(sys.argv[1]), Path(sys.argv[2])
CALLS: list[tuple[Any, ...]] = []
_result = lanes.FlatDecode.result


def result(self: Any, launching: Any) -> Any:
    t_in, was_done = time.perf_counter(), self.future.done()
    got = _result(self, launching)
    ended = self.ended[0] if self.ended else None
    CALLS.append((self.launched, ended, t_in, time.perf_counter(), was_done, len(self.hwc)))
    return got


lanes.FlatDecode.result = result  # type: ignore[method-assign]


def instrument(ld: Any) -> dict[str, list[Any]]:
    rec: dict[str, list[Any]] = {"obs": [], "counts": [], "split_rates": []}
    sp = ld._path.split
    observe, counts = sp.observe, sp.counts

    def logged_observe(name: str, images: int, busy: float, waited: float = 0.0, period: float = 0.0) -> None:
        rec["obs"].append((name, images, busy, waited, period))
        observe(name, images, busy, waited, period)

    def logged_counts(batch: int) -> dict[str, int]:
        c = counts(batch)
        rec["counts"].append(dict(c))
        rec["split_rates"].append(dict(sp.rates()))
        return c

    sp.observe, sp.counts = logged_observe, logged_counts
    return rec


def make(kind: str, cache: Path, crop: Any, cpu: int = 12) -> Any:
    if kind == "gpu_only":
        return harness.make_loader(cache, 512, "decode", transform=crop)
    if kind.startswith("auto"):
        ld = harness.make_loader(cache, 512, "decode", transform=crop, cpu_decoders=cpu)
        ld._path.split.tune = kind == "auto"  # auto_notune: the rate model alone, no ShareTuner
        return ld
    s = float(kind.split("_")[1])
    split = {"cpu": s, "nvjpeg": 1 - s}
    return harness.make_loader(cache, 512, "decode", transform=crop, cpu_decoders=cpu, split=split)


def measured(ld: Any, run: Any) -> tuple[Any, dict[str, Any]]:
    rec: dict[str, Any] = dict(instrument(ld))
    CALLS.clear()
    value = run()
    rec["calls"], rec["stats"] = CALLS[:], dict(vars(ld.stats))
    ld.close()
    return value, rec


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if not (WORK / "jpeg_short128").exists():
        jpeg_cache.section_data(argparse.Namespace(images=4096, caches="jpeg_short128"), WORK)
    cache = WORK / "jpeg_short128"
    crop = RaggedRandomResizedCrop(
        112, mean=harness.MEAN, std=harness.STD, out_dtype=torch.bfloat16, channels_last=True
    ).to("cuda")
    step = harness.model_step("resnet18", 10)

    def synthetic() -> float:
        return harness.timed_steps(harness.synthetic((512, 3, 112, 112), 10), step, 10, 40, 512)

    res: dict[str, Any] = {"synthetic": [synthetic()]}
    for kind in [
        "auto",
        "auto_notune",
        "gpu_only",
        "fixed_0.35",
        "fixed_0.5",
        "fixed_0.65",
        "fixed_0.8",
        "auto",
    ]:
        ld = make(kind, cache, crop)
        rate, rec = measured(ld, lambda ld=ld: harness.timed_steps(lambda: iter(ld), step, 10, 40, 512))
        res[kind + "_again" if kind in res else kind] = {"rate": rate, **rec}
        ceiling = res["synthetic"][-1]
        print(f"train {kind:10s} {rate:,.0f} img/s, {rate / ceiling:.3f} of the ceiling, "
              f"cpu_share {rec['stats'].get('cpu_share')}", flush=True)  # fmt: skip
    res["synthetic"].append(synthetic())
    for kind, cpu in [("gpu_only", 0), ("auto", 12), ("auto_notune", 12), ("fixed_0.3", 12)]:
        ld = make(kind, cache, crop, cpu)
        rate, rec = measured(ld, lambda ld=ld: jpeg_cache.alone(ld, epochs=4))
        res[f"alone_{kind}_{cpu}"] = {"rate": rate, **rec}
        print(
            f"alone {kind} cpu{cpu}: {rate:,.0f} img/s, cpu_share {rec['stats'].get('cpu_share')}", flush=True
        )
    print("synthetic", [round(x) for x in res["synthetic"]])
    auto = res["auto"]
    print(
        "auto: the model's rates, first and last splits:", auto["split_rates"][:2], auto["split_rates"][-2:]
    )
    print("auto: counts, first and last:", auto["counts"][:2], auto["counts"][-2:])
    for name in ("nvjpeg", "cpu"):
        obs = [(o[1], round(o[2] * 1e3, 2)) for o in auto["obs"] if o[0] == name]
        print(f"auto: {name} samples (images, busy ms), last 8:", obs[-8:])
    for kind in ("auto", "gpu_only"):
        calls = [
            (c[5], c[1] and round((c[1] - c[0]) * 1e3, 2), round((c[3] - c[0]) * 1e3, 2), c[4])
            for c in res[kind]["calls"][-8:]
        ]
        print(
            f"{kind}: nvJPEG calls (images, callback - launch ms, result - launch ms, done at entry):", calls
        )
    (OUT / "probe_split.json").write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
