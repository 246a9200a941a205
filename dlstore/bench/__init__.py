"""``dlstore bench``: measure each input-pipeline stage alone and end to end, then name the bottleneck.

>>> from dlstore.bench import BenchConfig, run_bench          # doctest: +SKIP
>>> doc = run_bench(BenchConfig(loaders=("raw", "ram"), workers=(0, 2)))
>>> doc["verdict"], doc["runs"][0]["bottleneck"]

``run_bench`` is imported lazily: ``dlstore.bench.protocol`` needs no torch.
"""

from __future__ import annotations

from typing import Any

from dlstore.bench.protocol import BenchConfig

__all__ = ["BenchConfig", "run_bench"]


def __getattr__(name: str) -> Any:
    if name == "run_bench":
        from dlstore.bench.run import run_bench

        return run_bench
    raise AttributeError(f"module 'dlstore.bench' has no attribute {name!r}")
