"""Random NVFP4 expert weights as ModelOpt stores them, their float64 dequantization, and a launcher of the
Triton kernel (its fixture, ``nvfp4_kernel``, is in conftest.py), shared by the CPU, interpreter and GPU tests of
the NVFP4 grouped GEMMs and MoE layer."""

import torch

from flashinfer_moe import reference as ref
from flashinfer_moe import reference_quant as rq

FP8 = torch.float8_e4m3fn


def nvfp4_weights(num_experts: int, n: int, k: int, g: torch.Generator, device="cpu", gated: bool = False):
    """``(w [E, N, K/2] uint8, block_scale [E, N, K/16] e4m3, global_scale [E] or [E, 2] fp32)``: each expert
    (and with ``gated`` each half of its rows) quantized with its own global scale, magnitudes spread across
    experts and rows, as a checkpoint's gate_proj and up_proj are quantized separately."""
    w = torch.randn(num_experts, n, k, generator=g) / k**0.5
    w = w * (0.25 + torch.rand(num_experts, n, 1, generator=g) * 4)
    halves = [w[:, : n // 2], w[:, n // 2 :]] if gated else [w]
    packed, scales, globals_ = [], [], []
    for part in halves:
        gs = part.abs().amax(dim=(1, 2)) / (6 * 448)  # [E], ModelOpt's weight_scale_2
        q = [rq.quantize_nvfp4(part[e], float(gs[e])) for e in range(num_experts)]
        packed.append(torch.stack([p for p, _, _ in q]))
        scales.append(torch.stack([s for _, s, _ in q]))
        globals_.append(gs.float())
    w_q = torch.cat(packed, dim=1)
    s = torch.cat([x.view(torch.uint8) for x in scales], dim=1).view(FP8)
    gs = torch.stack(globals_, dim=1) if gated else globals_[0]
    return w_q.to(device), s.to(device), gs.to(device)


def dequantized(w, block_scale, global_scale) -> torch.Tensor:
    """float64 `[E, N, K]` of NVFP4 weights, on their device; a `[E, 2]` global scale covers the first and
    second half of the rows."""
    return rq.nvfp4_global_scaled(rq.dequantize_nvfp4(w, block_scale, 1.0).double(), global_scale)


def grouped_reference(a, w, block_scale, global_scale, counts, offsets, activation) -> torch.Tensor:
    """float64 `[rows, N]` (or `[rows, N / 2]` with an activation) of an NVFP4 grouped GEMM on ``a``'s device:
    group ``e`` is rows ``offsets[e]`` to ``offsets[e] + counts[e]``, and only experts that own rows are
    dequantized. Rows of no group are zero."""
    a2 = a.reshape(-1, a.shape[-1]).double()
    n = w.shape[1] // 2 if activation else w.shape[1]
    out = torch.zeros(a2.shape[0], n, dtype=torch.float64, device=a.device)
    for e, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist(), strict=False)):
        if count:
            we = dequantized(w[e : e + 1], block_scale[e : e + 1], global_scale[e : e + 1])[0]
            rows = slice(start, start + count)
            out[rows] = ref.activation(a2[rows] @ we.T, activation)
    return out


def launch_kernel(kernel, a, w, s, gs, out, counts, offsets, act, capacity, kperm=False, split_bits=False, **cfg):
    """One launch of the Triton kernel with a small tile config (``cfg`` overrides it)."""
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2, GROUP_M=2) | cfg
    kernel.launch(
        a,
        w,
        s,
        gs,
        out,
        counts,
        offsets,
        act=act,
        alpha=1.702,
        limit=7.0,
        capacity=capacity,
        config=config,
        kperm=kperm,
        split_bits=split_bits,
    )


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations for the W4A8 GEMMs: ``(q [..., K] e4m3, scale [...] fp32)``, one scale per row
    (``amax / 448``, at least 2**-126)."""
    scale = (x.float().abs().amax(dim=-1) / 448).clamp(min=2.0**-126)
    return (x.float() / scale[..., None]).to(FP8), scale


def w4a8_reference(a, a_scale, w, block_scale, global_scale, counts, offsets, activation) -> torch.Tensor:
    """float64 `[rows, N]` of a W4A8 grouped GEMM as the kernel rounds it: FP8 rows ``a`` times ``a_scale`` (per row
    or one), weights folded to ``8 x e4m3(|e2m1| x block_scale / 8)`` (``w4a8_weight_values``); plain ``w``."""
    from flashinfer_moe.moe.gemm_nvfp4_w4a8 import w4a8_weight_values

    a2 = a.reshape(-1, a.shape[-1]).double()
    s = a_scale.reshape(-1).double()
    a2 = a2 * (s[:, None] if s.numel() > 1 else s)
    values = rq.nvfp4_global_scaled(w4a8_weight_values(w, block_scale).double(), global_scale)
    n = w.shape[1] // 2 if activation else w.shape[1]
    out = torch.zeros(a2.shape[0], n, dtype=torch.float64, device=a.device)
    for e, (start, count) in enumerate(zip(offsets.tolist(), counts.tolist(), strict=False)):
        if count:
            rows = slice(start, start + count)
            out[rows] = ref.activation(a2[rows] @ values[e].T, activation)
    return out


def every_code_weights(k: int = 256):
    """``(w [1, N, K / 2] uint8, block_scale [1, N, K / 16] e4m3, N)`` with N = 16 x 128 rows: every E2M1 code under
    every finite non-negative E4M3 scale (subnormals and zero included; 16 more rows of scale 0), for the tests that
    read the expanded weights back through an identity."""
    n = 16 * 128
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16).view(1, n, k)
    scales = (torch.arange(128, dtype=torch.uint8) % 127).repeat_interleave(16)[:, None].expand(n, k // 16)
    return rq.pack_nibbles(codes), scales.clone().view(FP8)[None], n
