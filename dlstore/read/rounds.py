"""How W ranks share one epoch order ``G`` a window per rank, and where a resume on W' ranks picks up.

``G`` (``dlstore.read.order``) is a sequence of windows (for the chunk order, ``window`` units whose
images are shuffled together); ``starts[k]`` is where window k begins (``starts[-1] == n``). The random
and sequential orders have no units (``starts`` is None): their ranks simply take turns in ``G``.

**Rounds.** W ranks read ``G`` in rounds of W windows. A round of T samples is cut into W contiguous
pieces of ``q = T // W`` samples, the first ``T % W`` one longer (the windows themselves when they are
of one size). The consumption sequence ``C`` lists a round piece by piece in turns: position
``j*W + a`` is sample j of piece a (the longer pieces' last samples at ``q*W + a``). Rank r takes
``c + r, c + r + W, ...``, so it reads one whole piece of every round: each unit is decoded by one
rank, and with W = 1, ``C`` is ``G``. After every rank took k samples, the prefix ``c + k*W`` of ``C``
is consumed; at a round's end that is a prefix of ``G``.

**Segments: the elastic resume.** ``Segment(base, width)`` reads ``G`` in rounds of ``width`` windows
from window ``base`` on; a state holds its segment and the consumed count. A world of W' != ``width``
ranks first finishes the segment's current round (in ``C``'s order, the W' ranks taking turns), then
starts ``Segment(window at that round's end, W')``: any chain of stops and resumes on any world sizes
reads each sample once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    """``G`` read in rounds of ``width`` windows, one per rank, from window ``base`` on."""

    base: int
    width: int


def round_bounds(starts: np.ndarray, seg: Segment) -> np.ndarray:
    """Where the segment's rounds begin in ``G``, then n."""
    nw = len(starts) - 1
    return np.append(starts[min(seg.base, nw) : nw : seg.width], starts[nw]).astype(np.int64)


def in_rounds(p: np.ndarray, bounds: np.ndarray, width: int) -> np.ndarray:
    """Positions ``p`` of ``C`` (each in ``[bounds[0], n)``) as positions of ``G``."""
    if width == 1:  # rounds of one window: C is G
        return p
    i = np.searchsorted(bounds, p, side="right") - 1
    s = bounds[i]
    q, rem = np.divmod(bounds[i + 1] - s, width)
    t = p - s
    full = t < q * width
    piece = np.where(full, t % width, t - q * width)
    return s + piece * q + np.minimum(piece, rem) + np.where(full, t // width, q)


class Route:
    """The consumption sequence ``C`` from a consumed count on, for a world of ``world`` ranks: the
    saved segment up to ``cut`` (the end of its current round), then ``then``."""

    def __init__(self, starts: np.ndarray | None, n: int, seg: Segment, consumed: int, world: int) -> None:
        self.starts, self.n = starts, n
        self.first = self.then = Segment(0, world) if starts is None else seg
        self.cut = n
        if starts is None:
            return
        nw = len(starts) - 1
        if not (0 <= seg.base <= nw and seg.width >= 1 and starts[seg.base] <= consumed <= n):
            raise ValueError(
                f"order state: segment base={seg.base} width={seg.width} with consumed={consumed} does not "
                f"fit this epoch ({nw} windows, window {seg.base} starts at position "
                f"{int(starts[min(seg.base, nw)])}); pass a state saved by a dlstore sampler or loader"
            )
        self.bounds_first = round_bounds(starts, seg)
        if seg.width != world:
            k = int(np.searchsorted(self.bounds_first, consumed, side="left"))
            self.cut = int(self.bounds_first[k])
            self.then = Segment(min(seg.base + k * seg.width, nw), world)
        self.bounds_then = round_bounds(starts, self.then)

    def segment(self, consumed: int) -> Segment:
        """The segment a state taken after ``consumed`` positions records."""
        return self.first if consumed < self.cut else self.then

    def positions(self, p: np.ndarray) -> np.ndarray:
        """Positions of ``C`` as positions of ``G``; those past n wrap to ``G``'s start (padding)."""
        over = p >= self.n
        if over.any():
            p = np.where(over, p % max(1, self.n), p)
        if self.starts is None:
            return p
        out = np.empty_like(p)
        head = (p < self.cut) & ~over
        out[head] = in_rounds(p[head], self.bounds_first, self.first.width)
        tail = ~head & ~over
        out[tail] = in_rounds(p[tail], self.bounds_then, self.then.width)
        out[over] = p[over]
        return out
