"""The in-loop trial of the workers advice. After the replay, the loop is paused inside next(); the advice
is computed from what was observed so far, and when it says more workers, watch feeds the loop batches
from a second DataLoader over the same dataset with the advised workers (``probes.workers_kwargs``) for a
time (``trial_s``). Its first N × prefetch + 1 steps (the queue filling, the workers starting) are
dropped, the rest timed; then that loader is shut down and the user's own iterator goes on where it
paused. The trial's batches take the places of the user's (the epoch's length is unchanged).

Why in the loop: beside N busy workers the loop's own step slows too (a main thread that synchronises
every step contends with them), which no probe after the loop sees. The trial's rate is the prediction.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from dlstore.bench.watch.window import MIN_TIMED, Window, cap_for

if TYPE_CHECKING:
    from dlstore.bench.watch.record import LoaderRecord, Session


def advised_workers(session: Session, rec: LoaderRecord) -> int | None:
    """The worker count the advice computed from the record so far names, when more than the loop's."""
    from dlstore.bench.watch.analyse import analyse
    from dlstore.bench.watch.raw import raw_document

    doc = raw_document(session, "running", None, None, rec.now(), side=False)
    report = analyse([doc])
    mine = next((r for r in report["loaders"] if r["index"] == rec.index), None)
    if mine is None:
        return None
    n = next((int(a["workers"]) for a in mine["advice"] if a.get("workers")), None)
    return n if n is not None and n > int(rec.settings["num_workers"] or 0) else None


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
        warm = workers * self.prefetch + 1
        cap = cap_for(c.trial_steps, rec.epoch_len, warm + MIN_TIMED)
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
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def summary(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "prefetch_factor": self.prefetch,
            "steps": self.window.n,
            "dropped": len(self.window.warm()),
            "epochs": self.epochs,
            "first_step": self.window.first_step,
        }


def start(session: Session, rec: LoaderRecord) -> None:
    """Decide and start the trial (``rec.trial``); why not, in ``rec.trial_info``."""
    try:
        n = advised_workers(session, rec)
        if n is None:
            return
        rec.trial = Trial(session, rec, n)
    except Exception as e:  # advice only: the user's loop goes on with its own loader
        rec.trial_info = {"skipped": f"the trial could not start: {type(e).__name__}: {e}"}


def step(rec: LoaderRecord, t: float) -> tuple[Any, str] | None:
    """One trial step's batch, or None once the trial is over (then its loader is shut down)."""
    tr = rec.trial
    if tr is None:
        return None
    if tr.window.more(t):
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
