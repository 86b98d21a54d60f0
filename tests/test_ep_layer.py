"""``EPMoELayer`` on CPUs with gloo, 1 to 4 ranks: equal to the single-process ``MoELayer`` (plus the shared MLP)
on the same global weights in both modes, bf16 and FP8, with skewed routing and ranks without tokens; loading
from safetensors files; arguments that differ between ranks and bad checkpoints raise on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ep_cases import TOLERANCE, E, H, Reference, build, checkpoint, relative_error, skewed_logits, tokens
from launcher import run_ranks

from flashinfer_moe import CommTimeoutError, EPMoELayer

CONFIGS = [(quant, mode) for quant in (None, "fp8_block", "fp8_tensor") for mode in ("high_throughput", "low_latency")]


def _token_counts(world: int) -> list[int]:
    # Odd counts, a rank with none, one at the low-latency bound (24).
    return [[7, 0, 24, 1][r % 4] for r in range(world)]


def _agreement(rank: int, world: int, seed: int) -> list[tuple[str, str, float]]:
    """Every (quant, mode) and auto on two ranks, fewer elsewhere; random and skewed routing: the max relative
    error per case."""
    weights = checkpoint(seed, fp8=False)
    results = []
    configs = [*CONFIGS, (None, "auto")] if world == 2 else [CONFIGS[0], CONFIGS[3], ("fp8_block", "auto")]
    for quant, mode in configs:
        layer = build(None, quant, mode, "cpu", weights, backend="nccl", timeout_s=60)
        ref = Reference(quant, "cpu", weights)
        x = tokens(seed, rank, _token_counts(world)[rank], "cpu")
        results.append((f"{quant} {mode} random", relative_error(layer(x), ref(x)), TOLERANCE[quant]))
        # Every token to the first rank's experts: the other ranks' experts idle, rank 0 gets every row.
        logits = skewed_logits(x, range(0, E // world))
        results.append((f"{quant} {mode} skewed", relative_error(layer(x, logits), ref(x, logits)), TOLERANCE[quant]))
        if mode == "auto":  # a prefill-sized call takes the other exchange
            x = tokens(seed + 1, rank, 40 - rank, "cpu")
            results.append((f"{quant} auto large", relative_error(layer(x), ref(x)), TOLERANCE[quant]))
        times = {}
        layer(x, phase_times=times)
        assert set(times) <= {"route", "dispatch", "experts", "combine", "shared"} and "shared" in times, times
        layer.close()
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ep_layer_equals_single_process_layer(world):
    seed = int.from_bytes(os.urandom(3), "little")
    for rank, cases in enumerate(run_ranks(_agreement, world, seed, timeout_s=600)):
        for name, err, tol in cases:
            assert err < tol, f"seed {seed} rank {rank}/{world} {name}: relative error {err:.3g} >= {tol}"


def _nvfp4(rank: int, world: int, seed: int) -> list[tuple[str, float]]:
    """NVFP4 experts (the bf16 checkpoint quantized at load, the same way on every rank and in the reference):
    bf16 rows travel, W4A16 GEMMs on each rank; also with the local experts' weights K-permuted."""
    weights = checkpoint(seed)
    ref = Reference("nvfp4", "cpu", weights)
    results = []
    for mode, packed in (("high_throughput", False), ("low_latency", False), ("low_latency", True)):
        layer = build(None, "nvfp4", mode, "cpu", weights, backend="nccl", timeout_s=60)
        if packed:
            layer.pack_weights()
        x = tokens(seed, rank, _token_counts(world)[rank], "cpu")
        results.append((f"{mode}{' packed' if packed else ''}", relative_error(layer(x), ref(x))))
        layer.close()
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_ep_layer_nvfp4_equals_single_process_layer(world):
    seed = int.from_bytes(os.urandom(3), "little")
    for rank, cases in enumerate(run_ranks(_nvfp4, world, seed, timeout_s=600)):
        for mode, err in cases:
            assert err < TOLERANCE["nvfp4"], f"seed {seed} rank {rank}/{world} nvfp4 {mode}: relative error {err:.3g}"


def _fp8_checkpoint_and_safetensors(rank: int, world: int, seed: int, folder: str) -> list[float]:
    from safetensors.torch import save_file

    weights = checkpoint(seed, fp8=True, prefix="model.layers.5.mlp.")
    if rank == 0:  # two files, as a sharded checkpoint is
        keys = sorted(weights)
        save_file({k: weights[k].contiguous() for k in keys[::2]}, os.path.join(folder, "model-1.safetensors"))
        save_file({k: weights[k].contiguous() for k in keys[1::2]}, os.path.join(folder, "model-2.safetensors"))
    dist.barrier()
    plain = {k[len("model.layers.5.mlp.") :]: v for k, v in weights.items()}
    errors = []
    for mode in ("high_throughput", "low_latency"):
        layer = build(None, "fp8_block", mode, "cpu", plain, backend="nccl")
        from_files = EPMoELayer(
            E, 4, H, 128, quant="fp8_block", mode=mode, max_tokens_per_rank=48, low_latency_max_tokens=24,
            num_shared_experts=1, backend="nccl", scoring_func="sigmoid", num_expert_group=4, topk_group=2,
            correction_bias=True, routed_scaling_factor=2.5,
        )  # fmt: skip
        from_files.load_safetensors(folder, prefix="model.layers.5.mlp.")
        # The checkpoint's FP8 bytes are kept as stored: the two layers hold the same bits.
        for a, b in zip(layer.state_dict().values(), from_files.state_dict().values(), strict=True):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)  # fmt: skip
        x = tokens(seed, rank, 5 + 3 * rank, "cpu")
        errors.append(relative_error(from_files(x), Reference("fp8_block", "cpu", plain)(x)))
        layer.close()
        from_files.close()
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_ep_layer_loads_fp8_checkpoint_from_safetensors(world, tmp_path):
    seed = int.from_bytes(os.urandom(3), "little")
    for rank, errors in enumerate(run_ranks(_fp8_checkpoint_and_safetensors, world, seed, str(tmp_path))):
        assert max(errors) < TOLERANCE["fp8_block"], (seed, rank, errors)


def _caught(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _bad_input(rank: int, world: int, seed: int) -> dict[str, str]:
    weights = checkpoint(seed)
    base = dict(num_shared_experts=1, backend="nccl", max_tokens_per_rank=16)
    out = {}
    # An argument that differs on the last rank.
    hidden = 256 if rank < world - 1 else 384
    out["hidden_size differs"] = _caught(lambda: EPMoELayer(E, 4, hidden, 128, **base))
    # An argument that is bad on one rank only.
    experts = E if rank != 1 else 10
    out["num_experts bad on rank 1"] = _caught(lambda: EPMoELayer(experts, 4, 256, 128, **base))
    out["num_experts not divisible"] = _caught(lambda: EPMoELayer(E + 1, 4, 256, 128, **base))
    layer = EPMoELayer(E, 4, 256, 128, **base)
    # A checkpoint missing an expert that only the last rank holds; one with a NaN that only rank 0 holds.
    missing = {k: v for k, v in weights.items() if not k.startswith(f"experts.{E - 1}.")}
    out["missing expert"] = _caught(lambda: layer.load_expert_weights(missing))
    poisoned = dict(weights)
    poisoned["experts.0.down_proj.weight"] = weights["experts.0.down_proj.weight"].clone()
    poisoned["experts.0.down_proj.weight"][3, 5] = float("nan")
    out["nan weight"] = _caught(lambda: layer.load_expert_weights(poisoned))
    bias = dict(weights)
    bias["gate.e_score_correction_bias"] = torch.full((E,), float("inf"))
    out["inf bias"] = _caught(
        lambda: EPMoELayer(E, 4, 256, 128, correction_bias=True, **base).load_expert_weights(bias)
    )
    out["missing router"] = _caught(
        lambda: layer.load_expert_weights({k: v for k, v in weights.items() if k != "gate.weight"})
    )
    gate = dict(weights)
    gate["gate.weight"] = weights["gate.weight"][:, :-1]
    out["router shape"] = _caught(lambda: layer.load_expert_weights(gate))
    wrong = dict(weights)
    wrong["shared_experts.up_proj.weight"] = weights["shared_experts.up_proj.weight"][:, :128]
    out["wrong shape"] = _caught(lambda: layer.load_expert_weights(wrong))
    layer.load_expert_weights(weights)  # the layer is still usable after the refusals
    x = tokens(seed, rank, 3, "cpu")
    out["forward after refusals"] = str(relative_error(layer(x), layer(x)))
    out["too many tokens"] = _caught(lambda: layer(tokens(seed, rank, 17, "cpu")))
    layer.close()
    return out


def test_ep_layer_bad_input_raises_on_every_rank():
    results = run_ranks(_bad_input, 3, 7, timeout_s=300)
    for rank, out in enumerate(results):
        where = f"rank {rank}: {out}"
        assert out["hidden_size differs"].startswith("ValueError") and "hidden_size" in out["hidden_size differs"]
        assert "rank(s) 2" in out["hidden_size differs"], where
        assert "num_experts" in out["num_experts bad on rank 1"] and "rank 1" in out["num_experts bad on rank 1"]
        assert "num_experts must be divisible" in out["num_experts not divisible"], where
        assert "experts.11.gate_proj.weight" in out["missing expert"], where
        assert "experts.0.down_proj.weight must hold finite values" in out["nan weight"], where
        assert "gate.e_score_correction_bias must hold finite values" in out["inf bias"], where
        assert "shared_experts.up_proj.weight must have shape" in out["wrong shape"], where
        assert "gate.weight must be given for a layer with a router" in out["missing router"], where
        assert f"gate.weight must have shape ({E}, 256)" in out["router shape"], where
        assert out["forward after refusals"] == "0.0", where
        assert out["too many tokens"].startswith("ValueError: hidden_states must have at most"), where


def _late_rank(rank: int, world: int) -> str:
    """Rank 1 skips a forward: rank 0 raises CommTimeoutError naming it instead of waiting."""
    layer = EPMoELayer(E, 4, 256, 128, backend="nccl", mode="high_throughput", max_tokens_per_rank=8, timeout_s=3)
    layer.load_expert_weights(checkpoint(1))
    if rank == 1:
        return "skipped"
    try:
        layer(tokens(1, rank, 4, "cpu"))
    except CommTimeoutError as exc:
        return str(exc)
    return "no error"


def test_ep_layer_times_out_naming_the_missing_rank():
    message = run_ranks(_late_rank, 2, timeout_s=120)[0]
    assert "rank(s) 1 did not arrive" in message, message


def _one_rank_refused(rank: int, world: int, seed: int, mode: str) -> tuple[str, float, float]:
    """Rank 1 passes too many tokens: it raises ValueError, the others get their own tokens' exact results
    (the refused rank still served its experts), and every rank's next call is in step again."""
    weights = checkpoint(seed)
    layer = build(None, None, mode, "cpu", weights, backend="nccl", timeout_s=30)
    ref = Reference(None, "cpu", weights)
    bound = 24 if mode == "low_latency" else 48
    x = tokens(seed, rank, bound + 1 if rank == 1 else 9, "cpu")
    refused, first = "no error", 0.0
    try:
        first = relative_error(layer(x), ref(x))
    except ValueError as exc:
        refused = str(exc)
    x = tokens(seed + 1, rank, 5, "cpu")
    second = relative_error(layer(x), ref(x))
    layer.close()
    return refused, first, second


@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_ep_layer_refused_call_keeps_the_ranks_in_step(mode):
    results = run_ranks(_one_rank_refused, 3, 11, mode, timeout_s=300)
    for rank, (refused, first, second) in enumerate(results):
        if rank == 1:
            assert refused.startswith("hidden_states must have at most"), refused
        else:
            assert refused == "no error" and first < TOLERANCE[None], (rank, refused, first)
        assert second < TOLERANCE[None], (rank, second)
