"""What ``dlstore watch`` is asked to do, and how the child process learns it (one environment variable
holding JSON, so the target script's ``sys.argv`` stays exactly what it expects). No torch here."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from dlstore.errors import DlstoreError

ENV_VAR = "DLSTORE_WATCH_CONFIG"


class WatchError(DlstoreError, ValueError):
    """A watch option or target command that cannot be run as given."""


@dataclass(frozen=True)
class WatchConfig:
    """Options of one watch.

    ``steps``: stop the script after this many real (non-replayed) steps; None lets it run to its end.
    ``warmup``: the first steps of the first epoch, kept apart (worker start, cudnn tuning), as the bench does.
    ``replay``: after ``replay_at`` real steps, feed ``replay_batches`` of the loop's own batches back to it:
    first ``replay_warmup_s`` seconds of warm-up (clocks and caches waking after a data-bound phase), then
    at least ``replay_s`` seconds timed, ``replay_steps`` steps at most in all: the loop's rate with data
    free (the median of three blocks of the timed steps). ``replay_rounds``: the replay runs that many
    times, ``replay_every`` real steps apart, the rate with data free the median round's: on a machine
    whose speed moves between windows seconds apart (a shared GPU: ±15%) one window is that noisy.
    ``trial``: then, when the advice so far says more workers, feed the loop for ``trial_s`` seconds from
    a second DataLoader over the same dataset with the advised workers (its queue's filling dropped): the
    rate the loop itself reaches with them (``trial.py``).
    ``parts``: time the dataset's parts alone at the end (``parts_budget_s`` seconds at most).
    ``try_cache``: when a dlstore cache is advised, convert a sample of the dataset that way and time the
    recommended loader (``parts_budget_s`` seconds of timing too, after the conversion).
    """

    result_dir: str = ""
    steps: int | None = None
    warmup: int = 5
    replay: bool = True
    replay_at: int = 100
    replay_batches: int = 4
    replay_steps: int = 2000  # the most replayed steps (warm-up included): a cap on the time window
    replay_s: float = 1.5
    replay_warmup_s: float = 0.3
    replay_rounds: int = 1
    replay_every: int = 100  # real steps from one round's start to the next's
    trial: bool = True
    trial_s: float = 1.5
    trial_steps: int = 2000
    parts: bool = True
    parts_budget_s: float = 3.0
    profile: bool = False
    try_cache: bool = False  # convert a sample as the cache advice says and time that loader (try_cache.py)
    profile_steps: int = 8
    max_event_steps: int = 20_000  # CUDA event pairs kept (two small objects per step)
    # CUDA events on one step in N: on the H200's host a pair cost ~20 µs of the step's host time (watch's
    # whole cost per next() 27.8 µs with events on every step, 8.2 µs on one in 4: 1.0% / 0.3% of a 2.7 ms
    # SmallCNN step; benchmarks/RESULTS.md, "dlstore watch: accuracy"). The device span is a mean: a
    # sample of the steps gives it. The device's wait between two steps (steps.csv's device_wait_ms) needs
    # events on consecutive steps: every step (1). One in 8 since watch8: the H200 then read 40.5 / 15.3 /
    # 9.1 / 3.2 µs per next() with events on every step / 1 in 4 / 1 in 8 / none (watch r3; 0.45% of a
    # 2.1 ms step at 1 in 8); a window of 1.5 s still holds dozens of sampled steps (ResNet-50's ~30 ms: ~6)
    event_every: int = 8
    sample_interval_s: float = 0.5  # /proc and NVML sampling period of the background thread

    def __post_init__(self) -> None:
        parse_positive("--steps", self.steps, allow_none=True)
        parse_positive("--replay-steps", self.replay_steps)
        parse_positive("--replay-batches", self.replay_batches)
        parse_positive("--replay-rounds", self.replay_rounds)
        parse_positive("--replay-every", self.replay_every)
        parse_positive("event_every", self.event_every)
        parse_positive("--trial-steps", self.trial_steps)
        for name, value in (("--replay-s", self.replay_s), ("--trial-s", self.trial_s)):
            if not value >= 0:
                raise WatchError(f"{name} must be ≥ 0 seconds, got {value!r}")
        if self.warmup < 0:
            raise WatchError(f"--warmup must be ≥ 0, got {self.warmup}")

    def pauses(self) -> bool:
        """Whether the loop is paused once (at ``replay_start``) for a replay or a trial."""
        return self.replay or self.trial

    def pauses_total(self) -> int:
        """How many times the loop is paused: once per replay round (once when only the trial runs)."""
        return self.replay_rounds if self.replay else 1

    def replay_start(self, epoch_len: int) -> int:
        """The real step count after which the replay runs: at --steps when given, else ``replay_at``, or
        half the first epoch when that comes sooner (a short run is paused inside itself); never inside
        the warm-up, and with room to keep the batches it replays."""
        at = self.steps if self.steps is not None else min(self.replay_at, epoch_len // 2)
        return max(at, self.warmup + self.replay_batches)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WatchConfig:
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            raise WatchError(
                f"{ENV_VAR} is not set: dlstore.bench.watch.boot is started by `dlstore watch -- python "
                "train.py`, not by hand"
            )
        doc = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


def parse_positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise WatchError(f"{name} must be a positive integer, got {value!r}")


def rank_info(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    env = environ if environ is not None else os.environ
    try:
        return int(env.get("RANK", "0")), max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def rank_file(result_dir: str | Path, rank: int) -> Path:
    return Path(result_dir) / f"watch-rank{rank}.json"
