"""``MoELayer(quant="nvfp4")``'s parameters and checkpoint loading (ModelOpt NVFP4 as stored, or higher precision
quantized on load).

A ModelOpt NVFP4 checkpoint (DeepSeek-R1/V3 FP4, Kimi-K2 FP4, Qwen3 FP4) holds per expert and projection
(``gate_proj``, ``up_proj``, ``down_proj``): ``weight`` `[N, K / 2]` uint8, ``weight_scale`` `[N, K / 16]`
float8_e4m3fn, ``weight_scale_2`` (one fp32 value) and ``input_scale`` (one fp32 value, the activations' global
scale, which W4A16 does not use). Gate and up are quantized separately, so their ``weight_scale_2`` may differ:
the layer keeps both, ``w13_global_scale`` `[E, 2]`, and GEMM1 applies each to its half of the rows, exactly.

Dimension legend: ``E`` experts, ``H`` hidden, ``I`` intermediate.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from . import _checks
from .layer_checkpoint import dense, projection
from .moe.packed_nvfp4 import K_MULTIPLE as PACK_K_MULTIPLE
from .moe.packed_nvfp4 import _convert, repack_nvfp4_experts_in_place
from .moe.quant import FLOATS, FP8, quantize_nvfp4

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
K_MULTIPLE = 32


def add_parameters(layer: nn.Module, num_experts: int, hidden: int, inter: int, device) -> None:
    """The scale parameters of an NVFP4 layer, zero (block scales) or one until loaded: ``w13_scale``
    `[E, 2I, H / 16]` and ``w2_scale`` `[E, H, I / 16]` float8_e4m3fn, ``w13_global_scale`` `[E, 2]` (gate, up)
    and ``w2_global_scale`` `[E]` fp32, and the checkpoint's ``input_scale`` as ``w13_input_scale`` `[E, 2]` /
    ``w2_input_scale`` `[E]` (kept, unused by W4A16). ``w13`` `[E, 2I, H / 2]` and ``w2`` `[E, H, I / 2]` uint8
    are the layer's own."""

    def param(*shape, dtype, fill):
        return nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False)

    e, h, i = num_experts, hidden, inter
    layer.w13_scale = nn.Parameter(torch.zeros(e, 2 * i, h // 16, dtype=FP8, device=device), requires_grad=False)
    layer.w2_scale = nn.Parameter(torch.zeros(e, h, i // 16, dtype=FP8, device=device), requires_grad=False)
    layer.w13_global_scale = param(e, 2, dtype=torch.float32, fill=1.0)
    layer.w2_global_scale = param(e, dtype=torch.float32, fill=1.0)
    layer.w13_input_scale = param(e, 2, dtype=torch.float32, fill=1.0)
    layer.w2_input_scale = param(e, dtype=torch.float32, fill=1.0)


def _one_value(key: str, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    s = _checks.tensor(key, weights[key])
    _checks.dtype_in(key, s, FLOATS)
    if s.numel() != 1:
        raise ValueError(f"{key} must hold one value, got shape {tuple(s.shape)}")
    v = s.detach().float().reshape(()).cpu()
    if not (torch.isfinite(v) and v > 0):
        raise ValueError(f"{key} must be a positive finite number, got {v.item()}")
    return v


def _projection(layer, weights: Mapping[str, torch.Tensor], key: str, shape: tuple[int, int]):
    """``(packed, block_scale, global_scale, input_scale or None)`` of one projection, checked; a float or FP8
    weight is quantized to NVFP4 here (global scale from its amax)."""
    n, k = shape
    w = _checks.tensor(key + "weight", weights[key + "weight"])
    if w.dtype != torch.uint8:
        parts = projection(weights, key, shape)  # the layer's own checks, and FP8 dequantized
        packed, block, gs = quantize_nvfp4(dense(*parts).float().to(layer.w13.device))
        return packed, block, gs.reshape(()).cpu(), None
    if tuple(w.shape) != (n, k // 2):
        raise ValueError(f"{key}weight must have shape {(n, k // 2)} (NVFP4, two codes per byte), got {tuple(w.shape)}")
    for name in ("weight_scale", "weight_scale_2"):
        if key + name not in weights:
            raise ValueError(f"{key}{name} must be given for an NVFP4 (uint8) weight, got no such key")
    s = _checks.tensor(key + "weight_scale", weights[key + "weight_scale"])
    _checks.dtype_in(key + "weight_scale", s, (FP8,))
    if tuple(s.shape) != (n, k // 16):
        raise ValueError(f"{key}weight_scale must have shape {(n, k // 16)}, got {tuple(s.shape)}")
    if not bool(torch.isfinite(s.float()).all()):
        raise ValueError(f"{key}weight_scale must hold finite values, got a NaN")
    gs = _one_value(key + "weight_scale_2", weights)
    inp = _one_value(key + "input_scale", weights) if key + "input_scale" in weights else None
    return w, s, gs, inp


@torch.no_grad()
def load(layer, weights: Mapping[str, torch.Tensor], prefix: str, names: list) -> None:
    """Fills the NVFP4 layer's ``w13``/``w2``, block scales, global scales and input scales from per-expert
    tensors (see :meth:`MoELayer.load_expert_weights`); checks every expert before writing any."""
    h, i = layer.hidden_size, layer.intermediate_size
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    loaded = [
        {p: _projection(layer, weights, f"{prefix}{name}.{p}.", shapes[p]) for p in _PROJECTIONS} for name in names
    ]
    device = layer.w13.device
    for e, parts in enumerate(loaded):
        (wg, sg, gg, ig), (wu, su, gu, iu), (wd, sd, gd, idn) = (parts[p] for p in _PROJECTIONS)
        w13, wd = torch.cat((wg.to(device), wu.to(device))), wd.to(device)
        if layer.weights_packed:  # K-permuted (split, and shaped) as the rest of the layer's weights
            w13 = _convert(w13, True, layer.nvfp4_split_bits).view(layer.w13.shape[1:])
            wd = _convert(wd, True, layer.nvfp4_split_bits).view(layer.w2.shape[1:])
        layer.w13[e] = w13
        # Concatenated as bytes: not every torch build concatenates float8.
        layer.w13_scale[e] = torch.cat((sg.view(torch.uint8).to(device), su.view(torch.uint8).to(device))).view(FP8)
        layer.w2[e], layer.w2_scale[e] = wd, sd.to(device)
        layer.w13_global_scale[e] = torch.stack((gg, gu)).to(device)
        layer.w2_global_scale[e] = gd.to(device)
        if ig is not None and iu is not None:
            layer.w13_input_scale[e] = torch.stack((ig, iu)).to(device)
        if idn is not None:
            layer.w2_input_scale[e] = idn.to(device)


def check_sizes(hidden: int, inter: int) -> None:
    if hidden % K_MULTIPLE or inter % K_MULTIPLE:
        raise ValueError(
            f"hidden_size and intermediate_size must be multiples of {K_MULTIPLE} with quant='nvfp4', "
            f"got {hidden} and {inter}"
        )


def check_packable(hidden: int, inter: int) -> None:
    if hidden % PACK_K_MULTIPLE or inter % PACK_K_MULTIPLE:
        raise ValueError(
            f"hidden_size and intermediate_size must be multiples of {PACK_K_MULTIPLE} to K-permute NVFP4 weights, "
            f"got {hidden} and {inter}"
        )


def _plain(w: torch.Tensor) -> torch.Tensor:
    """`[E, N, K / 2]` view of weights in either shape."""
    return w.view(*w.shape[:2], -1)


def packed_views(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed layer's ``w13`` and ``w2`` as `[E, N, K / 2]` views (its parameters are shaped in spans)."""
    return _plain(layer.w13), _plain(layer.w2)


SPLIT_WORD = 4  # bytes per split-bits word: the last dimension of a layer packed with split bits


@torch.no_grad()
def repack(layer: nn.Module, pack: bool, split_bits: bool = False) -> None:
    """K-permutes (``pack``; with ``split_bits`` into split bits) or restores the layer's ``w13`` and ``w2`` in
    place; if ``w2`` fails, ``w13`` is put back, so the layer is never half converted. Packed, the parameters are
    viewed `[E, N, K / 64, 32]` (one row of 32 bytes per permuted span), with split bits `[E, N, K / 8, 4]` (one
    row per word): a packed ``state_dict`` then loads only into a layer packed the same way, and a plain one only
    into a plain layer, instead of either being read in another byte order."""
    w13, w2 = _plain(layer.w13.data), _plain(layer.w2.data)
    repack_nvfp4_experts_in_place(w13, w2, pack=pack, split_bits=split_bits)
    row = SPLIT_WORD if split_bits else PACK_K_MULTIPLE // 2
    for name, w in (("w13", w13), ("w2", w2)):
        shaped = w.view(*w.shape[:2], -1, row) if pack else w
        setattr(layer, name, nn.Parameter(shaped, requires_grad=False))
