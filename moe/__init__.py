"""Single-GPU MoE ops (installed as ``flashinfer_moe.moe``): routing, expert-major layouts, permute with fused
quantization, quantizers, and combine. Grouped GEMMs arrive with their own module."""
