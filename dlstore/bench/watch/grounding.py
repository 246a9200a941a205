"""``--try-cache``'s measurement beside its prediction: the tried loader's per-batch times composed with
the loop's own step (the replay) through the bench's parts model. Pure functions over plain data."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dlstore.bench.advice import plural
from dlstore.bench.predict import LoaderTiming, LoopParts, compose, prediction_error


def tried_parts(parts: LoopParts, tried: dict[str, Any]) -> LoopParts:
    """The observed loop with its loader replaced by one timed alone (``probes.time_batches``: a tried
    or probed cache loader, or the loop's loader at other workers), and the GPU augmentation's device time
    added to the step's when the advice moved the augmentation there."""
    workers = int(tried["workers"])
    if workers == 0:  # in the caller: next() and the augmentation's launch are the main thread's
        loader = LoaderTiming(tried["main_s"], tried["main_s"], tried["main_s"], in_caller=True)
    else:  # the main thread's share: its CPU in next() (the hand-over); the CPU: the workers' and that
        cpu = tried.get("workers_cpu_s")
        cpu = tried["period_s"] * workers if cpu is None else cpu  # older records: a full core each
        loader = LoaderTiming(tried["period_s"], tried["main_s"], cpu + tried["main_s"], in_caller=False)
    fed = parts.fed
    aug = tried.get("augment_device_s")
    if aug:  # the device's own time grows by it; a step bound by the host keeps its period (the main
        # thread's share above holds the augmentation's launch)
        device = (fed.device_s or 0.0) + aug
        period = max(fed.period_s, device) if fed.device_s is not None else fed.period_s + aug
        fed = replace(fed, period_s=period, device_s=device)
    return replace(parts, workers=workers, loader=loader, fed=fed)


def ground(advice: dict[str, Any], parts: LoopParts, tried: dict[str, Any]) -> None:
    """Put the try's figures on the cache advice (``tried``) and say them in its text."""
    if "skipped" in tried:
        advice["tried"] = tried
        advice["text"] += f" (--try-cache: {tried['skipped']}.)"
        return
    rate = compose(tried_parts(parts, tried)).img_per_s
    expected = advice.get("expected_img_per_s")
    advice["grounded_img_per_s"] = rate  # the prediction with the tried loader measured, not modelled
    advice["tried"] = {
        **tried,
        "loop_img_per_s": rate,
        "error_vs_predicted": prediction_error(rate, expected) if expected else None,
    }
    how = plural(tried["workers"], "worker")
    if tried.get("gpu_augment"):
        how += " + GpuAugment"
    vs = f", predicted {expected:,.0f}" if expected else ""
    advice["text"] += (
        f" --try-cache: a sample of {plural(tried['images'], 'image')} converted in {tried['convert_s']:.1f} s; that "
        f"loader alone read {tried['loader_img_per_s']:,.0f} img/s at batch {tried['batch']} ({how}), "
        f"which with your step gives {rate:,.0f} img/s{vs}."
    )
