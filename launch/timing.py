"""GPU timing shared by the benchmarks: CUDA events around repeated calls, medians of repetitions; and
``require_gpus``, the check every GPU script makes before its heavy imports."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

EXIT_NO_GPU = 2


def require_gpus(count: int = 1, what: str | None = None, *, capability: tuple[int, int] | None = None) -> None:
    """Exits with status 2 and says why unless ``count`` CUDA GPUs are visible (each of compute capability
    ``capability``, e.g. ``(9, 0)``, where given). Scripts call it before importing the library or doing any work;
    ``-h``/``--help`` on the command line passes, so the usage can be read on any machine.

    Args:
        count: GPUs needed (under torchrun: the ranks on this machine).
        what: the script's name in the message; default ``sys.argv[0]``'s.
        capability: the only compute capability the script runs on.
    """
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        return
    what = what or Path(sys.argv[0]).name
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = f"{count} CUDA GPUs" if count > 1 else "a CUDA GPU"
    if capability is not None:
        need += f" of compute capability {capability[0]}.{capability[1]} (sm_{capability[0]}{capability[1]})"
    problem = None
    if visible < count:
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is built without CUDA"
        elif os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            why = f"{visible} visible with CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
        else:
            why = f"{visible} visible to torch"
        problem = f"{what} needs {need}; {why}"
    elif capability is not None:
        other = [(i, torch.cuda.get_device_capability(i)) for i in range(count)]
        other = [f"GPU {i} is {ma}.{mi}" for i, (ma, mi) in other if (ma, mi) != tuple(capability)]
        if other:
            problem = f"{what} needs {need}; {', '.join(other)}"
    if problem is None:
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per machine under torchrun
        print(problem, file=sys.stderr, flush=True)
    sys.exit(EXIT_NO_GPU)


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
