"""Which engine does each GPU JPEG decoder use? (issue 27 probe, run 7's last call)

torchvision's ``decode_jpegs_cuda`` creates its nvJPEG handle with ``NVJPEG_BACKEND_HARDWARE`` where the GPU
has one (A100, H100, H200) and batch-decodes baseline JPEGs there. This samples ``nvidia-smi dmon -s u``
(its ``jpg`` column: the NVJPG engines' utilisation) while each decoder runs alone on 256 px crops of the
``skimage.data`` photos, idle between them; and times torchvision's batched call beside a thread that runs
Python all the time, with its inputs as ``torch.frombuffer`` views (as ``DecodeLoader`` passes them) and as
tensors torch owns.

python3 probe_engines.py OUTDIR  -> OUTDIR/probe_engines.json, OUTDIR/dmon.txt; phases on stdout.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torchvision
from PIL import Image
from torchvision.io import decode_jpeg

OUT = sys.argv[1] if len(sys.argv) > 1 else "probe_out"
os.makedirs(OUT, exist_ok=True)
RES: dict = {"torch": torch.__version__, "torchvision": torchvision.__version__, "phases": []}


def payloads(n: int, short: int) -> list[bytes]:
    from skimage import data

    pics = []
    for name in ("astronaut", "coffee", "chelsea", "rocket", "retina", "cat"):
        try:
            a = np.asarray(getattr(data, name)())
        except Exception:  # noqa: BLE001 (a photo this scikit-image does not have, or cannot fetch)
            continue
        pics.append(a[..., :3] if a.ndim == 3 else np.stack([a] * 3, -1))
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        p = pics[i % len(pics)]
        h, w = p.shape[:2]
        ch = int(rng.uniform(0.5, 1.0) * min(h, w))
        y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - ch + 1)
        img = Image.fromarray(p[y : y + ch, x : x + int(ch * 0.75)])
        s = short / min(img.size)
        img = img.resize((round(img.size[0] * s), round(img.size[1] * s)), Image.BILINEAR)
        b = io.BytesIO()
        img.save(b, format="JPEG", quality=90)
        out.append(b.getvalue())
    return out


def phase(name: str, fn, seconds: float) -> None:
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        n += fn()
    torch.cuda.synchronize()
    dt = time.time() - t0
    RES["phases"].append({"name": name, "start": t0, "end": t0 + dt, "img_s": n / dt})
    print(f"{time.strftime('%H:%M:%S', time.localtime(t0))} {name}: {n / dt:,.0f} img/s", flush=True)


def idle(seconds: float) -> None:
    phase("idle", lambda: (time.sleep(0.1), 0)[1], seconds)


def main() -> None:
    data = payloads(1024, 256)
    batch = 256
    views = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    owned = [torch.tensor(list(b), dtype=torch.uint8) for b in data]
    k = [0]

    def tv(inputs):
        def run() -> int:
            a = (k[0] * batch) % len(inputs)
            k[0] += 1
            decode_jpeg(inputs[a : a + batch], device="cuda")
            return batch

        return run

    dmon = subprocess.Popen(
        ["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-o", "T"],
        stdout=open(os.path.join(OUT, "dmon.txt"), "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        tv(views)()  # warm: the decoder's handle and buffers
        idle(3)
        phase("torchvision decode_jpeg, batches of 256", tv(views), 6)
        idle(3)
        try:
            from dlstore.read.hw_decode import HardwareJpeg

            lane = HardwareJpeg.open(torch.device("cuda"))
        except Exception as e:  # noqa: BLE001
            lane, RES["hw_lane"] = None, f"absent: {e}"
        if lane is not None:
            arrays = [np.frombuffer(b, np.uint8) for b in data]

            def hw() -> int:
                a = (k[0] * batch) % len(arrays)
                k[0] += 1
                lane.decode(arrays[a : a + batch])
                return batch

            hw()
            phase("nvImageCodec hardware-only lane (dlstore hw)", hw, 6)
            idle(3)

        def one() -> int:
            a = k[0] % len(views)
            k[0] += 1
            decode_jpeg(views[a], device="cuda")
            return 1

        phase("torchvision decode_jpeg, one image per call", one, 5)
        idle(2)
        stop = threading.Event()

        def busy() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        for name, inputs in (("frombuffer views", views), ("tensors torch owns", owned)):
            stop.clear()
            t = threading.Thread(target=busy)
            t.start()
            try:
                phase(f"torchvision batches beside a Python thread, inputs {name}", tv(inputs), 4)
            finally:
                stop.set()
                t.join()
    finally:
        time.sleep(1.5)
        dmon.terminate()
    RES["dmon"] = open(os.path.join(OUT, "dmon.txt")).read()
    with open(os.path.join(OUT, "probe_engines.json"), "w") as f:
        json.dump(RES, f, indent=1)
    print(RES["dmon"])


if __name__ == "__main__":
    main()
