"""Triton kernels of the paged MLA decode: the attention (split-KV flash decoding), and the launch of it and of
the combine of split sequences' partial results (``decode_combine.py``).

The schedule (``sched``) comes from ``plan_kernel.py``.

Attention. Rows of the dot products are (new token, head) pairs of one sequence, ``BLOCK_M`` of them per
program (grid axis 0, varying fastest, so the row blocks that read the same pages run together and share
them in L2); columns are ``BLOCK_N`` cached tokens, each token's page found in the block table (which makes
page size 1 the same code as page 64). Scores are ``q_nope . ckv + q_pe . kpe`` on tensor cores, the online
softmax in base 2, the values the first 512 columns of the same tile. FP8 pages are widened in registers after
the load (to fp16 under bf16 queries in small row blocks, ``FP8_F16_MATH``; else to the query dtype); their scale
multiplies the scores and the output instead. The gathered loads and the fold of a tile are in
``decode_tile.py``. Where the pages
hold whole tiles in a contiguous pool (``TMA``), a piece's tiles come by TMA instead (``decode_tma.py``).

Imported only where a kernel is launched (never on the CPU path), so that ``TRITON_INTERPRET=1`` can be set
before the first import to run the kernels on CPU tensors.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .decode_combine import combine_kernel as _combine_kernel
from .decode_tile import D_LATENT, D_ROPE
from .decode_tile import fold as _fold
from .decode_tile import load_tile as _load_tile
from .decode_tma import attend_tma, descriptors
from .plan_kernel import OVERHEAD, UNIT

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Triton 3.6's interpreter computes tl.dot on bf16 operands from their raw bits: interpreted runs widen them
# to fp32 first (exact), the compiled kernel never does.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# FP8 pages under bf16 queries, up to FP8_F16_MAX_ROWS query rows (s_q x h_q) or in pages of one token, are
# widened to fp16, not bf16, with the queries (times the softmax scale) in fp16 too: E4M3 -> fp16 is one
# conversion per two values, E4M3 -> bf16 several, and the widening is on the critical path there (on an H200
# 1.2-1.4x faster up to 32 rows, 1.1x at page 1 with more; 0.84-0.87x with 64 rows or more at page 64,
# docs/perf-notes.md). fp16 holds every E4M3 value exactly; scaled queries beyond its range (65504) would overflow.
FP8_F16_MATH = True
FP8_F16_MAX_ROWS = 32

_UNIT = tl.constexpr(UNIT)
_OVERHEAD = tl.constexpr(OVERHEAD)
_DL = tl.constexpr(D_LATENT)
_DR = tl.constexpr(D_ROPE)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _decode_kernel(
    qn_ptr,
    qp_ptr,
    ckv_ptr,
    kpe_ptr,
    ckv_desc,
    kpe_desc,
    bt_ptr,
    lens_ptr,
    sched_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    scale_ptr,
    B,
    M,
    HQ,
    S_Q,
    max_tokens,
    qk_scale,
    kv_scale_value,
    stride_qn_b,
    stride_qn_s,
    stride_qn_h,
    stride_qp_b,
    stride_qp_s,
    stride_qp_h,
    stride_ckv_p,
    stride_ckv_t,
    stride_kpe_p,
    stride_kpe_t,
    stride_bt,
    stride_o_b,
    stride_o_s,
    stride_o_h,
    stride_l_b,
    stride_l_s,
    stride_l_h,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
    KPE_FP8: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    HAS_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    MIXED: tl.constexpr,
    TMA: tl.constexpr,
    SWAP: tl.constexpr,
    F16: tl.constexpr,
):
    mb = tl.program_id(0)
    p = tl.program_id(1)
    chunk = tl.load(sched_ptr)
    total = tl.load(sched_ptr + 1)
    starts_ptr = sched_ptr + 2
    ends_ptr = starts_ptr + B
    splits_ptr = ends_ptr + B
    slot_ptr = splits_ptr + B
    cursor = p * chunk
    end = tl.minimum(cursor + chunk, total)
    b = tl.load(slot_ptr + B + p)

    kv_scale = 1.0
    if KV_FP8 or KPE_FP8:
        if SCALE_PTR:
            kv_scale = tl.load(scale_ptr)
        else:
            kv_scale = kv_scale_value
    nope_scale = qk_scale * kv_scale if KV_FP8 else qk_scale
    pe_scale = qk_scale * kv_scale if KPE_FP8 else qk_scale
    if F16:  # the queries carry qk_scale (see FP8_F16_MATH); the rope part of MIXED stays in the query dtype
        nope_scale = kv_scale
        if KPE_FP8:
            pe_scale = kv_scale
    out_scale = kv_scale if KV_FP8 else 1.0

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qi = rows // HQ
    qh = rows % HQ
    dl = tl.arange(0, _DL)
    dr = tl.arange(0, _DR)
    qn_rows = qi.to(tl.int64) * stride_qn_s + qh * stride_qn_h
    qp_rows = qi.to(tl.int64) * stride_qp_s + qh * stride_qp_h
    o_rows = qi.to(tl.int64) * stride_o_s + qh * stride_o_h
    l_rows = qi * stride_l_s + qh * stride_l_h

    while cursor < end:
        seq_start = tl.load(starts_ptr + b)
        seq_end = tl.load(ends_ptr + b)
        splits = tl.load(splits_ptr + b)
        piece_end = tl.minimum(end, seq_end)
        # A length past the table row (no host check inside a graph) is cut to the row: nothing past the
        # table is read.
        length = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_tokens)
        tok_lo = tl.maximum(cursor - seq_start - _OVERHEAD, 0) * _UNIT
        tok_hi = tl.minimum(tl.maximum(piece_end - seq_start - _OVERHEAD, 0) * _UNIT, length)

        b64 = b.to(tl.int64)
        bt_row = bt_ptr + b64 * stride_bt
        if CAUSAL:
            vis_min = length - S_Q + 1
            row_vis = length - S_Q + 1 + qi
        else:
            vis_min = length
            row_vis = tl.zeros([BLOCK_M], dtype=tl.int32) + length
        # Tiles every row sees whole need no mask; the rest (the causal diagonal, the tail) do.
        safe = tok_lo + tl.maximum(tl.minimum(tok_hi, vis_min) - tok_lo, 0) // BLOCK_N * BLOCK_N
        if TMA:
            acc, m_i, l_i = attend_tma(
                qn_ptr + b64 * stride_qn_b + qn_rows, qp_ptr + b64 * stride_qp_b + qp_rows, row_ok, ckv_desc,
                kpe_desc, ckv_ptr, kpe_ptr, stride_ckv_t, stride_kpe_t, bt_row, tok_lo, safe, tok_hi, row_vis,
                nope_scale, pe_scale, PAGE, BLOCK_M, BLOCK_N, MIXED, UPCAST, SWAP,
            )  # fmt: skip
        else:
            qn = tl.load(qn_ptr + b64 * stride_qn_b + qn_rows[:, None] + dl[None, :], mask=row_ok[:, None], other=0.0)
            qp = tl.load(qp_ptr + b64 * stride_qp_b + qp_rows[:, None] + dr[None, :], mask=row_ok[:, None], other=0.0)
            if UPCAST:
                qn = qn.to(tl.float32)
                qp = qp.to(tl.float32)
            if F16:
                qn = (qn.to(tl.float32) * qk_scale).to(tl.float16)
                if KPE_FP8:
                    qp = (qp.to(tl.float32) * qk_scale).to(tl.float16)
            acc = tl.zeros([BLOCK_M, _DL], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            if PREFETCH:
                # The next tile's loads are issued before this tile's math (a register double buffer): the
                # compiler's own pipelining does not cover the FP8 widening, and more bytes stay in flight. The
                # last iteration reloads its own tile (in bounds) rather than masking.
                if safe > tok_lo:
                    ckv_t, kpe_t = _load_tile(
                        ckv_ptr,
                        kpe_ptr,
                        bt_row,
                        tok_lo,
                        tok_hi,
                        stride_ckv_p,
                        stride_ckv_t,
                        stride_kpe_p,
                        stride_kpe_t,
                        PAGE,
                        BLOCK_N,
                        False,
                    )
                    for t in range(tok_lo, safe, BLOCK_N):
                        ckv_n, kpe_n = _load_tile(
                            ckv_ptr,
                            kpe_ptr,
                            bt_row,
                            tl.minimum(t + BLOCK_N, safe - BLOCK_N),
                            tok_hi,
                            stride_ckv_p,
                            stride_ckv_t,
                            stride_kpe_p,
                            stride_kpe_t,
                            PAGE,
                            BLOCK_N,
                            False,
                        )
                        acc, m_i, l_i = _fold(
                            acc,
                            m_i,
                            l_i,
                            qn,
                            qp,
                            ckv_t,
                            kpe_t,
                            t,
                            tok_hi,
                            row_vis,
                            nope_scale,
                            pe_scale,
                            BLOCK_N,
                            False,
                            MIXED,
                            UPCAST,
                        )
                        ckv_t, kpe_t = ckv_n, kpe_n
            else:
                for t in range(tok_lo, safe, BLOCK_N):
                    ckv_t, kpe_t = _load_tile(
                        ckv_ptr,
                        kpe_ptr,
                        bt_row,
                        t,
                        tok_hi,
                        stride_ckv_p,
                        stride_ckv_t,
                        stride_kpe_p,
                        stride_kpe_t,
                        PAGE,
                        BLOCK_N,
                        False,
                    )
                    acc, m_i, l_i = _fold(
                        acc,
                        m_i,
                        l_i,
                        qn,
                        qp,
                        ckv_t,
                        kpe_t,
                        t,
                        tok_hi,
                        row_vis,
                        nope_scale,
                        pe_scale,
                        BLOCK_N,
                        False,
                        MIXED,
                        UPCAST,
                    )
            for t in range(safe, tok_hi, BLOCK_N):
                ckv_t, kpe_t = _load_tile(
                    ckv_ptr,
                    kpe_ptr,
                    bt_row,
                    t,
                    tok_hi,
                    stride_ckv_p,
                    stride_ckv_t,
                    stride_kpe_p,
                    stride_kpe_t,
                    PAGE,
                    BLOCK_N,
                    True,
                )
                acc, m_i, l_i = _fold(
                    acc,
                    m_i,
                    l_i,
                    qn,
                    qp,
                    ckv_t,
                    kpe_t,
                    t,
                    tok_hi,
                    row_vis,
                    nope_scale,
                    pe_scale,
                    BLOCK_N,
                    True,
                    MIXED,
                    UPCAST,
                )
        seen = l_i > 0.0
        o = acc * (out_scale / tl.where(seen, l_i, 1.0))[:, None]
        lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        if splits == 1:
            tl.store(
                out_ptr + b64 * stride_o_b + o_rows[:, None] + dl[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
            if HAS_LSE:
                tl.store(lse_ptr + b * stride_l_b + l_rows, lse2 * _LN2, mask=row_ok)
        else:
            slot = (tl.load(slot_ptr + b) + p - seq_start // chunk).to(tl.int64)
            tl.store(part_out_ptr + (slot * M + rows)[:, None] * _DL + dl[None, :], o, mask=row_ok[:, None])
            tl.store(part_lse_ptr + slot * M + rows, lse2, mask=row_ok)
        cursor = piece_end
        b += 1


def launch_decode(
    q_nope,
    q_pe,
    ckv,
    kpe,
    block_table,
    seq_lens,
    sched,
    part_out,
    part_lse,
    out,
    lse,
    sm_scale: float,
    kv_scale,
    causal: bool,
    num_programs: int,
    config: dict,
) -> None:
    """Attention then combine. ``ckv`` `[P, page, 512 or 576]`; ``kpe`` `[P, page, 64]` (a view of ``ckv``'s
    last 64 columns for the one-tensor layout); ``kv_scale`` a float or a 1-element fp32 tensor; ``lse`` may be
    None; ``config["TMA"]``: the TMA loads (``decode_tma.py``) where the layout allows them. Shapes and dtypes
    arrive checked."""
    import torch

    from .decode import tma_layout

    batch, s_q, heads, _ = q_nope.shape
    rows = s_q * heads
    block_m = config["BLOCK_M"]
    fp8 = torch.float8_e4m3fn
    scale_is_tensor = isinstance(kv_scale, torch.Tensor)
    upcast = INTERPRET and q_nope.dtype == torch.bfloat16
    lse_arg = lse if lse is not None else part_lse
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    block_n = config["BLOCK_N"]
    tma = bool(config.get("TMA", 0)) and tma_layout(ckv, kpe, block_n)
    f16 = FP8_F16_MATH and (rows <= FP8_F16_MAX_ROWS or ckv.shape[1] == 1)
    f16 = f16 and ckv.dtype == fp8 and q_nope.dtype == torch.bfloat16
    f16 = f16 and not (upcast or tma)
    grid = (triton.cdiv(rows, block_m), num_programs)
    _decode_kernel[grid](
        q_nope,
        q_pe,
        ckv,
        kpe,
        *(descriptors(ckv, kpe, block_n) if tma else (ckv, kpe)),
        block_table,
        seq_lens,
        sched,
        part_out,
        part_lse,
        out,
        lse_arg,
        kv_scale if scale_is_tensor else sched,
        batch,
        rows,
        heads,
        s_q,
        block_table.shape[1] * ckv.shape[1],
        float(sm_scale) * LOG2E,
        1.0 if scale_is_tensor or kv_scale is None else float(kv_scale),
        *q_nope.stride()[:3],
        *q_pe.stride()[:3],
        ckv.stride(0),
        ckv.stride(1),
        kpe.stride(0),
        kpe.stride(1),
        block_table.stride(0),
        *out.stride()[:3],
        *lse_strides,
        PAGE=ckv.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        KV_FP8=ckv.dtype == fp8,
        KPE_FP8=kpe.dtype == fp8,
        SCALE_PTR=scale_is_tensor,
        HAS_LSE=lse is not None,
        UPCAST=upcast,
        PREFETCH=bool(config.get("PREFETCH", 0)) and not tma,
        MIXED=ckv.dtype == fp8 and kpe.dtype != fp8,
        TMA=tma,
        SWAP=tma and bool(config.get("SWAP", 0)),
        F16=f16,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    launch_combine(sched, part_out, part_lse, out, lse, block_m)


def launch_combine(sched, part_out, part_lse, out, lse, block_m: int) -> None:
    """The merge of split sequences' partial results into ``out`` (and ``lse``, which may be None); also run
    after the CUDA attention kernel (``decode_sm90.py``)."""
    batch, _, heads, _ = out.shape
    rows = part_out.shape[1]
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    combine_m = min(block_m, 16)
    _combine_kernel[(batch, triton.cdiv(rows, combine_m))](
        sched,
        part_out,
        part_lse,
        out,
        lse if lse is not None else part_lse,
        batch,
        rows,
        heads,
        *out.stride()[:3],
        *lse_strides,
        BLOCK_M=combine_m,
        HAS_LSE=lse is not None,
        num_warps=4,
    )
