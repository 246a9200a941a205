"""``dlstore watch --apply``: the script watched, then run again with the advised DataLoader settings put into
its training loader (no edit to the script) through watch's ``DataLoader.__iter__`` hook, and the rate it
then reached beside the rate predicted. The settings are the advice's ``settings`` fields (in watch.json);
the loader is the one the advice was for: the same position among the loaders the script iterates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dlstore.bench.watch.config import WatchConfig, WatchError, rank_info
from dlstore.bench.watch.watch_report import cell, compare, compare_text, summary


def advised_settings(report: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The DataLoader settings the advice names (the first advice, the largest gain, wins where two name
    one setting), and the advice they come from."""
    settings: dict[str, Any] = {}
    used = [a for a in report.get("advice") or [] if a.get("settings")]
    for a in used:
        for name, value in a["settings"].items():
            settings.setdefault(name, value)
    return settings, used


def inject(session: Any, loader: Any) -> None:
    """Before every ``iter(loader)`` in the watched child: on the advised loader's first iteration, put the
    advised settings in place of the script's (the DataLoader reads them when it starts workers)."""
    plan = session.config.apply
    if plan is None or id(loader) in session.records or len(session.records) != plan["loader"]:
        return
    s = plan["settings"]
    workers = int(s.get("num_workers", loader.num_workers))
    values = {
        "num_workers": workers,
        "prefetch_factor": s.get("prefetch_factor", loader.prefetch_factor or 2) if workers else None,
        "pin_memory": bool(s.get("pin_memory", loader.pin_memory)),
        "persistent_workers": bool(s.get("persistent_workers", loader.persistent_workers)) and workers > 0,
    }
    for name, value in values.items():
        object.__setattr__(loader, name, value)  # DataLoader refuses persistent_workers after __init__


def watch_and_apply(
    argv: list[str], config: WatchConfig, out: Path | None, stdout_to_stderr: bool, apply: bool = True
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, int]:
    """(the first run's report, with ``applied`` when ``apply``; the second run's report or None; the last
    run's exit code). With ``config.steps``, both runs stop after that many steps."""
    from dlstore.bench.watch.launch import run_watch

    if apply and rank_info()[1] > 1:
        raise WatchError("--apply runs the script twice: not under torchrun (apply the advice by hand)")
    first, code = run_watch(argv, config, out, stdout_to_stderr)
    if not apply or first is None:
        return first, None, code
    settings, used = advised_settings(first)
    if code != 0 or not settings:
        why = f"the script ended with exit code {code}" if code else "no advice changes a DataLoader setting"
        if code == 0 and any(a.get("cache") for a in first.get("advice") or ()):
            why += " (a cache is applied by converting: --try-cache times one)"
        first["applied"] = {"skipped": f"{why}: nothing was applied"}
        return first, None, code
    plan = {"loader": first["primary"], "settings": settings}
    # the trial tries more workers: with them applied it has nothing left to try
    again = replace(config, apply=plan, trial=False, try_cache=False)
    second, code = run_watch(argv, again, None if out is None else out / "applied", stdout_to_stderr)
    assert second is not None
    first["applied"] = applied_summary(first, second, plan, used)
    return first, second, code


def applied_summary(
    first: dict[str, Any], second: dict[str, Any], plan: dict[str, Any], used: list[dict[str, Any]]
) -> dict[str, Any]:
    """The second run's steady rate on the advised loader beside the largest predicted rate of the advice
    applied, and the first run's rate."""
    before, after = summary(first, plan["loader"]), summary(second, plan["loader"])
    reached = all(after.get(k) == v for k, v in plan["settings"].items())
    predicted = max(a["expected_img_per_s"] or 0.0 for a in used) or None
    measured = after["img_per_s"] if reached else None
    return {
        "loader": plan["loader"],
        "settings": plan["settings"],
        "advice": [a["text"] for a in used],
        # what the advice says to change in the script's own code is not applied (only the loader is)
        "not_applied": [a["command"].split(";", 1)[1].strip() for a in used if ";" in a["command"]],
        "before_img_per_s": before["img_per_s"],
        "predicted_img_per_s": predicted,
        "measured_img_per_s": measured,
        "error": measured / predicted - 1 if measured and predicted else None,
        "reached": reached,
        "exit_code": second["exit_code"],
    }


def apply_text(first: dict[str, Any], second: dict[str, Any] | None) -> str:
    """What was applied, measured beside predicted, then the two runs side by side (``compare``)."""
    a = first["applied"]
    if second is None:
        return f"--apply: {a['skipped']}."
    what = ", ".join(f"{k}={v}" for k, v in a["settings"].items())
    if not a["reached"]:
        line = (
            f"--apply: {what} did not reach DataLoader #{a['loader']} in the second run (the script "
            "iterated its loaders in another order, or made a new one): no measurement."
        )
    else:
        line = (
            f"--apply: the script re-ran with {what} in DataLoader #{a['loader']}: measured "
            f"{cell('img_per_s', a['measured_img_per_s'])} img/s, predicted "
            f"{cell('img_per_s', a['predicted_img_per_s'])}"
            + (f" ({100 * a['error']:+.0f}%)" if a["error"] is not None else "")
            + "".join(f"; not applied (a change to your code): {c}" for c in a["not_applied"])
        )
    return line + "\n" + compare_text(compare(first, second, ("as written", "applied")))
