"""``CudaGraphed``: a per-batch device transform replayed from a CUDA graph instead of launched op by op:
an eager ``GpuAugment`` is a few dozen launches (≈ 2 ms per small batch), which a small model at a
high step rate cannot hide."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Transform = Callable[[torch.Tensor], Any]


class CudaGraphed:
    """``transform`` captured for inputs of one shape, dtype and strides; other inputs run eagerly. The
    output is the graph's static one, overwritten by the next call (``.clone()`` what you keep); random
    draws must use the device's default generator, which CUDA graphs advance on every replay.

    >>> aug = CudaGraphed(GpuAugment(112).cuda())          # doctest: +SKIP
    >>> x = aug(images)                                      # doctest: +SKIP
    """

    def __init__(self, transform: Transform, warmup: int = 3) -> None:
        if getattr(transform, "generator", None) is not None:
            raise ValueError("CudaGraphed needs a transform on the default generator")
        self.transform, self.warmup = transform, warmup
        self._key: tuple[object, ...] | None = None
        self._static: tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return self.transform(x)
        key = (x.shape, x.stride(), x.dtype, x.device)
        if self._static is None:
            self._capture(x)
            self._key = key
        elif key != self._key:  # e.g. a last partial batch: not worth a second graph
            return self.transform(x)
        assert self._static is not None
        static_in, graph, out = self._static
        static_in.copy_(x)
        graph.replay()
        return out

    def _capture(self, x: torch.Tensor) -> None:
        static_in = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        static_in.copy_(x)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # first-use work (cudnn, allocator) stays out of the graph
            for _ in range(self.warmup):
                self.transform(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.transform(static_in)
        self._static = (static_in, graph, out)
