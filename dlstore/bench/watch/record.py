"""The observer, and what it saw as one JSON-able record (``raw_document``, written per rank).

Every DataLoader iteration is timed in ``__next__`` with ``time.perf_counter`` only, CUDA events at batch
hand-overs (read at the end, never synchronised on the way), workers' CPU and memory sampled from /proc by
a thread; at a pause, the loop's own batches are replayed to it (its rate with data free), then batches
from a second loader with the advised workers (``trial.py``). Those stand-ins take real batches' places,
so every epoch still yields ``len(loader)`` batches.

Per step: ``t_call`` (next() called), ``t_ret`` (the batch handed over), ``t_next`` (the following call).
Wait = t_ret − t_call; host work = t_next − t_ret; device span = hand-over event to the next call's event.
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import threading
import time
from dataclasses import asdict
from typing import Any

import torch
from torch.utils.data import DataLoader

from dlstore.bench.monitor import memory_kb, process_cpu_s
from dlstore.bench.watch import WatchConfig, rank_info, trial
from dlstore.bench.watch.describe_loop import batch_images, dataset_info, loader_settings
from dlstore.bench.watch.launch import inject
from dlstore.bench.watch.trial import MIN_TIMED, Window, cap_for
from dlstore.machine import usable_cores

FED = ("replay", "trial")  # steps watch fed the loop itself (not the user's loader's batches)
NEVER = float("inf")  # a step count never reached (no pause or stop due)
NVML_EVERY = 4  # GPU utilisation on one sampler tick in 4 (every 2 s at the default 0.5 s)


class WatchStop(SystemExit):
    """Raised from ``next()`` once ``--steps`` steps were observed: a clean exit, past ``except Exception``."""


class LoaderRecord:
    """Everything seen of one DataLoader, across its epochs (one ``__iter__`` call = one epoch)."""

    def __init__(self, index: int, loader: Any, config: WatchConfig, t0: float) -> None:
        self.index, self.loader, self.config, self.t0 = index, loader, config, t0
        self.settings = loader_settings(loader)
        self.epoch_len: int | None = self.settings["batches_per_epoch"]
        self.start = config.replay_start(self.epoch_len) if self.epoch_len is not None else NEVER
        self.dataset = dataset_info(getattr(loader, "dataset", None))
        self.t_call: list[float] = []
        self.t_ret: list[float] = []
        self.t_next: list[float | None] = []
        self.phase: list[str] = []
        self.epoch: list[int] = []
        self.events: list[tuple[int, Any, Any]] = []  # (step, hand-over event, next-call event or None)
        self.epochs: list[dict[str, Any]] = []
        self.kept: collections.deque[Any] = collections.deque(maxlen=config.replay_batches)
        self.sample_batch: Any = None
        self.images: int | None = None
        # real steps; pauses begun (one per replay round, the first also times the parts and the trial)
        self.real = self.pauses = self.replay_index = self.refill_left = 0
        self.mode: str | None = None  # "replay" or "trial" while watch feeds the loop
        self.paused = False  # every pause is done
        self.gate: float = 0  # real steps before which no pause or stop is due (``Session.set_gate``)
        self.keep_from: float = NEVER  # real steps after which batches are kept for the next replay round
        self.window: Any = None  # the current replay round's Window
        self.parts: dict[str, Any] | None = None  # the side measurement, once made (at the pause)
        self.trial: Any = None  # the running trial.Trial
        self.trial_info: dict[str, Any] | None = None
        self.window_warm: list[int] = []  # steps of the replay's and the trial's warm-up
        self.worker_cpu: dict[int, float] = {}  # pid → last CPU seconds seen (dead workers keep theirs)
        self.worker_samples: list[list[float | None]] = []  # [t, Σ CPU s, rss MB, pss MB, shared MB, n]
        self.iterators: list[Any] = []

    def new_epoch(self, it: Any) -> int:
        t = time.perf_counter() - self.t0
        self.epochs.append({"epoch": len(self.epochs), "first_step": len(self.t_call), "t_iter": t})
        # persistent workers: every epoch's iter() returns the same iterator, kept once (not summed twice)
        kept = [i for i in self.iterators if i is not it and getattr(i, "_workers", None)]
        self.iterators = [*kept, it]
        return len(self.epochs) - 1

    def worker_pids(self) -> list[int]:
        pids: dict[int, None] = {}
        for it in list(self.iterators):
            for w in list(getattr(it, "_workers", None) or ()):
                with contextlib.suppress(AssertionError, ValueError):  # not our child, or closed
                    if getattr(w, "pid", None) and w.is_alive():
                        pids[w.pid] = None
        return list(pids)


class WatchedIterator:
    """Wraps a DataLoader iterator; ``__next__`` times the call and decides replay and stop."""

    def __init__(self, session: Session, record: LoaderRecord, it: Any) -> None:
        self._session, self._record, self._it = session, record, it
        self._last: int | None = None
        self._epoch = record.new_epoch(it)
        # this epoch's batches handed over (stand-ins included), and its stand-ins
        self._handed = self._stand_ins = 0

    def __iter__(self) -> WatchedIterator:
        return self

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:  # _workers, _num_yielded, ...: the real iterator's
        return getattr(self._it, name)

    def __next__(self) -> Any:
        t_call = time.perf_counter()
        rec, s = self._record, self._session
        cuda = s.cuda_in_use()
        if self._last is not None:
            rec.t_next[self._last] = t_call - rec.t0
            if cuda and rec.events and rec.events[-1][0] == self._last and rec.events[-1][2] is None:
                rec.events[-1] = (self._last, rec.events[-1][1], s.event())
        batch, phase = self._fetch(rec, t_call)
        self._handed += 1
        t_ret = time.perf_counter()
        i = len(rec.t_call)
        rec.t_call.append(t_call - rec.t0)
        rec.t_ret.append(t_ret - rec.t0)
        rec.t_next.append(None)
        rec.phase.append(phase)
        rec.epoch.append(self._epoch)
        self._last = i
        if cuda and i % rec.config.event_every == 0 and len(rec.events) < rec.config.max_event_steps:
            rec.events.append((i, s.event(), None))
        s.after_step(rec, batch, phase)
        return batch

    def _full(self) -> bool:
        """Every place in this epoch is taken; its length read now (a batch sampler's may change)."""
        try:
            return self._handed >= len(self._it)
        except TypeError:  # no length: no pause was made (``LoaderRecord.start``)
            return False

    def _fetch(self, rec: LoaderRecord, t_call: float) -> tuple[Any, str]:
        s = self._session
        # the common step: nothing fed, no pause or stop due before ``gate`` real steps: no checks
        while rec.mode is not None or rec.real >= rec.gate:
            if rec.mode is not None:
                if self._full():
                    break  # every place in this epoch is taken: it ends here; the window goes on in the next
                got = s.fed(rec, t_call)
                if got is not None:
                    self._stand_ins += 1
                    return got
                continue  # its window just ended: the next one, or the loop's own data
            if not rec.paused and s.should_pause(rec):
                s.pause(rec, t_call)
                continue
            if s.should_stop(rec):
                raise WatchStop(0)
            break  # past the gate with nothing due now (a stop waiting for a pause): this step is real
        try:
            if self._stand_ins and self._full():
                raise StopIteration  # the real batches whose places stand-ins took are never drawn
            batch = next(self._it)
        except StopIteration:
            rec.epochs[self._epoch].update(t_end=t_call - rec.t0, stand_ins=self._stand_ins)
            self._last = None
            raise
        return batch, s.phase_of(rec)


class Session:
    """One watch: patches ``DataLoader.__iter__`` (``install``) or wraps given loaders, and returns the raw
    record (``finish``) that ``analyse`` turns into a report."""

    def __init__(self, config: WatchConfig) -> None:
        self.config, self.world, self.t0 = config, rank_info()[1], time.perf_counter()
        self.records: dict[int, LoaderRecord] = {}
        self._original_iter: Any = None
        self._sampler: _Sampler | None = None
        self._profiler: Any = None
        self._profile_started, self._profiled, self._cuda = False, 0, False
        self.profile_trace: str | None = None
        self._cuda_possible: bool | None = None
        self.finished: dict[str, Any] | None = None

    def install(self) -> None:
        """Watch every DataLoader iterated from now on (subclasses included, unless they replace
        ``__iter__`` without calling it)."""
        if self._original_iter is not None:
            return
        original = DataLoader.__iter__
        session = self

        def __iter__(loader: Any) -> Any:
            inject(session, loader)  # --apply's settings, before the loader starts its workers
            return session.wrap(loader, original(loader))

        self._original_iter = original
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        self._start_sampler()

    def uninstall(self) -> None:
        if self._original_iter is not None:
            DataLoader.__iter__ = self._original_iter  # type: ignore[method-assign]
            self._original_iter = None

    def wrap(self, loader: Any, it: Any) -> Any:
        if isinstance(it, WatchedIterator):
            return it
        self._start_sampler()
        key = id(loader)
        if key not in self.records:
            self.records[key] = rec = LoaderRecord(len(self.records), loader, self.config, self.t0)
            self.set_gate(rec)
        return WatchedIterator(self, self.records[key], it)

    def cuda_in_use(self) -> bool:
        # once CUDA is up it stays up; whether it exists is asked once, at the first step (after the
        # script set its CUDA_VISIBLE_DEVICES): is_available() reads the environment at each call
        if not self._cuda:
            if self._cuda_possible is None:
                self._cuda_possible = torch.cuda.is_available()
            self._cuda = self._cuda_possible and torch.cuda.is_initialized()
        return self._cuda

    def event(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()  # on the current stream: asynchronous, no synchronisation
        return e

    def phase_of(self, rec: LoaderRecord) -> str:
        if rec.refill_left > 0:
            rec.refill_left -= 1
            return "refill"
        if len(rec.epochs) == 1 and len(rec.t_call) < self.config.warmup:
            return "warmup"
        return "profiled" if self._profiler is not None else "real"

    def should_pause(self, rec: LoaderRecord) -> bool:
        return self.config.pauses() and rec.real >= self.next_pause(rec)

    def next_pause(self, rec: LoaderRecord) -> int:
        """The real step count after which the next pause (replay round) begins."""
        return rec.start + rec.pauses * self.config.replay_every

    def set_gate(self, rec: LoaderRecord) -> None:
        """``rec.gate``: the real step count from which next() checks for a pause or the stop;
        ``rec.keep_from``: after which real batches are kept for the next replay round."""
        c = self.config
        pause = self.next_pause(rec) if c.pauses() and not rec.paused else NEVER
        rec.gate = min(pause, NEVER if c.steps is None else c.steps)
        rec.keep_from = pause - c.replay_batches if c.replay else NEVER

    def should_stop(self, rec: LoaderRecord) -> bool:
        c = self.config
        no_pause = rec.paused or not c.pauses() or rec.start == NEVER  # no len(): no pause, no stand-ins
        return c.steps is not None and rec.real >= c.steps and no_pause

    def pause(self, rec: LoaderRecord, t: float) -> None:
        """One pause of the loop: a replay round when batches were kept, then ``after_replay``."""
        c = self.config
        rec.pauses += 1
        rec.paused = rec.pauses >= c.pauses_total()
        self.set_gate(rec)
        if c.replay and rec.kept:
            rec.mode = "replay"
            fixed = self.world > 1  # ranks must take the same number of steps
            cap = cap_for(c.replay_steps, rec.epoch_len, MIN_TIMED + 1)
            rec.window = Window(len(rec.t_call), 1, c.replay_warmup_s, c.replay_s, cap, fixed)
        else:
            self.after_replay(rec)

    def fed(self, rec: LoaderRecord, t: float) -> tuple[Any, str] | None:
        """A batch watch feeds the loop (replayed, or the trial's), None when the current window ended."""
        if rec.mode == "replay":
            if rec.window.more(t):
                batch = rec.kept[rec.replay_index % len(rec.kept)]
                rec.replay_index += 1
                return batch, "replay"
            self.end_window(rec)
            self.after_replay(rec)
            return None
        got = trial.step(rec, t)
        if got is None:
            rec.mode = None
        return got

    def end_window(self, rec: LoaderRecord) -> None:
        """A replay or trial window is over (done, or the run ended inside it): its warm-up steps noted."""
        if rec.mode == "replay":
            rec.window_warm += rec.window.warm()
        elif rec.mode == "trial":
            trial.end(rec)
        rec.mode = None

    def after_replay(self, rec: LoaderRecord) -> None:
        """Still paused inside next(), nothing running beside it: the dataset's parts timed alone, then
        the trial of the workers advice (``trial.py``)."""
        c = self.config
        if c.parts and rec.parts is None:
            rec.parts = measure_record_parts(rec, self.cuda_in_use(), c.parts_budget_s)
        rec.kept.clear()  # the references held the batches' memory (pinned, shared) alive
        if c.trial and self.world == 1 and rec.pauses == 1:
            trial.start(self, rec)
        # the user's workers kept filling their queue meanwhile: the next steps drain it (at 0 workers
        # the next step's wait holds this pause's end)
        w = rec.settings["num_workers"]
        rec.refill_left = w * (rec.settings["prefetch_factor"] or 2) + 1 if w else 1

    def original_iter(self) -> Any:
        """``DataLoader.__iter__`` unwatched (a loader watch makes itself is not the user's)."""
        return self._original_iter if self._original_iter is not None else DataLoader.__iter__

    def after_step(self, rec: LoaderRecord, batch: Any, phase: str) -> None:
        if phase in FED:
            return
        rec.real += 1
        if rec.images is None:
            rec.images = batch_images(batch)
        if rec.real > rec.keep_from:
            rec.kept.append(batch)
        elif rec.sample_batch is None and phase != "warmup":
            rec.sample_batch = batch  # for the copy timing at the end
        if self.config.profile:
            self._profile_step(rec, phase)

    def _profile_step(self, rec: LoaderRecord, phase: str) -> None:
        if rec.index != 0:
            return
        if self._profiler is None and not self._profile_started and rec.real >= self.config.warmup:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda_in_use() else [])
            self._profile_started, self._profiled = True, 0
            self._profiler = profile(activities=acts)
            self._profiler.__enter__()
        elif self._profiler is not None and phase == "profiled":
            self._profiled += 1
            if self._profiled >= self.config.profile_steps:
                self._stop_profiler()

    def _stop_profiler(self) -> None:
        prof, self._profiler = self._profiler, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        if self.config.result_dir:
            path = os.path.join(self.config.result_dir, f"trace-rank{os.environ.get('RANK', '0')}.json")
            prof.export_chrome_trace(path)
            self.profile_trace = path

    def _start_sampler(self) -> None:
        if self._sampler is None:
            self._sampler = _Sampler(self, self.config.sample_interval_s)
            self._sampler.start()

    def finish(self, status: str, exit_code: int | None = None, error: str | None = None) -> dict[str, Any]:
        """Stop watching and return the raw record: the steps, device spans, samples and parts."""
        if self.finished is not None:
            return self.finished
        self.uninstall()
        try:
            self._stop_profiler()
        except Exception as e:  # a failed trace export must not lose the record
            self.profile_trace = f"failed: {e}"
        if self._sampler is not None:
            self._sampler.stop()
        for rec in self.records.values():
            self.end_window(rec)
        self.finished = raw_document(self, status, exit_code, error)
        return self.finished


class _Sampler(threading.Thread):
    """Every ``interval`` seconds: the watched loaders' worker CPU and memory, the main process's CPU, and
    GPU utilisation through NVML when pynvml imports. Off the training thread."""

    def __init__(self, session: Session, interval: float) -> None:
        super().__init__(name="dlstore-watch-sampler", daemon=True)
        self.session, self.interval, self.halt = session, interval, threading.Event()
        self.main_cpu: list[list[float | None]] = []
        self.gpu_util: list[list[float]] = []
        self.nvml: Any = None
        self.nvml_tried, self.ticks = False, 0

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        s = self.session
        t = time.perf_counter() - s.t0
        self.main_cpu.append([t, process_cpu_s(os.getpid())])
        for rec in list(s.records.values()):
            _sample_workers(rec, t)
        self.ticks += 1
        # NVML's queries contend with kernel launches: one sample in NVML_EVERY (it reads the driver's own
        # average). CUDA's state is the main thread's flag, never asked here: from this thread a query
        # would initialise CUDA before the script set CUDA_VISIBLE_DEVICES
        if not self.nvml_tried and s._cuda:
            self.nvml_tried = True
            self.nvml = _nvml_handle()
        if self.nvml is not None and self.ticks % NVML_EVERY == 1:
            try:
                self.gpu_util.append([t, float(self.nvml[0].nvmlDeviceGetUtilizationRates(self.nvml[1]).gpu)])
            except Exception:
                self.nvml = None


def _sample_workers(rec: LoaderRecord, t: float) -> None:
    rss = pss = shared = 0.0
    pids = rec.worker_pids()
    seen = 0  # workers whose memory was readable: one that is exiting has none, which is not 0 MB
    for pid in pids:
        cpu = process_cpu_s(pid)
        if cpu is not None:
            rec.worker_cpu[pid] = max(cpu, rec.worker_cpu.get(pid, 0.0))
        mem = memory_kb(pid)
        if mem["rss_kb"] and mem["pss_kb"] is not None:  # smaps read, and not empty (exiting)
            seen += 1
            rss, pss = rss + mem["rss_kb"] / 1024, pss + mem["pss_kb"] / 1024
            shared += (mem["shared_kb"] or 0) / 1024
    if not pids and not rec.worker_cpu:
        return
    memory: list[float | None] = [rss, pss, shared] if seen else [None, None, None]
    rec.worker_samples.append([t, sum(rec.worker_cpu.values()), *memory, float(len(pids))])


def _nvml_handle() -> tuple[Any, Any] | None:
    """(pynvml, handle of this process's CUDA device) or None: NVML is optional."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        p = torch.cuda.get_device_properties(index)
        bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        try:
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            return None


VERSION = 1


def raw_document(
    session: Session, status: str, exit_code: int | None, error: str | None, side: bool = True
) -> dict[str, Any]:
    """The record; ``side=False``: what was observed only (no parts, probes or --try-cache timed now:
    the trial's decision mid-loop)."""
    rank, world = rank_info()
    cuda = session.cuda_in_use()
    sampler = session._sampler
    doc: dict[str, Any] = {"version": VERSION, "status": status, "exit_code": exit_code, "error": error}
    doc.update(rank=rank, world_size=world, cuda=cuda, cores=usable_cores(), torch=torch.__version__)
    doc["device_label"] = torch.cuda.get_device_name() if cuda else platform.processor() or "CPU"
    doc.update(python=platform.python_version(), profile_trace=session.profile_trace)
    doc["config"] = {k: v for k, v in asdict(session.config).items() if k != "result_dir"}
    doc.update(main_cpu=sampler.main_cpu if sampler else [], gpu_util=sampler.gpu_util if sampler else [])
    doc.update(nvml=bool(sampler and sampler.nvml is not None), loaders=[])
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
    same = "index settings dataset t_call t_ret t_next phase epoch epochs worker_samples".split()
    return {
        **{name: getattr(rec, name) for name in same},
        "images_per_batch": rec.images or rec.settings.get("batch_size"),
        "device_s": device,
        "device_gap_s": gap,
        "tried": tried(rec, session.config),
        "window_warm": list(rec.window_warm),
        "trial": rec.trial_info,
        "parts": parts,
    }


def tried(rec: LoaderRecord, config: WatchConfig) -> dict[str, Any]:
    """Whether the replay and the in-loop trial ran long enough to be timed: True, False (then ``why`` and
    ``how``), or None where not asked for."""
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
    """Per step: the device span (hand-over to the next call) and the device's wait for data (that call to
    the next hand-over). The one synchronisation of the watch, after the loop."""
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
