"""``dlstore watch``: the bottleneck of the user's own training loop, the loop unchanged. From the shell,
``dlstore watch -- python train.py ARGS…``; in code, around the loop or on one loader::

    with dlstore.watch(steps=200) as w:  # every DataLoader iterated inside is watched
        train()
    print(w.text())                      # w.report: the same as a dict

    loader = dlstore.watch(loader)       # the report prints to stderr when the script ends

The watched child learns its ``WatchConfig`` from one environment variable holding JSON, so the target
script's ``sys.argv`` stays exactly what it expects. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from dlstore.errors import DlstoreError

__all__ = ["Watch", "WatchConfig", "WatchError", "watch"]

ENV_VAR = "DLSTORE_WATCH_CONFIG"


class WatchError(DlstoreError, ValueError):
    """A watch option or target command that cannot be run as given."""


@dataclass(frozen=True)
class WatchConfig:
    """Options of one watch (``dlstore watch --help`` says what each does). ``steps`` counts real steps;
    ``apply``: ``{"loader": index, "settings": {...}}``, what ``--apply`` puts into that loader."""

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
    def from_env(cls) -> WatchConfig:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise WatchError(f"{ENV_VAR} is not set: boot is started by `dlstore watch -- python train.py`")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


def rank_info() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    try:
        return int(os.environ.get("RANK", "0")), max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def rank_file(result_dir: str | Path, rank: int) -> Path:
    return Path(result_dir) / f"watch-rank{rank}.json"


class Watch:
    """A watch in this process: a context manager over a block, or attached to loaders (``attach``)."""

    def __init__(self, config: WatchConfig, out: Path | None = None, quiet: bool = False) -> None:
        from dlstore.bench.watch.record import Session

        if out is not None:
            config = replace(config, result_dir=str(Path(out) / "ranks"))
            Path(config.result_dir).mkdir(parents=True, exist_ok=True)
        self.config = config
        self.out = None if out is None else Path(out)
        self.quiet = quiet
        self.session = Session(config)
        self.report: dict[str, Any] | None = None

    def __enter__(self) -> Watch:
        self.session.install()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        from dlstore.bench.watch.record import WatchStop

        status, error = "completed", None
        if isinstance(exc, WatchStop):
            status = "stopped"
        elif isinstance(exc, KeyboardInterrupt):
            status = "interrupted"
        elif exc is not None:
            status, error = "error", f"{type(exc).__name__}: {exc}"
        self.finish(status, error)
        return isinstance(exc, WatchStop)  # --steps reached: a clean end of the block

    def attach(self, loader: Any) -> Any:
        """Watch this loader: its class becomes a subclass whose ``__iter__`` is watched (the object, its
        attributes and ``isinstance`` stay the same)."""
        session = self.session
        base = type(loader)
        if getattr(base, "_dlstore_watched", False):
            return loader

        def __iter__(self_: Any) -> Any:
            return session.wrap(self_, base.__iter__(self_))

        loader.__class__ = type(
            f"Watched{base.__name__}", (base,), {"__iter__": __iter__, "_dlstore_watched": True}
        )
        return loader

    def finish(self, status: str = "completed", error: str | None = None) -> dict[str, Any]:
        """Stop watching; analyse (with the other ranks' records on rank 0) and print unless quiet."""
        if self.report is not None:
            return self.report
        from dlstore.bench.watch.analyse import analyse
        from dlstore.bench.watch.boot import write_record
        from dlstore.bench.watch.watch_report import text_report, write_outputs

        raw = self.session.finish(status, None, error)
        write_record(raw, self.config)
        rank, world = rank_info()
        docs = [raw]
        if world > 1 and rank == 0 and self.config.result_dir:
            from dlstore.bench.watch.launch import collect

            docs = collect(Path(self.config.result_dir), world)
        self.report = analyse(docs)
        if rank == 0 and self.out is not None:
            write_outputs(self.report, self.out)
        if rank == 0 and not self.quiet:
            print(text_report(self.report), file=sys.stderr)
        return self.report

    def text(self) -> str:
        from dlstore.bench.watch.watch_report import text_report

        return text_report(self.finish())  # stops watching first


def watch(
    loader: Any = None,
    config: WatchConfig | None = None,
    *,
    out: str | Path | None = None,
    quiet: bool = False,
    **options: Any,
) -> Any:
    """``with watch(config) as w:`` watches every DataLoader iterated in the block; ``watch(loader, config)``
    returns the loader watched, reporting at the script's end. ``options``: WatchConfig's fields by name."""
    if config is not None and options:
        raise WatchError("watch(): give a WatchConfig or options by name, not both")
    config = config if config is not None else WatchConfig(**options)  # an unknown name: TypeError
    w = Watch(config, None if out is None else Path(out), quiet)
    if loader is None:
        return w
    atexit.register(w.finish)
    loaded = w.attach(loader)
    loaded._dlstore_watch = w  # the report, for code that wants it: loader._dlstore_watch.finish()
    return loaded
