"""SGLang plugin: ``--moe-runner-backend flashinfer_moe`` runs SGLang's ``FusedMoE`` layers on this library's
kernels, with SGLang's own checkpoints, weight loader, routing and dispatcher.

SGLang finds :func:`register` through the ``sglang.srt.plugins`` entry point of this package and calls it in
every process before it parses its arguments. :func:`register` adds the backend name to the flag's choices,
registers the runner core (:mod:`flashinfer_moe.integrations.sglang_runner`) and wraps four methods of the
unquantized and FP8 MoE quant methods. The wrappers do nothing unless the flag names this backend; with it, each
layer is either taken over (one log line per kind of layer) or left to SGLang's own runner with one warning
naming what is not supported. On an SGLang outside :data:`SUPPORTED_SGLANG` the plugin logs one line and registers
nothing, so the flag is refused by SGLang's parser.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from importlib import metadata

from flashinfer_moe._version import __version__

BACKEND = "flashinfer_moe"
# The versions the plugin is tested with; the `sglang` extra in pyproject.toml pins the same range.
SUPPORTED_SGLANG = ((0, 5, 23), (0, 5, 24))  # [first, past the last)
SUPPORTED_SGLANG_SPEC = ">=0.5.23,<0.5.24"

logger = logging.getLogger("flashinfer_moe.sglang")

_QUANT_METHODS = (
    "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod",
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod",
    "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod",
)
_NVFP4_METHOD = _QUANT_METHODS[2]
_LOADER = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.weight_loader"
_registered = False
_announced: set[str] = set()


def _release(version: str) -> tuple[int, ...] | None:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def sglang_version_problem(version: str | None = None) -> str | None:
    """Why the installed SGLang (or ``version``) is not one the plugin supports; None when it is."""
    if version is None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return "SGLang is not installed"
    release = _release(version)
    first, past = SUPPORTED_SGLANG
    if release is None or not first <= release < past:
        return f"SGLang {version} is outside the supported range {SUPPORTED_SGLANG_SPEC}"
    return None


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: registers the backend and its hooks (once per process)."""
    global _registered
    if _registered:
        return
    problem = sglang_version_problem()
    if problem is not None:
        logger.warning(
            "flashinfer_moe: %s; --moe-runner-backend %s is not registered (flashinfer-moe %s)",
            problem,
            BACKEND,
            __version__,
        )
        return
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices
    from sglang.srt.layers.moe.moe_runner import register_moe_runner_core
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .sglang_runner import FlashInferMoERunnerCore

    if BACKEND not in MOE_RUNNER_BACKEND_CHOICES:
        add_moe_runner_backend_choices([BACKEND])
    register_moe_runner_core(BACKEND, FlashInferMoERunnerCore)
    for cls in _QUANT_METHODS:
        HookRegistry.register(f"{cls}.create_moe_runner", _create_moe_runner, HookType.AROUND)
        HookRegistry.register(f"{cls}.process_weights_after_loading", _process_weights_after_loading, HookType.AROUND)
        HookRegistry.register(f"{cls}.apply", _apply, HookType.AROUND)
    HookRegistry.register(_LOADER, _weight_loader, HookType.AROUND)
    HookRegistry.register(f"{_NVFP4_METHOD}.__init__", _nvfp4_init, HookType.AROUND)
    _registered = True


def backend_selected() -> bool:
    """Whether this process runs with ``--moe-runner-backend flashinfer_moe``."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend().value == BACKEND


@contextmanager
def _sglang_choice(name: str = "auto"):
    """SGLang's own code for a layer we leave to it runs as under ``--moe-runner-backend auto`` (or
    ``name``): that code branches on the global choice."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.runtime_context import get_flags

    flags = get_flags().moe
    saved = flags.runner_backend
    flags.runner_backend = MoeRunnerBackend(name)
    try:
        yield
    finally:
        flags.runner_backend = saved


def _nvfp4_init(original, method, *args, **kwargs):
    # SGLang's NVFP4 method refuses any backend but its own Blackwell kernels and Marlin (Hopper, Ampere) when
    # it is built; under ours it is built as for Marlin, the layout-neutral choice, and taken over afterwards.
    if not backend_selected():
        return original(method, *args, **kwargs)
    with _sglang_choice("marlin"):
        return original(method, *args, **kwargs)


def _layer_name(layer) -> str:
    return getattr(layer, "layer_name", "") or f"layer {getattr(layer, 'layer_id', '?')}"


def _create_moe_runner(original, method, layer, moe_runner_config):
    if not backend_selected():
        return original(method, layer, moe_runner_config)
    from sglang.srt.layers.moe.moe_runner import MoeRunner
    from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

    from .sglang_runner import plan_takeover

    takeover, why = plan_takeover(method, layer)
    method._flashinfer_moe_takeover = takeover
    if takeover is None:
        logger.warning(
            "flashinfer_moe: %s keeps SGLang's own MoE runner; not supported by flashinfer_moe: %s",
            _layer_name(layer),
            why,
        )
        with _sglang_choice():
            return original(method, layer, moe_runner_config)
    method.moe_runner_config = moe_runner_config
    method.runner = MoeRunner(resolve_moe_runner_backend(BACKEND), moe_runner_config)
    method._moe_runner_backend = method.runner.runner_backend  # what the FP8 and NVFP4 methods report
    if hasattr(method, "_owns_moe_runner"):
        method._owns_moe_runner = True
    what = takeover.describe(method)
    if what not in _announced:
        _announced.add(what)
        logger.info(
            "flashinfer_moe: MoE runner backend %s (flashinfer-moe %s, SGLang %s) runs the %s layers",
            BACKEND,
            __version__,
            metadata.version("sglang"),
            what,
        )
    return None


def _sglang_own(original, method, *args, **kwargs):
    """SGLang's own method for a layer we did not take over (as under ``auto`` when our flag is given)."""
    if not backend_selected():
        return original(method, *args, **kwargs)
    with _sglang_choice():
        return original(method, *args, **kwargs)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    """The hooked method's arguments by name, whether SGLang passed them by position or by keyword."""
    return dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}


def _process_weights_after_loading(original, method, layer):
    takeover = getattr(method, "_flashinfer_moe_takeover", None)
    if takeover is None:
        return _sglang_own(original, method, layer)
    if takeover.quant == "fp8_tensor":
        from .sglang_runner import fp8_tensor_after_loading_

        fp8_tensor_after_loading_(method, layer)
    if takeover.quant is not None and hasattr(layer, "dispatcher"):
        layer.dispatcher.set_quant_config({"weight_dtype": layer.w13_weight.dtype, "use_mxfp8": False})
    if takeover.split_interleaved_w13:
        from .sglang_runner import split_interleaved_w13_

        split_interleaved_w13_(layer.w13_weight.data)
    if takeover.quant == "nvfp4":
        from .sglang_runner import k_permute_nvfp4_

        k_permute_nvfp4_(layer)
    return None


def _apply(original, method, *args, **kwargs):
    takeover = getattr(method, "_flashinfer_moe_takeover", None)
    if takeover is None:
        return _sglang_own(original, method, *args, **kwargs)
    from .sglang_runner import quant_info_for

    bound = _bind(("layer", "dispatch_output"), args, kwargs)
    layer, dispatch_output = bound["layer"], bound["dispatch_output"]
    return method.runner.run(dispatch_output, quant_info_for(layer, takeover))


def _expected_shard_shape(layer, param, shard_id: str) -> tuple[str, tuple[int, int]] | None:
    """``(name, (rows, cols))`` a per-expert checkpoint tensor for ``param`` must have, for the weights and block
    scales (3-D parameters) of a layer we run; None for other parameters (SGLang checks those itself). A
    gate or up shard is half of w13's rows, on every tensor-parallel rank unless presharded."""
    if getattr(param, "ndim", 0) != 3:
        return None
    names = (
        "w13_weight",
        "w2_weight",
        "w13_weight_scale_inv",
        "w2_weight_scale_inv",
        "w13_weight_scale",
        "w2_weight_scale",
    )
    name = next((n for n in names if getattr(layer, n, None) is param), None)
    if name is None:
        return None
    tp = 1 if layer.use_presharded_weights else layer.moe_tp_size
    if name.startswith("w13"):
        return name, (param.shape[1] // 2 * tp, param.shape[2])
    return name, (param.shape[1], param.shape[2] * tp)


def _weight_loader(original, layer, *args, **kwargs):
    method = getattr(layer, "quant_method", None)
    if getattr(method, "_flashinfer_moe_takeover", None) is not None:
        from .sglang_runner import k_permute_nvfp4_

        # A reload writes checkpoint bytes: the layer goes back to plain order first, and the post-load step
        # (where SGLang runs it again) permutes the whole layer anew; until then the runner reads it plain.
        k_permute_nvfp4_(layer, pack=False)
        bound = _bind(("param", "loaded_weight", "weight_name", "shard_id", "expert_id"), args, kwargs)
        param, loaded = bound.get("param"), bound.get("loaded_weight")
        # expert_id None: a fused checkpoint tensor holding every expert, which SGLang splits itself.
        expected = (
            None if bound.get("expert_id") is None else _expected_shard_shape(layer, param, str(bound.get("shard_id")))
        )
        if expected is not None and loaded is not None:
            what, shape = expected
            if tuple(loaded.shape) != shape:
                raise ValueError(
                    f"{bound.get('weight_name')} (expert {bound.get('expert_id')}, shard {bound.get('shard_id')}) "
                    f"must have the shape {shape} for {what} of {_layer_name(layer)} (H={layer.hidden_size}, "
                    f"I={layer.intermediate_size_per_partition} per rank), got {tuple(loaded.shape)}"
                )
    return original(layer, *args, **kwargs)
