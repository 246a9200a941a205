"""From the raw record of a watched loop to the report: the steady numbers, the loop's parts composed
through the bench's parts model (``dlstore.bench.predict``), the binding stage, the verdict in the bench's
words and at most five recommendations ranked by predicted gain. Pure functions over plain data."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from dlstore.bench import advice as rules
from dlstore.bench.advice import fmt, item, plural
from dlstore.bench.predict import (
    FedTiming,
    LoaderTiming,
    LoopParts,
    Prediction,
    compose,
    over_epochs,
    prediction_error,
)
from dlstore.bench.watch.steps import by_phase, epoch_start_excess, slope, step_rows, window_max, window_mean

# A DataLoader worker's hand-over to the main thread (unpickling shared-memory handles): used only when
# the loop ran with 0 workers, so none was measured. ~0.1–1 ms per batch on the machines measured.
HANDOVER_S = 0.3e-3
DEVICE_BUSY = 0.95  # a replayed device span this share of the period: the device never idled
CACHE_READ_BYTES_PER_S = 4e9  # a RAM cache's gather + collate, about half of memcpy
WORKER_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

FAILED_EARLY = "The script failed before any DataLoader ran; fix the error above and run again."
NEVER_ITERATED = (
    "The script never iterated a torch.utils.data.DataLoader, so there is nothing to measure. A loader that "
    "is not a DataLoader (or a subclass that replaces __iter__ without calling it) is not seen: wrap it with "
    "`loader = dlstore.watch(loader)`."
)
STAGE_NAMES = {
    "read_s": "file read",
    "decode_s": "image decode",
    "transform_s": "CPU transform",
    "collate_s": "collate",
    "getitem_s": "the Dataset's __getitem__",
}


def analyse(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of one watch from each rank's raw document (rank 0 first)."""
    docs = sorted(docs, key=lambda d: d.get("rank", 0))
    main = docs[0]
    out: dict[str, Any] = {
        k: main.get(k) for k in ("status", "exit_code", "error", "cuda", "cores", "profile_trace")
    }
    out.update(device=main["device_label"] if main["cuda"] else "cpu", world_size=main.get("world_size", 1))
    out.update(notes=[], loaders=[])
    if not main["loaders"]:  # with an error, its traceback is above: the script's own failure
        out["notes"].append(FAILED_EARLY if main.get("error") else NEVER_ITERATED)
        out["verdict"] = out["notes"][0]
        out["recommendations"], out["advice"] = [], []
        return out
    out["loaders"] = [loader_report(ld, main) for ld in main["loaders"]]
    primary = max(out["loaders"], key=lambda r: r["steps_observed"])
    out["primary"] = primary["index"]
    out["ranks"] = rank_summary(docs) if len(docs) > 1 else None
    out["verdict"] = verdict(primary)
    out["detail"] = detail(primary, out["ranks"])
    out["advice"] = primary["advice"]
    out["recommendations"] = rules.recommendations(primary["advice"])
    out["notes"] += primary["notes"]
    return out


def loader_report(ld: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    rows = step_rows(ld)
    images = ld.get("images_per_batch")
    phases = by_phase(rows, images)
    fed = Counter(r["phase"] for r in rows)
    steady = phases.get("real") or phases.get("profiled") or phases.get("warmup")
    rep: dict[str, Any] = {
        "index": ld["index"],
        "settings": ld["settings"],
        "dataset": ld["dataset"],
        "images_per_batch": images,
        "steps_observed": len(rows) - fed["replay"] - fed["trial"],
        "steps_replayed": fed["replay"],
        "steps_trial": fed["trial"],
        "stand_in_steps": fed["replay"] + fed["trial"],  # in real batches' places
        "tried": ld.get("tried"),  # whether the replay and the trial were timed; if not, why and how
        "trial": ld.get("trial"),
        "epochs": len(ld.get("epochs", [])),
        "phases": phases,
        "steady": steady,
        "rows": rows,
        "notes": [],
        "advice": [],
    }
    if ld["settings"].get("keeps_state") is False:
        from dlstore.read.order import STATELESS_NOTE

        rep["notes"].append(STATELESS_NOTE)
    if steady is None:
        rep["notes"].append("No step of this loader completed: nothing to time.")
        return rep
    if "real" not in phases:
        rep["notes"].append(
            "Every observed step fell in the warm-up (first epoch's first steps): the numbers include "
            "start-up; run more steps (--steps) for a steady figure."
        )
    rep["resources"] = resources(ld, doc, steady)
    if "replay" in phases:
        rep["notes"].append(
            f"{plural(rep['steps_replayed'], 'step')} replayed on {doc['config']['replay_batches']} of the "
            "loop's own batches to time it with data free: the model trained on those repeated batches "
            "(turn this off with --no-replay)."
        )
    tried = trial_of(rep)
    if tried is not None:
        rep["notes"].append(
            f"{plural(rep['steps_trial'], 'step')} trained on real batches from a second DataLoader over the same "
            f"dataset with {plural(tried['workers'], 'worker')} (the in-loop trial of the workers advice, its first "
            f"{plural(tried['dropped'], 'step')} dropped as its queue filled; turn this off with --no-trial)."
        )
    elif (ld.get("trial") or {}).get("skipped"):
        rep["notes"].append(f"No in-loop trial: {ld['trial']['skipped']}.")
    parts = loop_parts(rep, ld, doc)
    if parts is None:
        return rep
    pred = compose(parts)
    rep["model"] = model_summary(parts, pred, rate_with_starts(phases, rep["images_per_batch"]))
    rep["binding"] = binding(rep, parts, pred, ld.get("parts") or {})
    rep["advice"] = rules.rank(advice(rep, parts, ld, doc))
    tried = trial_of(rep)
    if tried is not None and not any(a.get("workers") == tried["workers"] for a in rep["advice"]):
        rep["notes"].append(
            f"Tried in the loop with {plural(tried['workers'], 'worker')}: {fmt(tried['img_per_s'])} img/s (now "
            f"{fmt(steady['img_per_s'])}): more workers do not speed this loop up, so they are not advised."
        )
    if ld.get("try_cache") is not None:
        _ground_tried(rep, parts, ld["try_cache"])
    return rep


def _ground_tried(rep: dict[str, Any], parts: LoopParts, tried: dict[str, Any]) -> None:
    """--try-cache: its measurement beside the cache advice's prediction, or why there is none."""
    rep["try_cache"] = tried
    target = next((a for a in rep["advice"] if a.get("cache")), None)
    if target is not None:
        ground(target, parts, tried)
    elif "skipped" in tried:
        rep["notes"].append(f"--try-cache: {tried['skipped']}.")


def resources(ld: dict[str, Any], doc: dict[str, Any], steady: dict[str, Any]) -> dict[str, Any]:
    t0, t1 = steady["t_first_s"], steady["t_last_s"]
    ws = ld.get("worker_samples") or []
    return {
        "workers_cpu_cores": slope(ws, t0, t1, 1),
        "workers_rss_mb_max": window_max(ws, 2),
        "workers_pss_mb_max": window_max(ws, 3),
        "workers_shared_mb_max": window_max(ws, 4),
        "main_cpu_cores": slope(doc.get("main_cpu") or [], t0, t1, 1),
        "gpu_util_percent": window_mean(doc.get("gpu_util") or [], t0, t1, 1),
        "nvml": doc.get("nvml", False),
    }


def producer_cost(ld: dict[str, Any], rep: dict[str, Any]) -> dict[str, float | None]:
    """Per batch: the Dataset's and collate's CPU seconds from the side measurement, and the workers'
    CPU seconds per batch seen in /proc during the steady steps (the same work under the real load)."""
    p = ld.get("parts") or {}
    b = rep["images_per_batch"] or 0
    side = None
    if p.get("getitem_s") is not None and b:
        side = b * p["getitem_s"] + (p.get("collate_s") or 0.0)
    proc = None
    cores = (rep.get("resources") or {}).get("workers_cpu_cores")
    if cores and rep["settings"]["num_workers"]:
        proc = cores * rep["steady"]["period_s"]
    return {"side_s": side, "workers_s": proc}


def loop_parts(rep: dict[str, Any], ld: dict[str, Any], doc: dict[str, Any]) -> LoopParts | None:
    """The observed loop as the bench's parts: the loader (its per-batch period, the main thread's share,
    its CPU), the step fed with data free (the replay), the usable cores."""
    steady, phases = rep["steady"], rep["phases"]
    b = rep["images_per_batch"]
    if not b:
        rep["notes"].append("The batch size could not be read off the batches: no rates in images/s.")
        return None
    workers = rep["settings"]["num_workers"]
    cost = producer_cost(ld, rep)
    if workers == 0:
        wait = steady["wait_mean_s"]
        loader = LoaderTiming(period_s=wait, main_s=wait, cpu_s=wait, in_caller=True)
    else:
        per_batch = max(v for v in (cost["side_s"], cost["workers_s"], 0.0) if v is not None)
        if per_batch <= 0:  # nothing measured the workers: the loop's own wait bounds their period
            per_batch = steady["period_s"] * workers
        handover = steady["wait_p10_s"] or HANDOVER_S
        loader = LoaderTiming(period_s=per_batch / workers, main_s=handover, cpu_s=per_batch, in_caller=False)
        # each epoch of the script starts with its queue empty (and its workers started again unless
        # persistent): the first step's extra wait beyond one batch's build is that start-up
        excess = epoch_start_excess(rep["rows"], steady["wait_mean_s"]) or 0.0
        startup = max(0.0, excess + steady["wait_mean_s"] - per_batch)
        loader = over_epochs(loader, workers, _epoch(rep, doc, rep["stand_in_steps"]), startup)
    return LoopParts(
        batch=b,
        workers=workers,
        loader=loader,
        fed=fed_of(steady, phases.get("replay")),
        cores=max(1, doc["cores"]),
        step_on_host=not doc["cuda"],
    )


def fed_of(steady: dict[str, Any], replay: dict[str, Any] | None) -> FedTiming:
    """The step with data free: the replayed steps' period; without a replay, the steady steps' own work
    (host time, and the device span where it is longer). The main thread's own cost is the smaller of the
    two host times: in the replay the host also waits for the device once it runs ahead (back-pressure)."""
    host = steady["host_mean_s"] or 0.0
    if replay is not None:
        serial = min(host, replay["host_mean_s"] or host)
        return FedTiming(period_s=replay["period_s"], serial_s=serial, device_s=replay["device_mean_s"])
    device = steady["device_mean_s"]
    return FedTiming(period_s=max(host, device or 0.0), serial_s=host, device_s=device)


def rate_with_starts(phases: dict[str, Any], images: int | None) -> float | None:
    """The loop's rate over its real steps, later epochs' starts included: what the prediction (made over
    the script's epochs) is checked against; the steady figure leaves those starts out."""
    groups = [phases[k] for k in ("real", "start") if k in phases]
    steps = sum(g["steps"] for g in groups)
    seconds = sum(g["steps"] * g["period_mean_s"] for g in groups)
    return images * steps / seconds if images and seconds > 0 else None


def loop_rate(rep: dict[str, Any]) -> float | None:
    """The loop's rate as the script would time it over its real steps, epoch starts included (the steady
    figure leaves them out); the advice's gains and the lead sentence are against it."""
    measured = (rep.get("model") or {}).get("measured_img_per_s")
    return measured if measured else (rep.get("steady") or {}).get("img_per_s")


def model_summary(parts: LoopParts, pred: Prediction, measured: float | None) -> dict[str, Any]:
    return {
        "predicted_img_per_s": pred.img_per_s,
        "measured_img_per_s": measured,
        "prediction_error": prediction_error(measured, pred.img_per_s) if measured else None,
        "bottleneck": pred.bottleneck,
        "limits_ms": {k: 1e3 * v for k, v in pred.terms_s.items()},
        "data_free_img_per_s": parts.batch / parts.fed.period_s if parts.fed.period_s > 0 else None,
        "loader_img_per_s": parts.batch / parts.loader.period_s if parts.loader.period_s > 0 else None,
    }


def stage_split(p: dict[str, Any], images: int) -> dict[str, float]:
    """Per batch seconds of each measured stage: read, decode, transform, collate (or __getitem__ whole)."""
    out = {k: images * p[k] for k in ("read_s", "decode_s", "transform_s") if p.get(k) is not None}
    if "read_s" not in out and p.get("load_s") is not None:
        out["read_s"] = images * p["load_s"]  # a load we cannot split: read and decode together
    if not out and p.get("getitem_s") is not None:
        out["getitem_s"] = images * p["getitem_s"]
    if p.get("collate_s") is not None:
        out["collate_s"] = p["collate_s"]
    return out


def binding(rep: dict[str, Any], parts: LoopParts, pred: Prediction, p: dict[str, Any]) -> dict[str, Any]:
    """The stage that binds, in words a user acts on, e.g. "CPU transform: 4 workers reach 1,900 img/s,
    the step takes 9,800"."""
    model = rep["model"]
    stage = pred.bottleneck
    fed = parts.fed
    if stage == "host" and fed.device_s is not None and fed.device_s >= DEVICE_BUSY * fed.period_s:
        # the device ran the whole replayed period: the main thread's time there is its wait for the
        # device (back-pressure), not its own work, so the step's compute binds
        stage = "compute"
    stage = rules.named_stage(stage, loop_rate(rep), model["data_free_img_per_s"], parts.step_on_host)
    out: dict[str, Any] = {"stage": stage, "words": rules.STAGE_WORDS.get(stage, stage)}
    split = stage_split(p, parts.batch)
    if stage in ("transform", "cores") and split:
        key = max(split, key=lambda k: split[k])
        out["part"] = key.removesuffix("_s")
        name = STAGE_NAMES[key]
        if key == "transform_s":
            steps = [t["name"] for t in rep["dataset"].get("transforms", [])]
            name += f" ({', '.join(steps)})" if steps else ""
        out["part_share"] = split[key] / sum(split.values())
        who = plural(parts.workers, "worker") if parts.workers else "0 workers (the main thread)"
        part = f"{name}, {100 * out['part_share']:.0f}% of the loader's work,"
        if stage == "transform":  # the part the user changes; with too few cores, the cores are it
            out["words"] = part
        out["text"] = (
            f"{part.rstrip(',')}: {who} {'reaches' if parts.workers == 1 else 'reach'} "
            f"{fmt(model['loader_img_per_s'])} img/s, the step takes "
            f"{fmt(model['data_free_img_per_s'])}"
        )
    else:
        out["text"] = (
            f"{out['words']}: the step with data free runs {fmt(model['data_free_img_per_s'])} img/s, "
            f"the loader alone {fmt(model['loader_img_per_s'])}"
        )
    return out


def verdict(primary: dict[str, Any]) -> str:
    """The one sentence the report leads with."""
    steady, model, b = primary["steady"], primary.get("model"), primary.get("binding")
    if steady is None:
        return "No step completed: nothing to judge."
    if not model or not b:
        return f"The loop ran {fmt(steady['img_per_s'])} img/s and waited for data {100 * steady['wait_share']:.0f}% of the time."
    best = primary["advice"][0] if primary["advice"] else None
    return rules.lead(
        b["stage"], loop_rate(primary), model["data_free_img_per_s"], steady["wait_share"], best, b["words"]
    )


def detail(primary: dict[str, Any], ranks: dict[str, Any] | None) -> str:
    """The figures behind the lead sentence: the wait, the step with data free, the prediction for now."""
    steady = primary["steady"]
    if steady is None:
        return ""
    text = [
        f"The loop waited for data {100 * steady['wait_share']:.1f}% of its step time "
        f"({1e3 * steady['wait_mean_s']:.2f} ms of {1e3 * steady['period_s']:.2f} ms per step, p95 "
        f"{1e3 * steady['wait_p95_s']:.2f} ms) over {plural(steady['steps'], 'step')}."
    ]
    model = primary.get("model")
    if model:
        free = primary["phases"].get("replay")
        how = "timed on replayed batches" if free else "estimated from the step's own time (no replay)"
        if free and free.get("rounds"):
            each = ", ".join(fmt(r["img_per_s"]) for r in free["rounds"])
            how += f"; the median of {plural(len(free['rounds']), 'round')}: {each}"
        text.append(f"With data free the step runs {fmt(model['data_free_img_per_s'])} img/s ({how}).")
        if model["prediction_error"] is not None:
            text.append(
                f"The parts timed alone predict {fmt(model['predicted_img_per_s'])} img/s for this loop "
                f"(measured {100 * model['prediction_error']:+.0f}%)."
            )
    if ranks:
        text.append(
            f"Across {ranks['ranks']} ranks: data wait {100 * ranks['wait_share_mean']:.1f}% mean, "
            f"{100 * ranks['wait_share_max']:.1f}% on the slowest (rank {ranks['slowest_rank']})."
        )
    return " ".join(text)


def rank_summary(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's steady data-wait share and rate, their mean and the slowest rank."""
    per = []
    for d in docs:
        phases = [by_phase(step_rows(ld), ld.get("images_per_batch")) for ld in d["loaders"]]
        s = max(
            (p.get("real") or p.get("warmup") or {} for p in phases),
            key=lambda g: g.get("steps", 0),
            default={},
        )
        per.append(
            {"rank": d.get("rank", 0), "wait_share": s.get("wait_share"), "img_per_s": s.get("img_per_s")}
        )
    known = [r for r in per if r["wait_share"] is not None]
    slowest = max(known, key=lambda r: r["wait_share"]) if known else {"rank": None, "wait_share": None}
    return {
        "ranks": len(docs),
        "per_rank": per,
        "wait_share_mean": sum(r["wait_share"] for r in known) / len(known) if known else None,
        "wait_share_max": slowest["wait_share"],
        "slowest_rank": slowest["rank"],
    }


# -- recommendations ------------------------------------------------------------------------------------


def advice(
    rep: dict[str, Any], parts: LoopParts, ld: dict[str, Any], doc: dict[str, Any]
) -> list[dict[str, Any]]:
    now = loop_rate(rep)
    out = []
    for make in (_workers_advice, _persistent_advice, _pin_advice, _cache_advice):
        got = make(rep, parts, ld, doc, now)
        if got is not None:
            out.append(got)
    step = rules.step_advice(rep.get("binding", {}).get("stage", ""), doc["cuda"], now)
    tried = ld.get("tried") or {}
    if tried.get("trial") is False:  # the in-loop trial did not run long enough: its rate is a prediction
        for a in out:
            if a.get("workers"):
                a["not_tried"] = "; ".join(x for x in (tried.get("why"), tried.get("how")) if x)
    return out + ([step] if step else [])


def _advice(
    text: str, command: str | None, now: float | None, expected: float | None, what: str, **extra: Any
) -> dict[str, Any]:
    return item(text, command, expected / now if expected and now else None, expected, what=what, **extra)


def _epoch(rep: dict[str, Any], doc: dict[str, Any], stand_ins: int | None = None) -> int | None:
    """The batches between epoch starts in the run the prediction is checked against. Without --steps, the
    script's epochs. With --steps N the run is cut: its observed steps plus the stand-ins in their places
    (``stand_ins``: this run's; by default the replayed steps, all a re-run with the advice has) span a
    fraction of an epoch or a few; the rate is timed after the warm-up, so only the starts after it count,
    each over its share of those steps; none (a run within its first epoch) leaves no epoch term."""
    e = rep["settings"].get("batches_per_epoch")
    config = doc.get("config") or {}
    if not e or not config.get("steps"):
        return e
    spots = rep["steps_observed"] + (rep["steps_replayed"] if stand_ins is None else stand_ins)
    starts = (spots - 1) // e
    if starts < 1:
        return None
    return max(2, round((spots - min(config.get("warmup") or 0, e)) / starts))


def _rate(parts: LoopParts, epoch: int | None) -> float:
    """The rate of an advised loop over epochs of ``epoch`` batches (its workers persistent, as advised);
    None: no epoch start in the timed steps, the observed loop's own start-up left out too."""
    if epoch:
        loader = over_epochs(parts.loader, parts.workers, epoch, 0.0)
    else:
        loader = replace(parts.loader, refill_s=None, epoch_batches=None)
    return compose(replace(parts, loader=loader)).img_per_s


def _workers_advice(
    rep: dict[str, Any], parts: LoopParts, ld: dict[str, Any], doc: dict[str, Any], now: float
) -> dict[str, Any] | None:
    """More workers while cores are idle: N picked by composing each candidate with the loader's per-batch
    CPU cost spread over N workers (the fewest within 5% of the best), over the script's epochs; the
    predicted rate from the loader timed alone at N (``probes``) when it was, since workers contend for
    the cores, or the rate the loop reached with N in the in-loop trial."""
    cost = parts.loader.cpu_s if parts.workers else parts.loader.main_s
    if cost <= 0:
        return None
    cands = [n for n in WORKER_CHOICES if parts.workers < n <= max(1, parts.cores)]
    if not cands:
        return None
    main = parts.loader.main_s if parts.workers else HANDOVER_S
    e = _epoch(rep, doc)
    rates = {
        n: _rate(
            replace(parts, workers=n, loader=LoaderTiming(cost / n, main, cost + main, in_caller=False)), e
        )
        for n in cands
    }
    best = max(rates.values())
    n = next(k for k in cands if rates[k] >= best / rules.WORTH_FRACTION)
    tried = trial_of(rep)
    if tried is not None and tried["workers"] in cands:
        n = tried["workers"]  # the count tried in the loop (the advice at the pause named it)
    probe = _probe(ld, "workers")
    measured = probe is not None and probe.get("n") == n
    expected = _rate(tried_parts(parts, probe), e) if measured else rates[n]
    baseline = parts.batch / compose(parts).period_s  # a modelled rate against the model's rate now
    how = (
        f"; the loader alone at {plural(n, 'worker')}: {fmt(probe['loader_img_per_s'])} img/s"
        if measured
        else "; modelled, the loader not timed at that count"
    )
    if tried is not None and tried["workers"] == n:
        # the rate the loop itself reached with n workers, against the rate it runs now: both measured
        expected, baseline = tried["img_per_s"], now
        how = f"; tried in the loop: {plural(tried['steps'], 'timed step')} on a second DataLoader with {plural(n, 'worker')}"
    if expected < rules.WORTH_FRACTION * baseline:
        return None
    if e and not (tried is not None and tried["workers"] == n):
        how += f", over epochs of {plural(e, 'batch', 'batches')} each starting with an empty queue"
    busy = _cores_busy(rep)
    idle = f" ({busy:.1f} of {parts.cores} cores busy now)" if busy is not None else ""
    settings = {"num_workers": n, "persistent_workers": True, **({"pin_memory": True} if doc["cuda"] else {})}
    return _advice(
        f"Use {plural(n, 'DataLoader worker')}{idle}: predicted {fmt(expected)} img/s (now {fmt(now)}{how}).",
        rules.loader_code(settings),
        now,
        expected,
        plural(n, "DataLoader worker"),
        workers=n,
        settings=settings,
    )


def trial_of(rep: dict[str, Any]) -> dict[str, Any] | None:
    """The in-loop trial (``trial.py``) with its timed steps' summary, None when there was none."""
    info, timed = rep.get("trial"), rep["phases"].get("trial")
    if not info or "skipped" in info or timed is None or not timed.get("img_per_s"):
        return None
    return {**info, **timed}


def _probe(ld: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The advised loader's timings (``probes.attach_probes``), None when not probed or skipped."""
    got = (ld.get("probes") or {}).get(key)
    return got if got and "skipped" not in got else None


def _cores_busy(rep: dict[str, Any]) -> float | None:
    r = rep.get("resources") or {}
    vals = [v for v in (r.get("main_cpu_cores"), r.get("workers_cpu_cores")) if v is not None]
    return sum(vals) if vals else None


def _persistent_advice(
    rep: dict[str, Any], parts: LoopParts, ld: dict[str, Any], doc: dict[str, Any], now: float
) -> dict[str, Any] | None:
    """Workers restart at every epoch unless persistent: the first step's extra wait, spread over the epoch."""
    s = rep["settings"]
    if not s["num_workers"] or s["persistent_workers"] or not s.get("batches_per_epoch"):
        return None
    excess = epoch_start_excess(rep["rows"], rep["steady"]["wait_mean_s"])
    if not excess:
        return None
    period = rep["steady"]["period_s"] + excess / s["batches_per_epoch"]  # per batch, epoch start included
    now_epoch = parts.batch / period
    expected = parts.batch / max(parts.fed.period_s, period - excess / s["batches_per_epoch"])
    if expected < rules.WORTH_FRACTION * now_epoch:
        return None
    return _advice(
        f"Keep the workers between epochs: each epoch's first batch waited {1e3 * excess:.0f} ms more than "
        f"the steady steps (worker start-up): predicted {fmt(expected)} img/s over an epoch, start "
        f"included (now {fmt(now_epoch)} with it).",
        "DataLoader(..., persistent_workers=True)",
        now_epoch,
        expected,
        "persistent_workers=True",
        settings={"persistent_workers": True},
    )


def _pin_advice(
    rep: dict[str, Any], parts: LoopParts, ld: dict[str, Any], doc: dict[str, Any], now: float
) -> dict[str, Any] | None:
    """A pageable copy blocks the main thread for the whole transfer; a pinned one is asynchronous. The
    gain is the parts model's ratio with and without the saving, applied to the rate measured now (the
    model's own rate for an input-bound loop is not it)."""
    h2d = (ld.get("parts") or {}).get("h2d")
    if not doc["cuda"] or rep["settings"]["pin_memory"] or not h2d:
        return None
    saving = max(0.0, h2d["pageable_s"] - h2d["pinned_s"])
    fed = parts.fed
    period, serial = max(fed.device_s or 0.0, fed.period_s - saving), max(0.0, fed.serial_s - saving)
    faster = replace(parts, fed=replace(fed, period_s=period, serial_s=serial))
    expected = now * compose(faster).img_per_s / compose(parts).img_per_s
    if expected < rules.WORTH_FRACTION * now:
        return None
    text = (
        f"Pin the batches: the copy takes {1e3 * h2d['pageable_s']:.2f} ms pageable vs {1e3 * h2d['pinned_s']:.2f} "
        f"ms pinned ({h2d['bytes'] / 1e6:.1f} MB per batch): predicted {fmt(expected)} img/s."
    )
    code = "DataLoader(..., pin_memory=True); x = x.to('cuda', non_blocking=True)"
    return _advice(text, code, now, expected, "pin_memory=True", settings={"pin_memory": True})


def cache_size(transforms: list[dict[str, Any]]) -> tuple[int, str] | None:
    """The cache side S read off the user's transform: Resize's size, else CenterCrop's, else a random
    crop's plus the room ImageNet's recipe leaves around it (224 cut from 256)."""
    sized = {t["name"]: min(t["size"]) for t in transforms if t.get("size")}
    if "Resize" in sized:
        return sized["Resize"], f"Resize({sized['Resize']})"
    if "CenterCrop" in sized:
        return sized["CenterCrop"], f"CenterCrop({sized['CenterCrop']})"
    for name in (*rules.WHOLE_IMAGE_CROPS, "RandomCrop"):
        if name in sized:
            s = round(sized[name] * 256 / 224)
            return s, f"{name}({sized[name]}) with room around the crop"
    return None


def _cache_advice(
    rep: dict[str, Any], parts: LoopParts, ld: dict[str, Any], doc: dict[str, Any], now: float
) -> dict[str, Any] | None:
    """A dlstore cache removes the file read, decode and resize; with the random augmentation moved to
    the GPU (GpuAugment, with the user's parameters) the loader's CPU work is a gather from memory."""
    ds = rep["dataset"]
    src = ds.get("convert") or ({"source": ds["root"], "extra": ""} if ds.get("image_folder") else {})
    sized = cache_size(ds.get("transforms") or [])
    p = ld.get("parts") or {}
    if src.get("why"):
        rep["notes"].append(f"No cache advice: {src['why']}.")
    if not src.get("source") or sized is None or p.get("getitem_s") is None:
        return None
    size, why = sized
    random_steps = [t["name"] for t in ds["transforms"] if t.get("random")]
    gpu = doc["cuda"] and bool(random_steps)
    channels = 1 if "MNIST" in src["source"] else 3
    probe = _probe(ld, "cache")
    cached = tried_parts(parts, probe) if probe else _cached_parts(parts, p, size, channels, gpu)
    expected = _rate(cached, _epoch(rep, doc))
    if expected < rules.WORTH_FRACTION * now:
        return None
    plan = _cache_plan(size, channels, gpu, ds, parts.batch)
    command = rules.convert_command(src["source"], size, src["extra"], channels, plan["bytes"], plan["avail"])
    command = (f"{src['prepare']}; " if src.get("prepare") else "") + command[0]
    memory = ", in_memory=True" if plan["in_memory"] else ""
    whole = rules.crops_whole_image(ds["transforms"])
    caveat = rules.border_note(src["source"], size, src["extra"]) if whole else ""
    caveat += f" ({src['why_callable']}.)" if src.get("why_callable") else ""
    how = f"predicted {fmt(expected)} img/s"
    if gpu:
        text = (
            f"CPU augmentation ({', '.join(random_steps)}) on decoded files binds: cache the images pre-resized "
            f"(size {size}, from {why}) and augment on the GPU with the same parameters: {how} "
            f"({_cache_how(probe, gpu)}).{rules.not_reproduced(plan['missing'])}{caveat}"
        )
        code = f"ds = dlstore.CachedDataset(DEST{memory}); aug = {rules.augment_code(plan['augment'])}; x = aug(x.to('cuda', non_blocking=True))"
        what = "a dlstore cache with the augmentation on the GPU"
    else:
        split = stage_split(p, parts.batch)
        share = sum(v for k, v in split.items() if k in ("read_s", "decode_s")) / (sum(split.values()) or 1.0)
        text = (
            f"A dlstore cache pre-resized to {size} (from {why}) removes the file read and decode "
            f"({100 * share:.0f}% of the loader's work): {how} with your transforms kept ({_cache_how(probe, gpu)}).{caveat}"
        )
        code = f"ds = dlstore.CachedDataset(DEST, transform=your_transform, pil=True{memory})"
        what = "a dlstore cache"
    return _advice(text, f"{command}; {code}", now, expected, what, cache=plan)


def _cached_parts(parts: LoopParts, p: dict[str, Any], size: int, channels: int, gpu: bool) -> LoopParts:
    """The loop with a cache's loader, modelled: a gather from memory, plus the CPU transform kept
    where the augmentation stays on the CPU (then in the loop's own workers)."""
    b = parts.batch
    collate = (p.get("collate_s") or 0.0) * (0.2 if gpu else 1.0)
    cost = b * size * size * channels / CACHE_READ_BYTES_PER_S + collate
    if gpu:
        return replace(parts, workers=0, loader=LoaderTiming(cost, cost, cost, in_caller=True))
    cost += b * (p.get("transform_s") or 0.0)
    main = parts.loader.main_s if parts.workers else cost
    loader = replace(parts.loader, period_s=cost / max(1, parts.workers), cpu_s=cost, main_s=main)
    return replace(parts, loader=loader)


def _cache_how(probe: dict[str, Any] | None, gpu: bool) -> str:
    """How the cache prediction was made: its loader timed on synthetic images, or modelled."""
    if probe is None:
        return "modelled: the cache's gather alone, its loader not timed" + (
            ", the GPU augmentation's cost not included" if gpu else ""
        )
    aug = " + GpuAugment" if gpu else ""
    return (
        f"its loader{aug} timed on {plural(probe['images'], 'synthetic image')} of that shape: "
        f"{fmt(probe['loader_img_per_s'])} img/s alone"
    )


def _cache_plan(size: int, channels: int, gpu: bool, ds: dict[str, Any], b: int) -> dict[str, Any]:
    """The cache advice as data: what ``--try-cache`` converts and reads (the command's options and the
    snippet's GpuAugment arguments)."""
    from dlstore.formats import DEFAULT_FORMAT, get_format
    from dlstore.machine import available_memory

    augment, missing = rules.gpu_augment(ds["transforms"], size)
    needed = (ds.get("len") or 0) * size * size * channels or None
    avail = available_memory()[0]
    jpeg = rules.convert_command("S", size, "", channels, needed, avail)[1]
    return {
        "size": size,
        "channels": channels,
        "format": DEFAULT_FORMAT,
        "in_memory": get_format(DEFAULT_FORMAT).traits.loads_into_ram,
        "jpeg": jpeg,
        "bytes": needed,
        "avail": avail,
        "gpu": gpu,
        "augment": augment,
        "missing": missing if gpu else [],  # what GpuAugment cannot do of the user's transform
        "crop": augment["size"],
        "degrees": augment.get("degrees", 0.0),
        "batch": b,
    }


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
