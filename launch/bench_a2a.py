"""Benchmark of the expert-parallel all-to-all: MoEAllToAll dispatch and combine (P2P and NCCL backends)
against NCCL ``all_to_all_single`` of the same payload and (``--symm-mem``) ``torch.ops.symm_mem.all_to_all_vdev``
where available, all timed in the same run.

    torchrun --nproc-per-node 4 launch/bench_a2a.py [--tokens 1,128,512,4096] [--json FILE] [--symm-mem]

DeepSeek-V3 shapes: H = 7168, top-8 of 256 experts, uniform random routing. Dispatch sends FP8 rows with their
per-128 scales; combine returns bf16 rows. 1, 128 and 512 tokens per rank run in low-latency mode, 4096 in
high-throughput mode. Each time is the median over ranks' medians of CUDA-event timings of eager calls, with
a barrier before each call (so a call never overlaps the previous one on another rank); the low-latency rows
also time dispatch + combine captured in one CUDA graph (how decode runs them), with no host work in the time.
Those per-call times include the ranks' skew after each barrier; the "back to back" columns time 10 calls after
one barrier (wall time per call, host work included: what a loop of eager calls costs) and 10 round trips
captured in one graph (per trip). Bandwidth counts the bytes a rank sends to other ranks (its own rows
excluded). Nothing is asserted: the goals are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus  # noqa: E402

require_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # one GPU per rank on this machine

from flashinfer_moe import quantize_fp8_per_token_group  # noqa: E402
from flashinfer_moe.comm import MoEAllToAll  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN = 256, 8, 7168
LOW_LATENCY_MAX = 512
STEADY_CALLS, STEADY_REPS = 10, 5  # the back-to-back timings: calls per timing, timings


def _slowest_median(samples: list[float]) -> float:
    """This rank's median, then the slowest rank's (a collective is as slow as its last rank)."""
    mine = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def _time_us(fn, reps: int) -> float:
    """Median over this rank's calls, then the slowest rank's median (a collective is as slow as its last rank)."""
    samples = []
    for i in range(reps + 3):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(start.elapsed_time(end) * 1e3)
    return _slowest_median(samples)


def _steady_us(fn, calls: int, reps: int) -> float:
    """Per call, of ``calls`` eager calls back to back after one barrier (the ranks' skew paid once, the host work of
    every call included): median over ``reps``, then the slowest rank's."""
    samples = []
    for i in range(reps + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        if i:
            samples.append((time.perf_counter() - t0) / calls * 1e6)
    return _slowest_median(samples)


def _captured(fn, calls: int = 1):
    """``calls`` calls of ``fn`` captured in one CUDA graph (after an eager warm-up call): returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def _inputs(tokens: int, gen: torch.Generator):
    h = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.rand(tokens, NUM_EXPERTS, generator=gen).argsort(-1)[:, :TOP_K].int().cuda()
    w = torch.rand(tokens, TOP_K, generator=gen).cuda()
    q, scales = quantize_fp8_per_token_group(h, 128)
    return q, scales.contiguous(), ids, w


def _remote_bytes(ids: torch.Tensor, rank: int, world: int, row_bytes: int) -> int:
    dest = ids.long() // (NUM_EXPERTS // world)
    goes = torch.zeros(ids.shape[0], world, dtype=torch.bool, device=ids.device)
    goes.scatter_(1, dest, True)
    goes[:, rank] = False
    return int(goes.sum()) * row_bytes


def _nccl_baseline(nbytes: int, world: int, reps: int) -> float:
    """all_to_all_single of ``nbytes`` per rank (split evenly), the bytes the dispatch moves."""
    per = max(1, nbytes // world // 16) * 16
    inp = torch.empty(per * world, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(inp)
    return _time_us(lambda: dist.all_to_all_single(out, inp), reps)


def _symm_mem_baseline(nbytes: int, world: int, reps: int) -> float | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        op = torch.ops.symm_mem.all_to_all_vdev
    except (ImportError, AttributeError):
        return None
    try:
        per = max(1, nbytes // world // 2)
        dev = torch.device("cuda", torch.cuda.current_device())  # an explicit index: NVSHMEM keys its teams by it
        inp = symm_mem.empty(per * world, dtype=torch.bfloat16, device=dev)
        out = symm_mem.empty(per * world * 2, dtype=torch.bfloat16, device=dev)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device=dev).fill_(per)
        out_splits = symm_mem.empty(2, world, dtype=torch.int64, device=dev)
        group_name = dist.group.WORLD.group_name
        symm_mem.rendezvous(inp, group_name)
        symm_mem.rendezvous(out, group_name)
        symm_mem.rendezvous(in_splits, group_name)
        symm_mem.rendezvous(out_splits, group_name)
        return _time_us(lambda: op(inp, out, in_splits, out_splits, group_name), reps)
    except Exception as exc:  # not built with NVSHMEM, or an older signature
        if dist.get_rank() == 0:
            print(f"# symm_mem all_to_all_vdev unavailable: {type(exc).__name__}: {exc}")
        return None


def _bench(tokens: int, backend: str, reps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mode = "low_latency" if tokens <= LOW_LATENCY_MAX else "high_throughput"
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens_per_rank=tokens,
        dtype=torch.float8_e4m3fn, mode=mode, backend=backend, validate=False,  # no host sync for the id check
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1234 + rank)
    q, scales, ids, w = _inputs(tokens, gen)
    out = comm.dispatch(q, ids, w, scales=scales)
    y = out.hidden_states.to(torch.bfloat16)

    def dispatch():
        return comm.dispatch(q, ids, w, scales=scales)

    def combine():
        return comm.combine(y, out.handle)

    dispatch_us, combine_us = _time_us(dispatch, reps), _time_us(combine, reps)
    dispatch_steady_us = _steady_us(dispatch, STEADY_CALLS, STEADY_REPS)
    combine_steady_us = _steady_us(combine, STEADY_CALLS, STEADY_REPS)
    graph_us = graph_steady_us = None
    if mode == "low_latency":  # decode runs in CUDA graphs: no host in the time

        def round_trip():
            got = dispatch()
            return comm.combine(got.hidden_states.to(torch.bfloat16), got.handle)

        graph_us = _time_us(_captured(round_trip), reps)
        graph_steady_us = _time_us(_captured(round_trip, STEADY_CALLS), reps) / STEADY_CALLS
    if comm.backend == "p2p":
        comm.check()
    row_bytes = HIDDEN + 4 * scales.shape[1] + 8 * TOP_K
    sent = torch.tensor([_remote_bytes(ids, rank, world, row_bytes)], device="cuda")
    back = torch.tensor([_remote_bytes(ids, rank, world, 2 * HIDDEN)], device="cuda")
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    dist.all_reduce(back, op=dist.ReduceOp.MAX)
    row = dict(tokens=tokens, mode=mode, backend=comm.backend, dispatch_us=dispatch_us, combine_us=combine_us,
               round_trip_graph_us=graph_us, dispatch_steady_us=dispatch_steady_us,
               combine_steady_us=combine_steady_us, round_trip_graph_steady_us=graph_steady_us,
               dispatch_bytes=int(sent), combine_bytes=int(back),
               reason=comm.fallback_reason)  # fmt: skip
    comm.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,128,512,4096")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--symm-mem",
        action="store_true",
        help="also time torch.ops.symm_mem.all_to_all_vdev (off by default: with torch 2.11 on 4 H100s it failed a "
        "device-side assertion at 128 tokens per rank, which ends the process)",
    )
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.symm_mem:
        try:  # the vdev ops run on NVSHMEM's symmetric heap; chosen once, before any symmetric allocation
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.set_backend("NVSHMEM")
        except Exception:  # noqa: S110 - older torch, or no NVSHMEM: the baseline then reports n/a
            pass
    rows = []
    if rank == 0:
        print(f"# {world} ranks, {torch.cuda.get_device_name()}, H={HIDDEN}, top-{TOP_K} of {NUM_EXPERTS} experts")
        header = ("tokens", "mode", "backend", "dispatch us", "GB/s", "combine us", "GB/s", "graph round trip us",
                  "NCCL a2a us", "symm_mem us", "NCCL/dispatch", "NCCL/combine", "back to back: dispatch us",
                  "combine us", f"graph of {STEADY_CALLS} round trips, us each")  # fmt: skip
        print(" | ".join(header))
    for tokens in (int(t) for t in args.tokens.split(",")):
        for backend in ("p2p", "nccl"):
            try:
                row = _bench(tokens, backend, args.reps)
            except RuntimeError as exc:  # backend='p2p' impossible here: say so and go on
                if rank == 0:
                    print(f"# {tokens} tokens, {backend}: {exc}")
                continue
            row["nccl_a2a_us"] = _nccl_baseline(row["dispatch_bytes"], world, args.reps)
            row["symm_mem_us"] = _symm_mem_baseline(row["dispatch_bytes"], world, args.reps) if args.symm_mem else None
            rows.append(row)
            if rank == 0:
                d_bw = row["dispatch_bytes"] / row["dispatch_us"] / 1e3
                c_bw = row["combine_bytes"] / row["combine_us"] / 1e3
                symm = f"{row['symm_mem_us']:.1f}" if row["symm_mem_us"] is not None else "n/a"
                trip = f"{graph_us:.1f}" if (graph_us := row["round_trip_graph_us"]) is not None else ""
                print(
                    f"{tokens} | {row['mode']} | {row['backend']} | {row['dispatch_us']:.1f} | {d_bw:.0f} | "
                    f"{row['combine_us']:.1f} | {c_bw:.0f} | {trip} | {row['nccl_a2a_us']:.1f} | {symm} | "
                    f"{row['nccl_a2a_us'] / row['dispatch_us']:.2f}x | {row['nccl_a2a_us'] / row['combine_us']:.2f}x | "
                    f"{row['dispatch_steady_us']:.1f} | {row['combine_steady_us']:.1f} | "
                    + (f"{g:.1f}" if (g := row["round_trip_graph_steady_us"]) is not None else "")
                )
    if rank == 0:
        print("# goals at 4 ranks: low-latency dispatch <= 25 us and combine <= 35 us at 128 tokens (>= 3x NCCL); "
              "high throughput >= 300 GB/s per rank")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
