"""How a batch is split between JPEG decode lanes, and what happens when a lane fails (pure logic).

The decode path decodes each JPEG batch with several lanes at once: CPU worker processes (the batch's
first part, decoded ahead), the GPU's hardware JPEG engines (nvImageCodec) and torchvision's batched
nvJPEG call. ``LaneSplit`` sets each lane's part of the next batch from its measured rate and the
loader's measured batch period. Each lane's time for ``n`` images is modelled as ``fixed + n / rate``
(a device call costs a fixed time however few images it has; a rate alone would read low for a lane
given a small part, which would then get less still), fitted by least squares with EWMA weights. Each
lane takes what it decodes in ``H = max(margin * period, T)``, ``T`` being the time in which all
lanes together decode the batch: loader-bound, all finish together; consumer-bound, the lanes are
filled in ``lanes`` order (cheapest for the step first) and the last takes the rest.

The model does not see what a lane costs the training step (it landed 4-9% below the best fixed
split), so the first lane's share is tuned on the loop's own batch-to-batch time (``ShareTuner``). A
lane that fails is dropped for good: its images go to the next live lane (``decode_parts``), counted
in ``rerouted``.

    split = LaneSplit(["cpu", "hw", "nvjpeg"])
    counts = split.counts(256)                 # {"cpu": ..., "hw": ..., "nvjpeg": ...}, summing to 256
    split.observe("hw", images=80, busy=0.004)  # after the batch: each lane's images and busy seconds
    split.period(0.011)                         # the consumer's batch period
    split.loop_period(0.012)                    # the loop's batch-to-batch time (in batch order)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

# EWMA weight of a new rate sample (about the last 4 batches count).
ALPHA = 0.25
# Consumer-bound: a lane is filled to what it decodes in MARGIN of a batch period (headroom for noise).
MARGIN = 0.85
# A last lane left with fewer than MIN_PART of a batch gives them to the lanes before it: a device
# decode call costs a fixed time on the batch's path however few images it has (a few images per
# nvJPEG call trained well below all-CPU decoding).
MIN_PART = 0.1
# A lane decoded ahead (the CPU processes) that the loader had to wait for more than WAIT_TOLERANCE of
# the period is slower than its busy time says: its sample shrinks in proportion to the wait.
WAIT_TOLERANCE = 0.05
# The tuner starts again from the model's split when the first lane's measured rate moves this much (the
# step's own CPU use changed); a CPU lane made late by a larger share reads slower too, so not less.
RETUNE = 0.5


@dataclass
class Lane:
    """One lane's measured state."""

    name: str
    rate: float | None = None  # images per second of its marginal busy time; None: not measured yet
    fixed: float = 0.0  # seconds a call costs besides its images
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # EWMA sums of 1, n, t, n², n·t
    alive: bool = True
    images: int = 0  # images it decoded
    busy: float = 0.0  # seconds it was busy
    rerouted: int = 0  # its images decoded by another lane after it failed (or refused them)
    error: str = ""  # why it failed


MAX_STEP = 0.3  # the tuner's longest stride, of a loop period


@dataclass
class ShareTuner:
    """Hill climbing of the first lane's share on the loop's measured batch period: each trial share
    holds for the batches split under its tag; after ``window`` of them its median period is compared
    with the kept share's: ``gain`` faster and it is kept, else the other direction; neither: the step
    halves and the kept share is measured again (a lucky low median would block every trial). Below
    ``min_step`` it rests ``rest`` batches, then probes again at twice ``min_step``."""

    share: float = 1.0  # the kept share
    trial: float = 1.0  # the share being measured (== share while the kept one is measured)
    anchor: float | None = None  # the first lane's rate when tuning started
    engaged: bool = False  # loop periods arrive (until then the model's split stands)
    window: int = 6
    step: float = 0.1  # of a loop period
    min_step: float = 0.025
    gain: float = 0.01
    rest: int = 60
    tag: int = 0  # the trial's id: batches split under it carry it
    direction: float = 1.0
    tried_other: bool = False
    best: float | None = None  # the kept share's median period
    samples: list[float] = field(default_factory=list)
    resting: int = 0
    scale: float = 1.0  # the share a lane's time moves by one loop period

    def current(self) -> tuple[int, float]:
        """(tag, share) for the next batch split."""
        return self.tag, self.trial

    def observe(self, tag: int, seconds: float, scale: float = 1.0) -> None:
        """A batch split under ``tag`` took ``seconds`` in the loop; ``scale``: the share by which a
        lane's time moves one loop period (so a probe costs the same however fast the lanes are)."""
        self.scale = max(1e-3, scale)
        if self.resting > 0:
            self.resting -= 1
            if self.resting == 0:
                self.step = 2 * self.min_step
                self._next(self.share)
            return
        if tag != self.tag or seconds <= 0:
            return
        self.samples.append(seconds)
        if len(self.samples) < self.window:
            return
        median = sorted(self.samples)[len(self.samples) // 2]
        if self.best is None or self.trial == self.share:  # the kept share measured
            self.best, self.tried_other = median, False
        elif median < (1.0 - self.gain) * self.best:  # faster: keep it, go on that way (a longer stride)
            self.share, self.best, self.tried_other = self.trial, median, False
            self.step = min(MAX_STEP, 1.5 * self.step)
        elif not self.tried_other:
            self.direction, self.tried_other = -self.direction, True
        else:
            self._finer()
            return
        nxt = self._move()
        if abs(nxt - self.share) < 1e-9:  # at a bound: the other way, or a finer step
            if self.tried_other:
                self._finer()
                return
            self.direction, self.tried_other = -self.direction, True
            nxt = self._move()
        self._next(nxt)

    def _move(self) -> float:
        return min(1.0, max(0.0, self.share + self.direction * self.step * self.scale))

    def _finer(self) -> None:
        """Neither way helped: half the step, from a fresh measurement of the kept share (or a rest)."""
        self.step /= 2
        self.tried_other = False
        if self.step < self.min_step:
            self.resting = self.rest
        self._next(self.share)

    def _next(self, trial: float) -> None:
        self.trial = trial
        self.tag += 1
        self.samples = []


@dataclass
class LaneSplit:
    """Per-batch counts for ``lanes`` (in fill order); ``fixed`` fractions (name -> share, summing to 1)
    turn the measured split off."""

    lanes: Sequence[str]
    fixed: Mapping[str, float] | None = None
    tune: bool = True
    state: dict[str, Lane] = field(init=False)
    last_period: float | None = field(init=False, default=None)
    tuner: ShareTuner = field(init=False, default_factory=ShareTuner)
    # (tuner tag, first lane's share bounds) of each batch split, in split order, until its loop period
    _tags: deque[int] = field(init=False, default_factory=lambda: deque(maxlen=64))
    _batch: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.lanes:
            raise ValueError("LaneSplit needs at least one lane")
        self.state = {n: Lane(n) for n in self.lanes}
        if self.fixed is not None:
            unknown = set(self.fixed) - set(self.lanes)
            if unknown or any(v < 0 for v in self.fixed.values()):
                raise ValueError(
                    f"a fixed split gives lanes of {list(self.lanes)} shares >= 0; got {dict(self.fixed)}"
                )

    @property
    def live(self) -> list[str]:
        return [n for n in self.lanes if self.state[n].alive]

    def counts(self, batch: int) -> dict[str, int]:
        """Images of a ``batch`` for each lane (dead lanes 0), summing to ``batch``."""
        live = self.live
        if not live:
            raise RuntimeError(f"every decode lane failed: {self.errors()}")
        out = dict.fromkeys(self.lanes, 0)
        if self.fixed is not None:
            weights = self._fixed_weights(live)
            if sum(weights.values()) <= 0:  # the fixed lanes all failed: the rest share equally
                weights = dict.fromkeys(live, 1.0)
            out.update(_apportion(weights, batch))
            return out
        counts = self._measured(live, batch)
        if self.tune and len(live) > 1 and all(self.state[n].rate is not None for n in live):
            counts = self._tuned(counts, live, batch)
        else:
            self._tags.append(-1)  # not tuned: its loop period is not a trial's
        out.update(counts)
        return out

    def _tuned(self, counts: dict[str, int], live: list[str], batch: int) -> dict[str, int]:
        """The first lane's share from the tuner (which starts at the model's, and again at the model's
        when that lane's rate moved by more than ``RETUNE``); the other lanes keep the model's
        proportions. The batch is tagged for ``loop_period``."""
        first = live[0]
        rate = float(self.state[first].rate)  # type: ignore[arg-type]
        base, self._batch = counts[first] / batch, batch
        if not self.tuner.engaged or abs(rate / float(self.tuner.anchor or rate) - 1.0) > RETUNE:
            self.tuner = ShareTuner(share=base, trial=base, anchor=rate, engaged=self.tuner.engaged)
        tag, share = self.tuner.current()
        self._tags.append(tag)
        if not self.tuner.engaged:  # no loop period measured yet: the model's split
            return counts
        take = min(batch, max(0, int(round(share * batch))))
        rest = {n: float(counts[n]) for n in live[1:]}
        if sum(rest.values()) <= 0:
            rest = {n: float(self.state[n].rate or 1.0) for n in live[1:]}
        return {first: take} | _apportion(rest, batch - take)

    def loop_period(self, seconds: float | None) -> None:
        """The training loop's batch-to-batch time for the oldest batch split and not yet reported (in
        split order); None: a batch not to measure (the pipeline filling at an epoch's start)."""
        if not self._tags:
            return
        tag = self._tags.popleft()
        if seconds is not None:
            self.tuner.engaged = True
            self.tuner.observe(tag, seconds, self._share_per_second() * seconds)

    def _share_per_second(self) -> float:
        """The fraction of a batch by which the first lane's (or the others') decode time moves one
        second: the slower side's rate over the batch."""
        live = self.live
        rates = [self.state[n].rate for n in live]
        if len(live) < 2 or None in rates or not self._batch:
            return 1.0
        first, rest = float(rates[0]), sum(float(r) for r in rates[1:])  # type: ignore[arg-type]
        return min(first, rest) / self._batch

    def restart(self) -> None:
        """Batches split but never consumed (an epoch left early) are forgotten."""
        self._tags.clear()

    def _fixed_weights(self, live: list[str]) -> dict[str, float]:
        """The fixed shares, a dead lane's share going to the next live lane after it (as its images do
        in ``decode_parts``), so the live lanes keep the shares they were sized for."""
        assert self.fixed is not None
        weights = {n: self.fixed.get(n, 0.0) for n in live}
        for i, name in enumerate(self.lanes):
            if name not in weights:
                after = [n for n in (*self.lanes[i + 1 :], *self.lanes[:i]) if n in weights]
                weights[after[0]] += self.fixed.get(name, 0.0)
        return weights

    def _measured(self, live: list[str], batch: int) -> dict[str, int]:
        if any(self.state[n].rate is None for n in live):  # not all measured yet: equal parts
            return _apportion(dict.fromkeys(live, 1.0), batch)
        per = {n: 1.0 / float(self.state[n].rate) for n in live}  # type: ignore[arg-type]
        fixed = {n: self.state[n].fixed for n in live}

        def capacity(n: str, seconds: float) -> float:
            return max(0.0, (seconds - fixed[n]) / per[n])

        lo, hi = 0.0, max(fixed[n] + batch * per[n] for n in live)
        for _ in range(50):  # the time in which the lanes together decode the batch
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if sum(capacity(n, mid) for n in live) >= batch else (mid, hi)
        horizon = max(MARGIN * (self.last_period or 0.0), hi)
        counts, left = {}, batch
        for n in live:
            take = min(left, int(round(capacity(n, horizon))))
            counts[n], left = take, left - take
        counts[live[-1]] += left  # rounding, or a consumer-bound batch the lanes before did not fill
        return self._no_small_tail(counts, {n: 1.0 / per[n] for n in live}, batch)

    def _no_small_tail(self, counts: dict[str, int], rates: dict[str, float], batch: int) -> dict[str, int]:
        """The last lane with images, when it holds under ``min_part`` of the batch and is not the only
        one, gives them to the lanes before it (in proportion to their rates)."""
        used = [n for n in counts if counts[n] > 0]
        if len(used) < 2 or counts[used[-1]] >= MIN_PART * batch:
            return counts
        tail, before = used[-1], used[:-1]
        extra = _apportion({n: rates[n] for n in before}, counts[tail])
        counts[tail] = 0
        for n, k in extra.items():
            counts[n] += k
        return counts

    def observe(self, name: str, images: int, busy: float, waited: float = 0.0, period: float = 0.0) -> None:
        """A lane decoded ``images`` in ``busy`` seconds of its own time; for a lane decoded ahead, the
        loader then ``waited`` seconds for it in a batch ``period`` seconds long."""
        lane = self.state[name]
        lane.images += images
        lane.busy += busy
        if images <= 0 or busy <= 0:
            return
        if period > 0 and waited > WAIT_TOLERANCE * period:  # late: slower than its busy time says
            busy /= max(0.5, 1.0 - waited / period)
        keep = 1.0 - ALPHA if lane.rate is not None else 0.0
        for i, v in enumerate((1.0, images, busy, images * images, images * busy)):
            lane.sums[i] = keep * lane.sums[i] + v
        lane.fixed, per_image = _fit(lane.sums, lane.fixed)
        lane.rate = 1.0 / per_image

    def period(self, seconds: float) -> None:
        """The consumer's last batch period (batch to batch), an EWMA."""
        if seconds <= 0:
            return
        last = self.last_period
        self.last_period = seconds if last is None else last + ALPHA * (seconds - last)

    def fail(self, name: str, error: BaseException | str) -> None:
        """``name`` is dropped for good (its next batches go to the other lanes)."""
        lane = self.state[name]
        lane.alive, lane.error = False, lane.error or str(error)

    def rerouted(self, name: str, images: int) -> None:
        self.state[name].rerouted += images

    def rates(self) -> dict[str, float | None]:
        return {n: lane.rate for n, lane in self.state.items()}

    def errors(self) -> dict[str, str]:
        return {n: lane.error for n, lane in self.state.items() if lane.error}


def _fit(sums: list[float], fixed: float) -> tuple[float, float]:
    """(fixed seconds, seconds per image) of ``t = fixed + n * per_image`` from EWMA sums of 1, n, t,
    n², n·t: least squares where the counts varied enough (10%) to tell the two apart, else the
    previous fixed part (at most 80% of the mean time) and the per-image time it leaves."""
    w, n, t, nn, nt = sums
    mean_n, mean_t = n / w, t / w
    var, cov = nn / w - mean_n * mean_n, nt / w - mean_n * mean_t
    if var > (0.1 * mean_n) ** 2 and cov > 0:
        per = cov / var
        fixed = mean_t - per * mean_n
    fixed = min(max(0.0, fixed), 0.8 * mean_t)
    return fixed, max((mean_t - fixed) / mean_n, 1e-9)


def _apportion(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """``total`` split in proportion to ``weights`` (largest remainder: sums exactly to ``total``)."""
    names = list(weights)
    w = sum(weights.values())
    if w <= 0:
        return dict.fromkeys(names, 0) | ({names[0]: total} if names else {})
    exact = {n: total * weights[n] / w for n in names}
    out = {n: int(exact[n]) for n in names}
    order = sorted(names, key=lambda n: exact[n] - out[n], reverse=True)
    for n in order[: total - sum(out.values())]:
        out[n] += 1
    return out


# A lane's decode call: images [start, stop) of the batch's device part -> one result per image (None
# for an image this lane refuses).
DecodeFn = Callable[[int, int], list[Any]]


class Busy(list):  # type: ignore[type-arg]
    """A lane's images with the seconds it was busy on them, where that is not the call's wall time (a
    decode started ahead: the wait for it is shorter than the work)."""

    def __init__(self, images: list[Any], busy: float) -> None:
        super().__init__(images)
        self.busy = busy


def decode_parts(
    split: LaneSplit,
    parts: Sequence[tuple[str, int, int]],
    lanes: Mapping[str, DecodeFn],
    fallback: DecodeFn,
    pool: Executor | None = None,
) -> list[Any]:
    """Decode each ``(lane, start, stop)`` part with its lane, all at once (all but the last in ``pool``),
    the results in order. A lane that raises is failed and its part decoded by the next live lane
    (``fallback`` when none is left); images a lane refuses (None) by ``fallback``; both counted in
    that lane's ``rerouted``."""
    parts = [p for p in parts if p[2] > p[1]]
    jobs: list[Future[tuple[list[Any], float]]] = []
    for i, (name, start, stop) in enumerate(parts):
        if not split.state[name].alive:
            jobs.append(Future())  # never run: rerouted below
            continue
        call = _timed(lanes[name], start, stop)
        jobs.append(_run_here(call) if pool is None or i == len(parts) - 1 else pool.submit(call))
    out: list[Any] = []
    for (name, start, stop), job in zip(parts, jobs):
        try:
            if not split.state[name].alive:  # failed since this batch was split
                raise RuntimeError(split.state[name].error or f"the {name} lane failed")
            images, busy = job.result()
        except Exception as e:  # the lane is gone: its part to the next live lane
            split.fail(name, e)
            split.rerouted(name, stop - start)
            images = _rescue(split, parts, name, lanes, fallback)(start, stop)
        else:
            split.observe(name, sum(img is not None for img in images), busy)
        refused = [i for i, img in enumerate(images) if img is None]
        if refused:
            split.rerouted(name, len(refused))
            for i in refused:
                images[i] = fallback(start + i, start + i + 1)[0]
        out.extend(images)
    return out


def _run_here(call: Callable[[], Any]) -> Future[Any]:
    """``call`` run in this thread now, as a settled future."""
    future: Future[Any] = Future()
    try:
        future.set_result(call())
    except Exception as e:
        future.set_exception(e)
    return future


def _timed(fn: DecodeFn, start: int, stop: int) -> Callable[[], tuple[list[Any], float]]:
    def call() -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        got = fn(start, stop)
        images = list(got)
        if len(images) != stop - start:
            raise RuntimeError(f"a decode lane returned {len(images)} images for {stop - start}")
        return images, getattr(got, "busy", time.perf_counter() - t0)

    return call


def _rescue(
    split: LaneSplit,
    parts: Sequence[tuple[str, int, int]],
    failed: str,
    lanes: Mapping[str, DecodeFn],
    fallback: DecodeFn,
) -> DecodeFn:
    """The lane that decodes a failed lane's part: the next live lane of this batch (failed in turn,
    and ``fallback`` decoding, if it raises too), else ``fallback``."""
    names = [p[0] for p in parts]
    at = names.index(failed)
    name = next((n for n in names[at + 1 :] + names[:at] if split.state[n].alive), None)
    if name is None:
        return fallback

    def call(start: int, stop: int) -> list[Any]:
        try:
            return list(lanes[name](start, stop))
        except Exception as e:
            split.fail(name, e)
            return list(fallback(start, stop))

    return call
