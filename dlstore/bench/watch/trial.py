"""The windows of steps watch feeds the loop (the replay's, the trial's), and the in-loop trial.

A window drops its first steps as warm-up, then times at least ``min_s`` (clocks wake over a data-bound
phase: a time, not a count), capped at half an epoch. Under torchrun the ranks take the same number of
steps (their all-reduces pair up): there a window counts steps only (``fixed``). The trial: at the pause,
when the advice says more workers, the loop is fed from a second DataLoader with them for ``trial_s``;
beside N busy workers the loop's own step slows too, which no probe after it sees.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlstore.bench.watch.record import LoaderRecord, Session

MIN_TIMED = 3  # timed steps at the least: one per block
FIXED_STEPS = 100  # a window's length in steps where it cannot follow the clock (torchrun)
FIXED_WARM = 10


class Window:
    """Steps ``first_step`` … of a record fed by watch: ``more(t)`` at each next() call says whether one
    more is fed; the first ones (at least ``warm_steps``, and ``warm_s`` seconds) are warm-up."""

    def __init__(
        self, first_step: int, warm_steps: int, warm_s: float, min_s: float, cap: int, fixed: bool = False
    ) -> None:
        self.first_step, self.cap = first_step, cap
        self.warm_steps, self.warm_s, self.min_s = warm_steps, warm_s, min_s
        if fixed:
            self.cap = min(cap, FIXED_STEPS)
            self.warm_steps, self.warm_s, self.min_s = min(FIXED_WARM, self.cap // 4), 0.0, float("inf")
        self.n = 0  # steps fed so far
        self.t0: float | None = None
        self.timed_from: int | None = None  # the first timed step, counted in the window
        self.t_timed = 0.0

    def more(self, t: float) -> bool:
        """At a next() call at ``t``: True to feed one more step; False when the window is over."""
        if self.t0 is None:
            self.t0 = t
        if self.timed_from is None and (
            (self.n >= self.warm_steps and t - self.t0 >= self.warm_s)
            or self.n >= max(self.warm_steps, self.cap // 4)
        ):
            self.timed_from, self.t_timed = self.n, t
        timed = self.timed_from is not None and self.n - self.timed_from >= MIN_TIMED
        if self.n >= self.cap or (timed and t - self.t_timed >= self.min_s):
            return False
        self.n += 1
        return True

    def warm(self) -> list[int]:
        """The record's step indices of the warm-up (all of the window's while none was timed)."""
        upto = self.n if self.timed_from is None else self.timed_from
        return list(range(self.first_step, self.first_step + upto))


def cap_for(steps: int, epoch_len: int | None, least: int) -> int:
    """A window's most steps: ``steps``, or half an epoch when that is fewer; never fewer than ``least``."""
    half = steps if epoch_len is None else max(1, epoch_len // 2)
    return max(least, min(steps, half))


def advised_workers(session: Session, rec: LoaderRecord) -> int | None:
    """The worker count the advice computed from the record so far names, when more than the loop's."""
    from dlstore.bench.watch.analyse import analyse
    from dlstore.bench.watch.record import raw_document

    doc = raw_document(session, "running", None, None, side=False)
    report = analyse([doc])
    mine = next((r for r in report["loaders"] if r["index"] == rec.index), None)
    if mine is None:
        return None
    n = next((int(a["workers"]) for a in mine["advice"] if a.get("workers")), None)
    return n if n is not None and n > int(rec.settings["num_workers"] or 0) else None


def trial_steps(workers: int, prefetch: int, steps: int, epoch_len: int | None) -> tuple[int, int]:
    """(warm-up, most steps) of a trial: its queue's filling dropped, then two rounds of the workers timed
    at the least, however short the epoch (they hand batches over in bursts, one each: fewer, timed
    inside one burst, read 3x the rate the loop then kept)."""
    warm = workers * prefetch + 1
    return warm, cap_for(steps, epoch_len, warm + max(MIN_TIMED, 2 * workers))


class Trial:
    """A second DataLoader of the loop's dataset with ``workers`` workers, fed to the loop step by step."""

    def __init__(self, session: Session, rec: LoaderRecord, workers: int) -> None:
        from torch.utils.data import DataLoader

        from dlstore.bench.watch.probes import workers_kwargs

        c = session.config
        kw = workers_kwargs(rec.loader, workers, session.cuda_in_use())
        self.workers = workers
        self.prefetch = int(kw.get("prefetch_factor") or 2)
        self._iter = session.original_iter()  # the DataLoader's own __iter__: this loader is not watched
        self.loader: Any = DataLoader(**kw)
        self.it: Any = self._iter(self.loader)
        self.epochs = 1
        warm, cap = trial_steps(workers, self.prefetch, c.trial_steps, rec.epoch_len)
        self.window = Window(len(rec.t_call), warm, 0.0, c.trial_s, cap, fixed=False)

    def batch(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:  # its epoch ended: a new one (persistent workers), as the loop's would
            self.it = self._iter(self.loader)
            self.epochs += 1
            return next(self.it)

    def close(self) -> None:
        """Shut the trial's workers down now (not at garbage collection)."""
        it, self.it, self.loader = self.it, None, None
        getattr(it, "_shutdown_workers", lambda: None)()

    def summary(self) -> dict[str, Any]:
        w = self.window
        out = {"workers": self.workers, "prefetch_factor": self.prefetch, "steps": w.n}
        return {**out, "dropped": len(w.warm()), "epochs": self.epochs, "first_step": w.first_step}


def start(session: Session, rec: LoaderRecord) -> None:
    """Decide and start the trial (``rec.trial``, fed from the next step); why not, in ``rec.trial_info``."""
    try:
        n = advised_workers(session, rec)
        if n is None:
            return
        rec.trial, rec.mode = Trial(session, rec, n), "trial"
    except Exception as e:  # advice only: the user's loop goes on with its own loader
        rec.trial_info = {"skipped": f"the trial could not start: {type(e).__name__}: {e}"}


def step(rec: LoaderRecord, t: float) -> tuple[Any, str] | None:
    """One trial step's batch, or None once the trial is over (then its loader is shut down)."""
    tr = rec.trial
    if tr is not None and tr.window.more(t):
        try:
            return tr.batch(), "trial"
        except Exception as e:  # a worker failed: end the trial, the loop continues on its own data
            end(rec, f"the trial's loader failed: {type(e).__name__}: {e}")
            return None
    end(rec)
    return None


def end(rec: LoaderRecord, failed: str | None = None) -> None:
    """The trial is over (its window done, its loader failed, or the run ended): its loader shut down."""
    tr, rec.trial = rec.trial, None
    if tr is None:
        return
    rec.trial_info = {"skipped": failed} if failed else tr.summary()
    rec.window_warm += tr.window.warm()
    with contextlib.suppress(Exception):  # its workers end with the process
        tr.close()
