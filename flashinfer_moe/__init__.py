"""flashinfer-moe: Mixture-of-Experts kernels and expert-parallel communication for NVIDIA GPUs.

Dimension legend used across the API: ``T`` tokens, ``E`` experts, ``H`` hidden size, ``I`` expert
intermediate size, ``k`` experts per token, ``R`` rows of an expert-major layout, ``C`` slots per expert
of the masked layout.

One MoE layer, single GPU::

    topk_weights, topk_ids = route(router_logits, k)             # [T, k], [T, k]
    layout = moe_align_contiguous(topk_ids, E, block_rows=128)   # where each (t, j) pair lives
    q, scales = permute_fp8_per_token_group(hidden, layout)      # [R, H] FP8, [R, H / 128]
    y = ...  # the experts' GEMMs, [R, H]
    out = combine(y, topk_weights, layout)                       # [T, H]
"""

from ._version import __version__
from .errors import CommTimeoutError, FlashInferMoEError, JitError, KernelLaunchError
from .layout import ExpertLayout
from .moe.layout import moe_align_contiguous, moe_align_masked
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
    "ExpertLayout",
    "FlashInferMoEError",
    "JitError",
    "KernelLaunchError",
    "combine",
    "dequantize_nvfp4",
    "moe_align_contiguous",
    "moe_align_masked",
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
