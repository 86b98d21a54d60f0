"""``EPMoELayer``'s constructor checks, run on every rank of the group together (``validate_collectively``)."""

from __future__ import annotations

import torch

from . import _checks
from .layer import BLOCK, QUANTS, MoELayer

FP8_QUANTS = ("fp8_block", "fp8_tensor")  # the quants whose tokens travel as FP8 rows
MODES = ("auto", "high_throughput", "low_latency")


def checked_parts(world_size: int, device: torch.device, **a) -> tuple[MoELayer, MoELayer]:
    """The constructor's checks (run on every rank by ``validate_collectively``); returns the local experts and
    a meta-device layer that holds the checked routing options."""
    num_experts, hidden_size, intermediate_size, quant = (
        a["num_experts"], a["hidden_size"], a["intermediate_size"], a["quant"]
    )  # fmt: skip
    mode, max_tokens_per_rank, low_latency_max_tokens = a["mode"], a["max_tokens_per_rank"], a["low_latency_max_tokens"]
    num_shared_experts, shared_intermediate_size = a["num_shared_experts"], a["shared_intermediate_size"]
    params_dtype, activation, alpha, limit = a["params_dtype"], a["activation"], a["alpha"], a["limit"]
    _checks.integer("num_experts", num_experts, 1)
    if num_experts % world_size:
        raise ValueError(f"num_experts must be divisible by the group size {world_size}, got {num_experts}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if quant in FP8_QUANTS and (hidden_size % BLOCK or intermediate_size % BLOCK):
        raise ValueError(
            f"hidden_size and intermediate_size must be multiples of {BLOCK} with quant={quant!r} (FP8 "
            f"rows travel with one scale per {BLOCK} channels), got {hidden_size} and {intermediate_size}"
        )
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _checks.integer("max_tokens_per_rank", max_tokens_per_rank, 1)
    _checks.integer("low_latency_max_tokens", low_latency_max_tokens, 1)
    _checks.integer("num_shared_experts", num_shared_experts, 0)
    if shared_intermediate_size is not None:
        _checks.integer("shared_intermediate_size", shared_intermediate_size, 1)
        if num_shared_experts == 0:
            raise ValueError(f"shared_intermediate_size needs num_shared_experts > 0, got {shared_intermediate_size}")
    if params_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"params_dtype must be bfloat16 or float16, got {params_dtype}")
    # The routed experts: every check of MoELayer's (routing options, activation, dtypes) applies.
    experts = MoELayer(
        num_experts // world_size, 1, hidden_size, intermediate_size, router=False, quant=quant,
        activation=activation, alpha=alpha, limit=limit, params_dtype=params_dtype, device=device,
    )  # fmt: skip
    routing = MoELayer(
        num_experts, a["top_k"], hidden_size, 1, router=a["router"], scoring_func=a["scoring_func"],
        renormalize=a["renormalize"], num_expert_group=a["num_expert_group"], topk_group=a["topk_group"],
        correction_bias=a["correction_bias"], routed_scaling_factor=a["routed_scaling_factor"],
        params_dtype=params_dtype, device="meta",
    )  # fmt: skip
    return experts, routing
