"""The ``flashinfer_moe::grouped_gemm_`` custom op behind ``moe/gemm.py``'s public functions: its schema, the
CPU implementation (the reference) and the CUDA one, which picks the kernel (Hopper: ``gemm_sm90``'s grouped
GEMMs, GEMM1 with an activation in our wgmma kernel's epilogue, or split into GEMM + ``act_kernel`` where
``pick`` chooses CUTLASS; elsewhere and otherwise the Triton kernel of ``gemm_kernel``). Arguments arrive
checked by ``moe/gemm.py``; dimension legend as there.
"""

from __future__ import annotations

import torch

from flashinfer_moe import reference_gemm as ref
from flashinfer_moe import reference_quant as ref_quant
from flashinfer_moe._ops import LIB, on_device

from . import gemm_config
from .packed import PackedFp8BlockWeights

# Codes shared with moe/gemm_kernel.py (kept here so that the CPU path never imports Triton); the activation
# codes also with the Hopper wgmma kernel (csrc/gemm/sm90_wgmma_common.cuh, through moe/gemm_sm90.py).
A_NONE, A_TENSOR, A_ROW, A_GROUP = 0, 1, 2, 3
W_NONE, W_EXPERT, W_BLOCK = 0, 1, 2
ACT_CODES = {None: 0, "silu": 1, "clamped_silu": 2}
ACT_NAMES = {code: name for name, code in ACT_CODES.items()}
BLOCK = 128  # FP8 block-scale granularity along K (and weight rows)
NO_CAPACITY = 2**31 - 1

LIB.define(
    "grouped_gemm_(Tensor a, Tensor w, Tensor counts, Tensor? offsets, Tensor? a_scale, Tensor? w_scale, "
    "Tensor(a!) out, Tensor(b!)? out_scale, int a_mode, int w_mode, int act, float alpha, float limit, "
    "int capacity, bool fast_accum, int w_packed) -> ()"
)
# w_packed: 0 for w `[E, N, K]`; 1 for w packed (moe/packed.py), 2 packed with gate and up rows interleaved.
W_PLAIN, W_PACKED, W_PACKED_GATED = 0, 1, 2


def _packed(w: torch.Tensor, w_packed: int) -> PackedFp8BlockWeights:
    return PackedFp8BlockWeights(w, w_packed == W_PACKED_GATED)


def _gemm_cpu(
    a,
    w,
    counts,
    offsets,
    a_scale,
    w_scale,
    out,
    out_scale,
    a_mode,
    w_mode,
    act,
    alpha,
    limit,
    capacity,
    fast_accum,
    w_packed,
):
    kind = ACT_NAMES[act]
    w = w if w_packed == W_PLAIN else _packed(w, w_packed).unpack()
    counts = counts.clamp(max=capacity)
    if offsets is None:
        offsets = torch.arange(counts.shape[0], dtype=torch.int32) * capacity
    y = ref.grouped_gemm(
        a,
        w,
        counts,
        offsets,
        a_scale=a_scale,
        w_scale=w_scale,
        activation_kind=kind,
        alpha=alpha,
        limit=limit,
        compute_dtype=torch.float32,
    )  # [R, N]
    # zip stops at the E counts (contiguous offsets hold E + 1 entries).
    for start, count in zip(offsets.tolist(), counts.tolist(), strict=False):
        rows = slice(start, start + count)
        if out_scale is None:
            out[rows] = y[rows].to(out.dtype)
        else:
            out[rows], out_scale[rows] = ref_quant.quantize_fp8_per_token_group(y[rows], BLOCK)


def _gemm_cuda(
    a,
    w,
    counts,
    offsets,
    a_scale,
    w_scale,
    out,
    out_scale,
    a_mode,
    w_mode,
    act,
    alpha,
    limit,
    capacity,
    fast_accum,
    w_packed,
):
    from . import gemm_kernel

    cap = None if offsets is not None else capacity

    def ours(w, chosen=(), packed=False):
        """One kernel of ``gemm_sm90`` (``chosen``: its config and tile order; default ``pick``'s), with the
        activation, if any, in its epilogue."""
        from . import gemm_sm90

        with on_device(a):
            gemm_sm90.launch(
                a,
                a_scale,
                w,
                w_scale,
                out,
                counts,
                offsets,
                cap,
                *chosen,
                activation=ACT_NAMES[act],
                alpha=alpha,
                limit=limit,
                out_scale=out_scale,
                packed=packed,
            )

    if w_packed != W_PLAIN:
        from . import gemm_sm90

        packed = _packed(w, w_packed)
        num_experts, nw, k = packed.shape
        plain_out = not act and out_scale is None
        fits = num_experts <= gemm_sm90.WGMMA_MAX_EXPERTS and (plain_out or gemm_sm90.gated_output_ok(out, out_scale))
        if fits and gemm_sm90.usable(a, w, out if plain_out else None, a_scale, w_scale, nw, k):
            ours(w, packed=True)
            return
        # Elsewhere (no sm_90, more experts than our kernel takes, an output it cannot write) the packing only
        # costs: undo it into a temporary [E, N, K] and go on as for plain weights.
        w = packed.unpack()

    num_experts, nw, k = w.shape
    n = nw // 2 if act else nw
    rows = a.shape[0]
    if a_mode == A_GROUP and w_mode == W_BLOCK:
        from . import gemm_sm90

        if not act and out_scale is None and gemm_sm90.usable(a, w, out, a_scale, w_scale, n, k):
            ours(w)
            return
        gated = act and n % 128 == 0 and gemm_sm90.usable(a, w, None, a_scale, w_scale, nw, k)
        chosen = (
            gated and gemm_sm90.gated_output_ok(out, out_scale) and gemm_sm90.pick_gated(rows, num_experts, cap, nw, k)
        )
        if chosen:
            # GEMM1 in one kernel: the activation (and FP8 groups) in the epilogue, no [R, 2I] intermediate.
            ours(w, chosen)
            return
        if gated and gemm_sm90.split_activation(rows, num_experts, cap):
            # GEMM1: the CUTLASS GEMM to bf16, then the activation (+ FP8) as its own pass; the extra bf16 round
            # trip costs less than the Triton kernel's slower mainloop (docs/perf-notes.md).
            from . import act_kernel

            gate_up = torch.empty(rows, nw, dtype=torch.bfloat16, device=a.device)  # [R, 2I]
            with on_device(a):
                gemm_sm90.launch(a, a_scale, w, w_scale, gate_up, counts, offsets, cap)
                act_kernel.launch(gate_up, out, out_scale, counts, offsets, cap, act, alpha, limit)
            return
    config = gemm_config.pick(a.dtype, a_mode, w_mode, act, out_scale is not None, rows, num_experts, capacity, n, k)
    with on_device(a):
        gemm_kernel.launch(
            a,
            w,
            out,
            out_scale,
            counts,
            offsets,
            a_scale,
            w_scale,
            a_mode=a_mode,
            w_mode=w_mode,
            act=act,
            alpha=alpha,
            limit=limit,
            capacity=capacity,
            fast_accum=fast_accum,
            config=config,
        )


LIB.impl("grouped_gemm_", _gemm_cpu, "CPU")
LIB.impl("grouped_gemm_", _gemm_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::grouped_gemm_", lambda *args: None, lib=LIB)


def run(
    a,
    w,
    counts,
    offsets,
    capacity,
    a_scale,
    w_scale,
    outs,
    a_mode,
    w_mode,
    act,
    alpha,
    limit,
    fast_accum=False,
    w_packed=0,
):
    out = outs[0]
    out_scale = outs[1] if len(outs) == 2 else None
    if a.numel() and out.numel():
        torch.ops.flashinfer_moe.grouped_gemm_(
            a.reshape(-1, a.shape[-1]),
            w,
            counts,
            offsets,
            a_scale,
            w_scale,
            out.view(-1, out.shape[-1]),
            None if out_scale is None else out_scale.view(-1, out_scale.shape[-1]),
            a_mode,
            w_mode,
            act,
            alpha,
            limit,
            capacity,
            bool(fast_accum),
            w_packed,
        )
    return outs if out_scale is not None else out
