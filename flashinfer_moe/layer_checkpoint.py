"""One expert projection's checkpoint tensors, checked and converted as ``MoELayer`` loads them: a float or FP8
weight with its optional block (``weight_scale_inv``) or tensor (``weight_scale``) scale, and the static
activation scale (``input_scale``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _checks
from .moe.quant import FLOATS, FP8, quantize_fp8_block_weights
from .reference_quant import dequantize_fp8_block

BLOCK = 128


def projection(weights: Mapping[str, torch.Tensor], key: str, shape: tuple[int, int]):
    """``(weight, weight_scale_inv, weight_scale)`` of one projection, checked; absent scales are None."""
    w = _checks.tensor(key + "weight", weights[key + "weight"])
    if tuple(w.shape) != shape:
        raise ValueError(f"{key}weight must have shape {shape}, got {tuple(w.shape)}")
    _checks.dtype_in(key + "weight", w, (*FLOATS, FP8))
    finite(key + "weight", w)
    block, tensor = weights.get(key + "weight_scale_inv"), weights.get(key + "weight_scale")
    if w.dtype != FP8:
        for name, s in (("weight_scale_inv", block), ("weight_scale", tensor)):
            if s is not None:
                raise ValueError(
                    f"{key}{name} must be absent for a {str(w.dtype).replace('torch.', '')} weight, got a tensor"
                )
        return w, None, None
    if (block is None) == (tensor is None):
        got = "both" if block is not None else "neither"
        raise ValueError(f"{key}weight_scale_inv or {key}weight_scale must be given (one) for an FP8 weight, got {got}")
    name = key + ("weight_scale_inv" if block is not None else "weight_scale")
    s = _checks.tensor(name, block if block is not None else tensor)
    _checks.dtype_in(name, s, FLOATS)
    expected = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)) if block is not None else None
    if (expected is not None and tuple(s.shape) != expected) or (expected is None and s.numel() != 1):
        raise ValueError(f"{name} must have shape {expected or '() (one value)'}, got {tuple(s.shape)}")
    s = finite(name, s.float())
    return (w, s, None) if block is not None else (w, None, s.reshape(()))


def input_scale(weights: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    name = key + "input_scale"
    if name not in weights:
        raise ValueError(f"{name} must be given for a layer with static activation scales, got no such key")
    s = _checks.tensor(name, weights[name])
    _checks.dtype_in(name, s, FLOATS)
    if s.numel() != 1:
        raise ValueError(f"{name} must hold one value, got shape {tuple(s.shape)}")
    return finite(name, s.detach().float().reshape(()).cpu())


def finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, checked once at load time to hold no inf or NaN (FP8 NaN codes included)."""
    bad = ~torch.isfinite(t.detach().float() if t.element_size() == 1 else t.detach())
    if bool(bad.any()):
        raise ValueError(f"{name} must hold finite values, got {int(bad.sum())} non-finite of {t.numel()}")
    return t


def dense(w: torch.Tensor, block_scale: torch.Tensor | None, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    """One projection's weight in fp32 (or its own float dtype), FP8 dequantized with its scale."""
    if block_scale is not None:
        return dequantize_fp8_block(w, block_scale)
    if tensor_scale is not None:
        return w.float() * tensor_scale
    return w


def as_blocks(w, block_scale, tensor_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, weight_scale_inv)`` of one projection: as stored when it is FP8 blocks already, else quantized."""
    if block_scale is not None:
        return w, block_scale
    return quantize_fp8_block_weights(dense(w, block_scale, tensor_scale))
