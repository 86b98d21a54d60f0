"""The MoE runner behind SGLang's ``--moe-runner-backend flashinfer_moe``: which layers it takes, and the
runner core that turns SGLang's standard dispatch output into its combine input with :func:`fused_moe`.

Imported only by :mod:`flashinfer_moe.integrations.sglang`, once SGLang is known to be installed and in range.

Dimension legend: ``T`` tokens, ``k`` top-k, ``E`` local experts, ``H`` hidden, ``I`` intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore, MoeQuantInfo, MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.moe.utils import get_moe_a2a_backend, resolve_moe_runner_backend
from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
from sglang.srt.utils import is_cuda

from flashinfer_moe import envs
from flashinfer_moe.moe.fused import fused_moe
from flashinfer_moe.moe.packed_nvfp4 import K_MULTIPLE as NVFP4_K_MULTIPLE
from flashinfer_moe.moe.packed_nvfp4 import PackedNvfp4Weights, repack_nvfp4_experts_in_place

BACKEND = "flashinfer_moe"
SCALE_BLOCK = 128  # the only FP8 weight block (DeepSeek-V3's 128 x 128) our kernels take


@dataclass
class FlashInferMoEQuantInfo(MoeQuantInfo):
    """The weights one call needs, in :func:`fused_moe`'s terms.

    Attributes:
        w13: `[E, 2I, H]` gate rows then up rows (bf16/fp16, or float8_e4m3fn with ``quant``).
        w2: `[E, H, I]`, the dtype of ``w13``.
        quant: ``None``, ``"fp8_block"``, ``"fp8_tensor"`` or ``"nvfp4"``.
        w13_scale, w2_scale: ``[E, 2I/128, H/128]``/``[E, H/128, I/128]`` (block) or `[E]` (tensor) float32;
            NVFP4: the E4M3 block scales ``[E, 2I, H/16]``/``[E, H, I/16]``.
        w13_global_scale, w2_global_scale: NVFP4 only, ModelOpt's ``weight_scale_2``: `[E, 2]` (gate, up), `[E]`.
        a13_scale, a2_scale: static activation scales (per-tensor FP8 with ``activation_scheme="static"``).
        activation: ``"silu"`` or ``"clamped_silu"``; ``alpha``/``limit`` for the latter.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    quant: str | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class Takeover:
    """How a layer runs on our kernels: its quantization, activation and whether its w13 rows arrive
    interleaved (gate, up, gate, ...) and are split into halves after loading."""

    quant: str | None
    activation: str
    alpha: float
    limit: float
    split_interleaved_w13: bool

    def describe(self, method: object) -> str:
        what = {
            None: "bf16/fp16",
            "fp8_block": "FP8 block 128x128",
            "fp8_tensor": "FP8 per tensor",
            "nvfp4": "NVFP4 W4A16",
        }[self.quant]
        return f"{type(method).__name__} ({what}, {self.activation})"


def plan_takeover(method: object, layer: torch.nn.Module) -> tuple[Takeover | None, str]:
    """``(Takeover, "")`` when our kernels run ``layer`` exactly as SGLang's Triton runner would, else
    ``(None, why not)``: the layer then keeps SGLang's own runner."""
    cfg: MoeRunnerConfig = layer.moe_runner_config
    if type(method) is UnquantizedFusedMoEMethod:
        quant = None
        dtype = layer.w13_weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            return None, f"unquantized weights of dtype {dtype} (bf16/fp16 are supported)"
        if method.use_triton_kernels or method.use_flashinfer_trtllm_moe or method.use_deep_gemm:
            return None, "the layer was built for another kernel family's weight layout"
    elif type(method) is Fp8MoEMethod:
        if method.use_mxfp8 or method.is_fp4_expert:
            return None, "MXFP8/FP4 experts (FP8 E4M3 with float32 scales is supported)"
        if method.block_quant:
            if list(method.weight_block_size) != [SCALE_BLOCK, SCALE_BLOCK]:
                return None, f"weight_block_size {list(method.weight_block_size)} (128x128 is supported)"
            quant = "fp8_block"
        else:
            quant = "fp8_tensor"
    elif type(method) is ModelOptNvFp4FusedMoEMethod:
        config = method.quant_config
        if not config.is_checkpoint_nvfp4_serialized or config.group_size not in (None, 16):
            return None, "NVFP4 other than a serialized ModelOpt checkpoint with 16-element groups"
        if getattr(layer, "inference_moe_w13_interleaved", False):
            return None, "NVFP4 gate/up rows stored interleaved"
        quant = "nvfp4"
    else:
        return (
            None,
            f"quant method {type(method).__name__} (unquantized, Fp8MoEMethod and ModelOpt NVFP4 are supported)",
        )
    if getattr(method, "with_bias", False):
        return None, "expert biases"
    if not cfg.is_gated or cfg.activation != "silu":
        return None, f"activation {cfg.activation!r} (gated 'silu' is supported)"
    if cfg.swiglu_limit is not None:
        return None, f"swiglu_limit={cfg.swiglu_limit} (the clamp before silu_and_mul)"
    if cfg.gemm1_beta is not None:
        return None, f"gemm1_beta={cfg.gemm1_beta}"
    if cfg.gemm1_alpha is None and cfg.gemm1_clamp_limit is not None:
        return None, f"gemm1_clamp_limit={cfg.gemm1_clamp_limit} without gemm1_alpha (silu, clamp, multiply)"
    if cfg.apply_router_weight_on_input and cfg.top_k != 1:
        return None, f"apply_router_weight_on_input with top_k={cfg.top_k} (SGLang allows it with top_k=1)"
    if not get_moe_a2a_backend().is_none():
        return None, f"--moe-a2a-backend {get_moe_a2a_backend().value} (its dispatch output is not the standard one)"
    h, two_i = layer.w13_weight.shape[2] * (2 if quant == "nvfp4" else 1), layer.w13_weight.shape[1]
    if quant == "nvfp4" and (h % 32 or (two_i // 2) % 32):
        return None, f"H={h}, I={two_i // 2} not multiples of 32 with NVFP4"
    if quant == "fp8_block" and (h % SCALE_BLOCK or (two_i // 2) % SCALE_BLOCK):
        return None, f"H={h}, I={two_i // 2} not multiples of 128 with FP8 block scales"
    activation, alpha, limit, interleaved = "silu", 1.702, 7.0, False
    if cfg.gemm1_alpha is not None:
        if cfg.gemm1_clamp_limit is None:
            return None, "gemm1_alpha without gemm1_clamp_limit"
        activation, alpha, limit = "clamped_silu", float(cfg.gemm1_alpha), float(cfg.gemm1_clamp_limit)
        interleaved = bool(cfg.gate_up_interleaved)
        if interleaved and quant is not None:
            # Splitting interleaved rows would cut through the FP8 scale blocks.
            return None, "interleaved gate/up rows with FP8 weights"
    return Takeover(quant, activation, alpha, limit, interleaved), ""


def split_interleaved_w13_(w13: torch.Tensor) -> None:
    """Rows (gate0, up0, gate1, up1, ...) of each expert of `[E, 2I, H]` become (gate rows, up rows), in
    place, one expert at a time (one expert's worth of scratch, not a second copy of the layer)."""
    for e in range(w13.shape[0]):
        w = w13[e]
        w.copy_(torch.cat((w[0::2], w[1::2])))


# Set on a layer whose NVFP4 weights are K-permuted in place (the quant method's Takeover is frozen), and on one
# whose permuted weights are in split bits too.
K_PERMUTED = "_flashinfer_moe_k_permuted"
SPLIT_BITS = "_flashinfer_moe_split_bits"


def k_permute_nvfp4_(layer: torch.nn.Module, pack: bool = True) -> None:
    """K-permutes (``pack``; in split bits unless ``FLASHINFER_MOE_NVFP4_SPLIT_BITS=0``) an NVFP4 layer's loaded
    ``w13_weight`` and ``w2_weight`` in place for the Hopper kernel (split bits measured faster than plain bytes
    at every size, docs/perf.md), or restores the checkpoint's byte order; a no-op where the layer is already so,
    or where H or I is not a multiple of 64 (left plain)."""
    w13, w2 = layer.w13_weight.data, layer.w2_weight.data
    span = NVFP4_K_MULTIPLE // 2  # bytes
    if getattr(layer, K_PERMUTED, False) == pack or w13.shape[2] % span or w2.shape[2] % span:
        return
    split = envs.nvfp4_split_bits() if pack else getattr(layer, SPLIT_BITS, False)
    repack_nvfp4_experts_in_place(w13, w2, pack=pack, split_bits=split)
    setattr(layer, K_PERMUTED, pack)
    setattr(layer, SPLIT_BITS, split and pack)


def fp8_tensor_after_loading_(method: Fp8MoEMethod, layer: torch.nn.Module) -> None:
    """SGLang's post-load step for per-tensor FP8 experts, in torch (SGLang's runs a CUDA kernel): a bf16
    checkpoint is quantized with one scale per expert; an FP8 one gets one w13 scale per expert (the larger
    of gate's and up's, the other half requantized in place) and, with static activations, one input scale
    per layer (the largest)."""
    fp8 = torch.float8_e4m3fn
    if not method.quant_config.is_checkpoint_fp8_serialized:
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data
            scale = (w.float().abs().amax(dim=(1, 2)) / 448.0).clamp_min(2.0**-126)  # [E]
            q = torch.empty_like(w, dtype=fp8)
            for e in range(w.shape[0]):
                q[e] = (w[e].float() / scale[e]).clamp(-448.0, 448.0).to(fp8)
            setattr(layer, f"{name}_weight", torch.nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
        return
    if method.quant_config.activation_scheme == "static":
        for name in ("w13_input_scale", "w2_input_scale"):
            s = getattr(layer, name)
            if s is None:
                raise ValueError(f"{name} must be loaded with activation_scheme='static', got None")
            setattr(layer, name, torch.nn.Parameter(s.data.max(), requires_grad=False))
    s13 = layer.w13_weight_scale.data
    if s13.dim() == 2:  # [E, 2]: gate's and up's scales
        half = layer.w13_weight.shape[1] // s13.shape[1]
        top = s13.amax(dim=1)
        w = layer.w13_weight.data
        for e in range(w.shape[0]):
            for j in range(s13.shape[1]):
                rows = w[e, j * half : (j + 1) * half]
                rows.copy_((rows.float() * (s13[e, j] / top[e])).clamp(-448.0, 448.0).to(fp8))
        layer.w13_weight_scale = torch.nn.Parameter(top, requires_grad=False)


def quant_info_for(layer: torch.nn.Module, takeover: Takeover) -> FlashInferMoEQuantInfo:
    """The layer's parameters as :func:`fused_moe` takes them (views, no copies)."""
    w13, w2 = layer.w13_weight, layer.w2_weight
    if getattr(layer, K_PERMUTED, False):
        split = getattr(layer, SPLIT_BITS, False)
        w13, w2 = PackedNvfp4Weights(w13, split), PackedNvfp4Weights(w2, split)
    info = FlashInferMoEQuantInfo(
        w13=w13,
        w2=w2,
        quant=takeover.quant,
        activation=takeover.activation,
        alpha=takeover.alpha,
        limit=takeover.limit,
    )
    if takeover.quant == "fp8_block":
        info.w13_scale, info.w2_scale = layer.w13_weight_scale_inv, layer.w2_weight_scale_inv
    elif takeover.quant == "fp8_tensor":
        info.w13_scale, info.w2_scale = layer.w13_weight_scale, layer.w2_weight_scale
        # Static activation scales: SGLang has reduced them to one per layer after loading.
        info.a13_scale = getattr(layer, "w13_input_scale", None)
        info.a2_scale = getattr(layer, "w2_input_scale", None)
    elif takeover.quant == "nvfp4":  # W4A16: the input scales are not used
        info.w13_scale, info.w2_scale = layer.w13_weight_scale, layer.w2_weight_scale
        info.w13_global_scale, info.w2_global_scale = layer.w13_weight_scale_2, layer.w2_weight_scale_2
    return info


def runner_applies_routed_scaling_factor() -> bool:
    """SGLang's Triton runner multiplies by ``routed_scaling_factor`` in its final sum on CUDA; elsewhere the
    model (e.g. ``DeepseekV2MoE.forward``) multiplies the layer's output. Ours does the same, so a model
    scales exactly once on either."""
    return is_cuda()


class FlashInferMoERunnerCore(DispatchMoeRunnerCore):
    """Runs a layer's experts from SGLang's standard dispatch output (``topk_weights`` `[T, k]` float32,
    ``topk_ids`` `[T, k]` int32 local expert ids, -1 for experts on other ranks) and returns its combine
    input: `[T, H]`, or `[T, k, H]` with ``no_combine``."""

    def __init__(self, config: MoeRunnerConfig):
        super().__init__(config)
        self._backend = resolve_moe_runner_backend(BACKEND)

    @property
    def runner_backend(self):
        return self._backend

    def run_from_dispatch(self, dispatch_output, quant_info, runner_config, hooks=None):
        if hooks is not None:
            raise ValueError("the flashinfer_moe runner has no LoRA hooks; run LoRA models with another backend")
        if not isinstance(quant_info, FlashInferMoEQuantInfo):
            raise TypeError(f"quant_info must be a FlashInferMoEQuantInfo, got {type(quant_info).__name__}")
        if dispatch_output.hidden_states_scale is not None:
            raise ValueError("hidden_states_scale must be None (pre-quantized dispatch is not supported), got a tensor")
        cfg = self.config
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        weights, ids = topk.topk_weights, topk.topk_ids
        if ids.dtype != torch.int32:
            ids = ids.to(torch.int32)
        if cfg.apply_router_weight_on_input:
            # SGLang scales the input rows (top_k is 1) and then sums unweighted.
            x = (x.float() * weights.float()).to(x.dtype)
            weights = torch.ones_like(weights)
        rsf = cfg.routed_scaling_factor
        layer = cfg.layer
        if (
            rsf in (None, 1.0)
            or not runner_applies_routed_scaling_factor()
            or getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False)
        ):
            rsf = None
        kwargs = dict(
            quant=quant_info.quant,
            w13_scale=quant_info.w13_scale,
            w2_scale=quant_info.w2_scale,
            a13_scale=quant_info.a13_scale,
            a2_scale=quant_info.a2_scale,
            activation=quant_info.activation,
            alpha=quant_info.alpha,
            limit=quant_info.limit,
            validate=False,  # SGLang's ids are in range by construction; no host sync per layer
        )
        if quant_info.quant == "nvfp4":
            kwargs.update(w13_global_scale=quant_info.w13_global_scale, w2_global_scale=quant_info.w2_global_scale)
        if cfg.no_combine:
            # Each token's k expert outputs stay apart (unweighted unless asked), unscaled: the caller sums.
            out = torch.empty(x.shape[0], ids.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
            keep = cfg.no_combine_keep_router_weight and not cfg.apply_router_weight_on_input
            for j in range(ids.shape[1]):
                w = weights[:, j : j + 1] if keep else torch.ones_like(weights[:, j : j + 1])
                out[:, j].copy_(fused_moe(x, quant_info.w13, quant_info.w2, w, ids[:, j : j + 1], **kwargs))
            return StandardCombineInput(hidden_states=out)
        out = fused_moe(x, quant_info.w13, quant_info.w2, weights, ids, routed_scaling_factor=rsf, **kwargs)
        return StandardCombineInput(hidden_states=out)
