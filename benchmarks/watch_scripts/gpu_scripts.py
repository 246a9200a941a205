"""``dlstore watch`` on third-party training scripts and real photographs, against torch.profiler (see
README.md): ``imagenet`` (pytorch/examples ``imagenet/main.py``, ResNet-18, 4 workers), ``lightning``
(``lightning_resnet18.py``), ``timm`` (timm's ``train.py``, ResNet-50, 8 workers; ``resnet50.py`` when the
installed timm lacks a name it imports). Each: ``profiler_share.py``, ``dlstore watch --json --apply``, and a
cache advice applied by hand. ``$OUT/gpu_scripts.json`` and ``table.md`` are rewritten after every run.

    python gpu_scripts.py --out $OUT [--third-party DIR] [--photos DIR] [--budget-s 480] [--cases …]
    python gpu_scripts.py --out /tmp/o --cpu --quick    # the dry run

``--third-party`` defaults to the vendored, commit-pinned copies in tests/third_party.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing as mp
import re
import sys
import time
from pathlib import Path
from typing import Any

import accuracy as acc
from accuracy import HERE, Clock, dlstore_cli, run

sys.path.insert(0, str(acc.REPO / "benchmarks"))  # jpeg_cache, harness
WEIGHTS = {"imagenet": 0.4, "lightning": 0.35, "timm": 0.25}  # the budget's shares, unused time flows on


def make_data(root: Path, images: int, photos: Path | None) -> dict[str, Any]:
    """``root/train`` (``images`` crops of real photos in 10 classes) and a small ``root/val``, made once."""
    import jpeg_cache as jc

    if photos is not None:  # skimage.data's photo files, carried in: no scikit-image needed
        import numpy as np
        from PIL import Image

        arrays = [np.asarray(Image.open(p).convert("RGB")) for p in sorted(photos.glob("*.[pj][np]g"))]
        jc._photo_arrays = lambda: arrays  # the forked writers inherit it
    t = time.perf_counter()
    for split, n in (("train", images), ("val", max(20, images // 100))):
        if (root / split / "done").is_file():
            continue
        step = -(-n // jc.CORES)
        with mp.get_context("fork").Pool(jc.CORES) as pool:
            pool.map(jc._write_crops, [(a, min(n, a + step), str(root / split)) for a in range(0, n, step)])
        (root / split / "done").write_text(str(n))
    source = str(photos) if photos else "skimage.data"
    return {"root": str(root), "images": images, "photos": source, "make_s": time.perf_counter() - t}


def timm_ok(train: Path) -> str | None:
    """None when the installed timm has every name ``train.py`` imports from it, else the error."""
    code = [
        f"from {n.module} import {', '.join(a.name for a in n.names)}"
        for n in ast.parse(train.read_text()).body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("timm")
    ]
    p = run([sys.executable, "-c", "\n".join(code)], timeout=120)
    return None if p.returncode == 0 else p.stderr.strip().splitlines()[-1]


def cases(a: argparse.Namespace, data: Path) -> tuple[dict[str, tuple[Path, list[str]]], str | None]:
    """({name: (script, its arguments)}, why timm's train.py is not the timm case, if it is not)."""
    tp, q, b = a.third_party.resolve(), a.quick, str(a.batch)
    train = tp / "pytorch-image-models" / "train.py"
    cpu = a.cpu
    out: dict[str, tuple[Path, list[str]]] = {
        "imagenet": (tp / "examples" / "imagenet" / "main.py",
                     [str(data), "-a", "resnet18", "-j", "4", "-b", b, "--epochs", "3", "-p", "100000"]
                     + (["--no-accel"] if cpu else ["--gpu", "0"])),
        "lightning": (HERE / "lightning_resnet18.py",
                      [str(data / "train"), "--workers", "4", "--batch-size", b, "--epochs", "3"]
                      + (["--cpu", "--crop", "64"] if cpu else [])),
    }  # fmt: skip
    why = timm_ok(train) if train.is_file() else f"{train} missing"
    if why is None:
        out["timm"] = (train, ["--data-dir", str(data), "--train-split", "train", "--val-split", "val",
                               "--epochs", "3", "--model", "resnet18" if q else "resnet50", "-b", str(a.batch // 2),
                               "-j", "8", "--log-interval", "100000", "--output", "/tmp/gpu_scripts_timm"]
                       + (["--device", "cpu", "--no-prefetcher", "--img-size", "64"] if cpu else []))  # fmt: skip
    else:
        out["timm"] = (HERE / "resnet50.py", ["--workers", "8", "--batch-size", str(a.batch // 2), "--steps", "1000000"]
                       + (["--cpu", "--images", "16"] if cpu else []))  # fmt: skip
    return out, why


def with_workers(args: list[str], n: int) -> list[str]:
    """The script's arguments with its worker count (``-j N`` or ``--workers N``) set to ``n``."""
    i = next(i for i, x in enumerate(args) if x in ("-j", "--workers"))
    return [*args[: i + 1], str(n), *args[i + 2 :]]


def profiled(script: Path, args: list[str], a: argparse.Namespace, *extra: str) -> dict[str, Any] | None:
    cmd = [
        sys.executable,
        str(HERE / "profiler_share.py"),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
    ]
    p = run([*cmd, *extra, "--", str(script), *args])
    got = [
        json.loads(x)["profiler_share"] for x in p.stdout.splitlines() if x.startswith('{"profiler_share"')
    ]
    return got[-1] if got else {"error": p.stderr[-800:]}


def cache_by_hand(advice: dict[str, Any], script: Path, args: list[str], a: Any) -> dict[str, Any]:
    """The advised ``dlstore convert`` run, then the script reading the cache (its transform kept)."""
    plan = advice["cache"]
    m = re.search(r"dlstore convert (\S+) DEST (--size \d+[^;#]*)", advice["command"])
    if not m:
        return {"skipped": "no convert command in the advice"}
    dest = Path(a.data) / f"cache-s{plan['size']}"
    t = time.perf_counter()
    if not (dest / "dlstore.json").is_file():
        p = run([*dlstore_cli(), "convert", m.group(1), str(dest), *m.group(2).split()])
        if p.returncode:
            return {"skipped": f"convert failed: {p.stderr[-300:]}"}
    row: dict[str, Any] = {"convert": f"dlstore convert {m.group(1)} DEST {m.group(2).strip()}"}
    row["convert_s"] = time.perf_counter() - t
    extra = ["--no-profile", "--cache", str(dest)] + (["--in-memory"] if plan.get("in_memory") else [])
    if plan["gpu"]:  # as advised: the loader in the main process, the augmentation on the GPU
        kw = {k: v for k, v in plan["augment"].items() if k != "out_dtype"}
        extra += ["--gpu-augment", json.dumps(kw)]
        args = with_workers(args, 0)
    got = profiled(script, args, a, *extra) or {}
    if not got.get("cache"):
        return {**row, "skipped": f"the script read no ImageFolder the cache could replace: {got}"[:300]}
    row.update(measured_img_per_s=got.get("img_per_s"), predicted_img_per_s=advice["expected_img_per_s"])
    if row["measured_img_per_s"] and row["predicted_img_per_s"]:
        row["error"] = row["measured_img_per_s"] / row["predicted_img_per_s"] - 1
    return row


def measure(name: str, script: Path, args: list[str], a: Any, case: dict[str, Any], save: Any) -> None:
    case.update(script=str(script), args=args)
    case["profiler"] = profiled(script, args, a)
    save()
    watch = ["watch", "--json", "--apply", "--steps", str(a.steps), "--warmup", str(a.warmup)]
    p = run([*dlstore_cli(), *watch, "--out", str(a.out / name), "--", "python", str(script), *args])
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
    if not doc or not doc.get("loaders"):
        case["error"] = f"watch gave no report: {p.stderr[-800:]}"
        return
    rep = next(r for r in doc["loaders"] if r["index"] == doc["primary"])
    case["watch"] = {
        "verdict": doc["verdict"],
        "wait_share": rep["steady"]["wait_share"],
        "img_per_s": rep["steady"]["img_per_s"],
        "stage": (rep.get("binding") or {}).get("stage"),
        "advice": [{k: x.get(k) for k in ("text", "command", "expected_img_per_s")} for x in doc["advice"]],
        "applied": doc.get("applied"),
    }
    prof = (case["profiler"] or {}).get("wait_share")
    case["share_points"] = 100 * (rep["steady"]["wait_share"] - prof) if prof is not None else None
    save()
    cache = next((x for x in doc["advice"] if x.get("cache")), None)
    if cache is not None:
        case["cache"] = cache_by_hand(cache, script, args, a)


def table(results: dict[str, Any]) -> str:
    rows = ["| case | watch wait share | torch.profiler | Δ points | fix | predicted img/s | measured | error |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    num = lambda v: "" if v is None else f"{v:,.0f}"  # noqa: E731
    for name, c in results["cases"].items():
        w, pr = c.get("watch") or {}, c.get("profiler") or {}
        d = c.get("share_points")
        first = f"| {name} | {pct(w.get('wait_share'))} | {pct(pr.get('wait_share'))} | {'' if d is None else f'{d:+.1f}'}"
        fixes = []
        ap = w.get("applied") or {}
        if ap.get("settings"):
            what = ", ".join(f"{k}={v}" for k, v in ap["settings"].items())
            fixes.append((what, ap.get("predicted_img_per_s"), ap.get("measured_img_per_s"), ap.get("error")))
        elif ap:
            fixes.append(("--apply: " + ap.get("skipped", "")[:60], None, None, None))
        ch = c.get("cache") or {}
        if ch:
            fixes.append(("cache by hand" + (f": {ch['skipped'][:60]}" if "skipped" in ch else ""),
                          ch.get("predicted_img_per_s"), ch.get("measured_img_per_s"), ch.get("error")))  # fmt: skip
        for fix, p, m, e in fixes or [(c.get("error", "")[:60], None, None, None)]:
            rows.append(
                f"{first} | {fix} | {num(p)} | {num(m)} | {'' if e is None else f'{100 * e:+.0f}%'} |"
            )
            first = "| | | | "
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--third-party", type=Path, default=acc.REPO / "tests" / "third_party",
                    help="holds examples/imagenet/main.py and pytorch-image-models/train.py")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--cases", default="imagenet,lightning,timm")
    ap.add_argument("--data", default="/tmp/gpu_scripts_data", help="the photos' ImageFolder, made once")
    ap.add_argument("--photos", type=Path, help="skimage.data's photo files (else read with scikit-image)")
    ap.add_argument("--images", type=int, default=16_000)
    ap.add_argument("--steps", type=int, default=100, help="observed steps of each run (watch's --steps)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the dry run)")
    a = ap.parse_args()
    if a.quick:
        a.images, a.steps, a.warmup, a.batch = min(a.images, 160), min(a.steps, 8), min(a.warmup, 2), 8
    acc.CLOCK = Clock(a.budget_s)
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"argv": sys.argv[1:], "cases": {}}

    def save() -> None:
        results["wall_s"] = acc.CLOCK.elapsed()
        (a.out / "gpu_scripts.json").write_text(json.dumps(results, indent=1, default=str))
        (a.out / "table.md").write_text(table(results))

    results["data"] = make_data(Path(a.data), a.images, a.photos)
    todo, results["timm_fallback"] = cases(a, Path(a.data))
    save()
    names = [n for n in a.cases.split(",") if n in todo]
    for i, name in enumerate(names):
        left = acc.CLOCK.study_left()
        if left < 30:
            results.setdefault("skipped", []).extend(names[i:])
            break
        share = WEIGHTS[name] / sum(WEIGHTS[n] for n in names[i:])
        acc.CLOCK.start_case(max(30.0, left * share))
        print(f"[{acc.CLOCK.elapsed():6.1f} s] {name}", file=sys.stderr, flush=True)
        t, results["cases"][name] = time.monotonic(), {}
        try:
            measure(name, *todo[name], a, results["cases"][name], save)
        except Exception as e:  # one case's failure must not lose the others
            results["cases"][name]["error"] = f"{type(e).__name__}: {e}"
        results["cases"][name]["wall_s"] = time.monotonic() - t
        save()
    print(table(results))


if __name__ == "__main__":
    main()
