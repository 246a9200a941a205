"""``dlstore watch --compare A B``: two runs' ``watch.json`` side by side (settings, rates, wait share,
binding stage) and which was faster, by how much."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dlstore.bench.watch.config import WatchError

SETTINGS = ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor", "batch_size")
ROWS = {
    **{k: k for k in SETTINGS},
    "img_per_s": "img/s",
    "data_free_img_per_s": "img/s with data free",
    "wait_share": "data wait share",
    "binds": "binds",
    "steps": "steps observed",
}


def load_report(path: Path) -> dict[str, Any]:
    """A watch report from ``watch.json`` or from the ``--out`` folder that holds it."""
    file = path / "watch.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise WatchError(
            f"{file}: not a watch.json ({e}); give a file or folder written by watch --out"
        ) from e
    if not isinstance(doc, dict) or "loaders" not in doc or "verdict" not in doc:
        raise WatchError(f"{file}: not a watch.json (no loaders or verdict); give one written by watch --out")
    return doc


def summary(report: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """A loader's figures (the training loader's unless ``index``): its settings, steady and data-free
    rates, wait share, binding."""
    index = report.get("primary") if index is None else index
    rep = next((r for r in report["loaders"] if r["index"] == index), None)
    if rep is None:
        return {"img_per_s": None}
    steady = rep.get("steady") or {}
    return {
        **{k: rep["settings"].get(k) for k in SETTINGS},
        "img_per_s": steady.get("img_per_s"),
        "wait_share": steady.get("wait_share"),
        "data_free_img_per_s": (rep.get("model") or {}).get("data_free_img_per_s"),
        "binds": (rep.get("binding") or {}).get("stage"),
        "steps": rep["steps_observed"],
    }


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Both summaries and the verdict: B's rate against A's."""
    sa, sb = summary(a), summary(b)
    ra, rb = sa["img_per_s"], sb["img_per_s"]
    change = rb / ra - 1 if ra and rb else None
    if change is None:
        verdict = "No rate to compare: a run observed no steady step."
    else:
        word = "faster" if change >= 0 else "slower"
        verdict = f"{names[1]} vs {names[0]}: {abs(100 * change):.0f}% {word} ({rb:,.0f} vs {ra:,.0f} img/s)."
    return {"names": list(names), "a": sa, "b": sb, "change": change, "verdict": verdict}


def compare_text(result: dict[str, Any]) -> str:
    """A short table, one row per figure, then the verdict."""
    rows = [("", *result["names"])]
    for key, label in ROWS.items():
        rows.append((label, cell(key, result["a"].get(key)), cell(key, result["b"].get(key))))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}" for r in rows]
    return "\n".join([*lines, result["verdict"]])


def cell(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key == "wait_share":
        return f"{100 * value:.1f}%"
    if key.endswith("img_per_s"):
        return f"{value:,.0f}"
    return str(value)
