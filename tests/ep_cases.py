"""Expert-parallel layer cases shared by the CPU and GPU tests: global checkpoints drawn from a seed (every
rank draws the same), the single-process reference (``MoELayer`` over all experts plus the shared MLP), the
layer under test, and the comparison."""

from __future__ import annotations

import torch
from test_layer import ROUTING as ROUTINGS

import flashinfer_moe
from flashinfer_moe import EPMoELayer, MoELayer

# DeepSeek-style routing at a size that runs on CPUs: 12 experts split over 1, 2, 3 or 4 ranks.
E, K, H, I = 12, 4, 256, 128
ROUTING = ROUTINGS["deepseek_v3"]
# Bound of the worst token's relative error per quant: bf16 rounding of the exchanged sums; FP8 block the same
# quantized operands summed in another order, where an fp32 sum one ulp apart can round GEMM2's FP8 input to the
# next e4m3 value (6% of that element; 1.17% of a token seen, seed 15403230 on three ranks, so 3%); FP8 per
# tensor, activations quantized per 128 channels on the wire where the single-process layer takes one scale for the
# whole batch (a token far below the batch's amax keeps only a few bits there: up to ~6% seen). A token missing one
# of its k = 4 experts scores ~0.25 or more.
TOLERANCE = {None: 1e-2, "fp8_block": 3e-2, "fp8_tensor": 0.1, "nvfp4": 1e-2}
PROJECTIONS = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def checkpoint(seed: int, fp8: bool = False, prefix: str = "") -> dict[str, torch.Tensor]:
    """HF-named global weights: routed experts, one shared expert, router and correction bias. ``fp8`` stores
    the experts as DeepSeek-V3 does (float8_e4m3fn with 128 x 128 ``weight_scale_inv``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    names = [f"experts.{e}" for e in range(E)] + ["shared_experts"]
    for name in names:
        for proj, shape in PROJECTIONS.items():
            w = (torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(torch.bfloat16)
            if fp8:
                q, s = flashinfer_moe.quantize_fp8_block_weights(w.float())
                out[f"{prefix}{name}.{proj}.weight"], out[f"{prefix}{name}.{proj}.weight_scale_inv"] = q, s
            else:
                out[f"{prefix}{name}.{proj}.weight"] = w
    out[f"{prefix}gate.weight"] = (torch.randn(E, H, generator=g) / H**0.5).to(torch.bfloat16)
    out[f"{prefix}gate.e_score_correction_bias"] = torch.rand(E, generator=g) * 0.2 - 0.1
    return out


def tokens(seed: int, rank: int, count: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(count, H, generator=g).to(torch.bfloat16).to(device)


def skewed_logits(x: torch.Tensor, rank_experts: range) -> torch.Tensor:
    """Router logits that send every token to experts of one rank only (the others far below)."""
    logits = torch.full((x.shape[0], E), -30.0, device=x.device)
    logits[:, rank_experts.start : rank_experts.stop] = torch.linspace(1.0, 2.0, len(rank_experts), device=x.device)
    return logits


def build(group, quant, mode, device, weights, **kwargs) -> EPMoELayer:
    layer = EPMoELayer(
        E, K, H, I, group=group, quant=quant, mode=mode, max_tokens_per_rank=48, low_latency_max_tokens=24,
        num_shared_experts=1, device=device, **ROUTING, **kwargs,
    )  # fmt: skip
    layer.load_expert_weights(weights)
    return layer


class Reference:
    """The single-process layer on the same global weights: ``MoELayer`` over all ``E`` experts plus the shared
    MLP (a one-expert ``MoELayer`` whose softmax over one logit weighs it 1)."""

    def __init__(self, quant, device, weights):
        self.routed = MoELayer(E, K, H, I, quant=quant, device=device, **ROUTING)
        self.routed.load_expert_weights(weights, "experts.")
        self.routed.load_router_weight(weights["gate.weight"], weights["gate.e_score_correction_bias"])
        self.shared = MoELayer(1, 1, H, I, router=False, quant=quant, device=device)
        self.shared.load_expert_weights(weights, "", experts=["shared_experts"])

    def __call__(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        one = torch.zeros(x.shape[0], 1, device=x.device)
        return (self.routed(x, logits).float() + self.shared(x, one).float()).to(x.dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst token's ``|out - ref| / |ref|`` (2-norms over H) in float64; 0 for an empty batch. A token
    that misses one expert's share scores about that share, whatever the other tokens do."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape and torch.isfinite(out).all(), "wrong shape or non-finite output"
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)).max())
