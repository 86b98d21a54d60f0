"""How much of MoELayer's FP8 block-scaled error (test_layer's GPU test at T = 1) comes from re-quantizing
GEMM1's output: for many seeds, the layer's error against the float64 reference, and the error against the
same reference whose GEMM2 is fed the kernel's own FP8 input (``q1``, ``s1``).

    python launch/requant_error.py [--seeds 60]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus  # noqa: E402

require_gpus(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_layer import GPU_SHAPE, hf_experts, layer_weights_ref, make_layer, rel_error  # noqa: E402

from flashinfer_moe import reference  # noqa: E402
from flashinfer_moe.moe import gemm  # noqa: E402
from flashinfer_moe.moe.layout import moe_align_contiguous  # noqa: E402
from flashinfer_moe.moe.permute import permute_fp8_per_token_group  # noqa: E402
from flashinfer_moe.reference_gemm import grouped_gemm as ref_grouped_gemm  # noqa: E402
from flashinfer_moe.reference_layout import combine_rows  # noqa: E402
from flashinfer_moe.reference_layout import moe_align_contiguous as ref_align  # noqa: E402

ROUTING = dict(scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)


def errors(seed: int) -> tuple[float, float]:
    num_experts, top_k, hidden, inter = GPU_SHAPE
    g = torch.Generator().manual_seed(seed)
    layer = make_layer("deepseek_v3", num_experts, top_k, hidden, inter, "fp8_block", g, device="cuda")
    layer.load_expert_weights(hf_experts(g, num_experts, hidden, inter))
    x = torch.randn(1, hidden, generator=g).bfloat16().cuda()
    logits = (torch.randn(1, num_experts, generator=g) * 2).cuda()
    out = layer(x, logits)
    weights, ids = reference.route(logits, top_k, correction_bias=layer.correction_bias, **ROUTING)
    ws = layer_weights_ref(layer)
    rsf = layer.routed_scaling_factor
    ref = reference.fused_moe(
        x.cpu(),
        **ws,
        topk_weights=weights.cpu(),
        topk_ids=ids.cpu(),
        quant="fp8_block",
        routed_scaling_factor=rsf,
        out_dtype=torch.float64,
    )
    # GEMM1 as the layer runs it, to get the FP8 input its GEMM2 saw.
    layout = moe_align_contiguous(ids.int(), num_experts, 1)
    a, a_scale = permute_fp8_per_token_group(x, layout)
    q1, s1 = gemm.grouped_gemm_fp8_block_contiguous(
        a, a_scale, layer.w13, layer.w13_scale, layout, quantize_output=True, activation="silu"
    )
    rl = ref_align(ids.cpu(), num_experts, 1)
    y = ref_grouped_gemm(
        q1.cpu(),
        ws["w2"],
        rl.tokens_per_expert,
        rl.expert_offsets[:-1],
        a_scale=s1.cpu(),
        w_scale=ws["w2_scale"],
        compute_dtype=torch.float64,
    )
    ref_same_input = combine_rows(y, weights.cpu(), rl.row_of, rsf, None, torch.float64)
    return rel_error(out, ref), rel_error(out, ref_same_input)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--seed", type=int, action="append", default=[], help="extra seeds to include")
    args = parser.parse_args()
    rows = torch.tensor([errors(s) for s in [*args.seed, *range(args.seeds)]])
    for name, col in (("layer vs reference", rows[:, 0]), ("with the kernel's GEMM2 input", rows[:, 1])):
        print(f"{name}: median {col.median():.4f}, max {col.max():.4f} over {len(col)} seeds")


if __name__ == "__main__":
    main()
