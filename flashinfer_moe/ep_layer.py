"""``EPMoELayer``: one Mixture-of-Experts layer split over the ranks of an expert-parallel group.

Each rank holds ``E / W`` experts (expert ``e`` on rank ``e // (E / W)``). A forward routes the rank's own
tokens, dispatches each token once to every rank that holds one of its experts (FP8 rows and their per-128
scales on the wire when the layer is FP8), runs the local experts' grouped GEMMs on what arrived, sends the
results back and sums them per token, and adds the shared experts, computed on the rank's own tokens while
the tokens travel (a side stream on a GPU).

High-throughput mode (prefill) exchanges exact row counts (one host sync) and runs the contiguous layout;
low-latency mode (decode) sends fixed blocks, runs the masked layout straight from the dispatch, never syncs
the host, and can be captured in a CUDA graph.

Dimension legend: ``T`` tokens on this rank, ``E`` experts, ``W`` ranks, ``k`` top-k, ``H`` hidden size,
``I`` expert intermediate size, ``Is`` shared intermediate size, ``R`` rows received.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from . import _checks
from .checkpoint import SafetensorsMapping
from .comm.agreement import validate_collectively
from .comm.alltoall import MoEAllToAll
from .comm.collective import _permute_any
from .ep_checks import FP8_QUANTS, checked_parts
from .graphs import ShapeGraphs
from .layer import BLOCK, MoELayer, _capturing
from .layer_checkpoint import finite
from .moe import gemm, gemm_nvfp4
from .moe.fused import fused_moe
from .moe.layout import moe_align_contiguous
from .moe.permute import combine, permute, permute_fp8_per_token_group
from .moe.quant import FLOATS, FP8, quantize_fp8_per_token_group
from .moe.routing import route
from .phases import PhaseClock

__all__ = ["EPMoELayer"]


PHASES = ("route", "dispatch", "experts", "combine", "shared")


class EPMoELayer(nn.Module):
    """Router, routing, routed experts (split over the group) and shared experts of one MoE layer.

    Collective: every rank of ``group`` builds it at the same point with the same arguments (compared across
    ranks: a mismatch raises ``ValueError`` on every rank, naming the argument and the ranks), and calls
    :meth:`forward` at the same points. Its result equals :class:`~flashinfer_moe.MoELayer` holding all
    ``E`` experts plus the shared MLP, on the same weights.

    Args:
        num_experts: ``E``, divisible by the group size ``W``.
        top_k: ``k``.
        hidden_size: ``H`` (a multiple of 128 with FP8).
        intermediate_size: ``I`` (a multiple of 128 with FP8).
        group: the ``torch.distributed`` process group; None is the default group.
        quant: ``None`` (``params_dtype`` weights and rows), ``"fp8_block"`` (DeepSeek-V3 128 x 128 weight
            blocks), ``"fp8_tensor"`` (one weight scale per expert) or ``"nvfp4"`` (ModelOpt NVFP4 weights,
            W4A16). With either FP8 form, tokens travel as FP8 with one scale per 128 channels and the experts
            consume them so; with ``"nvfp4"`` they travel as ``params_dtype``.
        mode: ``"high_throughput"``, ``"low_latency"`` or ``"auto"``: low latency for calls of at most
            ``low_latency_max_tokens`` tokens, high throughput above. Every rank must take the same mode at
            each call (pad decode batches to a common size): ranks that disagree wait for each other in
            different exchanges and raise ``CommTimeoutError`` after the timeout.
        backend: the all-to-all's: ``"auto"``, ``"p2p"`` or ``"nccl"`` (the collective path, gloo on CPUs).
        max_tokens_per_rank: the most tokens a forward takes on any rank.
        low_latency_max_tokens: the low-latency exchange's fixed block (rows per rank), at most
            ``max_tokens_per_rank``.
        router: hold ``router_weight [E, H]``; without it :meth:`forward` needs ``router_logits``.
        scoring_func, renormalize, num_expert_group, topk_group, correction_bias, routed_scaling_factor: the
            routing, as :class:`~flashinfer_moe.MoELayer` takes it (the factor scales the routed experts'
            sum, not the shared experts).
        num_shared_experts: shared experts, run on every token as one MLP of ``shared_intermediate_size``.
        shared_intermediate_size: ``Is``; default ``num_shared_experts * intermediate_size``.
        activation, alpha, limit: ``"silu"`` or gpt-oss's ``"clamped_silu"``.
        params_dtype: bf16 or fp16: the weights without ``quant``, the router, and the rows sent back.
        device: where the parameters live; default the current CUDA device where there is one, else CPU.
        timeout_s: bound of every wait of the all-to-all (default ``FLASHINFER_MOE_A2A_TIMEOUT_S``): a rank
            that does not arrive makes the others raise ``CommTimeoutError`` naming it.
        cuda_graphs: on a GPU, eager low-latency calls replay a CUDA graph captured on the first call of each
            token count (8 kept at most; with the P2P all-to-all or one rank), which takes their host cost from
            a dozen launches to one. Calls inside a caller's own capture run as they are.

    Attributes:
        rank, world_size, experts_per_rank, first_expert: this rank's place; its experts are
            ``first_expert .. first_expert + experts_per_rank - 1``.
        experts: a :class:`~flashinfer_moe.MoELayer` holding this rank's experts (``w13 [E / W, 2I, H]``,
            ``w2 [E / W, H, I]`` and their scales); ``shared``: one holding the shared MLP, or None.
        backend: ``"p2p"`` or ``"nccl"``; ``fallback_reason``: why ``backend="auto"`` did not take P2P.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        quant: str | None = None,
        mode: str = "auto",
        backend: str = "auto",
        max_tokens_per_rank: int = 4096,
        low_latency_max_tokens: int = 128,
        router: bool = True,
        scoring_func: str = "softmax",
        renormalize: bool = True,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        correction_bias: bool = False,
        routed_scaling_factor: float | None = None,
        num_shared_experts: int = 0,
        shared_intermediate_size: int | None = None,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        timeout_s: float | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("group must come from an initialized torch.distributed, got no process group")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        args = dict(
            num_experts=num_experts, top_k=top_k, hidden_size=hidden_size, intermediate_size=intermediate_size,
            quant=quant, mode=mode, backend=backend, max_tokens_per_rank=max_tokens_per_rank,
            low_latency_max_tokens=low_latency_max_tokens, router=router, scoring_func=scoring_func,
            renormalize=renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
            correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor,
            num_shared_experts=num_shared_experts, shared_intermediate_size=shared_intermediate_size,
            activation=activation, alpha=alpha, limit=limit, params_dtype=params_dtype, device_type=device.type,
            timeout_s=timeout_s, cuda_graphs=cuda_graphs,
        )  # fmt: skip

        experts, routing = validate_collectively(
            group, "EPMoELayer", args, lambda: checked_parts(self.world_size, device, **args)
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.experts_per_rank = num_experts // self.world_size
        self.first_expert = self.rank * self.experts_per_rank
        self.quant, self.mode, self.params_dtype, self.device = quant, mode, params_dtype, device
        self._fp8 = quant in FP8_QUANTS  # FP8 rows (with per-128 scales) travel; else params_dtype rows
        self.max_tokens_per_rank = max_tokens_per_rank
        self.low_latency_max_tokens = min(low_latency_max_tokens, max_tokens_per_rank)
        self.scoring_func, self.renormalize = scoring_func, bool(renormalize)
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.routed_scaling_factor = routing.routed_scaling_factor
        self.experts = experts
        self.router_weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=params_dtype, device=device),
                                          requires_grad=False) if router else None  # fmt: skip
        self.correction_bias = (
            nn.Parameter(torch.zeros(num_experts, device=device), requires_grad=False) if correction_bias else None
        )
        self.shared = None
        if num_shared_experts:
            self.shared = MoELayer(
                1, 1, hidden_size, shared_intermediate_size or num_shared_experts * intermediate_size,
                router=False, quant=quant, activation=activation, alpha=alpha, limit=limit,
                params_dtype=params_dtype, device=device,
            )  # fmt: skip
        self._build_comms(backend, timeout_s)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and self.shared is not None else None
        self._graphs = None
        if cuda_graphs and device.type == "cuda" and self.backend in ("p2p", "local"):
            self._graphs = ShapeGraphs(lambda x, logits: self._forward(x, logits, "low_latency"))
        if self.shared is not None:
            # The shared MLP as fused_moe's one expert of weight 1: its routing is a slice of these per call
            # (buffers, so that they move with the layer; not in the state dict).
            self.register_buffer("_shared_weights", torch.ones(max_tokens_per_rank, 1, device=device), False)
            self.register_buffer(
                "_shared_ids", torch.zeros(max_tokens_per_rank, 1, dtype=torch.int32, device=device), False
            )

    def _build_comms(self, backend: str, timeout_s: float | None) -> None:
        """One all-to-all per mode that can run. In ``"auto"`` mode the low-latency one gets a process group of
        its own, so that ranks that disagree on the mode time out instead of mixing the two exchanges."""
        self._comms: dict[str, MoEAllToAll | None] = {}
        modes = ("high_throughput", "low_latency") if self.mode == "auto" else (self.mode,)
        for mode in modes:
            if self.world_size == 1:
                self._comms[mode] = None  # nothing to exchange: the experts run on the rank's own tokens
                continue
            group = self.group
            if mode == "low_latency" and self.mode == "auto":
                ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
                group = dist.new_group(ranks, use_local_synchronization=True)
            self._comms[mode] = MoEAllToAll(
                group, num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                max_tokens_per_rank=self.max_tokens_per_rank if mode == "high_throughput" else self.low_latency_max_tokens,
                dtype=FP8 if self._fp8 else self.params_dtype, mode=mode, backend=backend,
                combine_dtype=self.params_dtype, scale_groups=self.hidden_size // BLOCK if self._fp8 else 0,
                timeout_s=timeout_s,
            )  # fmt: skip
        first = next(iter(self._comms.values()))
        self.backend = "local" if first is None else first.backend
        reasons = [c.fallback_reason for c in self._comms.values() if c is not None and c.fallback_reason]
        self.fallback_reason = reasons[0] if reasons else ("one rank: no exchange" if first is None else None)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, rank={self.rank}/{self.world_size}, "
            f"experts={self.first_expert}..{self.first_expert + self.experts_per_rank - 1}, quant={self.quant!r}, "
            f"mode={self.mode!r}, backend={self.backend!r}"
        )

    # --------------------------------------------------------------------------------------------- forward

    def _mode_for(self, num_tokens: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "low_latency" if num_tokens <= self.low_latency_max_tokens or _capturing() else "high_throughput"

    def forward(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None, *, phase_times: dict | None = None
    ) -> torch.Tensor:
        """The layer's output for this rank's tokens. Collective: every rank of the group calls it (``T`` may
        differ between ranks, 0 included, within the mode's bound).

        Args:
            hidden_states: `[T, H]` bfloat16/float16/float32 on the layer's device, ``T <= max_tokens_per_rank``
                (``low_latency_max_tokens`` in low-latency mode).
            router_logits: `[T, E]`; None computes them with the layer's router in fp32.
            phase_times: a dict to receive the seconds spent in each of ``"route"``, ``"dispatch"``,
                ``"experts"``, ``"combine"``, ``"shared"``: the call then synchronizes the device around each
                phase and runs the shared experts in line (for reports, not for speed).

        Returns:
            `[T, H]` in the dtype of ``hidden_states``.

        Raises:
            ValueError, TypeError: the arguments are refused. The rank still takes its part in the step's
                exchanges with no tokens first, so that the other ranks complete the step rather than wait.
        """
        try:
            x, logits = self._check_forward(hidden_states, router_logits)
            mode = self._mode_for(x.shape[0])
            bound = self.low_latency_max_tokens if mode == "low_latency" else self.max_tokens_per_rank
            if x.shape[0] > bound:
                which = "low_latency_max_tokens" if mode == "low_latency" else "max_tokens_per_rank"
                raise ValueError(f"hidden_states must have at most {which} = {bound} tokens in {mode} mode, "
                                 f"got {x.shape[0]}")  # fmt: skip
        except (ValueError, TypeError):
            self._step_without_tokens(hidden_states)
            raise
        if (
            phase_times is None
            and self._graphs is not None
            and mode == "low_latency"
            and x.shape[0]
            and not _capturing()
        ):
            return self._graphs(x, logits)
        return self._forward(x, logits, mode, phase_times)

    def _forward(self, x, logits, mode: str, phase_times: dict | None = None) -> torch.Tensor:
        clock = PhaseClock(phase_times, x.device)
        with clock("route"):
            if logits is None:
                # fp32 logits: near-ties between experts are common and bf16 would decide them by rounding.
                logits = x.float() @ self.router_weight.float().t()  # [T, E]
            weights, ids = route(
                logits, self.top_k, scoring_func=self.scoring_func, renormalize=self.renormalize,
                num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                correction_bias=self.correction_bias,
            )  # fmt: skip  # [T, k] fp32, [T, k] int32 global ids
        comm = self._comms[mode]
        if comm is None:
            # One rank: nothing travels for the shared experts to overlap, so they run first and enter the
            # routed sum as combine's residual (one fp32 rounding, no extra pass).
            shared = None
            if self.shared is not None:
                with clock("shared"):
                    shared = self._shared_mlp(x)
            with clock("experts"):
                return self._experts_local(x, weights, ids, shared).to(x.dtype)
        shared = None
        if self.shared is not None and phase_times is None:
            shared = self._shared_async(x)
        with clock("dispatch"):
            if self._fp8:
                rows, scales = quantize_fp8_per_token_group(x, BLOCK)  # [T, H], [T, H / 128]
            else:
                rows, scales = x.to(self.params_dtype), None
            got = comm.dispatch(rows, ids, weights, scales=scales)
        with clock("experts"):
            y = self._experts_received(got, mode)  # [R, H], each received row's sum over local experts
        with clock("combine"):
            routed = comm.combine(y, got.handle)  # [T, H]
        if self.shared is not None:
            with clock("shared"):
                shared = self._shared_join(x, shared)
            routed = routed + shared
        return routed.to(x.dtype)

    def _step_without_tokens(self, hidden_states) -> None:
        """A refused call still takes its part in the step's exchanges, with no tokens, in the mode the call
        would have taken: the other ranks then finish the step (all their tokens computed, this rank's experts
        included) instead of waiting for this rank until their timeout."""
        if self.world_size == 1:
            return
        count = hidden_states.shape[0] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else 0
        x = torch.empty(0, self.hidden_size, dtype=self.params_dtype, device=self.device)
        logits = None if self.router_weight is not None else torch.empty(0, self.num_experts, device=self.device)
        try:
            self._forward(x, logits, self._mode_for(count))
        except Exception:  # the refusal is what the caller must see; a failing exchange shows on the peers
            pass

    def _check_forward(self, hidden_states, router_logits):
        x = _checks.tensor("hidden_states", hidden_states)
        _checks.dtype_in("hidden_states", x, FLOATS)
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states must have shape [T, H] with H = {self.hidden_size}, got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"hidden_states must be on the layer's device {self.device}, got {x.device}")
        if router_logits is None:
            if self.router_weight is None:
                raise ValueError("router_logits must be given for a layer built with router=False, got None")
            return x, None
        logits = _checks.tensor("router_logits", router_logits)
        if tuple(logits.shape) != (x.shape[0], self.num_experts):
            raise ValueError(f"router_logits must have shape [T, E] = {(x.shape[0], self.num_experts)}, "
                             f"got {tuple(logits.shape)}")  # fmt: skip
        _checks.same_device("router_logits", logits, "hidden_states", x)
        return x, logits

    # ---------------------------------------------------------------------------------------- the experts

    def _gemms(self, a, a_scale, layout, masked: bool) -> torch.Tensor:
        """GEMM1 + activation and GEMM2 of the local experts over ``layout``; `[*rows_shape, H]` bf16/fp16."""
        ex = self.experts
        act = dict(activation=ex.activation, alpha=ex.alpha, limit=ex.limit)
        w13, w2 = ex.expert_weights()
        where = layout.tokens_per_expert if masked else layout
        if self.quant is None:
            run = gemm.grouped_gemm_bf16_masked if masked else gemm.grouped_gemm_bf16_contiguous
            return run(run(a, w13, where, **act), w2, where)
        if self.quant == "nvfp4":  # W4A16: the rows stay bf16/fp16; global scales were checked at load
            run = gemm_nvfp4.grouped_gemm_nvfp4_masked if masked else gemm_nvfp4.grouped_gemm_nvfp4_contiguous
            h1 = run(a, w13, ex.w13_scale, ex.w13_global_scale, where, validate=False, **act)
            return run(h1, w2, ex.w2_scale, ex.w2_global_scale, where, validate=False)
        if self.quant == "fp8_block":
            run = gemm.grouped_gemm_fp8_block_masked if masked else gemm.grouped_gemm_fp8_block_contiguous
        else:
            run = gemm.grouped_gemm_fp8_tensor_masked if masked else gemm.grouped_gemm_fp8_tensor_contiguous
        q1, s1 = run(a, a_scale, w13, ex.w13_scale, where, quantize_output=True, **act)
        return run(q1, s1, w2, ex.w2_scale, where, out_dtype=self.params_dtype)

    def _experts_received(self, got, mode: str) -> torch.Tensor:
        """Each received row's weighted sum over this rank's experts (routed scaling included): `[R, H]`."""
        if mode == "low_latency":
            layout, a, a_scale = got.layout, got.expert_hidden_states, got.expert_scales
        else:
            layout = moe_align_contiguous(got.topk_ids, self.experts_per_rank, 1, validate=False)
            a = _permute_any(got.hidden_states, layout)
            a_scale = _permute_any(got.scales, layout) if got.scales is not None else None
        y = self._gemms(a, a_scale, layout, mode == "low_latency")
        return combine(y, got.topk_weights, layout, routed_scaling_factor=self.routed_scaling_factor,
                       out_dtype=self.params_dtype)  # fmt: skip

    def _experts_local(self, x, weights, ids, residual) -> torch.Tensor:
        """One rank: the experts run on the rank's own tokens, with the permute fused with quantization, in the
        contiguous layout in both modes (its size depends on the shapes only, so it is capturable too, and at
        decode sizes it measured faster than the masked layout)."""
        layout = moe_align_contiguous(ids, self.experts_per_rank, 1, validate=False)
        if not self._fp8:
            a, a_scale = permute(x.to(self.params_dtype), layout), None
        else:
            a, a_scale = permute_fp8_per_token_group(x, layout)
        y = self._gemms(a, a_scale, layout, False)
        return combine(y, weights, layout, routed_scaling_factor=self.routed_scaling_factor, residual=residual,
                       out_dtype=self.params_dtype)  # fmt: skip

    # ------------------------------------------------------------------------------------ shared experts

    def _shared_mlp(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shared
        weights, ids = self._shared_weights[: x.shape[0]], self._shared_ids[: x.shape[0]]
        return fused_moe(
            x, s.w13, s.w2, weights, ids, quant=self.quant, w13_scale=s.w13_scale, w2_scale=s.w2_scale,
            **self._global_scales(s),
            activation=s.activation, alpha=s.alpha, limit=s.limit, validate=False,
        ).to(self.params_dtype)  # fmt: skip

    def _global_scales(self, layer) -> dict:
        if self.quant != "nvfp4":
            return {}
        return dict(w13_global_scale=layer.w13_global_scale, w2_global_scale=layer.w2_global_scale)

    def _shared_async(self, x: torch.Tensor):
        """Starts the shared MLP on the side stream (GPU), so that it runs while the tokens travel."""
        if self._side is None:
            return None
        main = torch.cuda.current_stream(x.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            out = self._shared_mlp(x)
        x.record_stream(self._side)
        return out

    def _shared_join(self, x: torch.Tensor, started) -> torch.Tensor:
        if started is None:
            return self._shared_mlp(x)
        main = torch.cuda.current_stream(x.device)
        main.wait_stream(self._side)
        started.record_stream(main)
        return started

    # ------------------------------------------------------------------------------------------- loading

    @torch.no_grad()
    def load_expert_weights(self, weights: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Keeps this rank's slice of a checkpoint given under GLOBAL names (collective: a bad checkpoint raises
        on every rank, naming the rank and the key, and leaves the layer as it was).

        Keys (HF layout): ``{prefix}experts.{e}.gate_proj.weight`` `[I, H]`, ``up_proj`` `[I, H]`,
        ``down_proj`` `[H, I]` for every expert ``e`` of this rank (bf16/fp16/fp32, or float8_e4m3fn with
        ``weight_scale_inv`` 128 x 128 blocks or ``weight_scale`` per tensor; converted to the layer's format as
        :meth:`MoELayer.load_expert_weights` does); with shared experts ``{prefix}shared_experts.gate_proj``
        ... (`[Is, H]`, `[Is, H]`, `[H, Is]`); with a router ``{prefix}gate.weight`` `[E, H]`, and with a
        correction bias ``{prefix}gate.e_score_correction_bias`` `[E]`. Only these keys are read. Values
        must be finite (checked here, once).

        Raises:
            ValueError: a key is missing, a tensor has the wrong shape, or holds a non-finite value.
            TypeError: a tensor has the wrong dtype.
        """
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a Mapping of names to tensors, got {type(weights).__name__}")

        def load():
            mine = range(self.first_expert, self.first_expert + self.experts_per_rank)
            self.experts.load_expert_weights(weights, f"{prefix}experts.", experts=mine)
            if self.shared is not None:
                self.shared.load_expert_weights(weights, prefix, experts=["shared_experts"])
            if self.router_weight is not None:
                self._load_router(weights, prefix)

        validate_collectively(self.group, "EPMoELayer.load_expert_weights", {"prefix": prefix}, load)
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()

    def _apply(self, fn, recurse=True):
        self._drop_graphs()  # .to() and the like move the parameters the graphs read
        return super()._apply(fn, recurse)

    def _load_router(self, weights: Mapping[str, torch.Tensor], prefix: str) -> None:
        def checked(name: str, shape: tuple, what: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"{name} must be given for a layer with {what}, got no such key")
            t = finite(name, _checks.tensor(name, weights[name]))
            _checks.dtype_in(name, t, FLOATS)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
            return t

        w = checked(f"{prefix}gate.weight", (self.num_experts, self.hidden_size), "a router")
        bias = None
        if self.correction_bias is not None:
            bias = checked(f"{prefix}gate.e_score_correction_bias", (self.num_experts,), "a correction bias")
        self.router_weight.copy_(w)  # both checked before either is written
        if bias is not None:
            self.correction_bias.copy_(bias)

    def load_safetensors(self, path, prefix: str = "") -> None:
        """:meth:`load_expert_weights` from safetensors files: one ``.safetensors`` file, or a folder of them
        (its ``*.safetensors.index.json`` is used where there is one). Only the tensors this rank needs are
        read from disk."""
        with SafetensorsMapping(path) as weights:
            self.load_expert_weights(weights, prefix)

    def pack_weights(self, split_bits: bool | None = None) -> None:
        """Packs the local experts' FP8 block weights for the Hopper decode kernel, or NVFP4 ones into split bits
        (``split_bits=False``: K-permuted only; :meth:`MoELayer.pack_weights`)."""
        self.experts.pack_weights(split_bits)
        self._drop_graphs()

    def close(self) -> None:
        """Releases the all-to-all (idempotent). Call it on every rank at the same point."""
        self._drop_graphs()
        for comm in self._comms.values():
            if comm is not None:
                comm.close()
