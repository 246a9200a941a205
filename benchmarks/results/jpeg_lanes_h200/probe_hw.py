# ruff: noqa: B023  (the closures are called inside the iteration that makes them)
"""Bare GPU JPEG decode configurations on real photographs (issue 27 probe; lead's device call).

Kept as run (06:41-06:44 UTC, two calls; the first stopped at a GPU_ONLY decoder that cannot be created, the
second skips it); its results: probe_nvimgcodec.json beside it. Needs nvImageCodec and scikit-image.

python3 probe_hw.py OUTDIR  -> OUTDIR/probe.json, a table on stdout.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import sys
import threading
import time

import numpy as np
import torch
from PIL import Image

OUT = sys.argv[1] if len(sys.argv) > 1 else "probe_out"
os.makedirs(OUT, exist_ok=True)
RES: dict = {"env": {"torch": torch.__version__}}


def photos() -> list[np.ndarray]:
    from skimage import data

    names = [
        "astronaut",
        "coffee",
        "chelsea",
        "rocket",
        "hubble_deep_field",
        "immunohistochemistry",
        "motorcycle_left",
        "motorcycle_right",
        "retina",
        "cat",
        "colorwheel",
        "logo",
        "page",
        "camera",
        "brick",
        "grass",
        "gravel",
        "moon",
        "text",
        "coins",
    ]
    out = []
    for n in names:
        try:
            a = getattr(data, n)()
        except Exception:
            continue
        if isinstance(a, tuple):
            a = a[0]
        a = np.asarray(a)
        if a.ndim == 2:
            a = np.stack([a] * 3, -1)
        if a.shape[-1] == 4:
            a = a[..., :3]
        if a.dtype != np.uint8:
            a = (255 * (a - a.min()) / max(1e-9, a.max() - a.min())).astype(np.uint8)
        out.append(a)
    return out


def make(n: int, short: int, rng: np.random.Generator, pics: list[np.ndarray]) -> list[bytes]:
    res = []
    for i in range(n):
        p = pics[i % len(pics)]
        h, w = p.shape[:2]
        ar = rng.uniform(3 / 4, 4 / 3)
        ch = int(rng.uniform(0.5, 1.0) * min(h, w / ar))
        cw = int(ch * ar)
        y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        img = Image.fromarray(p[y : y + ch, x : x + cw])
        s = short / min(ch, cw)
        img = img.resize((max(1, round(cw * s)), max(1, round(ch * s))), Image.BILINEAR)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        b = io.BytesIO()
        img.save(b, format="JPEG", quality=90)
        res.append(b.getvalue())
    return res


def timed(name: str, fn, batches, budget: float = 1.2, warm: int = 2) -> dict:
    for i in range(warm):
        fn(batches[i % len(batches)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = imgs = 0
    parts: dict[str, float] = {}
    while time.perf_counter() - t0 < budget or n < 3:
        r = fn(batches[n % len(batches)])
        imgs += len(batches[n % len(batches)])
        n += 1
        if isinstance(r, dict):
            for k, v in r.items():
                parts[k] = parts.get(k, 0.0) + v
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"img_per_s": imgs / dt, "batches": n, "ms_per_batch": 1e3 * dt / n}
    out.update({f"{k}_ms": 1e3 * v / n for k, v in parts.items()})
    print(
        f"  {name:42s} {out['img_per_s']:10,.0f} img/s  {out['ms_per_batch']:7.2f} ms/batch  "
        + " ".join(f"{k}={v:.2f}" for k, v in out.items() if k.endswith("_ms") and k != "ms_per_batch"),
        flush=True,
    )
    return out


def safe(name, fn, *a, **k):
    try:
        return timed(name, fn, *a, **k)
    except Exception as e:
        print(f"  {name}: FAILED {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"}


def cpu_burner(stop, payloads):
    try:
        import simplejpeg

        dec = lambda b: simplejpeg.decode_jpeg(b)  # noqa: E731
    except Exception:
        dec = lambda b: np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))  # noqa: E731
    i = 0
    while not stop.is_set():
        dec(payloads[i % len(payloads)])
        i += 1


def main() -> None:
    from torchvision.io import decode_jpeg

    try:
        from nvidia import nvimgcodec
    except Exception as e:
        nvimgcodec = None
        RES["nvimgcodec_error"] = str(e)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    pics = photos()
    dev = torch.device("cuda")
    torch.ones(1, device=dev)
    RES["env"]["gpu"] = torch.cuda.get_device_name()
    RES["env"]["nvimgcodec"] = getattr(nvimgcodec, "__version__", None)
    stream = torch.cuda.Stream()
    for short, bs in ((128, 512), (256, 256)):
        payloads = make(bs * 6, short, rng, pics)
        print(
            f"== short {short}, batch {bs}: {len(payloads)} JPEGs, mean {np.mean([len(p) for p in payloads]):.0f} B "
            f"(made in {time.perf_counter() - t:.1f} s)",
            flush=True,
        )
        batches = [payloads[i : i + bs] for i in range(0, len(payloads), bs)]
        arrays = [[np.frombuffer(p, np.uint8) for p in b] for b in batches]
        r: dict = {}
        RES[f"short{short}"] = r

        def tv(b):
            t0 = time.perf_counter()
            ts = [torch.frombuffer(p, dtype=torch.uint8) for p in b]
            t1 = time.perf_counter()
            out = decode_jpeg(ts, device=dev)
            torch.cuda.synchronize()
            return {"wrap": t1 - t0, "call": time.perf_counter() - t1, "_n": len(out)}

        r["tv_nvjpeg"] = safe("torchvision decode_jpeg (nvJPEG)", tv, batches)

        if nvimgcodec is not None:
            B = nvimgcodec.Backend
            K = nvimgcodec.BackendKind
            params = nvimgcodec.DecodeParams(
                apply_exif_orientation=False,
                color_spec=nvimgcodec.ColorSpec.SRGB,
                sample_format=nvimgcodec.SampleFormat.P_RGB,
            )
            params_i = nvimgcodec.DecodeParams(
                apply_exif_orientation=False,
                color_spec=nvimgcodec.ColorSpec.SRGB,
                sample_format=nvimgcodec.SampleFormat.I_RGB,
            )

            def nv_fn(dec, src="cs", prm=params, reuse=False, wrap="ptr"):
                prev: list = []

                def f(b):
                    a = arrays[batches.index(b)] if src != "bytes" else b
                    t0 = time.perf_counter()
                    if src == "cs":
                        srcs = [nvimgcodec.CodeStream(x) for x in a]
                    else:
                        srcs = list(a)
                    t1 = time.perf_counter()
                    kw = {"images": prev[0]} if reuse and prev and len(prev[0]) == len(srcs) else {}
                    out = dec.decode(srcs, params=prm, cuda_stream=stream.cuda_stream, **kw)
                    stream.synchronize()
                    t2 = time.perf_counter()
                    if wrap == "ptr":
                        ptrs = [o.__cuda_array_interface__["data"][0] for o in out if o is not None]
                    else:
                        ptrs = [torch.as_tensor(o, device=dev) for o in out if o is not None]
                    t3 = time.perf_counter()
                    if reuse:
                        prev[:] = [out]
                    return {
                        "srcs": t1 - t0,
                        "call": t2 - t1,
                        "wrap": t3 - t2,
                        "failed": float(len(out) - len(ptrs)),
                    }

                return f

            def decoder(kinds, threads, options=""):
                try:
                    return nvimgcodec.Decoder(
                        device_id=0, max_num_cpu_threads=threads, backends=kinds, options=options
                    )
                except Exception as e:
                    print("  decoder failed:", kinds, threads, options, e, flush=True)
                    return None

            hw = decoder([B(K.HW_GPU_ONLY)], 2)
            for lh in (0.6, 0.7, 0.8):
                d = decoder([B(K.HW_GPU_ONLY, load_hint=lh), B(K.HYBRID_CPU_GPU), B(K.GPU_ONLY)], 4)
                r[f"mix_hw{lh}_threads4_reuse"] = safe(
                    f"HW {lh} + hybrid + gpu, 4 thr, reuse", nv_fn(d, reuse=True), batches
                )
                del d
            d = decoder([B(K.HW_GPU_ONLY, load_hint=0.7), B(K.HYBRID_CPU_GPU)], 4)
            r["mix_hw0.7_hybrid_reuse"] = safe("HW 0.7 + hybrid, 4 thr, reuse", nv_fn(d, reuse=True), batches)
            del d
            d = decoder([B(K.HW_GPU_ONLY, load_hint=0.7), B(K.GPU_ONLY)], 4)
            r["mix_hw0.7_gpu_reuse"] = safe("HW 0.7 + gpu, 4 thr, reuse", nv_fn(d, reuse=True), batches)
            del d
            r["hw_cs_ptr"] = safe("nvimgcodec HW, CodeStream, ptr", nv_fn(hw), batches)
            r["hw_cs_tensor"] = safe(
                "nvimgcodec HW, CodeStream, as_tensor", nv_fn(hw, wrap="tensor"), batches
            )
            r["hw_bytes_ptr"] = safe("nvimgcodec HW, bytes, ptr", nv_fn(hw, src="bytes"), batches)
            r["hw_cs_reuse"] = safe("nvimgcodec HW, CodeStream, reuse images", nv_fn(hw, reuse=True), batches)
            r["hw_cs_interleaved"] = safe("nvimgcodec HW, interleaved RGB", nv_fn(hw, prm=params_i), batches)
            for th in (1, 4):
                d = decoder([B(K.HW_GPU_ONLY)], th)
                r[f"hw_threads{th}"] = safe(f"nvimgcodec HW, {th} threads", nv_fn(d), batches)
                del d
            for th in (2, 4, 8, 12):
                d = decoder([], th)
                r[f"default_threads{th}"] = safe(f"nvimgcodec default backends, {th} thr", nv_fn(d), batches)
                del d
            for lh in (0.5, 0.7, 0.9):
                d = decoder([B(K.HW_GPU_ONLY, load_hint=lh), B(K.HYBRID_CPU_GPU), B(K.GPU_ONLY)], 4)
                r[f"mix_hw{lh}_threads4"] = safe(
                    f"nvimgcodec HW {lh} + hybrid + gpu, 4 thr", nv_fn(d), batches
                )
                del d
            for th in (2, 8):
                d = decoder([B(K.GPU_ONLY)], th)
                r[f"gpu_only_threads{th}"] = safe(f"nvimgcodec GPU_ONLY (CUDA), {th} thr", nv_fn(d), batches)
                del d
            d = decoder([B(K.GPU_ONLY)], 4, "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0")
            r["gpu_only_gpu_huffman"] = safe("nvimgcodec GPU_ONLY, huffman on GPU", nv_fn(d), batches)
            del d
            d = decoder([B(K.HYBRID_CPU_GPU)], 4)
            r["hybrid_threads4"] = safe("nvimgcodec HYBRID_CPU_GPU, 4 thr", nv_fn(d), batches)
            del d

            # ROI: a random half-area crop per image, decoded by the engines alone
            def roi_fn(b):
                a = arrays[batches.index(b)]
                t0 = time.perf_counter()
                srcs = []
                for x in a:
                    cs = nvimgcodec.CodeStream(x)
                    h, w = cs.height, cs.width
                    ch, cw = max(1, int(h * 0.7)), max(1, int(w * 0.7))
                    srcs.append(cs.get_sub_code_stream(0, region=nvimgcodec.Region([0, 0], [ch, cw])))
                t1 = time.perf_counter()
                out = hw.decode(srcs, params=params, cuda_stream=stream.cuda_stream)
                stream.synchronize()
                return {
                    "srcs": t1 - t0,
                    "call": time.perf_counter() - t1,
                    "failed": float(sum(o is None for o in out)),
                }

            r["hw_roi_half_area"] = safe("nvimgcodec HW, ROI 0.7x0.7", roi_fn, batches)

            # both GPU lanes at once: HW on one half in a thread, nvJPEG on the other here
            def both(b, hw_frac=0.5):
                k = int(len(b) * hw_frac)
                a = arrays[batches.index(b)][:k]
                box = {}

                def run_hw():
                    t0 = time.perf_counter()
                    srcs = [nvimgcodec.CodeStream(x) for x in a]
                    out = hw.decode(srcs, params=params, cuda_stream=stream.cuda_stream)
                    stream.synchronize()
                    box["hw"] = time.perf_counter() - t0
                    box["n"] = len(out)

                th = threading.Thread(target=run_hw)
                t0 = time.perf_counter()
                th.start()
                ts = [torch.frombuffer(p, dtype=torch.uint8) for p in b[k:]]
                decode_jpeg(ts, device=dev)
                torch.cuda.synchronize()
                tv_s = time.perf_counter() - t0
                th.join()
                return {"hw_lane": box["hw"], "nvjpeg_lane": tv_s}

            for frac in (0.5, 0.65, 0.8):
                r[f"both_lanes_hw{frac}"] = safe(
                    f"HW thread {frac} + nvJPEG rest", lambda b, f=frac: both(b, f), batches
                )

            # the same under a busy CPU: 12 processes decoding JPEGs (the CPU lane's load)
            ctx = mp.get_context("fork")
            stop = ctx.Event()
            procs = [
                ctx.Process(target=cpu_burner, args=(stop, payloads[:256]), daemon=True) for _ in range(12)
            ]
            for p in procs:
                p.start()
            time.sleep(0.5)
            try:
                r["busy12_tv_nvjpeg"] = safe("[12 CPU busy] torchvision nvJPEG", tv, batches)
                r["busy12_hw_reuse"] = safe(
                    "[12 CPU busy] nvimgcodec HW reuse", nv_fn(hw, reuse=True), batches
                )
                d = decoder([B(K.HW_GPU_ONLY, load_hint=0.7), B(K.HYBRID_CPU_GPU), B(K.GPU_ONLY)], 4)
                r["busy12_mix_hw0.7"] = safe(
                    "[12 CPU busy] HW 0.7 + hybrid + gpu, 4 thr reuse", nv_fn(d, reuse=True), batches
                )
                del d
                r["busy12_both_lanes_hw0.65"] = safe(
                    "[12 CPU busy] HW 0.65 + nvJPEG", lambda b: both(b, 0.65), batches
                )
            finally:
                stop.set()
                for p in procs:
                    p.join(timeout=5)
        with open(os.path.join(OUT, "probe.json"), "w") as f:
            json.dump(RES, f, indent=1)
    RES["wall_s"] = time.perf_counter() - t
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(RES, f, indent=1)
    print("done in", RES["wall_s"], flush=True)


if __name__ == "__main__":
    main()
