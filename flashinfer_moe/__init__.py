"""flashinfer-moe: Mixture-of-Experts kernels and expert-parallel communication for NVIDIA GPUs.

Dimension legend used across the API: ``T`` tokens, ``E`` experts, ``H`` hidden size, ``I`` expert
intermediate size, ``k`` experts per token, ``R`` rows of an expert-major layout, ``C`` slots per expert
of the masked layout.

One MoE layer, single GPU::

    topk_weights, topk_ids = route(router_logits, k)             # [T, k], [T, k]
    layout = moe_align_contiguous(topk_ids, E, block_rows=128)   # where each (t, j) pair lives
    q, scales = permute_fp8_per_token_group(hidden, layout)      # [R, H] FP8, [R, H / 128]
    h = grouped_gemm_fp8_block_contiguous(q, scales, w13, w13_scale, layout,
                                          activation="silu", quantize_output=True)  # ([R, I], [R, I / 128])
    y = grouped_gemm_fp8_block_contiguous(*h, w2, w2_scale, layout)  # [R, H] bf16
    out = combine(y, topk_weights, layout)                       # [T, H]

or all of it in one call: ``fused_moe(hidden, w13, w2, topk_weights, topk_ids, quant="fp8_block", ...)``.
"""

from ._version import __version__
from .ep_layer import EPMoELayer
from .errors import CommTimeoutError, FlashInferMoEError, JitError, KernelLaunchError
from .layer import MoELayer
from .layout import ExpertLayout
from .mla.append import mla_append_kv
from .mla.attention import MLAAttention
from .mla.decode import MLADecodePlan, mla_decode, mla_decode_plan
from .mla.merge import merge_attn_states
from .mla.prefill import mla_prefill
from .moe.fused import fused_moe
from .moe.gemm import (
    grouped_gemm_bf16_contiguous,
    grouped_gemm_bf16_masked,
    grouped_gemm_fp8_block_contiguous,
    grouped_gemm_fp8_block_masked,
    grouped_gemm_fp8_tensor_contiguous,
    grouped_gemm_fp8_tensor_masked,
)
from .moe.gemm_nvfp4 import grouped_gemm_nvfp4_contiguous, grouped_gemm_nvfp4_masked
from .moe.layout import moe_align_contiguous, moe_align_masked
from .moe.packed import PackedFp8BlockWeights, pack_fp8_block_weights
from .moe.packed_nvfp4 import PackedNvfp4Weights, pack_nvfp4_weights
from .moe.permute import combine, permute, permute_fp8_per_tensor, permute_fp8_per_token_group, permute_nvfp4
from .moe.quant import (
    dequantize_nvfp4,
    quantize_fp8_block_weights,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
    quantize_nvfp4,
)
from .moe.routing import route

__all__ = [
    "__version__",
    "CommTimeoutError",
    "EPMoELayer",
    "ExpertLayout",
    "FlashInferMoEError",
    "JitError",
    "KernelLaunchError",
    "MLAAttention",
    "MLADecodePlan",
    "MoELayer",
    "PackedFp8BlockWeights",
    "PackedNvfp4Weights",
    "combine",
    "dequantize_nvfp4",
    "fused_moe",
    "grouped_gemm_bf16_contiguous",
    "grouped_gemm_bf16_masked",
    "grouped_gemm_fp8_block_contiguous",
    "grouped_gemm_fp8_block_masked",
    "grouped_gemm_fp8_tensor_contiguous",
    "grouped_gemm_fp8_tensor_masked",
    "grouped_gemm_nvfp4_contiguous",
    "grouped_gemm_nvfp4_masked",
    "merge_attn_states",
    "mla_append_kv",
    "mla_decode",
    "mla_decode_plan",
    "mla_prefill",
    "moe_align_contiguous",
    "moe_align_masked",
    "pack_fp8_block_weights",
    "pack_nvfp4_weights",
    "permute",
    "permute_fp8_per_tensor",
    "permute_fp8_per_token_group",
    "permute_nvfp4",
    "quantize_fp8_block_weights",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "quantize_nvfp4",
    "route",
]
