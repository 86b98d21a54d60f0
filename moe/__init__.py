"""Single-GPU MoE ops (installed as ``flashinfer_moe.moe``): routing, expert-major layouts, permute with fused
quantization, quantizers, grouped GEMMs, combine, and the fused pipeline."""
