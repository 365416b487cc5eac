"""CUDA graphs of the padded decode / verify step (runtime/static_step.py).

A step's launches are recorded once per key (its shape and the hidden layers it returns) at the
key's first step and replayed after that: one launch instead of a few hundred, with no host work
between them. Graphs share one memory pool; each keeps its output tensors, which the next replay
of the same graph overwrites, so the caller takes what it needs (runner.py indexes the real rows
out) before the next step. The first step of a key runs eagerly once before the capture (Triton
compiles its kernels, lazy buffers are made); running it again on replay writes the same keys
and values to the same slots, so the step's result is unchanged.

If a capture raises, one line is logged and every later step runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]


class StepGraphs:
    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self._pool: tuple | None = None
        self.failed = False

    @property
    def num_graphs(self) -> int:
        """Graphs recorded so far (one per step shape and hidden layers seen)."""
        return len(self._graphs)

    def run(self, key: Hashable, forward: Callable[[], Outputs]) -> Outputs:
        """forward()'s outputs, by replaying the graph recorded for `key` (recorded now if new)."""
        if self.failed:
            return forward()
        entry = self._graphs.get(key)
        if entry is None:
            # Warmed up on a side stream, as torch advises before a capture (lazy handles and
            # workspaces are made there, not inside the graph).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm = forward()
            torch.cuda.current_stream().wait_stream(side)
            try:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    outputs = forward()
            except Exception as error:  # any capture failure: the eager step is still right
                logger.warning("CUDA graph capture of the step failed (%s: %s); running eagerly",
                               type(error).__name__, error)
                self.failed = True
                return warm
            self._pool = graph.pool()
            entry = self._graphs[key] = (graph, outputs)
        graph, outputs = entry
        graph.replay()
        return outputs
