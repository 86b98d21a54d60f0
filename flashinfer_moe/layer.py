"""``MoELayer``: one Mixture-of-Experts layer as an ``nn.Module`` (router, routing, the experts, FP8 config).

On a GPU it runs the fused kernels (:func:`flashinfer_moe.route` then :func:`flashinfer_moe.fused_moe`); on a
CPU the same calls run the reference.

Dimension legend: ``T`` tokens, ``E`` experts, ``k`` top-k, ``H`` hidden, ``I`` expert intermediate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from . import _checks, layer_nvfp4
from .graphs import ShapeGraphs
from .layer_checkpoint import as_blocks, dense, finite, input_scale, projection
from .moe.fused import fused_moe
from .moe.packed import ROWS, PackedFp8BlockWeights, pack_fp8_block_weights, repack_in_place
from .moe.packed_nvfp4 import PackedNvfp4Weights
from .moe.quant import FLOATS, FP8, quantize_fp8_per_tensor
from .moe.routing import route

__all__ = ["MoELayer"]

QUANTS = (None, "fp8_block", "fp8_tensor", "nvfp4")
BLOCK = 128
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GRAPH_MAX_TOKENS = 256  # eager calls up to this size replay a graph (decode); larger ones are launch-bound no more


def _capturing() -> bool:
    # Compiling first: torch.compile's fullgraph mode cannot trace the capture query.
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class MoELayer(nn.Module):
    """Router GEMM, top-k routing and the routed experts of one MoE layer (shared experts are the caller's).

    Weights follow the serving-engine layout: ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``,
    bf16/fp16 without ``quant``, float8_e4m3fn with it, plus fp32 scales: ``w13_scale [E, 2I/128, H/128]`` and
    ``w2_scale [E, H/128, I/128]`` for ``"fp8_block"``, ``[E]`` for ``"fp8_tensor"``. All weights are
    parameters with ``requires_grad=False`` (zero until loaded with :meth:`load_expert_weights`,
    :meth:`load_router_weight` or ``load_state_dict``). Move the layer with ``.to(device)`` only: a dtype cast
    such as ``.half()`` would also cast the FP8 weights and the scales. With ``"fp8_block"``,
    :meth:`pack_weights` re-lays ``w13`` and ``w2`` for the Hopper kernel's weight stream after loading; with
    ``"nvfp4"`` it K-permutes them for the Hopper kernel's expansion.

    Args:
        num_experts: ``E``.
        top_k: ``k``, experts per token.
        hidden_size: ``H``.
        intermediate_size: ``I``, each expert's intermediate size.
        router: hold a router weight ``router_weight [E, H]``; without it, ``forward`` needs ``router_logits``.
        scoring_func, renormalize, num_expert_group, topk_group: as :func:`flashinfer_moe.route` takes them.
        correction_bias: hold ``correction_bias [E]`` fp32 (DeepSeek-V3's ``e_score_correction_bias``), added
            to the scores for expert selection only.
        routed_scaling_factor: multiplies the weighted sum of the experts' outputs, a positive finite float;
            None means 1.
        quant: ``None``, ``"fp8_block"`` (128 x 128 weight blocks, activations per token and 128 channels; ``H``
            and ``I`` multiples of 128), ``"fp8_tensor"`` (one scale per expert, activations per tensor) or
            ``"nvfp4"`` (W4A16 with ModelOpt NVFP4 weights, ``H`` and ``I`` multiples of 32; parameters as
            :mod:`flashinfer_moe.layer_nvfp4` makes them).
        static_activation_scales: with ``"fp8_tensor"``, hold static activation scales ``a13_scale`` and
            ``a2_scale`` (0-d fp32, loaded from the checkpoint's ``input_scale``) instead of computing them
            from each batch.
        activation: ``"silu"`` or ``"clamped_silu"`` (gpt-oss, with ``alpha`` and ``limit``: ``alpha`` finite,
            ``limit`` positive and finite).
        params_dtype: dtype of the router weight, and of the expert weights without ``quant``.
        device: where the parameters live.
        cuda_graphs: on a GPU, eager calls of up to 256 tokens replay a CUDA graph captured on the first call
            of each token count (8 kept at most), which takes their host cost from a dozen launches to one;
            :meth:`drop_graphs` forgets them (done by :meth:`pack_weights`, :meth:`unpack_weights` and by
            moving the layer; the loaders write in place, which the graphs read). Calls inside a caller's own capture or ``torch.compile`` run as they are.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        router: bool = True,
        scoring_func: str = "softmax",
        renormalize: bool = True,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: bool = False,
        routed_scaling_factor: float | None = None,
        quant: str | None = None,
        static_activation_scales: bool = False,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = _checks.integer("num_experts", num_experts, 1)
        self.top_k = _checks.integer("top_k", top_k, 1, num_experts)
        self.hidden_size = h = _checks.integer("hidden_size", hidden_size, 1)
        self.intermediate_size = i = _checks.integer("intermediate_size", intermediate_size, 1)
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
        if (num_expert_group is None) != (topk_group is None):
            raise ValueError(
                f"num_expert_group and topk_group must be given together, got {num_expert_group} and {topk_group}"
            )
        if num_expert_group is not None:
            _checks.integer("num_expert_group", num_expert_group, 1, num_experts)
            if num_experts % num_expert_group:
                raise ValueError(f"num_expert_group must divide num_experts = {num_experts}, got {num_expert_group}")
            _checks.integer("topk_group", topk_group, 1, num_expert_group)
        if routed_scaling_factor is not None:
            routed_scaling_factor = _checks.positive_float("routed_scaling_factor", routed_scaling_factor)
        if quant not in QUANTS:
            raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
        if quant == "fp8_block" and (h % BLOCK or i % BLOCK):
            raise ValueError(
                f"hidden_size and intermediate_size must be multiples of {BLOCK} with quant='fp8_block', "
                f"got {h} and {i}"
            )
        if quant == "nvfp4":
            layer_nvfp4.check_sizes(h, i)
        if static_activation_scales and quant != "fp8_tensor":
            raise ValueError(f"static_activation_scales needs quant='fp8_tensor', got quant={quant!r}")
        if activation not in ("silu", "clamped_silu"):
            raise ValueError(f"activation must be 'silu' or 'clamped_silu', got {activation!r}")
        if params_dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"params_dtype must be bfloat16 or float16, got {_dtype_name(params_dtype)}")
        self.scoring_func = scoring_func
        self.renormalize = bool(renormalize)
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.quant = quant
        self.activation = activation
        self.alpha = _checks.finite_float("alpha", alpha)
        self.limit = _checks.positive_float("limit", limit)
        self.params_dtype = params_dtype
        self.weights_packed = False
        self.nvfp4_split_bits = False  # packed NVFP4 weights in split bits (pack_weights(split_bits=True))
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs: ShapeGraphs | None = None

        def param(*shape, dtype):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        e = num_experts
        self.router_weight = param(e, h, dtype=params_dtype) if router else None
        self.correction_bias = param(e, dtype=torch.float32) if correction_bias else None
        weight_dtype = params_dtype if quant is None else torch.uint8 if quant == "nvfp4" else FP8
        per_byte = 2 if quant == "nvfp4" else 1  # two E2M1 codes per byte
        self.w13 = param(e, 2 * i, h // per_byte, dtype=weight_dtype)
        self.w2 = param(e, h, i // per_byte, dtype=weight_dtype)
        self.w13_scale = self.w2_scale = self.a13_scale = self.a2_scale = None
        self.w13_global_scale = self.w2_global_scale = self.w13_input_scale = self.w2_input_scale = None
        if quant == "nvfp4":
            layer_nvfp4.add_parameters(self, e, h, i, device)
        if quant == "fp8_block":
            self.w13_scale = param(e, _blocks(2 * i), _blocks(h), dtype=torch.float32)
            self.w2_scale = param(e, _blocks(h), _blocks(i), dtype=torch.float32)
        elif quant == "fp8_tensor":
            # Ones, not zeros: a zero scale would turn the activation quantizer's reciprocal into inf.
            self.w13_scale = nn.Parameter(torch.ones(e, device=device), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.ones(e, device=device), requires_grad=False)
            if static_activation_scales:
                self.a13_scale = nn.Parameter(torch.ones((), device=device), requires_grad=False)
                self.a2_scale = nn.Parameter(torch.ones((), device=device), requires_grad=False)

    def extra_repr(self) -> str:
        parts = [
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, router={self.router_weight is not None}",
            f"scoring_func={self.scoring_func!r}, renormalize={self.renormalize}",
        ]
        if self.num_expert_group is not None:
            parts.append(f"num_expert_group={self.num_expert_group}, topk_group={self.topk_group}")
        if self.correction_bias is not None:
            parts.append("correction_bias=True")
        if self.routed_scaling_factor is not None:
            parts.append(f"routed_scaling_factor={self.routed_scaling_factor}")
        parts.append(f"quant={self.quant!r}")
        if self.a13_scale is not None:
            parts.append("static_activation_scales=True")
        parts.append(f"activation={self.activation!r}")
        if self.activation == "clamped_silu":
            parts.append(f"alpha={self.alpha}, limit={self.limit}")
        parts.append(f"params_dtype={_dtype_name(self.params_dtype)}")
        if self.weights_packed:
            parts.append("weights_packed=True" + (", split_bits=True" if self.nvfp4_split_bits else ""))
        return ", ".join(parts)

    # --------------------------------------------------------------------------------------------- forward

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Route every token to its ``k`` experts and return the weighted sum of their outputs.

        Args:
            hidden_states: `[T, H]` bfloat16, float16 or float32, on the layer's device.
            router_logits: `[T, E]` float32/float16/bfloat16; None computes ``hidden_states @ router_weight.T``
                in float32 (needs ``router=True``).

        Returns:
            `[T, H]` in the dtype of ``hidden_states``.
        """
        x = _checks.tensor("hidden_states", hidden_states)
        _checks.dtype_in("hidden_states", x, FLOATS)
        shape = (x.shape[0], self.hidden_size) if x.dim() == 2 else ("T", self.hidden_size)
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must have shape [T, H] = {shape}, got {tuple(x.shape)}")
        _checks.same_device("hidden_states", x, "the layer's weights", self.w13)
        if router_logits is None:
            if self.router_weight is None:
                raise ValueError("router_logits must be given for a layer built with router=False, got None")
        else:
            router_logits = _checks.tensor("router_logits", router_logits)
            if tuple(router_logits.shape) != (x.shape[0], self.num_experts):
                raise ValueError(
                    f"router_logits must have shape [T, E] = {(x.shape[0], self.num_experts)}, "
                    f"got {tuple(router_logits.shape)}"
                )
            _checks.same_device("router_logits", router_logits, "hidden_states", x)
        if self.cuda_graphs and x.is_cuda and 0 < x.shape[0] <= GRAPH_MAX_TOKENS and not _capturing():
            if self._graphs is None:
                self._graphs = ShapeGraphs(self._forward)
            return self._graphs(x, router_logits)
        return self._forward(x, router_logits)

    def _forward(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        if logits is None:
            # fp32 logits: near-ties between experts are common, and bf16 logits would decide them by rounding.
            logits = x.float() @ self.router_weight.float().t()  # [T, E]
        topk_weights, topk_ids = route(
            logits,
            self.top_k,
            scoring_func=self.scoring_func,
            renormalize=self.renormalize,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=self.correction_bias,
        )  # [T, k] fp32, [T, k] int32
        w13, w2 = self.expert_weights()
        return fused_moe(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            quant=self.quant,
            w13_scale=self.w13_scale,
            w2_scale=self.w2_scale,
            a13_scale=self.a13_scale,
            a2_scale=self.a2_scale,
            w13_global_scale=self.w13_global_scale,
            w2_global_scale=self.w2_global_scale,
            activation=self.activation,
            alpha=self.alpha,
            limit=self.limit,
            routed_scaling_factor=self.routed_scaling_factor,
            # Route's ids are in [0, E) by construction: skip fused_moe's id check and its host sync.
            validate=False,
        )

    def expert_weights(self) -> tuple:
        """``(w13, w2)`` as the GEMMs take them: the parameters, or wrapped as packed weights after
        :meth:`pack_weights`."""
        if not self.weights_packed:
            return self.w13, self.w2
        if self.quant == "nvfp4":
            return tuple(PackedNvfp4Weights(w, self.nvfp4_split_bits) for w in layer_nvfp4.packed_views(self))
        return PackedFp8BlockWeights(self.w13, gated=True), PackedFp8BlockWeights(self.w2, gated=False)

    def drop_graphs(self) -> None:
        """Forgets the CUDA graphs of eager calls (they hold the weights' addresses and their own buffers)."""
        if self._graphs is not None:
            self._graphs.clear()

    def _apply(self, fn, recurse=True):
        self.drop_graphs()  # .to(), .cuda(): the parameters move, and the graphs would read the old memory
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------------------------------- loading

    @torch.no_grad()
    def pack_weights(self, split_bits: bool | None = None) -> None:
        """Re-lays ``w13`` and ``w2`` in place as :func:`flashinfer_moe.pack_fp8_block_weights` packs them
        (``w13`` with ``gated=True``): on Hopper the grouped GEMMs then stream each weight piece with one bulk
        copy, which measured 1-4% faster per layer up to T = 128 tokens and 2-4% slower at T = 4096
        (docs/perf-notes.md). Elsewhere the weights are unpacked per call, so pack for Hopper decode only.

        Call it once the weights are loaded (a no-op when they are packed already). Afterwards ``w13`` and ``w2``
        are new parameters of shape `[E, N / 256, K / 128, 256, 128]` over the same memory (one chunk of
        experts is the temporary memory); :meth:`load_expert_weights` packs what it loads, and ``state_dict``
        holds the packed layout, which loads only into a layer that is packed too. :meth:`unpack_weights`
        reverses it.

        With ``"nvfp4"`` it K-permutes ``w13`` and ``w2`` in place as :func:`flashinfer_moe.pack_nvfp4_weights`
        does (``H`` and ``I`` multiples of 64; the parameters then have shape `[E, N, K / 64, 32]`): the W4A16
        kernel then moves each thread's weight bytes out of shared memory in one instruction instead of eight
        (docs/perf-notes.md, NVFP4). By default (``split_bits`` None or True) they are packed as
        ``pack_nvfp4_weights(w)`` packs them, in split bits (parameters `[E, N, K / 8, 4]`); ``split_bits=False``
        K-permutes them only. A layer packed the other way is converted.

        Raises:
            ValueError: the layer's quant is not ``"fp8_block"`` or ``"nvfp4"``, ``hidden_size`` (the rows of
                ``w2``) is not a multiple of 256 (FP8), or ``split_bits=True`` is asked of FP8 weights.
            TypeError: ``split_bits`` is not None or a bool.
        """
        if split_bits is not None and not isinstance(split_bits, bool):
            raise TypeError(f"split_bits must be None or a bool, got {type(split_bits).__name__}")
        if split_bits is None:
            split_bits = self.quant == "nvfp4"
        if self.quant == "nvfp4":
            layer_nvfp4.check_packable(self.hidden_size, self.intermediate_size)
        elif self.quant != "fp8_block":
            raise ValueError(f"quant must be 'fp8_block' or 'nvfp4' for pack_weights, got quant={self.quant!r}")
        elif split_bits:
            raise ValueError(f"split_bits applies to NVFP4 weights only, got split_bits=True with quant={self.quant!r}")
        elif self.hidden_size % ROWS:
            raise ValueError(f"hidden_size must be a multiple of {ROWS} to pack w2 (its rows), got {self.hidden_size}")
        if self.weights_packed and self.nvfp4_split_bits != split_bits:
            self._repack(pack=False)
        if not self.weights_packed:
            self.nvfp4_split_bits = split_bits
            self._repack(pack=True)

    @torch.no_grad()
    def unpack_weights(self) -> None:
        """Undoes :meth:`pack_weights`: ``w13`` `[E, 2I, H]` and ``w2`` `[E, H, I]` again (a no-op when they
        are not packed)."""
        if self.weights_packed:
            self._repack(pack=False)

    def _repack(self, pack: bool) -> None:
        if self.quant == "nvfp4":
            layer_nvfp4.repack(self, pack, self.nvfp4_split_bits)
            self.weights_packed = pack
            self.nvfp4_split_bits = self.nvfp4_split_bits and pack
            self.drop_graphs()
            return
        done = []
        try:
            for name, gated in (("w13", True), ("w2", False)):
                data = repack_in_place(getattr(self, name).data, gated=gated, pack=pack)
                setattr(self, name, nn.Parameter(data, requires_grad=False))
                done.append((name, gated))
        except BaseException:
            # w2 failed (and restored itself): put w13 back too, so the layer is never half packed.
            for name, gated in done:
                data = repack_in_place(getattr(self, name).data, gated=gated, pack=not pack)
                setattr(self, name, nn.Parameter(data, requires_grad=False))
            raise
        self.weights_packed = pack
        self.drop_graphs()

    @torch.no_grad()
    def load_router_weight(self, weight: torch.Tensor, correction_bias: torch.Tensor | None = None) -> None:
        """Copy the router (HF ``gate.weight`` `[E, H]`) and, where the layer has one, the correction bias
        (``gate.e_score_correction_bias`` `[E]`)."""
        if self.router_weight is None:
            raise ValueError("weight cannot be loaded into a layer built with router=False, got a tensor")
        weight = _checks.tensor("weight", weight)
        _checks.dtype_in("weight", weight, FLOATS)
        finite("weight", weight)
        if tuple(weight.shape) != tuple(self.router_weight.shape):
            raise ValueError(
                f"weight must have shape [E, H] = {tuple(self.router_weight.shape)}, got {tuple(weight.shape)}"
            )
        self.router_weight.copy_(weight)
        if correction_bias is not None:
            if self.correction_bias is None:
                raise ValueError("correction_bias needs a layer built with correction_bias=True, got a tensor")
            bias = _checks.tensor("correction_bias", correction_bias)
            _checks.dtype_in("correction_bias", bias, FLOATS)
            finite("correction_bias", bias)
            if tuple(bias.shape) != (self.num_experts,):
                raise ValueError(f"correction_bias must have shape ({self.num_experts},), got {tuple(bias.shape)}")
            self.correction_bias.copy_(bias)

    @torch.no_grad()
    def load_expert_weights(
        self, weights: Mapping[str, torch.Tensor], prefix: str = "", experts: Sequence[int | str] | None = None
    ) -> None:
        """Fill ``w13``, ``w2`` and their scales from per-expert HF-style tensors, converting as needed.

        Keys, for every expert ``e`` in ``[0, E)``: ``{prefix}{e}.gate_proj.weight`` `[I, H]`,
        ``{prefix}{e}.up_proj.weight`` `[I, H]`, ``{prefix}{e}.down_proj.weight`` `[H, I]`, each bf16/fp16/fp32,
        or float8_e4m3fn with its scale: ``weight_scale_inv`` (128 x 128 blocks, `[ceil(N/128), ceil(K/128)]`
        fp32, DeepSeek-V3) or ``weight_scale`` (one value per tensor). With static activation scales, also
        ``input_scale`` of each projection. Other keys are ignored, and every value read must be finite.
        An ``"nvfp4"`` layer takes ModelOpt NVFP4 as stored (see :mod:`flashinfer_moe.layer_nvfp4`) and
        quantizes other weights on load.

        A checkpoint already in the layer's format is copied as stored (FP8 blocks into ``"fp8_block"``);
        higher precision is quantized (per 128 x 128 block, or per expert from the amax for ``"fp8_tensor"``);
        FP8 is dequantized into a bf16/fp16 layer, or requantized into the other FP8 format. ``w13`` holds one
        per-tensor scale per expert, so per-tensor gate and up scales that differ are merged: both are
        requantized to the larger one (exact for the projection that has it; the other loses the low bits its
        finer scale gave it). Likewise the static activation scales are the largest ``input_scale`` over the
        experts (of gate and up for ``a13_scale``, of down for ``a2_scale``).

        Args:
            weights: a mapping of names to tensors (e.g. a safetensors state dict), on any device.
            prefix: prepended to every key, e.g. ``"model.layers.3.mlp.experts."``.
            experts: the checkpoint's names of the layer's experts ``0 .. E - 1`` in keys, in order; default
                ``0 .. E - 1`` (an expert-parallel rank passes its global ids).

        Raises:
            ValueError: a key is missing (all missing experts are listed), a tensor has the wrong shape, or a
                value is not finite.
            TypeError: a tensor has the wrong dtype.
        """
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a Mapping of names to tensors, got {type(weights).__name__}")
        h, i = self.hidden_size, self.intermediate_size
        shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        names = list(range(self.num_experts)) if experts is None else list(experts)
        if len(names) != self.num_experts:
            raise ValueError(f"experts must name E = {self.num_experts} experts, got {len(names)}")
        # Check every expert before writing any, so a bad checkpoint leaves the layer as it was.
        missing = [
            (name, f"{prefix}{name}.{p}.weight")
            for name in names
            for p in _PROJECTIONS
            if f"{prefix}{name}.{p}.weight" not in weights
        ]
        if missing:
            absent = list(dict.fromkeys(name for name, _ in missing))
            shown = ", ".join(k for _, k in missing[:6]) + (f", ... ({len(missing)} keys)" if len(missing) > 6 else "")
            raise ValueError(
                f"weights must hold every expert's gate/up/down weight; missing experts {absent}: got no {shown}"
            )
        if self.quant == "nvfp4":
            layer_nvfp4.load(self, weights, prefix, names)
            return
        loaded = [{p: projection(weights, f"{prefix}{name}.{p}.", shapes[p]) for p in _PROJECTIONS} for name in names]
        if self.a13_scale is not None:
            inputs = {p: [input_scale(weights, f"{prefix}{name}.{p}.") for name in names] for p in _PROJECTIONS}
        device = self.w13.device
        for e, tensors in enumerate(loaded):
            gate, up, down = ([t.to(device) if t is not None else None for t in tensors[p]] for p in _PROJECTIONS)
            if self.quant is None:
                self.w13[e, :i] = dense(*gate)
                self.w13[e, i:] = dense(*up)
                self.w2[e] = dense(*down)
            elif self.quant == "fp8_block":
                nb = i // BLOCK  # I is a multiple of 128 here, so gate and up own whole scale rows
                (q_gate, s_gate), (q_up, s_up) = as_blocks(*gate), as_blocks(*up)
                # Concatenated as bytes: not every torch build concatenates float8.
                q13 = torch.cat((q_gate.view(torch.uint8), q_up.view(torch.uint8))).view(FP8)
                self.w13_scale[e, :nb], self.w13_scale[e, nb:] = s_gate, s_up
                q2, self.w2_scale[e] = as_blocks(*down)
                if self.weights_packed:
                    q13 = pack_fp8_block_weights(q13[None], gated=True).data[0]
                    q2 = pack_fp8_block_weights(q2[None]).data[0]
                self.w13[e], self.w2[e] = q13, q2
            else:
                merged = [g[2] for g in (gate, up) if g[2] is not None]
                scale = max(merged, key=float) if len(merged) == 2 else None
                self.w13[e], self.w13_scale[e] = quantize_fp8_per_tensor(torch.cat((dense(*gate), dense(*up))), scale)
                self.w2[e], self.w2_scale[e] = quantize_fp8_per_tensor(dense(*down), down[2])
        if self.a13_scale is not None:
            self.a13_scale.copy_(torch.stack(inputs["gate_proj"] + inputs["up_proj"]).max())
            self.a2_scale.copy_(torch.stack(inputs["down_proj"]).max())
