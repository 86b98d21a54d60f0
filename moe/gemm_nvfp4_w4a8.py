"""NVFP4 weights with FP8 activations (W4A8): the grouped GEMMs' second variant, ``grouped_gemm_nvfp4_*`` called
with ``float8_e4m3fn`` activations and their scales, on weights packed with ``pack_nvfp4_weights(w, w4a8=True)``.

The FP8 wgmma multiplies 32 K a step, and NVFP4's block scales change every 16, so the kernel cannot apply them per
step as the W4A16 kernel does: it folds each block scale into its weights, ``e4m3(|e2m1| x block_scale / 8)`` (the
8 back with the global scale), an E4M3 rounding of every weight whose product has more than E4M3's 4 significant
bits. That rounding and the activations' own make W4A8 less exact than W4A16, which expands the weights exactly:
docs/perf.md has both errors, measured. :func:`w4a8_weight_values` is that rounding, and the CPU implementation
computes with it, so the CPU and GPU results differ by the summation order only.

The activations' scales are per row (`[R]`, `[E, C]`: the kernel's epilogue multiplies each token's sums by its
scale) or per tensor (one element); the scales of 128-channel groups, which the FP8 block GEMM takes, would make the
kernel rescale its accumulators every 128 K.

Dimension legend as in ``moe/gemm_nvfp4.py``.
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_gemm as ref
from flashinfer_moe import reference_quant as ref_quant
from flashinfer_moe._ops import LIB

from .gemm_op import ACT_NAMES
from .packed_nvfp4 import PackedNvfp4Weights
from .quant import FP8

__all__ = ["w4a8_weight_values"]

LIB.define(
    "grouped_gemm_nvfp4_w4a8_(Tensor a, Tensor a_scale, Tensor w, Tensor w_block_scale, Tensor w_global_scale, "
    "Tensor counts, Tensor? offsets, Tensor(a!) out, int act, float alpha, float limit, int capacity) -> ()"
)


def w4a8_weight_values(w: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The values the W4A8 kernel multiplies, before the global scale: ``sign x 8 x e4m3(|e2m1(w)| x block_scale
    / 8)`` (round to nearest even), float32 `[..., K]`.

    Args:
        w: plain `[..., K / 2]` uint8 codes (ModelOpt layout).
        block_scale: `[..., K / 16]` float8_e4m3fn.
    """
    codes = ref_quant.unpack_nibbles(w)
    magnitude = ref_quant.e2m1_decode(codes & 7)
    scale = block_scale.float().repeat_interleave(16, dim=-1)
    folded = (magnitude * scale / 8).to(FP8).float() * 8
    return torch.where(codes >= 8, -folded, folded)


def _reference(a, a_scale, w, w_block_scale, w_global_scale, counts, offsets, out, act, alpha, limit, capacity):
    # w holds W4A8 words; computed in fp32 on a's device.
    plain = PackedNvfp4Weights(w, w4a8=True).unpack()
    wf = ref_quant.nvfp4_global_scaled(w4a8_weight_values(plain, w_block_scale), w_global_scale)
    af = a.float() * (a_scale.reshape(()) if a_scale.numel() == 1 else a_scale[:, None])
    kind = ACT_NAMES[act]
    ref.grouped_gemm_into(out, af, wf, counts, offsets, capacity, activation_kind=kind, alpha=alpha, limit=limit)


def _gemm_cuda(a, a_scale, w, w_block_scale, w_global_scale, counts, offsets, out, act, alpha, limit, capacity):
    from . import gemm_nvfp4_sm90 as sm90

    kw = dict(act=act, alpha=alpha, limit=limit, capacity=capacity, kperm=True, a_scale=a_scale)
    if sm90.run_if_usable(a, w, w_block_scale, w_global_scale, out, counts, offsets, **kw):
        return
    # Other GPUs and operands the kernel does not take: the same arithmetic in torch (host syncs, slow).
    _reference(a, a_scale, w, w_block_scale, w_global_scale, counts, offsets, out, act, alpha, limit, capacity)


LIB.impl("grouped_gemm_nvfp4_w4a8_", _reference, "CPU")
LIB.impl("grouped_gemm_nvfp4_w4a8_", _gemm_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::grouped_gemm_nvfp4_w4a8_", lambda *args: None, lib=LIB)


def check_activation_scale(a_scale: object, a: torch.Tensor) -> torch.Tensor:
    """``a_scale`` of FP8 activations ``a``: float32, one per row (`[R]` or `[E, C]`, ``a``'s shape without K) or
    one for the tensor; returned flattened (`[rows]` or `[1]`), contiguous."""
    if a_scale is None:
        raise ValueError("a_scale is required with float8_e4m3fn activations a (one per row, or one per tensor)")
    s = _checks.tensor("a_scale", a_scale)
    _checks.dtype_in("a_scale", s, (torch.float32,))
    _checks.same_device("a_scale", s, "a", a)
    lead = tuple(a.shape[:-1])
    if tuple(s.shape) not in (lead, (), (1,)):
        raise ValueError(
            f"a_scale must have shape {lead} (one per row) or () or (1,) (one per tensor), got {tuple(s.shape)}"
        )
    return s.reshape(-1).contiguous()
