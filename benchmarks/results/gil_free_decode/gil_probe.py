"""Which GPU JPEG decode runs a batch without handing the GIL over per image (issue 38, phase 1).

    python3 gil_probe.py OUT [--images 4096] [--secs 1.5] [--only tv,ts_flat,...]

Same pre-resized JPEG bytes for every candidate (crops of the skimage.data photos, shorter side 128 / 256,
q90), each decoded ALONE and BESIDE a busy thread (pure-Python spin; a loop of small CUDA ops), with the
busy thread's own rate; the decode runs in a Python thread as in a loader. Pixels vs Pillow at 256 px.
Writes OUT/gil_probe.json and prints a table last.
"""

import argparse
import ctypes
import io
import json
import re
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")


def _encode(job):
    import skimage.data
    from PIL import Image

    start, stop, short = job
    photos = [np.asarray(getattr(skimage.data, n)())[:, :, :3] for n in PHOTOS]
    rng, out = np.random.default_rng(start), []
    for i in range(start, stop):
        src = photos[i % len(photos)]
        h, w = src.shape[:2]
        side = rng.uniform(0.5, 1.0) * min(h, w)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        ch, cw = int(min(h, side / np.sqrt(aspect))), int(min(w, side * np.sqrt(aspect)))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        im = Image.fromarray(np.ascontiguousarray(src[top : top + ch, left : left + cw]))
        s = short / min(ch, cw)
        im = im.resize((max(short, round(cw * s)), max(short, round(ch * s))), Image.BILINEAR)
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def make_jpegs(n, short):
    with ProcessPoolExecutor(12) as ex:
        blobs = [
            b
            for part in ex.map(_encode, [(i, min(n, i + 256), short) for i in range(0, n, 256)])
            for b in part
        ]
    offs = np.zeros(n + 1, np.int64)
    offs[1:] = np.cumsum([len(b) for b in blobs])
    return np.frombuffer(b"".join(blobs), np.uint8).copy(), offs


def _spin_proc(shared):
    while True:
        n = 0
        for _ in range(1000):
            n += 1
        shared.value += 1000


class Busy(threading.Thread):
    """The training loop's stand-in: pure Python (spin; spinproc: the same in a process of its own, so CPU
    but no GIL is shared) or a loop of small CUDA ops (torch)."""

    def __init__(self, kind):
        super().__init__(daemon=True)
        self.kind, self.count, self.halt = kind, 0, False

    def run(self):
        if self.kind == "spinproc":
            import multiprocessing as mp

            shared = mp.get_context("fork").Value("q", 0, lock=False)
            p = mp.get_context("fork").Process(target=_spin_proc, args=(shared,), daemon=True)
            p.start()
            while not self.halt:
                time.sleep(0.01)
                self.count = shared.value
            p.terminate()
            p.join()
        elif self.kind == "spin":
            while not self.halt:
                n = 0
                for _ in range(1000):
                    n += 1
                self.count += 1000
        else:
            x = torch.zeros(4096, device="cuda")
            while not self.halt:
                for _ in range(50):
                    x.add_(1.0).mul_(0.5)
                torch.cuda.synchronize()
                self.count += 100


def busy_alone(kind, secs):
    b = Busy(kind)
    b.start()
    time.sleep(0.2)
    c0, t0 = b.count, time.perf_counter()
    time.sleep(secs)
    rate = (b.count - c0) / (time.perf_counter() - t0)
    b.halt = True
    b.join()
    return rate


def measure(step, busy_kind, secs, switch=None):
    """img/s of step() in a thread of its own, for about secs (whole batches), beside busy_kind."""
    res, old = {}, sys.getswitchinterval()

    def worker():
        step(0)
        torch.cuda.synchronize()
        b = Busy(busy_kind) if busy_kind else None
        if b:
            b.start()
            time.sleep(0.1)
        c0, t0, i, imgs = (b.count if b else 0), time.perf_counter(), 1, 0
        while time.perf_counter() - t0 < secs:
            imgs += step(i)
            i += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        res.update(img_s=imgs / dt, batches=i - 1, secs=dt)
        if b:
            res["busy_rate"] = (b.count - c0) / dt
            b.halt = True
            b.join()

    if switch:
        sys.setswitchinterval(switch)
    try:
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    finally:
        sys.setswitchinterval(old)
    return res


# --- candidates: make(flat, offs, bs, size) -> (step(i) -> images, pixels(k) -> list of HWC uint8) ---


def cand_tv(flat, offs, bs, size, phases):
    from torchvision.io import decode_jpeg

    src, o, nb = torch.from_numpy(flat), offs.tolist(), (len(offs) - 1) // bs

    def step(i):
        lo = (i % nb) * bs
        t0 = time.perf_counter()
        ins = [src[o[j] : o[j + 1]] for j in range(lo, lo + bs)]
        t1 = time.perf_counter()
        outs = decode_jpeg(ins, device="cuda")
        t2 = time.perf_counter()
        del outs, ins
        t3 = time.perf_counter()
        for k, v in zip(("make_inputs", "call", "free"), (t1 - t0, t2 - t1, t3 - t2)):
            phases[k] = phases.get(k, 0.0) + v
        phases["n"] = phases.get("n", 0) + 1
        return bs

    def pixels(k):
        return [
            t.permute(1, 2, 0).cpu().numpy()
            for t in decode_jpeg([src[o[j] : o[j + 1]] for j in range(k)], device="cuda")
        ]

    return step, pixels


_TS = {}


def _ts_fns():
    if not _TS:
        import torchvision.io  # noqa: F401  (registers torch.ops.image)

        @torch.jit.script
        def decode_flat(
            data: torch.Tensor, offs: list[int], device: torch.device
        ) -> tuple[torch.Tensor, torch.Tensor]:
            imgs = [data[offs[j] : offs[j + 1]] for j in range(len(offs) - 1)]
            outs = torch.ops.image.decode_jpegs_cuda(imgs, 3, device)
            hw = torch.tensor([[o.shape[1], o.shape[2]] for o in outs])
            return torch.cat([o.reshape(-1) for o in outs]), hw

        @torch.jit.script
        def decode_crop(data: torch.Tensor, offs: list[int], device: torch.device, size: int) -> torch.Tensor:
            imgs = [data[offs[j] : offs[j + 1]] for j in range(len(offs) - 1)]
            outs = torch.ops.image.decode_jpegs_cuda(imgs, 3, device)
            return torch.stack([o[:, :size, :size] for o in outs])

        @torch.jit.script
        def decode_into(
            src: torch.Tensor, offs: list[int], device: torch.device, size: int, out: torch.Tensor
        ) -> list[int]:
            imgs = [src[offs[j] : offs[j + 1]] for j in range(len(offs) - 1)]
            outs = torch.ops.image.decode_jpegs_cuda(imgs, 3, device)
            if size > 0:
                torch.stack([o[:, :size, :size] for o in outs], out=out)
                return [size]
            n = 0
            hw: list[int] = []
            for o in outs:
                out[n : n + o.numel()].copy_(o.reshape(-1))
                n += o.numel()
                hw += [o.shape[1], o.shape[2]]
            return hw

        _TS.update(flat=decode_flat, crop=decode_crop, into=decode_into)
    return _TS


def cand_ts_ring(flat, offs, bs, size, dense=False):
    """No Python tensor made or freed per batch: slices of one source tensor, outputs into a ring of 3 buffers."""
    into, dev, nb = _ts_fns()["into"], torch.device("cuda"), (len(offs) - 1) // bs
    src = torch.from_numpy(flat)
    rel = [[int(x) for x in offs[b * bs : (b + 1) * bs + 1]] for b in range(nb)]
    shape = (
        (bs, 3, size, size) if dense else (bs * 3 * size * (size * 3 // 2),)
    )  # crops' long side <= 1.34x short
    ring = [torch.empty(shape, dtype=torch.uint8, device=dev) for _ in range(3)]

    def step(i):
        into(src, rel[i % nb], dev, size if dense else 0, ring[i % 3])
        return bs

    def pixels(k):
        hw, res, at = into(src, rel[0], dev, 0, ring[0]), [], 0
        for h, w in list(zip(hw[0::2], hw[1::2]))[:k]:
            res.append(ring[0][at : at + 3 * h * w].view(3, h, w).permute(1, 2, 0).cpu().numpy())
            at += 3 * h * w
        return res

    return step, (None if dense else pixels)


def cand_ts(flat, offs, bs, size, dense=False, pinned=False):
    fns, dev, nb = _ts_fns(), torch.device("cuda"), (len(offs) - 1) // bs
    src = torch.from_numpy(flat)
    rel = [[int(x) for x in offs[b * bs : (b + 1) * bs + 1] - offs[b * bs]] for b in range(nb)]
    pin = torch.empty(
        int(max(offs[(b + 1) * bs] - offs[b * bs] for b in range(nb))), dtype=torch.uint8
    ).pin_memory()

    def run(b):
        data = src[int(offs[b * bs]) : int(offs[(b + 1) * bs])]
        if pinned:
            data = pin[: data.numel()].copy_(data)
        return fns["crop"](data, rel[b], dev, size) if dense else fns["flat"](data, rel[b], dev)

    def step(i):
        run(i % nb)
        return bs

    def pixels(k):
        out, hw = run(0)
        res, at = [], 0
        for h, w in hw.tolist()[:k]:
            res.append(out[at : at + 3 * h * w].view(3, h, w).permute(1, 2, 0).cpu().numpy())
            at += 3 * h * w
        return res

    return step, (None if dense else pixels)


class NvjpegCtypes:
    """libnvjpeg's batched decode through ctypes: header reads keep the GIL (PyDLL), the decode drops it once."""

    def __init__(self):
        from torchvision.io import decode_jpeg

        # libnvjpeg is mapped on torchvision's first CUDA decode: use the copy it loaded
        decode_jpeg([torch.from_numpy(np.frombuffer(_encode((0, 1, 64))[0], np.uint8).copy())], device="cuda")
        path = next(
            ln.split()[-1] for ln in open("/proc/self/maps") if re.search(r"/libnvjpeg(?!2k)[^/]*\.so", ln)
        )
        self.path, self.c, self.p = path, ctypes.CDLL(path), ctypes.PyDLL(path)
        self.h, self.st = ctypes.c_void_p(), ctypes.c_void_p()
        for backend in (3, 0):  # NVJPEG_BACKEND_HARDWARE, then DEFAULT (status 7: no engines)
            s = self.p.nvjpegCreateEx(backend, None, None, 0, ctypes.byref(self.h))
            if s == 0:
                self.backend = backend
                break
        self._chk(s, "nvjpegCreateEx")
        self._chk(self.p.nvjpegJpegStateCreate(self.h, ctypes.byref(self.st)), "nvjpegJpegStateCreate")
        info = self.p.nvjpegGetImageInfo
        info.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_void_p] * 4
        self.nc, self.ss = ctypes.c_int(), ctypes.c_int()
        self.w, self.hh = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        self.info = info
        self.dec = self.c.nvjpegDecodeBatched
        self.dec.argtypes = [ctypes.c_void_p] * 6

    @staticmethod
    def _chk(s, what):
        if s != 0:
            raise RuntimeError(f"{what}: nvjpeg status {s}")

    def decode(self, flat, offs):
        n, base = len(offs) - 1, flat.ctypes.data
        hw = np.empty((n, 2), np.int64)
        a_nc, a_ss, a_w, a_h = ctypes.byref(self.nc), ctypes.byref(self.ss), self.w, self.hh
        for j in range(n):
            self._chk(
                self.info(self.h, base + int(offs[j]), int(offs[j + 1] - offs[j]), a_nc, a_ss, a_w, a_h),
                "info",
            )
            hw[j, 0], hw[j, 1] = a_h[0], a_w[0]
        plane = hw[:, 0] * hw[:, 1]
        at = np.zeros(n + 1, np.int64)
        at[1:] = np.cumsum(3 * plane)
        out = torch.empty(int(at[-1]), dtype=torch.uint8, device="cuda")
        img = np.zeros(n, dtype=[("ch", np.uint64, 4), ("pitch", np.uint64, 4)])
        for c in range(3):
            img["ch"][:, c] = out.data_ptr() + at[:-1] + c * plane
            img["pitch"][:, c] = hw[:, 1]
        ptrs = (base + offs[:-1]).astype(np.uint64)
        lens = np.diff(offs).astype(np.uint64)
        self._chk(self.p.nvjpegDecodeBatchedInitialize(self.h, self.st, n, 1, 3), "init")  # NVJPEG_OUTPUT_RGB
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._chk(
            self.dec(self.h, self.st, ptrs.ctypes.data, lens.ctypes.data, img.ctypes.data, stream), "decode"
        )
        return out, hw


def cand_ctypes(flat, offs, bs, size):
    nv, nb = NvjpegCtypes(), (len(offs) - 1) // bs
    batches = [offs[b * bs : (b + 1) * bs + 1] for b in range(nb)]

    def step(i):
        nv.decode(flat, batches[i % nb])
        return bs

    def pixels(k):
        out, hw = nv.decode(flat, offs[: k + 1])
        res, at = [], 0
        for h, w in hw.tolist():
            res.append(out[at : at + 3 * h * w].view(3, h, w).permute(1, 2, 0).cpu().numpy())
            at += 3 * h * w
        return res

    return step, pixels


def cand_dali(flat, offs, bs, size, dense=False, threads=4):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    o, nb, it = offs.tolist(), (len(offs) - 1) // bs, [0]

    def source():
        lo = (it[0] % nb) * bs
        it[0] += 1
        return [flat[o[j] : o[j + 1]] for j in range(lo, lo + bs)]

    @pipeline_def(batch_size=bs, num_threads=threads, device_id=0, prefetch_queue_depth=2)
    def pipe_fn():
        jpegs = fn.external_source(source=source, batch=True, dtype=types.UINT8, ndim=1)
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        return fn.resize(images, resize_x=size, resize_y=size) if dense else images

    pipe = pipe_fn()
    pipe.build()
    dst = torch.empty((bs, size, size, 3), dtype=torch.uint8, device="cuda") if dense else None

    def step(i):
        (out,) = pipe.run()
        if dense:
            feed_ndarray(out.as_tensor(), dst, cuda_stream=torch.cuda.current_stream())
        return bs

    def pixels(k):  # must run first: the pipeline's first batch is images 0..bs-1
        (out,) = pipe.run()
        cpu = out.as_cpu()
        return [np.array(cpu.at(j)) for j in range(k)]

    return step, (None if dense else pixels)


def cand_nvimgcodec(flat, offs, bs, size, cached=False):
    from nvidia import nvimgcodec

    kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY)
    dec = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(k) for k in kinds])
    o, nb, prev = offs.tolist(), (len(offs) - 1) // bs, {}
    streams = [nvimgcodec.CodeStream(flat[o[j] : o[j + 1]]) for j in range(len(o) - 1)] if cached else None
    if cached:
        sum(s.height for s in streams)  # header read once, kept in each CodeStream

    def run(b):
        lo = b * bs
        if cached:
            imgs = dec.decode(streams[lo : lo + bs], images=prev.get("imgs"))
            prev["imgs"] = imgs
            return imgs
        srcs = [flat[o[j] : o[j + 1]] for j in range(lo, lo + bs)]
        try:
            return dec.decode(srcs)
        except TypeError:  # a version that takes CodeStreams only
            return dec.decode([nvimgcodec.CodeStream(s) for s in srcs])

    def step(i):
        run(i % nb)
        return bs

    def pixels(k):
        return [torch.as_tensor(im, device="cuda").cpu().numpy() for im in run(0)[:k]]

    return step, pixels


def pixel_check(pixels, flat, offs, k=64):
    from PIL import Image

    got = pixels(k)
    diffs = []
    for j, g in enumerate(got):
        ref = np.asarray(Image.open(io.BytesIO(flat[offs[j] : offs[j + 1]].tobytes())).convert("RGB"))
        if g.shape != ref.shape:
            return {"error": f"image {j}: shape {g.shape} vs Pillow {ref.shape}"}
        diffs.append(np.abs(g.astype(np.int16) - ref.astype(np.int16)))
    return {"mean_abs": float(np.mean([d.mean() for d in diffs])), "max": int(max(d.max() for d in diffs))}


CANDS = {  # name -> (factory, kwargs, switch interval)
    "tv": (cand_tv, {}, None),
    "tv_sw5e-4": (cand_tv, {}, 5e-4),
    "tv_sw1e-4": (cand_tv, {}, 1e-4),
    "ts_flat": (cand_ts, {}, None),
    "ts_flat_pinned": (cand_ts, {"pinned": True}, None),
    "ts_crop": (cand_ts, {"dense": True}, None),
    "ts_ring_flat": (cand_ts_ring, {}, None),
    "ts_ring_crop": (cand_ts_ring, {"dense": True}, None),
    "ctypes_nvjpeg": (cand_ctypes, {}, None),
    "dali": (cand_dali, {}, None),
    "dali_resize": (cand_dali, {"dense": True}, None),
    "nvimgcodec": (cand_nvimgcodec, {}, None),
    "nvimgcodec_cached": (cand_nvimgcodec, {"cached": True}, None),
}


def _cell(rows, b):
    if b not in rows:
        return "-"
    return f"{rows[b]['img_s']:,.0f}" + (f" ({rows[b]['busy_frac']:.2f})" if b != "alone" else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--secs", type=float, default=1.5)
    ap.add_argument("--only", default=",".join(CANDS))
    ap.add_argument("--sizes", default="128,256")
    ap.add_argument("--busy", default="spin,torch")
    a = ap.parse_args()
    import torchvision

    meta = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": sys.version.split()[0],
        "switchinterval": sys.getswitchinterval(),
    }
    for mod in ("nvidia.dali", "nvidia.nvimgcodec"):
        try:
            meta[mod] = __import__(mod, fromlist=["x"]).__version__
        except Exception as e:
            meta[mod] = f"missing: {e}"
    print(json.dumps(meta), flush=True)
    data = {}
    for short in [int(s) for s in a.sizes.split(",")]:  # before CUDA starts: the encoders fork
        t0 = time.perf_counter()
        data[short] = make_jpegs(a.images, short)
        print(
            f"{a.images} JPEGs at {short} px: {data[short][0].nbytes / a.images:.0f} B each, {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    meta["gpu"] = torch.cuda.get_device_name()
    res = {
        "meta": meta,
        "busy_alone": {k: busy_alone(k, 1.0) for k in a.busy.split(",")},
        "rows": [],
        "pixels": {},
    }
    print("busy alone", res["busy_alone"], flush=True)
    for short, (flat, offs) in data.items():
        bs = 512 if short == 128 else 256
        for name in a.only.split(","):
            fac, kw, switch = CANDS[name]
            phases = {}
            try:
                step, pixels = (
                    fac(flat, offs, bs, short, phases, **kw)
                    if fac is cand_tv
                    else fac(flat, offs, bs, short, **kw)
                )
                if pixels and short == 256 and name not in res["pixels"]:
                    res["pixels"][name] = pixel_check(pixels, flat, offs)
                for busy in [None, *a.busy.split(",")]:
                    if switch and not busy:
                        continue
                    phases.clear()
                    r = measure(step, busy, a.secs, switch)
                    r.update(cand=name, px=short, bs=bs, beside=busy or "alone")
                    if busy:
                        r["busy_frac"] = r["busy_rate"] / res["busy_alone"][busy]
                    if phases.get("n"):
                        r["phases_ms"] = {k: 1e3 * v / phases["n"] for k, v in phases.items() if k != "n"}
                    res["rows"].append(r)
                    print(json.dumps(r), flush=True)
            except Exception as e:
                res["rows"].append({"cand": name, "px": short, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{name} @{short}: {type(e).__name__}: {e}", flush=True)
            json.dump(res, open(f"{a.out}/gil_probe.json", "w"), indent=1)
    print("\npixels vs Pillow (256 px, 64 images):", json.dumps(res["pixels"]))
    busy = a.busy.split(",")
    print(
        "\n| candidate | px | alone img/s | "
        + " | ".join(f"beside {b} img/s ({b} kept)" for b in busy)
        + " |"
    )
    print("|---|---:|---:|" + "---:|" * len(busy))
    for name in a.only.split(","):
        for short in [int(s) for s in a.sizes.split(",")]:
            rows = {r.get("beside"): r for r in res["rows"] if r["cand"] == name and r["px"] == short}
            if any("error" in r for r in rows.values()) or not rows:
                print(
                    f"| {name} | {short} | {next(iter(rows.values()), {}).get('error', 'not run')[:60]} | | |"
                )
                continue
            print(
                f"| {name} | {short} | "
                + " | ".join(_cell(rows, b) for b in ("alone", "spin", "torch"))
                + " |"
            )


if __name__ == "__main__":
    main()
