"""Where the GPU-only loader loses to bare batched decode_jpeg (issue 38): rates and the loader's stats.

Run from the repository root. As run on the H100, except that the loader is built through
harness.make_loader, which makes the same call the run made (the decode path, no transform)."""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import harness
from PIL import Image
from torchvision.io import decode_jpeg

import dlstore

out = Path(os.environ.get("OUT", "/tmp")) / "probe38.json"
src, dest = (
    Path(os.environ.get("P38", "/tmp/p38") + "/src"),
    Path(os.environ.get("P38", "/tmp/p38") + "/jpeg256"),
)
if not dest.exists():
    photos = sorted(Path(".probe35/photos").glob("*.png"))
    rng = np.random.default_rng(0)
    ims = [Image.open(p).convert("RGB") for p in photos]
    for i in range(int(os.environ.get("N", 4096))):
        im = ims[i % len(ims)]
        w, h = im.size
        s = min(w, h, 300)
        x, y = rng.integers(0, w - s + 1), rng.integers(0, h - s + 1)
        d = src / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        im.crop((x, y, x + s, y + s)).save(d / f"{i}.jpg", quality=92)
    dlstore.convert(
        str(src),
        str(dest),
        dlstore.ConvertOptions(
            format="npz", size=256, codec="jpeg", writer_options={"quality": 90}, workers=16
        ),
    )
cache = dlstore.open_cache(str(dest))
bs, n = 256, len(cache) // 256 * 256
payloads, _ = cache.read_payloads(np.arange(n))
copies = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
batches = [copies[a : a + bs] for a in range(0, n, bs)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
res = {}


def bare(epochs, per_batch_sync=False):
    decode_jpeg(batches[0], device=DEV)
    sync()
    t0 = time.perf_counter()
    for _ in range(epochs):
        for b in batches:
            decode_jpeg(b, device=DEV)
            if per_batch_sync:
                sync()
    sync()
    return epochs * n / (time.perf_counter() - t0)


def alone(epochs, **kw):
    ld = harness.make_loader(cache, bs, "decode", device=DEV, **kw)
    for _ in ld:
        pass
    sync()
    t0, c = time.perf_counter(), 0
    for _ in range(epochs):
        for x, _y in ld:
            c += len(x)
    sync()
    r = c / (time.perf_counter() - t0)
    st = ld.stats
    ld.close()
    return r, (
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(st).items()}
        if st is not None
        else None
    )


for rep in range(2):
    res[f"bare2_{rep}"] = bare(2)
    res[f"bare2_sync_{rep}"] = bare(2, True)
    res[f"loader2_{rep}"], res[f"loader2_stats_{rep}"] = alone(2)
    res[f"bare8_{rep}"] = bare(8)
    res[f"loader8_{rep}"], res[f"loader8_stats_{rep}"] = alone(8)
    print({k: v for k, v in res.items() if not k.count("stats")}, flush=True)
# a trace of the loader's epoch
from torch.profiler import ProfilerActivity, profile  # noqa: E402

ld = harness.make_loader(cache, bs, "decode", device=DEV)
for _ in ld:
    pass
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _x, _ in ld:
        pass
    sync()
prof.export_chrome_trace(str(out.parent / "loader_trace.json"))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
ld.close()
out.write_text(json.dumps(res, indent=1))
