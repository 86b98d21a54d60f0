"""GEMM1's gated activation (and FP8 re-quantization) as its own pass over a bf16 `[rows, 2 N]` GEMM output.

On Hopper, where ``gemm_sm90.pick`` runs the block-scaled GEMM1 on a CUTLASS kernel (whose epilogue has no gated
activation; our wgmma kernel applies it in its own epilogue), this pass applies it with the same formulas and the
same quantization convention as the Triton GEMM's fused epilogue (``moe/gemm_kernel.py``). Only rows that belong to an expert are read and written, so the layout's
padding and the masked layout's unused slots keep whatever they held. Runs under ``TRITON_INTERPRET=1`` too.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The activation and the scale rule are the GEMM epilogue's own functions, so the two paths cannot drift.
from .gemm_kernel import FP8_MAX, SCALE_BLOCK, fp8_group_scale, gated_activation

_FP8_MAX = tl.constexpr(FP8_MAX)
_GROUP = tl.constexpr(SCALE_BLOCK)


@triton.jit
def gated_act_kernel(
    x_ptr,  # [rows, 2 N] bf16: gate columns, then up columns
    out_ptr,  # [rows, N]
    out_scale_ptr,  # [rows, N / 128] fp32 (QUANT_OUT only)
    counts_ptr,  # [E]
    offsets_ptr,  # [E + 1] (contiguous) or unused (masked)
    rows,
    N,
    num_experts,
    capacity,
    stride_x,
    stride_o,
    stride_os,
    alpha,
    limit,
    MASKED: tl.constexpr,
    ACT: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)  # one 128-column group: one scale per row when quantizing
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = pid_g * _GROUP + tl.arange(0, _GROUP)
    if MASKED:
        expert = offs_r // capacity
        count = tl.load(counts_ptr + expert, mask=offs_r < rows, other=0)
        owned = (offs_r < rows) & (offs_r - expert * capacity < tl.minimum(count, capacity))
    else:
        # A row is owned when it falls inside some expert's [offset, offset + count).
        offs_e = tl.arange(0, E_POW2)
        first = tl.load(offsets_ptr + offs_e, mask=offs_e < num_experts, other=0)
        count = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
        inside = (offs_r[:, None] >= first[None, :]) & (offs_r[:, None] < first[None, :] + count[None, :])
        owned = (tl.sum(inside.to(tl.int32), 1) > 0) & (offs_r < rows)
    r64 = offs_r.to(tl.int64)
    mask = owned[:, None] & (offs_n[None, :] < N)
    gate = tl.load(x_ptr + r64[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r64[:, None] * stride_x + (N + offs_n)[None, :], mask=mask, other=0.0).to(tl.float32)
    y = gated_activation(gate, up, alpha, limit, ACT)
    if QUANT_OUT:
        amax = tl.max(tl.abs(y), 1)  # [BLOCK_R]
        scale, inv = fp8_group_scale(amax)
        q = tl.minimum(tl.maximum(y * inv[:, None], -_FP8_MAX), _FP8_MAX)
        tl.store(out_ptr + r64[:, None] * stride_o + offs_n[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_scale_ptr + r64 * stride_os + pid_g, scale, mask=owned)
    else:
        tl.store(out_ptr + r64[:, None] * stride_o + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, out, out_scale, counts, offsets, capacity, act: int, alpha: float, limit: float) -> None:
    """``out[r] = act(x[r])`` (and FP8 per 128 columns with ``out_scale``) for every row an expert owns.

    Args:
        x: `[rows, 2 N]` bf16 (gate columns first), rows as in the layout.
        out: `[rows, N]` (FP8 when ``out_scale`` is given); N a multiple of 128.
        out_scale: `[rows, N / 128]` float32, or None.
        counts: `[E]` int32.
        offsets: `[E + 1]` int32 (contiguous layout), or None (masked, ``capacity`` rows per expert).
    """
    rows, n = out.shape[0], out.shape[-1]
    num_experts = counts.shape[0]
    out2 = out.reshape(rows, n)
    scale2 = out_scale.reshape(rows, -1) if out_scale is not None else out2
    block_r = 16
    grid = (triton.cdiv(rows, block_r), n // SCALE_BLOCK)
    gated_act_kernel[grid](
        x,
        out2,
        scale2,
        counts,
        offsets if offsets is not None else counts,
        rows,
        n,
        num_experts,
        max(int(capacity or 1), 1),
        x.stride(0),
        out2.stride(0),
        scale2.stride(0),
        float(alpha),
        float(limit),
        MASKED=offsets is None,
        ACT=act,
        QUANT_OUT=out_scale is not None,
        E_POW2=triton.next_power_of_2(num_experts),
        BLOCK_R=block_r,
        num_warps=4,
    )
