"""Single-GPU MoE ops (installed as ``flashinfer_moe.moe``): routing for now; permutation, quantization,
grouped GEMMs and combine arrive with their own modules."""
