"""Triton kernel of the paged MLA decode's split-KV schedule (one program), read by ``decode_kernel.py``.

Schedule. Every sequence costs ``ceil(L / UNIT) + OVERHEAD`` units (``UNIT`` = 64 tokens; the overhead stands
for the per-piece fixed work: loading the queries, the epilogue, the combine). The costs are laid end to end
and cut into ``num_programs`` chunks of equal size; attention program ``p`` walks chunk ``p``, which may end
one sequence and start the next ones. A sequence that a chunk boundary cuts is *split*: each piece writes a
normalized partial output and its LSE into the workspace slots the schedule gave the sequence, and the
combine kernel merges them; an unsplit sequence's program writes ``out`` directly.

Where every sequence costs the same, a chunk of whole sequences (``ceil(B / num_programs)`` of them) is taken
instead when it is at most ``SNAP`` units longer than the balanced chunk: then no sequence is split, and the
split's own cost (the second piece's query loads and epilogue, the partial results' round trip, the combine)
is gone. On an H200 that made batch 128 at 4096 tokens on 132 SMs 1.05-1.09x faster (66 units against 64).

The schedule depends only on ``seq_lens`` values, which the plan kernel reads on the device, so the sizes of
everything (grid, workspace) are fixed by the batch and ``num_programs`` and a CUDA graph replays with new
lengths.

``sched`` (int32) layout: ``[chunk, total, starts[B], ends[B], splits[B], slot[B], first_seq[num_programs]]``.

Imported only where a kernel is launched (never on the CPU path), so that ``TRITON_INTERPRET=1`` can be set
before the first import to run the kernel on CPU tensors.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

UNIT = 64  # tokens per schedule unit; every BLOCK_N divides it
OVERHEAD = 2  # schedule units charged per sequence piece
SNAP = 8  # how many units longer than the balanced chunk a chunk of whole equal sequences may be

_UNIT = tl.constexpr(UNIT)
_OVERHEAD = tl.constexpr(OVERHEAD)
_SNAP = tl.constexpr(SNAP)


def sched_size(batch: int, num_programs: int) -> int:
    return 2 + 4 * batch + num_programs


# ------------------------------------------------------------------------------------------------- plan


@triton.jit
def _plan_kernel(lens_ptr, sched_ptr, B, P, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    offs = tl.arange(0, BLOCK_B)
    total = 0
    cmin = 2**30
    cmax = 0
    for b0 in range(0, B, BLOCK_B):
        idx = b0 + offs
        lens = tl.maximum(tl.load(lens_ptr + idx, mask=idx < B, other=0), 0)
        cost = (lens + _UNIT - 1) // _UNIT + _OVERHEAD
        total += tl.sum(tl.where(idx < B, cost, 0), 0)
        cmin = tl.minimum(cmin, tl.min(tl.where(idx < B, cost, 2**30), 0))
        cmax = tl.maximum(cmax, tl.max(tl.where(idx < B, cost, 0), 0))
    chunk = tl.maximum((total + P - 1) // P, 1)
    whole = (B + P - 1) // P * cmax  # ceil(B / P) whole sequences a chunk, where all cost the same
    chunk = tl.where((cmin == cmax) & (whole - chunk <= _SNAP), whole, chunk)
    tl.store(sched_ptr, chunk)
    tl.store(sched_ptr + 1, total)
    starts_ptr = sched_ptr + 2
    ends_ptr = starts_ptr + B
    splits_ptr = ends_ptr + B
    slot_ptr = splits_ptr + B
    first_ptr = slot_ptr + B
    carry = 0
    slot_carry = 0
    for b0 in range(0, B, BLOCK_B):
        idx = b0 + offs
        ok = idx < B
        lens = tl.maximum(tl.load(lens_ptr + idx, mask=ok, other=0), 0)
        cost = tl.where(ok, (lens + _UNIT - 1) // _UNIT + _OVERHEAD, 0)
        ends = carry + tl.cumsum(cost, 0)
        starts = ends - cost
        splits = (ends - 1) // chunk - starts // chunk + 1
        taken = tl.where(ok & (splits > 1), splits, 0)
        slot = slot_carry + tl.cumsum(taken, 0) - taken
        tl.store(starts_ptr + idx, starts, mask=ok)
        tl.store(ends_ptr + idx, ends, mask=ok)
        tl.store(splits_ptr + idx, splits, mask=ok)
        tl.store(slot_ptr + idx, slot, mask=ok)
        carry += tl.sum(cost, 0)
        slot_carry += tl.sum(taken, 0)
    # The binary search below reads the ends this program's threads just stored.
    tl.debug_barrier()
    poffs = tl.arange(0, BLOCK_P)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + poffs
        target = p * chunk
        lo = tl.zeros([BLOCK_P], dtype=tl.int32)
        hi = tl.zeros([BLOCK_P], dtype=tl.int32) + B
        for _ in tl.static_range(SEARCH_STEPS):  # first sequence whose end is past the chunk's start
            live = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(ends_ptr + mid, mask=live, other=0)
            right = live & (end <= target)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(live & ~right, mid, hi)
        tl.store(first_ptr + p, lo, mask=p < P)


def launch_plan(seq_lens, sched, num_programs: int) -> None:
    batch = seq_lens.shape[0]
    _plan_kernel[(1,)](
        seq_lens,
        sched,
        batch,
        num_programs,
        BLOCK_B=min(triton.next_power_of_2(max(batch, 16)), 1024),
        BLOCK_P=min(triton.next_power_of_2(max(num_programs, 16)), 256),
        SEARCH_STEPS=max(1, math.ceil(math.log2(batch + 1))),
        num_warps=4,
    )


# -------------------------------------------------------------------------------------------- attention
