"""The Triton grouped GEMM behind every ``grouped_gemm_*`` op: one kernel, specialised at compile time by
operand type, scale granularity, fused activation and output quantization.

Each program owns one `[BLOCK_M, BLOCK_N]` output tile of one expert. Experts' row tiles are numbered
expert by expert (``ceil(tokens_per_expert[e] / BLOCK_M)`` each); a program finds its expert with a prefix
sum over the `[E]` counts it loads itself, so the schedule needs no host sync and no scratch buffer, and
the same kernel serves the contiguous layout (rows start at ``expert_offsets[e]``) and the masked one
(``e * C``). The grid is a static upper bound on the tile count; surplus programs return at once.

Imported only where a kernel is launched (never on the CPU path), so that ``TRITON_INTERPRET=1`` can be
set before the first import to run the kernel on CPU tensors.

Dimension legend: ``E`` experts, ``N`` output columns, ``K`` reduction, ``R`` rows of the layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Scale granularities (constexpr codes shared with moe/gemm.py).
SCALE_NONE, SCALE_TENSOR, SCALE_ROW, SCALE_GROUP = 0, 1, 2, 3  # activations: none, one, per row, per row x 128
WSCALE_NONE, WSCALE_EXPERT, WSCALE_BLOCK = 0, 1, 2  # weights: none, one per expert, per 128 x 128 block
ACT_NONE, ACT_SILU, ACT_CLAMPED_SILU = 0, 1, 2

FP8_MAX = 448.0
MIN_SCALE = 2.0**-126
FLT_MAX = 3.4028234663852886e38
SCALE_BLOCK = 128  # the K (and weight N) granularity of group and block scales

# The same values as constexprs: a jitted function may only read globals of that type.
_SCALE_NONE = tl.constexpr(SCALE_NONE)
_SCALE_TENSOR = tl.constexpr(SCALE_TENSOR)
_SCALE_ROW = tl.constexpr(SCALE_ROW)
_SCALE_GROUP = tl.constexpr(SCALE_GROUP)
_WSCALE_NONE = tl.constexpr(WSCALE_NONE)
_WSCALE_EXPERT = tl.constexpr(WSCALE_EXPERT)
_WSCALE_BLOCK = tl.constexpr(WSCALE_BLOCK)
_ACT_NONE = tl.constexpr(ACT_NONE)
_ACT_SILU = tl.constexpr(ACT_SILU)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_FLT_MAX = tl.constexpr(FLT_MAX)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


@triton.jit
def gated_activation(gate, up, alpha, limit, ACT: tl.constexpr):
    """``silu(gate) * up`` (ACT_SILU) or gpt-oss's clamped form (ACT_CLAMPED_SILU), in fp32."""
    if ACT == _ACT_SILU:
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        y = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    return y


@triton.jit
def fp8_group_scale(amax):
    """``(scale, 1 / scale)`` of a group from its amax, as quantize_fp8_per_token_group computes them:
    scale = max(amax / 448, 2**-126), the reciprocal correctly rounded and finite."""
    scale = tl.maximum(tl.div_rn(amax, _FP8_MAX), _MIN_SCALE)
    inv = tl.minimum(tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), _FLT_MAX)
    return scale, inv


@triton.jit
def _tile_of(
    pid_m, counts_ptr, offsets_ptr, E, capacity, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr
):
    """(expert, first row, rows in the tile) of row tile ``pid_m``; expert == E when the tile does not exist."""
    idx = tl.arange(0, BLOCK_E)
    # A count past the capacity (a caller's bug) must not spill into the next expert's slots.
    counts = tl.minimum(tl.load(counts_ptr + idx, mask=idx < E, other=0), capacity)  # [E]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    expert = tl.sum((ends <= pid_m).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(idx == expert, ends - tiles, 0), 0)
    count = tl.sum(tl.where(idx == expert, counts, 0), 0)
    local = (pid_m - first_tile) * BLOCK_M
    if MASKED:
        row0 = expert * capacity + local
    else:
        row0 = tl.load(offsets_ptr + tl.minimum(expert, E - 1)) + local
    return expert, row0, count - local


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [R, K]
    w_ptr,  # [E, NW, K]
    out_ptr,  # [R, N]
    out_scale_ptr,  # [R, N / 128] when QUANT_OUT
    counts_ptr,  # [E] int32
    offsets_ptr,  # [E] int32, first row of each expert (contiguous)
    a_scale_ptr,
    w_scale_ptr,
    E,
    N,  # output columns (NW / 2 with an activation)
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_osm,
    stride_asm,  # a_scale row stride (ROW / GROUP)
    stride_wse,  # w_scale expert stride (EXPERT / BLOCK)
    stride_wsn,  # w_scale block-row stride (BLOCK)
    num_m_tiles,
    capacity,  # slots per expert (masked), else 2**31 - 1
    alpha,
    limit,
    MASKED: tl.constexpr,
    A_SCALE: tl.constexpr,
    W_SCALE: tl.constexpr,
    ACT: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    EVEN_K: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    # Consecutive programs sweep GROUP_M row tiles for one column tile, so a weight tile is read from HBM
    # once per GROUP_M row tiles rather than once per tile.
    per_group = GROUP_M * num_n_tiles
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    expert, row0, rows = _tile_of(pid_m, counts_ptr, offsets_ptr, E, capacity, MASKED, BLOCK_M, BLOCK_E)
    if expert >= E:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the expert's last repeat its last row and columns past N repeat column N - 1: every load
    # stays in bounds without a mask, and the stores below drop them.
    a_rows = (row0 + tl.minimum(offs_m, rows - 1)).to(tl.int64)
    w_cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_ptrs = w_base + w_cols[:, None] * stride_wn + offs_k[None, :]
    if ACT != _ACT_NONE:
        u_ptrs = w_ptrs + N * stride_wn  # the up rows follow the gate rows in w13

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACT != _ACT_NONE:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if A_SCALE == _SCALE_GROUP:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
    if W_SCALE == _WSCALE_BLOCK:
        ws_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
        ws_ptrs = ws_base + (w_cols // _SCALE_BLOCK) * stride_wsn
        if ACT != _ACT_NONE:
            wsu_ptrs = ws_base + ((w_cols + N) // _SCALE_BLOCK) * stride_wsn

    for k0 in range(0, K, BLOCK_K):
        kb = k0 // BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k[None, :] < K - k0
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        if ACT != _ACT_NONE:
            if EVEN_K:
                u = tl.load(u_ptrs)
            else:
                u = tl.load(u_ptrs, mask=k_ok, other=0.0)
        if A_SCALE == _SCALE_GROUP or W_SCALE == _WSCALE_BLOCK:
            # Scales change every 128 along K, so each K block's product is scaled before it joins the
            # fp32 accumulator (BLOCK_K == 128 here).
            if A_SCALE == _SCALE_GROUP:
                sa = tl.load(as_ptrs + kb)[:, None]  # [BLOCK_M, 1]
            else:
                sa = 1.0
            if W_SCALE == _WSCALE_BLOCK:
                sw = tl.load(ws_ptrs + kb)[None, :]  # [1, BLOCK_N]
            else:
                sw = 1.0
            acc += tl.dot(a, tl.trans(w)) * (sa * sw)
            if ACT != _ACT_NONE:
                if W_SCALE == _WSCALE_BLOCK:
                    swu = tl.load(wsu_ptrs + kb)[None, :]
                else:
                    swu = 1.0
                acc_up += tl.dot(a, tl.trans(u)) * (sa * swu)
        else:
            # FP8 wgmma accumulates with reduced precision: MAX_IMPRECISE (128) makes the compiler promote
            # the partial sums to full fp32 every 128 along K, as the block-scaled path does by construction;
            # None (fast_accum) keeps the whole K in the tensor cores' accumulator: faster, less accurate.
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=MAX_IMPRECISE)
            if ACT != _ACT_NONE:
                acc_up = tl.dot(a, tl.trans(u), acc_up, max_num_imprecise_acc=MAX_IMPRECISE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if ACT != _ACT_NONE:
            u_ptrs += BLOCK_K

    # Scales that are constant along K are applied once, here.
    if A_SCALE == _SCALE_TENSOR:
        s = tl.load(a_scale_ptr)
        acc *= s
        if ACT != _ACT_NONE:
            acc_up *= s
    if A_SCALE == _SCALE_ROW:
        s_row = tl.load(a_scale_ptr + a_rows * stride_asm)[:, None]
        acc *= s_row
        if ACT != _ACT_NONE:
            acc_up *= s_row
    if W_SCALE == _WSCALE_EXPERT:
        s = tl.load(w_scale_ptr + expert * stride_wse)
        acc *= s
        if ACT != _ACT_NONE:
            acc_up *= s

    if ACT != _ACT_NONE:
        acc = gated_activation(acc, acc_up, alpha, limit, ACT)

    out_rows = (row0 + offs_m).to(tl.int64)
    store_mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    if QUANT_OUT:
        # One fp32 scale per 128 output columns of a row (BLOCK_N is a multiple of 128 here), the same
        # convention as quantize_fp8_per_token_group: scale = max(amax / 448, 2**-126), q = x * (1 / scale).
        groups: tl.constexpr = BLOCK_N // _SCALE_BLOCK
        amax = tl.max(tl.abs(tl.reshape(acc, (BLOCK_M, groups, _SCALE_BLOCK))), 2)  # [BLOCK_M, groups]
        scale, inv = fp8_group_scale(amax)
        q = tl.reshape(acc, (BLOCK_M, groups, _SCALE_BLOCK)) * inv[:, :, None]
        q = tl.reshape(tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX), (BLOCK_M, BLOCK_N))
        tl.store(
            out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], q.to(out_ptr.dtype.element_ty), mask=store_mask
        )
        offs_g = pid_n * groups + tl.arange(0, groups)
        tl.store(
            out_scale_ptr + out_rows[:, None] * stride_osm + offs_g[None, :],
            scale,
            mask=(offs_m[:, None] < rows) & (offs_g[None, :] < N // _SCALE_BLOCK),
        )
    else:
        tl.store(
            out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=store_mask
        )


def launch(
    a,
    w,
    out,
    out_scale,
    counts,
    offsets,
    a_scale,
    w_scale,
    *,
    a_mode: int,
    w_mode: int,
    act: int,
    alpha: float,
    limit: float,
    capacity: int,
    config: dict,
    fast_accum: bool = False,
) -> None:
    """Launch the kernel on 2-D views: ``a [R, K]``, ``w [E, NW, K]``, ``out [R, N]`` (all unit stride in
    their last dimension); ``counts`` `[E]` int32; ``offsets`` `[E]` int32 (contiguous) or None (masked,
    expert ``e`` at row ``e * capacity``); scales as their modes need. The grid is a static bound on the row
    tiles, from the layout's shape, never from the counts (no host sync)."""
    num_experts, nw, k = w.shape
    n = nw // 2 if act != ACT_NONE else nw
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    rows = a.shape[0]
    if offsets is None:  # masked: at most ceil(C / BLOCK_M) row tiles per expert
        num_m_tiles_bound = num_experts * triton.cdiv(capacity, block_m)
    else:  # contiguous: each expert wastes less than one tile
        num_m_tiles_bound = triton.cdiv(rows, block_m) + min(num_experts, rows)
    grid = (num_m_tiles_bound * triton.cdiv(n, block_n),)
    dummy = counts  # any device pointer for the unused ones
    grouped_gemm_kernel[grid](
        a,
        w,
        out,
        out_scale if out_scale is not None else dummy,
        counts,
        offsets if offsets is not None else dummy,
        a_scale if a_scale is not None else dummy,
        w_scale if w_scale is not None else dummy,
        num_experts,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        out_scale.stride(0) if out_scale is not None else 0,
        a_scale.stride(0) if a_mode in (SCALE_ROW, SCALE_GROUP) else 0,
        w_scale.stride(0) if w_mode != WSCALE_NONE else 0,
        w_scale.stride(1) if w_mode == WSCALE_BLOCK else 0,
        num_m_tiles_bound,
        capacity,
        alpha,
        limit,
        MASKED=offsets is None,
        A_SCALE=a_mode,
        W_SCALE=w_mode,
        ACT=act,
        QUANT_OUT=out_scale is not None,
        EVEN_K=k % block_k == 0,
        MAX_IMPRECISE=SCALE_BLOCK if a.dtype.itemsize == 1 and not fast_accum else None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        GROUP_M=config.get("GROUP_M", 8),
        num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 3),
    )
