"""Eager calls served by CUDA graphs captured per input shape: a decode step of a layer launches a dozen small
kernels whose Python and launch costs exceed their GPU time; one graph replay issues them all at once.

Dimension legend: ``T`` tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

__all__ = ["ShapeGraphs"]


class ShapeGraphs:
    """``fn(*inputs)`` through one CUDA graph per combination of input shapes and dtypes (and which inputs are
    None), captured on the first call that has it and replayed afterwards with the inputs copied into the
    graph's own buffers. At most ``max_graphs`` are kept (the least recently used goes first).

    ``fn`` must be capturable (no host sync) and must not depend on anything but its inputs and state that
    stays at the same addresses; whoever changes that state (loads weights into new tensors, repacks them)
    calls :meth:`clear`. A call returns a fresh tensor (a copy of the graph's output).

    Args:
        fn: the function; its tensor inputs may be None, its output one tensor.
        max_graphs: how many shapes keep a graph.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], max_graphs: int = 8):
        self.fn, self.max_graphs = fn, max_graphs
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list, torch.Tensor]] = OrderedDict()

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        key = tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            # The first call of a shape runs eagerly (it compiles kernels, warms the allocator, and is the
            # answer); the graph is captured right after it, from buffers of its own.
            out = self.fn(*inputs)
            self._graphs[key] = self._capture(inputs)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            return out
        self._graphs.move_to_end(key)
        graph, static, out = entry
        for buffer, t in zip(static, inputs, strict=True):
            if buffer is not None:
                buffer.copy_(t)
        graph.replay()
        return out.clone()

    def _capture(self, inputs) -> tuple[torch.cuda.CUDAGraph, list, torch.Tensor]:
        static = [None if t is None else t.clone() for t in inputs]
        main = torch.cuda.current_stream()
        stream = torch.cuda.Stream(main.device)
        stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = self.fn(*static)
        main.wait_stream(stream)
        return graph, static, out
