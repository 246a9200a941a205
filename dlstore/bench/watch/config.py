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
    """Options of one watch (``dlstore watch --help`` says what each does). ``steps`` counts real steps;
    ``apply``: ``{"loader": index, "settings": {...}}``, what ``--apply`` puts into that loader (``launch.inject``)."""

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
    try_cache: bool = False  # convert a sample as the cache advice says and time that loader (probes.py)
    profile_steps: int = 8
    max_event_steps: int = 20_000  # CUDA event pairs kept (two small objects per step)
    # CUDA events on one step in N: a pair cost ~20 µs of the step's host time; the device span is a mean,
    # which a sample of the steps gives (steps.csv's device_wait_ms needs events on consecutive steps: 1)
    event_every: int = 8
    sample_interval_s: float = 0.5  # /proc and NVML sampling period of the background thread
    apply: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        positive = ("steps", "replay_steps", "replay_batches", "replay_rounds", "replay_every", "event_every")
        for name in (*positive, "trial_steps"):
            value = getattr(self, name)
            if not (value is None and name == "steps") and (value is None or value < 1):
                raise WatchError(f"{name} must be a positive integer, got {value!r}")
        for name in ("replay_s", "trial_s", "warmup"):
            if not getattr(self, name) >= 0:
                raise WatchError(f"{name} must be ≥ 0, got {getattr(self, name)!r}")

    def pauses(self) -> bool:
        """Whether the loop is paused (at ``replay_start``) for a replay or a trial."""
        return self.replay or self.trial

    def pauses_total(self) -> int:
        return self.replay_rounds if self.replay else 1  # once per replay round, or for the trial alone

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


def rank_info(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    env = environ if environ is not None else os.environ
    try:
        return int(env.get("RANK", "0")), max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def rank_file(result_dir: str | Path, rank: int) -> Path:
    return Path(result_dir) / f"watch-rank{rank}.json"
