"""The watched process's record as one JSON-able document (written per rank, read by the parent)."""

from __future__ import annotations

import collections
import os
import platform
from dataclasses import asdict
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
        "config": {k: v for k, v in asdict(session.config).items() if k != "result_dir"},
        "main_cpu": sampler.main_cpu if sampler else [],
        "gpu_util": sampler.gpu_util if sampler else [],
        "nvml": bool(sampler and sampler.nvml is not None),
        "profile_trace": session.profile_trace,
        "loaders": [],
    }
    for rec in session.records.values():
        doc["loaders"].append(loader_document(rec, session, cuda, status == "interrupted", side))
    if not side or status == "interrupted" or rank != 0:  # rank 0 reports: its probes and try
        return doc
    from dlstore.bench.watch.probes import attach_probes, attach_try_cache

    if session.config.parts:
        try:
            attach_probes(doc, session)
        except Exception as e:  # advice only: a failed probe must not lose the record of the loop
            doc["probes_error"] = f"{type(e).__name__}: {e}"
    if session.config.try_cache:
        attach_try_cache(doc, session)
    return doc


def loader_document(
    rec: LoaderRecord, session: Session, cuda: bool, interrupted: bool, side: bool = True
) -> dict[str, Any]:
    device, gap = device_spans(rec) if cuda else (None, None)
    parts = rec.parts or {
        "skipped": "interrupted" if interrupted else "not measured" + ("" if side else " yet")
    }
    if rec.parts is None and side and session.config.parts and rec.t_call and not interrupted:
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
        "tried": tried(rec, session.config),
        "window_warm": list(rec.window_warm),
        "trial": rec.trial_info,
        "parts": parts,
    }


def tried(rec: LoaderRecord, config: WatchConfig) -> dict[str, Any]:
    """Whether the replay (the rate with data free) and the in-loop trial (the workers advice's rate) ran
    long enough to be timed: True, False (then ``why`` and ``how``), or None where not asked for (off,
    or no trial advised)."""
    warm = set(rec.window_warm)
    timed = collections.Counter(p for i, p in enumerate(rec.phase) if i not in warm)
    replay = timed["replay"] >= MIN_TIMED if config.replay else None
    trial = timed["trial"] >= MIN_TIMED if rec.trial_info or (config.trial and not rec.pauses) else None
    why = how = None
    if False in (replay, trial):
        need = config.replay_warmup_s + config.replay_s + config.trial_s
        how = f"run the script longer (more epochs or data): watch needs about {need:.0f} s of steps after step {rec.start}"
        if rec.epoch_len is None:
            why, how = "the loader has no len(): watch cannot feed the loop and keep its epochs' length", None
        elif not rec.pauses:
            why = f"the run ended after {rec.real} real steps, before watch's pause at step {rec.start}"
        else:
            why = (rec.trial_info or {}).get(
                "skipped"
            ) or "the run ended inside the pause, before enough was timed"
    pause_at = None if rec.epoch_len is None else rec.start
    return {"pause_at": pause_at, "replay": replay, "trial": trial, "why": why, "how": how}


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
    from dlstore.bench.watch.loop_parts import measure_parts

    batch = rec.sample_batch if rec.sample_batch is not None else (rec.kept[0] if rec.kept else None)
    try:
        return measure_parts(rec.loader, batch, cuda, budget)
    except Exception as e:  # the side measurement is advice; the record of the loop matters more
        return {"skipped": f"the side measurement failed: {type(e).__name__}: {e}"}
