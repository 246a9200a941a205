"""What ``dlstore watch`` is asked to do, and how the child process learns it (one environment variable
holding JSON, so the target script's ``sys.argv`` stays exactly what it expects). No torch here."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dlstore.errors import DlstoreError

ENV_VAR = "DLSTORE_WATCH_CONFIG"


class WatchError(DlstoreError, ValueError):
    """A watch option or target command that cannot be run as given."""


@dataclass(frozen=True)
class WatchConfig:
    """Options of one watch.

    ``steps``: stop the script after this many real (not stand-in) steps; None lets it run to its end.
    ``warmup``: the first steps of the first epoch, kept apart (worker start, cudnn tuning), as the bench does.
    ``replay``: after ``replay_at`` real steps (half the first epoch when sooner), feed ``replay_batches`` of
    the loop's own batches back to it in its real batches' places: ``replay_warmup_s`` of warm-up, then at
    least ``replay_s`` timed, ``replay_steps`` steps at most (half an epoch on short epochs): its rate with
    data free. ``replay_rounds``: that many times, ``replay_every`` real steps apart, the median round's
    rate (one window on a machine whose speed moves is that noisy).
    ``trial``: then, when the advice says more workers, feed the loop for ``trial_s`` from a second
    DataLoader with them (``trial.py``).
    ``parts``: time the dataset's parts alone at the end (``parts_budget_s`` seconds at most).
    ``try_cache``: when a dlstore cache is advised, convert a sample of the dataset that way and time the
    recommended loader (``parts_budget_s`` seconds of timing too, after the conversion).
    ``apply``: ``{"loader": index, "settings": {...}}``, the DataLoader settings ``--apply`` puts into the
    script's loader of that index (``apply.py``).
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
    # CUDA events on one step in N: a pair cost ~20 µs of the step's host time; the device span is a mean,
    # which a sample of the steps gives (steps.csv's device_wait_ms needs events on consecutive steps: 1)
    event_every: int = 8
    sample_interval_s: float = 0.5  # /proc and NVML sampling period of the background thread
    apply: dict[str, Any] | None = None

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
        """The real step count after which the replay runs: at --steps, else ``replay_at`` or half an epoch
        if sooner (a short run is paused inside itself); after the warm-up and the batches it replays."""
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
