"""A window of steps that watch feeds the loop itself (the replay, the trial): its first steps dropped as
warm-up, then at least a time timed, capped in steps. Decided at each next() call from perf_counter alone.

The replay follows a data-bound phase: the device's clocks and caches wake over its first steps, and a
short count of steps moves between runs; so the window runs for a time, not a count, and
``steps.block_period`` reads its steady period as the median of three blocks.
Under torchrun the ranks must take the same number of steps (their all-reduces pair up), so there the
window counts steps only (``fixed``). Its steps take the loop's own places: at most half an epoch each.
"""

from __future__ import annotations

MIN_TIMED = 3  # timed steps at the least: one per block
FIXED_STEPS = 100  # a window's length in steps where it cannot follow the clock (torchrun)
FIXED_WARM = 10


class Window:
    """Steps ``first_step`` … of a record fed by watch: ``more(t)`` at each next() call says whether one
    more is fed; the first ones (at least ``warm_steps``, and ``warm_s`` seconds) are warm-up."""

    def __init__(
        self, first_step: int, warm_steps: int, warm_s: float, min_s: float, cap: int, fixed: bool = False
    ) -> None:
        self.first_step = first_step
        self.warm_steps = warm_steps
        self.warm_s = warm_s
        self.min_s = min_s
        self.cap = cap
        if fixed:
            self.cap = min(cap, FIXED_STEPS)
            self.warm_steps, self.warm_s, self.min_s = min(FIXED_WARM, self.cap // 4), 0.0, float("inf")
        self.n = 0  # steps fed so far
        self.t0: float | None = None
        self.timed_from: int | None = None  # the first timed step, counted in the window
        self.t_timed = 0.0

    def more(self, t: float) -> bool:
        """At a next() call at ``t``: True to feed one more step; False when the window is over (``t``
        then ended its last step)."""
        if self.t0 is None:
            self.t0 = t
        if self.timed_from is None and (
            (self.n >= self.warm_steps and t - self.t0 >= self.warm_s)
            or self.n >= max(self.warm_steps, self.cap // 4)
        ):
            self.timed_from, self.t_timed = self.n, t
        if self.n >= self.cap:
            return False
        if (
            self.timed_from is not None
            and self.n - self.timed_from >= MIN_TIMED
            and t - self.t_timed >= self.min_s
        ):
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
