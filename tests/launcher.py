"""Runs a test function on several ranks: processes started with torch.multiprocessing, gloo on CPUs (NCCL,
one GPU per rank, with ``backend="nccl"``). The function runs as ``fn(rank, world_size, *args)`` after the
process group is up; its return value comes back to the test, and an exception in any rank fails it."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, backend, port, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # One thread per rank: several ranks share a few cores, and idle OpenMP threads spinning in each would
    # starve the rank that a collective waits for.
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # reported to the test, which fails with the rank's traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the result is in the pipe before the process ends
        # A rank whose peers are gone (a timeout test) must not wait for them in a collective teardown.
        os._exit(0)


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 180.0) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks and returns the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, backend, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    by_rank, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout_s)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            by_rank[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return [by_rank[r] for r in range(world_size)]
