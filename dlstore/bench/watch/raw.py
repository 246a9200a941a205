"""The watched process's record as one JSON-able document (written per rank, read by the parent)."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

import torch

from dlstore.bench.watch.config import WatchConfig, rank_info
from dlstore.bench.watch.window import MIN_TIMED
from dlstore.machine import usable_cores

if TYPE_CHECKING:
    from dlstore.bench.watch.record import LoaderRecord, Session

VERSION = 1


def raw_document(
    session: Session, status: str, exit_code: int | None, error: str | None, t_end: float, side: bool = True
) -> dict[str, Any]:
    """The record; ``side=False``: what was observed only (no parts, probes or --try-cache timed now:
    the trial's decision mid-loop)."""
    rank, world = rank_info()
    cuda = session.cuda_in_use()
    sampler = session._sampler
    doc: dict[str, Any] = {
        "version": VERSION,
        "status": status,
        "exit_code": exit_code,
        "error": error,
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "wall_s": t_end,
        "cuda": cuda,
        "device_label": torch.cuda.get_device_name() if cuda else platform.processor() or "CPU",
        "cores": usable_cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {
            k: getattr(session.config, k)
            for k in (
                "steps",
                "warmup",
                "replay",
                "replay_steps",
                "replay_batches",
                "replay_s",
                "replay_warmup_s",
                "replay_rounds",
                "replay_every",
                "trial",
                "trial_s",
                "profile",
                "try_cache",
            )  # fmt: skip
        },
        "main_cpu": sampler.main_cpu if sampler else [],
        "gpu_util": sampler.gpu_util if sampler else [],
        "nvml": bool(sampler and sampler.nvml is not None),
        "profile_trace": session.profile_trace,
        "loaders": [],
    }
    for rec in session.records.values():
        doc["loaders"].append(loader_document(rec, session, cuda, status == "interrupted", side))
    if not side:
        return doc
    if session.config.parts and status != "interrupted" and rank == 0:  # rank 0 reports: its probes
        from dlstore.bench.watch.probes import attach_probes

        try:
            attach_probes(doc, session)
        except Exception as e:  # advice only: a failed probe must not lose the record of the loop
            doc["probes_error"] = f"{type(e).__name__}: {e}"
    if session.config.try_cache and status != "interrupted" and rank == 0:  # one try: rank 0's
        from dlstore.bench.watch.try_cache import attach_try_cache

        attach_try_cache(doc, session)
    return doc


def loader_document(
    rec: LoaderRecord, session: Session, cuda: bool, interrupted: bool, side: bool = True
) -> dict[str, Any]:
    device, gap = device_spans(rec) if cuda else (None, None)
    parts = rec.parts
    if parts is None and side and session.config.parts and rec.t_call and not interrupted:
        parts = measure_record_parts(rec, cuda, session.config.parts_budget_s)
    return {
        "index": rec.index,
        "settings": rec.settings,
        "dataset": rec.dataset,
        "images_per_batch": rec.images or rec.settings.get("batch_size"),
        "t_call": rec.t_call,
        "t_ret": rec.t_ret,
        "t_next": rec.t_next,
        "phase": rec.phase,
        "epoch": rec.epoch,
        "device_s": device,
        "device_gap_s": gap,
        "epochs": rec.epochs,
        "worker_samples": rec.worker_samples,
        "replayed": rec.replayed,
        "stand_in_steps": sum(1 for p in rec.phase if p in ("replay", "trial")),
        "tried": tried(rec, session.config),
        "window_warm": list(rec.window_warm),
        "trial": rec.trial_info,
        "parts": parts
        if parts is not None
        else {
            "skipped": "interrupted" if interrupted else "not measured yet" if not side else "not measured"
        },
    }


def tried(rec: LoaderRecord, config: WatchConfig) -> dict[str, Any]:
    """Whether the replay (the rate with data free) and the in-loop trial (the workers advice's rate) ran
    long enough to be timed: ``True``, ``False`` (then ``why`` and ``how``), or None where not asked for
    (off, or no trial advised)."""
    warm = set(rec.window_warm)
    timed = {
        p: sum(1 for i, q in enumerate(rec.phase) if q == p and i not in warm) for p in ("replay", "trial")
    }
    out: dict[str, Any] = {
        "pause_at": None if rec.epoch_len is None else rec.start,
        "replay": timed["replay"] >= MIN_TIMED if config.replay else None,
        "trial": timed["trial"] >= MIN_TIMED if rec.trial_info or (config.trial and not rec.pauses) else None,
        "why": None,
        "how": None,
    }
    if False not in (out["replay"], out["trial"]):
        return out
    if rec.epoch_len is None:
        out["why"] = (
            "the loader has no len(), so watch cannot keep its epochs' length while it feeds the loop"
        )
        return out
    if not rec.pauses:
        out["why"] = f"the run ended after {rec.real} real steps, before watch's pause at step {rec.start}"
    elif (rec.trial_info or {}).get("skipped"):
        out["why"] = rec.trial_info["skipped"]
    else:
        out["why"] = "the run ended inside the pause, before enough of its steps were timed"
    out["how"] = (
        "run the script longer (more epochs or more data): watch needs about "
        f"{config.replay_warmup_s + config.replay_s + config.trial_s:.0f} s of steps after step {rec.start}"
    )
    return out


def device_spans(rec: LoaderRecord) -> tuple[list[float | None], list[float | None]]:
    """Per step: the stream's time from the batch's hand-over to the next next() call (the step's device
    span), and from that call to the following hand-over (the device's wait for data). Events are read
    here, once: the one synchronisation of the watch, after the loop."""
    n = len(rec.t_call)
    span: list[float | None] = [None] * n
    gap: list[float | None] = [None] * n
    try:
        if rec.events:
            torch.cuda.synchronize()
        for k, (i, start, end) in enumerate(rec.events):
            if end is None:
                continue
            span[i] = start.elapsed_time(end) / 1e3
            if k + 1 < len(rec.events) and rec.events[k + 1][0] == i + 1:
                gap[i] = end.elapsed_time(rec.events[k + 1][1]) / 1e3
    except RuntimeError:  # a CUDA error in the script: the device spans are lost, the host timings kept
        return [None] * n, [None] * n
    return span, gap


def measure_record_parts(rec: LoaderRecord, cuda: bool, budget: float) -> dict[str, Any]:
    from dlstore.bench.watch.parts import measure_parts

    batch = rec.sample_batch if rec.sample_batch is not None else (rec.kept[0] if rec.kept else None)
    try:
        return measure_parts(rec.loader, batch, cuda, budget)
    except Exception as e:  # the side measurement is advice; the record of the loop matters more
        return {"skipped": f"the side measurement failed: {type(e).__name__}: {e}"}
