"""SGLang 0.5.23 on CPU for the plugin's tests: the process set-up (SGLang's own parallel state, its plugin
loader), layers built by SGLang's ``FusedMoE``, checkpoints fed through SGLang's ``weight_loader`` and
``make_expert_params_mapping``, routing by SGLang's ``select_experts``, and the cases the tests run.

The cases run in worker processes (SGLang's state is per process): :func:`setup` is the initializer,
each case returns plain numbers. ``torchvision`` (imported at module level by SGLang's multimodal code,
never called on the MoE path) is answered by a stand-in, since no build for this torch exists on CPU.
"""

from __future__ import annotations

import logging
import os
import socket

from flashinfer_moe._import_standin import install_import_standin

E, H, I = 32, 256, 256  # experts, hidden, intermediate: multiples of 128 for the FP8 block scales
BLOCK = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOG = _Lines()


def setup(world_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """SGLang's process state for ``FusedMoE`` on CPU (expert parallel over ``world_size`` ranks), then its
    plugin loader, which finds this package's entry point."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # SGLang's grouped top-k is torch.compile'd: run it eagerly
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401  (records that torchvision is absent before the stand-in exists)

    install_import_standin("torchvision")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    logging.getLogger("flashinfer_moe").addHandler(LOG)
    logging.getLogger("flashinfer_moe").setLevel(logging.INFO)
    load_plugins()
    args = ServerArgs(model_path="dummy", device="cpu", tp_size=world_size, ep_size=world_size)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    initialize_moe_config()
    if not torch.distributed.is_initialized():
        port = port or _free_port()
        parallel_state.init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
    else:
        parallel_state.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    parallel_state.initialize_model_parallel()


def make_layer(ours: bool, quant: str | None = None, num_experts: int = E, **kwargs):
    """A ``FusedMoE`` built by SGLang, with ``--moe-runner-backend flashinfer_moe`` (``ours``) or SGLang's
    default; ``quant`` picks SGLang's ``Fp8Config`` (``"fp8_block"``: 128 x 128 block scales,
    ``"fp8_tensor"``: one scale per expert, static input scales)."""
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, resolve_moe_runner_backend
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.runtime_context import get_flags

    config = None
    if quant == "fp8_block":
        config = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[BLOCK, BLOCK])
    elif quant == "fp8_tensor":
        config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    elif quant == "nvfp4":
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

        config = ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16)
    flags = get_flags().moe
    flags.runner_backend = resolve_moe_runner_backend("flashinfer_moe") if ours else MoeRunnerBackend.AUTO
    try:
        kwargs.setdefault("top_k", 8)
        kwargs.setdefault("hidden_size", H)
        kwargs.setdefault("intermediate_size", I)
        return FusedMoE(num_experts=num_experts, layer_id=0, params_dtype=torch.bfloat16, quant_config=config, **kwargs)
    finally:
        flags.runner_backend = MoeRunnerBackend.AUTO


def checkpoint(quant: str | None, seed: int, num_experts: int = E, h: int = H, i: int = I) -> dict:
    """HF-named expert tensors as a checkpoint stores them (DeepSeek-V3's ``weight``/``weight_scale_inv``
    for FP8 blocks; ``weight_scale``/``input_scale`` per tensor)."""
    import torch

    from flashinfer_moe import quantize_fp8_block_weights, quantize_nvfp4

    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(num_experts):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = torch.randn(shape, generator=g) / shape[1] ** 0.5
            key = f"experts.{e}.{name}"
            if quant is None:
                out[f"{key}.weight"] = w.to(torch.bfloat16)
            elif quant == "fp8_block":
                q, s = quantize_fp8_block_weights(w)
                out[f"{key}.weight"], out[f"{key}.weight_scale_inv"] = q, s
            elif quant == "nvfp4":  # ModelOpt: E2M1 pairs, E4M3 per 16, fp32 weight_scale_2, input_scale
                q, s, s2 = quantize_nvfp4(w)
                out[f"{key}.weight"], out[f"{key}.weight_scale"], out[f"{key}.weight_scale_2"] = q, s, s2
                out[f"{key}.input_scale"] = torch.tensor(0.05)
            else:
                s = w.abs().amax() / 448
                out[f"{key}.weight"] = (w / s).to(torch.float8_e4m3fn)
                out[f"{key}.weight_scale"] = s.reshape(())
                out[f"{key}.input_scale"] = torch.tensor(0.02 + 0.01 * e)
    return out


def load(layer, ckpt: dict, num_experts: int = E) -> None:
    """Loads ``ckpt`` the way SGLang's model loaders do, then SGLang's post-load step."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    params = dict(layer.named_parameters(prefix="experts"))
    for name, tensor in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            param = params[name.replace(weight_name, param_name)]
            param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
            break
        else:
            raise KeyError(name)
    layer.quant_method.process_weights_after_loading(layer)


def dequantized(ckpt: dict, quant: str | None) -> dict:
    """The same checkpoint as bf16 weights (for SGLang's native CPU path, which has no FP8 MoE on CPUs
    without AMX)."""
    import torch

    from flashinfer_moe import dequantize_nvfp4
    from flashinfer_moe.reference_gemm import dequantize_weights

    out = {}
    for key, w in ckpt.items():
        if not key.endswith(".weight"):
            continue
        if quant == "fp8_block":
            w = dequantize_weights(w[None], ckpt[key + "_scale_inv"][None])[0]
        elif quant == "nvfp4":
            w = dequantize_nvfp4(w, ckpt[key + "_scale"], ckpt[key + "_scale_2"])
        elif quant == "fp8_tensor":
            w = w.double() * ckpt[key + "_scale"].double()
        out[key] = w.to(torch.bfloat16)
    return out


def stacked(ckpt: dict, suffix: str, num_experts: int = E):
    """``(w13, w2)`` for ``suffix`` as SGLang's loader lays them out: gate rows then up rows."""
    import torch

    w13 = torch.stack(
        [
            torch.cat((ckpt[f"experts.{e}.gate_proj.{suffix}"], ckpt[f"experts.{e}.up_proj.{suffix}"]))
            for e in range(num_experts)
        ]
    )
    w2 = torch.stack([ckpt[f"experts.{e}.down_proj.{suffix}"] for e in range(num_experts)])
    return w13, w2


def route(routing: str, tokens: int, seed: int, num_experts: int = E):
    """SGLang's own top-8: DeepSeek-V3's grouped sigmoid with a correction bias, or Qwen3's softmax."""
    import torch
    from sglang.srt.layers.moe.topk import TopKConfig, select_experts

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, generator=g)
    if routing == "deepseek":
        bias = torch.randn(num_experts, generator=g) / 10
        config = TopKConfig(
            top_k=8,
            use_grouped_topk=True,
            num_expert_group=8,
            topk_group=4,
            renormalize=True,
            scoring_func="sigmoid",
            correction_bias=bias,
        )
    else:
        config = TopKConfig(top_k=8, renormalize=True, torch_native=True)
    return x, select_experts(x, logits, config)


def relative_error(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def set_cuda_semantics(on: bool) -> None:
    """Makes the runner scale by ``routed_scaling_factor`` as it does on CUDA (where SGLang's model leaves it
    to the runner), or leave it to the model as on other devices."""
    from flashinfer_moe.integrations import sglang_runner

    sglang_runner.runner_applies_routed_scaling_factor = (lambda: True) if on else (lambda: False)


def case_matches_native(quant, routing, rsf, drop_ids, seed, tokens=37) -> dict:
    """One checkpoint in two layers, ours and SGLang's native CPU path (on the dequantized checkpoint for
    FP8), same SGLang routing; ``drop_ids`` sets some ids to -1 as SGLang's dispatcher does for experts on
    other ranks. Returns the errors and whether the loaded weights are the checkpoint's bytes."""
    import torch

    from flashinfer_moe.reference_gemm import fused_moe as reference

    ckpt = checkpoint(quant, seed)
    ours = make_layer(True, quant, routed_scaling_factor=rsf)
    native = make_layer(False, None, routed_scaling_factor=rsf)
    load(ours, ckpt)
    load(native, dequantized(ckpt, quant))
    x, topk = route(routing, tokens, seed)
    routed = topk
    if drop_ids:
        ids = topk.topk_ids.clone()
        ids[::3, ::2] = -1
        topk = topk._replace(topk_ids=ids)
    w13, w2 = stacked(ckpt, "weight")
    if quant == "nvfp4":  # the post-load step packs NVFP4 weights in split bits (each row's bytes, in place)
        from flashinfer_moe import pack_nvfp4_weights

        w13, w2 = pack_nvfp4_weights(w13).data, pack_nvfp4_weights(w2).data
    # Per-tensor FP8: SGLang's post-load step requantizes w13's lower-scaled half to one scale per expert.
    same_bytes = torch.equal(ours.w2_weight.view(torch.uint8), w2.view(torch.uint8))
    if quant != "fp8_tensor":
        same_bytes = same_bytes and torch.equal(ours.w13_weight.view(torch.uint8), w13.view(torch.uint8))
    scales = {}
    if quant == "fp8_block":
        s13, s2 = stacked(ckpt, "weight_scale_inv")
        same_bytes = (
            same_bytes and torch.equal(ours.w13_weight_scale_inv, s13) and torch.equal(ours.w2_weight_scale_inv, s2)
        )
        scales = dict(w13_scale=s13, w2_scale=s2)
    if quant == "nvfp4":
        s13, s2 = stacked(ckpt, "weight_scale")
        same_bytes = (
            same_bytes
            and torch.equal(ours.w13_weight_scale.view(torch.uint8), s13.view(torch.uint8))
            and torch.equal(ours.w2_weight_scale.view(torch.uint8), s2.view(torch.uint8))
        )
    results = {"same_bytes": same_bytes}
    # SGLang's native CPU path has no -1 ids: there a dropped slot keeps its expert with weight 0.
    native_topk = routed._replace(topk_weights=routed.topk_weights.masked_fill(topk.topk_ids < 0, 0.0))
    set_cuda_semantics(False)
    got, want = ours(x, topk), native(x, native_topk)
    results["vs_native"] = relative_error(got, want)
    results["nan"] = bool(got.isnan().any())
    if quant not in ("fp8_tensor", "nvfp4"):
        ids = topk.topk_ids.to(torch.int32)
        ref = reference(x, w13, w2, topk.topk_weights, ids, quant=quant, **scales)
        results["vs_reference"] = relative_error(got, ref)
    set_cuda_semantics(True)
    scaled = ours(x, topk)
    set_cuda_semantics(False)
    # SGLang folds routed_scaling_factor into the top-k weights for NVFP4 layers (not into the runner).
    results["fused_in_topk"] = bool(ours.should_fuse_routed_scaling_factor_in_topk)
    results["scaled_vs_native"] = relative_error(scaled, want * (1.0 if results["fused_in_topk"] else rsf or 1.0))
    return results


def case_nvfp4_reload(seed: int = 7, tokens: int = 13, split_bits: bool = False) -> dict:
    """NVFP4 weights are packed after loading (in split bits, the default, or with
    ``FLASHINFER_MOE_NVFP4_SPLIT_BITS=0`` K-permuted only); a reload through SGLang's ``weight_loader`` puts the layer back in
    checkpoint order before it writes, so a partial reload (no post-load step) and a full one (with it) both
    give the new checkpoint's output."""
    import os

    os.environ["FLASHINFER_MOE_NVFP4_SPLIT_BITS"] = "1" if split_bits else "0"
    try:
        return _nvfp4_reload(seed, tokens)
    finally:
        os.environ.pop("FLASHINFER_MOE_NVFP4_SPLIT_BITS", None)


def _nvfp4_reload(seed: int, tokens: int) -> dict:
    import torch

    from flashinfer_moe.integrations.sglang_runner import K_PERMUTED, SPLIT_BITS

    ours, native = make_layer(True, "nvfp4"), make_layer(False, None)
    load(ours, checkpoint("nvfp4", seed))
    results = {"permuted_after_load": getattr(ours, K_PERMUTED, False), "split": getattr(ours, SPLIT_BITS, False)}
    new = checkpoint("nvfp4", seed + 1)
    x, topk = route("qwen", tokens, seed)
    # One expert's tensors through the loader, no post-load step: read plain, the rest untouched.
    one = {k: v for k, v in new.items() if k.startswith("experts.3.")}
    params = dict(ours.named_parameters(prefix="experts"))
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    for name, tensor in one.items():
        for param_name, weight_name, expert_id, shard_id in FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", E
        ):
            if weight_name in name and expert_id == 3:
                param = params[name.replace(weight_name, param_name)]
                param.weight_loader(param, tensor, name, shard_id=shard_id, expert_id=expert_id)
                break
    results["permuted_after_partial"] = getattr(ours, K_PERMUTED, False)
    mixed = checkpoint("nvfp4", seed) | one
    load(native, dequantized(mixed, "nvfp4"))
    set_cuda_semantics(False)
    results["partial_vs_native"] = relative_error(ours(x, topk), native(x, topk))
    load(ours, new)
    load(native, dequantized(new, "nvfp4"))
    results["permuted_after_full"] = getattr(ours, K_PERMUTED, False)
    results["full_vs_native"] = relative_error(ours(x, topk), native(x, topk))
    results["nan"] = bool(ours(x, topk).isnan().any()) or not torch.isfinite(native(x, topk)).all()
    return results


def reference_layer(
    x, w13, w2, weights, ids, *, alpha=None, limit=None, interleaved=False, on_input=False, combine=True
):
    """float64 of what SGLang's Triton runner computes for a bf16 layer: per slot ``w2 @ act(w13 @ x)``,
    act = silu(gate) * up, or with ``alpha``/``limit`` gpt-oss's clamped form on interleaved or split rows;
    router weights on the input rows (``on_input``) or on the outputs; summed unless ``combine`` is False."""
    import torch

    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape[0], ids.shape[1], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            xt = x[t] * float(weights[t, j]) if on_input else x[t]
            gu = w13[e] @ xt
            if alpha is None:
                g, u = gu.chunk(2)
                h = torch.nn.functional.silu(g) * u
            else:
                g, u = (gu[0::2], gu[1::2]) if interleaved else gu.chunk(2)
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = g * torch.sigmoid(alpha * g) * (u + 1)
            out[t, j] = w2[e] @ h * (1.0 if on_input or not combine else float(weights[t, j]))
    return out.sum(1) if combine else out


def case_runner_config(kind: str, seed: int = 3, tokens: int = 19) -> dict:
    """A bf16 layer with one of SGLang's runner options, ours against the float64 of what SGLang's Triton
    runner computes (and, where SGLang's native CPU path has the option, against that too)."""
    import torch

    ckpt = checkpoint(None, seed)
    w13, w2 = stacked(ckpt, "weight")
    kw, ref_kw = {}, {}
    if kind in ("clamped_interleaved", "clamped_split"):
        interleaved = kind == "clamped_interleaved"
        kw = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gate_up_interleaved=interleaved)
        ref_kw = dict(alpha=1.702, limit=7.0, interleaved=interleaved)
        # gpt-oss checkpoints hold gate_up rows interleaved: w13's rows (gate0, up0, gate1, ...).
        if interleaved:
            w13 = torch.stack([torch.stack((w[:I], w[I:]), 1).reshape(2 * I, H) for w in w13])
    elif kind == "no_combine":
        kw = dict(no_combine=True, inplace=False)
        ref_kw = dict(combine=False)
    elif kind == "on_input":
        kw = dict(apply_router_weight_on_input=True, top_k=1)
        ref_kw = dict(on_input=True)
    top_k = kw.get("top_k", 8)
    ours = make_layer(True, None, **kw)
    _load_stacked(ours, w13, w2)
    x, topk = route("qwen", tokens, seed)
    if top_k == 1:
        topk = topk._replace(topk_weights=topk.topk_weights[:, :1], topk_ids=topk.topk_ids[:, :1])
    got = ours(x, topk)
    want = reference_layer(x, w13, w2, topk.topk_weights, topk.topk_ids, **ref_kw)
    results = {"vs_reference": relative_error(got, want), "shape": tuple(got.shape)}
    if kind == "clamped_interleaved":  # SGLang's native CPU path reads gate/up interleaved for gpt-oss
        native = make_layer(False, None, **kw)
        _load_stacked(native, w13, w2)
        results["vs_native"] = relative_error(got, native(x, topk))
    return results


def _load_stacked(layer, w13, w2) -> None:
    """Per-expert checkpoint tensors rebuilt from ``w13``/``w2`` and loaded through SGLang's loader (so
    interleaved rows stay interleaved: the loader copies gate and up into their halves)."""
    ckpt = {}
    for e in range(w13.shape[0]):
        half = w13.shape[1] // 2
        ckpt[f"experts.{e}.gate_proj.weight"] = w13[e, :half].to(layer.w13_weight.dtype)
        ckpt[f"experts.{e}.up_proj.weight"] = w13[e, half:].to(layer.w13_weight.dtype)
        ckpt[f"experts.{e}.down_proj.weight"] = w2[e].to(layer.w2_weight.dtype)
    load(layer, ckpt, w13.shape[0])


def case_fallback(kind: str, seed: int = 5, tokens: int = 11) -> dict:
    """A layer our kernels do not run: with the flag it keeps SGLang's runner (one warning naming why) and
    gives SGLang's result exactly."""
    kw = {"gelu": dict(activation="gelu"), "bias": dict(with_bias=True), "swiglu_limit": dict(swiglu_limit=10.0)}[kind]
    import torch

    LOG.lines.clear()
    ours = make_layer(True, None, **kw)
    warnings = [line for line in LOG.lines if "keeps SGLang's own MoE runner" in line]
    native = make_layer(False, None, **kw)
    ckpt = checkpoint(None, seed)
    for layer in (ours, native):
        load(layer, ckpt)
        if kind == "bias":
            g = torch.Generator().manual_seed(seed)
            layer.w13_weight_bias.data.copy_(torch.randn(layer.w13_weight_bias.shape, generator=g) / 10)
            layer.w2_weight_bias.data.copy_(torch.randn(layer.w2_weight_bias.shape, generator=g) / 10)
    x, topk = route("qwen", tokens, seed)
    return {
        "warnings": warnings,
        "taken_over": getattr(ours.quant_method, "_flashinfer_moe_takeover", "unset") is not None,
        "backend": str(ours.runner_backend),
        "equal": bool((ours(x, topk) == native(x, topk)).all()),
    }


def case_bad_checkpoint(what: str) -> str:
    """The error message when a checkpoint tensor's shape disagrees with the layer, or '' if none."""
    import torch

    ckpt = checkpoint("fp8_block" if what == "scale" else None, 7, num_experts=2)
    layer = make_layer(True, "fp8_block" if what == "scale" else None, num_experts=2)
    key = "experts.1.up_proj.weight_scale_inv" if what == "scale" else "experts.1.down_proj.weight"
    t = ckpt[key]
    ckpt[key] = torch.zeros(t.shape[0] + 1, t.shape[1], dtype=t.dtype)
    try:
        load(layer, ckpt, 2)
    except ValueError as e:
        return str(e)
    return ""


def case_discovery() -> dict:
    """What SGLang's plugin loader and argument parser see in this process."""
    from importlib.metadata import entry_points

    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
    from sglang.srt.layers.moe.utils import resolve_moe_runner_backend
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--moe-runner-backend", "flashinfer_moe"])
    hooked = [
        f"{cls.__name__}.{name}"
        for cls in (UnquantizedFusedMoEMethod, Fp8MoEMethod)
        for name in ("create_moe_runner", "process_weights_after_loading", "apply")
        if hasattr(getattr(cls, name), "__wrapped__")
    ]
    return {
        "entry_points": sorted(ep.value for ep in entry_points(group="sglang.srt.plugins")),
        "choice": "flashinfer_moe" in MOE_RUNNER_BACKEND_CHOICES,
        "resolved": str(resolve_moe_runner_backend("flashinfer_moe")),
        "parsed": args.moe_runner_backend,
        "hooked": hooked,
    }


def case_expert_parallel(rank: int, world_size: int) -> dict:
    """Experts split over ``world_size`` ranks by SGLang (its dispatcher maps the global ids to this rank's
    and -1), bf16 and FP8 block; the ranks' partial outputs summed equal the float64 reference of the whole
    layer."""
    import torch

    from flashinfer_moe.reference_gemm import fused_moe as reference

    setup(world_size, rank)
    errors = {}
    for quant in (None, "fp8_block"):
        ckpt = checkpoint(quant, 11)
        layer = make_layer(True, quant)
        load(layer, ckpt)
        # SGLang's dispatcher builds its global -> local id table on the accelerator it asks for, which a
        # CPU process has none of; the same table, made here on the CPU, is then used by SGLang's mapping.
        local = layer.num_local_experts
        table = torch.full((E,), -1, dtype=torch.int32)
        table[rank * local : (rank + 1) * local] = torch.arange(local, dtype=torch.int32)
        layer.dispatcher.local_expert_mapping = table
        x, topk = route("deepseek", 23, 11)
        total = layer(x, topk).float()
        torch.distributed.all_reduce(total)
        w13, w2 = stacked(ckpt, "weight")
        scales = dict(zip(("w13_scale", "w2_scale"), stacked(ckpt, "weight_scale_inv"), strict=True)) if quant else {}
        ref = reference(x, w13, w2, topk.topk_weights, topk.topk_ids.to(torch.int32), quant=quant, **scales)
        errors[str(quant)] = relative_error(total, ref)
    return errors
