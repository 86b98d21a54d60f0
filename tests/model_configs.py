"""Routing configurations of real models and random inputs for them (tests and benchmarks)."""

import torch

# Routing configurations of real models: name -> (E, k, route() keyword arguments).
MODEL_ROUTING = {
    "deepseek_v3": (
        256,
        8,
        dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5),
    ),
    "kimi_k2": (
        384,
        8,
        dict(scoring_func="sigmoid", num_expert_group=1, topk_group=1, renormalize=True, routed_scaling_factor=2.827),
    ),
    "qwen3": (128, 8, dict(scoring_func="softmax", renormalize=True)),
    "mixtral": (8, 2, dict(scoring_func="softmax", renormalize=True)),
    "llama4": (16, 1, dict(scoring_func="sigmoid", renormalize=False)),
}
BIASED_MODELS = {"deepseek_v3", "kimi_k2"}


def model_inputs(name: str, num_tokens: int, dtype: torch.dtype, device, generator: torch.Generator):
    """Fresh random logits (and a correction bias where the model has one) for a model's routing."""
    num_experts, top_k, kwargs = MODEL_ROUTING[name]
    logits = (torch.randn(num_tokens, num_experts, generator=generator) * 2.0).to(device=device, dtype=dtype)
    kwargs = dict(kwargs)
    if name in BIASED_MODELS:
        kwargs["correction_bias"] = (torch.rand(num_experts, generator=generator) * 0.2 - 0.1).to(device)
    return logits, top_k, kwargs
