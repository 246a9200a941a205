"""``dlstore watch``: the bottleneck of the user's own training loop, the loop unchanged. From the shell,
``dlstore watch -- python train.py ARGS…``; in code, around the loop or on one loader::

    with dlstore.watch(steps=200) as w:  # every DataLoader iterated inside is watched
        train()
    print(w.text())                      # w.report: the same as a dict

    loader = dlstore.watch(loader)       # the report prints to stderr when the script ends
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

from dlstore.bench.watch.config import WatchConfig, WatchError, rank_info

__all__ = ["Watch", "WatchConfig", "WatchError", "watch"]


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
    the loader, reporting when the script ends. ``options``: WatchConfig's fields instead of ``config``."""
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
