"""GPU timing shared by the benchmarks: CUDA events around repeated calls, medians of repetitions."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _median_us(run: Callable[[], None], calls: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def time_eager(fn: Callable[[], object], calls: int = 100, reps: int = 7) -> float:
    """Median wall time per call (us) of ``fn()`` issued from Python ``calls`` times in a row."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(calls):
            fn()

    return _median_us(run, calls, reps)


def capture_graph(fn: Callable[[int], object], calls: int) -> torch.cuda.CUDAGraph:
    """``fn(0 .. calls - 1)`` run once eagerly (compiling and allocating outside the capture), then captured
    in one CUDA graph on a side stream, replayed once and synchronized."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fn: Callable[[int], object], calls: int = 20, reps: int = 15, settle_ms: float = 0.0) -> float:
    """Median GPU time per call (us) of ``fn(i)``, i = 0 .. calls - 1, captured in one CUDA graph and replayed
    (no launch gaps; ``i`` lets a call pick one of several input sets).

    ``settle_ms``: replay for at least this long before timing, so that the board's power state is the
    kernel's own sustained one rather than whatever the previous measurement left (an H200 running FP8
    GEMMs is power-limited, and a kernel timed right after a lighter phase reads faster)."""
    graph = capture_graph(fn, calls)
    if settle_ms > 0:
        deadline = time.perf_counter() + settle_ms / 1e3
        while time.perf_counter() < deadline:
            graph.replay()
            torch.cuda.synchronize()
    return _median_us(graph.replay, calls, reps)
