"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) ops (installed as ``flashinfer_moe.mla``): paged decode
over bf16/fp16 or FP8 latent caches."""
