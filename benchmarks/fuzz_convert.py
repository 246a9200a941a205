"""Time-boxed byte-mutation fuzzing of JPEG/PNG/WebP through dlstore's convert path.

Each case mutates a valid seed file (random byte flips, inserted/deleted runs, truncation) and runs
``decode_file`` on it under the same per-file timeout the converter uses. Outcomes: ``decoded``,
``ImageDecodeError`` (grouped by the underlying exception class, which must be one of DECODE_ERRORS),
``timeout`` (reported as ImageDecodeError by the converter), or ``crash`` (anything else). Every
``--batch`` cases the mutated files also go through a real small ``convert`` (2 workers), which must
finish with those files skipped and reported. The slowest single decode is recorded.

    python benchmarks/fuzz_convert.py --seconds 120 --out benchmarks/results/fuzz_convert.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from dlstore.errors import ImageDecodeError  # noqa: E402
from dlstore.spec import ImagePolicy  # noqa: E402
from dlstore.write.imageops import DECODE_ERRORS, decode_file  # noqa: E402
from dlstore.write.unit_work import DecodeTimeout, time_limit  # noqa: E402

SUFFIX = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp"}


def seeds(rng: np.random.Generator) -> list[tuple[str, bytes]]:
    out = []
    for fmt, kw in (
        ("JPEG", {"quality": 85}),
        ("JPEG", {"quality": 70, "progressive": True}),
        ("PNG", {}),
        ("PNG", {"optimize": True}),
        ("WEBP", {"quality": 80}),
        ("WEBP", {"lossless": True}),
    ):
        arr = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        arr = np.asarray(Image.fromarray(arr).resize((96, 72), Image.BICUBIC))
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt, **kw)
        out.append((fmt, buf.getvalue()))
    return out


def mutate(data: bytes, rnd: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.random()
        i = rnd.randrange(len(b)) if b else 0
        if op < 0.55 and b:
            b[i] = rnd.randrange(256)
        elif op < 0.7:
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
        elif op < 0.85 and b:
            del b[i : i + rnd.randint(1, 64)]
        elif b:
            v = rnd.choice([0, 0xFF, 0x7F, 0x80])
            b[i : i + 4] = bytes([v] * 4)
    if rnd.random() < 0.2 and len(b) > 1:
        b = b[: rnd.randrange(1, len(b))]
    return bytes(b)


def classify(path: Path, policy: ImagePolicy, timeout: float) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        with time_limit(timeout, hard=False):
            decode_file(path, policy)
        outcome = "decoded"
    except ImageDecodeError as e:
        cause = e.__cause__
        if isinstance(cause, DecodeTimeout):
            outcome = "timeout"
        elif isinstance(cause, DECODE_ERRORS):
            outcome = f"ImageDecodeError/{type(cause).__name__}"
        else:
            outcome = f"crash: ImageDecodeError from {type(cause).__name__}"
    except DecodeTimeout:
        outcome = "timeout"
    except Exception as e:  # noqa: BLE001 - that is what we are counting
        outcome = f"crash: {type(e).__name__}: {e}"
        traceback.print_exc()
    return outcome, time.perf_counter() - t0


def convert_batch(files: list[Path], work: Path, timeout: float) -> dict[str, Any]:
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    (src / "fuzz").mkdir(parents=True)
    (src / "good").mkdir()
    Image.new("RGB", (20, 20), (1, 2, 3)).save(src / "good" / "ok.png")
    for f in files:
        shutil.copy(f, src / "fuzz" / f.name)
    try:
        r = harness.convert_cache(
            src,
            work / "cache",
            format="npz",
            size=16,
            workers=2,
            overwrite=True,
            max_bad=1.0,
            decode_timeout=timeout,
        )
        return {"ok": True, "n": r.n, "skipped": r.n_skipped}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--timeout", type=float, default=10.0, help="per-file decode limit, as in convert")
    ap.add_argument("--batch", type=int, default=400, help="cases per real convert run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    seed_files = seeds(np.random.default_rng(args.seed))
    policy = ImagePolicy(size=32)
    counts: dict[str, Counter[str]] = {fmt: Counter() for fmt in SUFFIX}
    slowest = (0.0, "")
    converts: list[dict[str, Any]] = []
    t_end = time.monotonic() + args.seconds
    tried = 0
    with tempfile.TemporaryDirectory(prefix="fuzz_") as tmp:
        work = Path(tmp)
        batch: list[Path] = []
        while time.monotonic() < t_end:
            fmt, data = seed_files[tried % len(seed_files)]
            path = work / f"case{tried:07d}{SUFFIX[fmt]}"
            path.write_bytes(mutate(data, rnd))
            outcome, secs = classify(path, policy, args.timeout)
            counts[fmt][outcome] += 1
            slowest = max(slowest, (secs, f"{fmt} {outcome}"))
            tried += 1
            batch.append(path)
            if len(batch) >= args.batch:
                converts.append(convert_batch(batch, work, args.timeout))
                for p in batch:
                    p.unlink()
                batch = []
        for p in batch:
            p.unlink(missing_ok=True)
    crashes = sum(n for c in counts.values() for k, n in c.items() if k.startswith("crash"))
    doc = {
        "command": "python benchmarks/fuzz_convert.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core CPU, {platform.platform()}, Python {platform.python_version()}",
        "pillow": Image.__version__,
        "seconds": args.seconds,
        "per_file_timeout_s": args.timeout,
        "files_tried": tried,
        "crashes": crashes,
        "timeouts": sum(c["timeout"] for c in counts.values()),
        "slowest_decode_s": round(slowest[0], 3),
        "slowest_case": slowest[1],
        "by_format": {fmt: dict(sorted(c.items())) for fmt, c in counts.items()},
        "real_converts": {
            "runs": len(converts),
            "all_finished": all(c["ok"] for c in converts),
            "failures": [c for c in converts if not c["ok"]][:5],
        },
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        json.dumps({k: doc[k] for k in ("files_tried", "crashes", "timeouts", "slowest_decode_s")}),
        file=sys.stderr,
    )
    return doc


if __name__ == "__main__":
    sys.exit(1 if main()["crashes"] else 0)
