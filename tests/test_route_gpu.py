"""GPU tier for routing (pytest -m gpu): the fused kernel against the reference run on the same device.

The reference runs on the GPU too, so that the sigmoid scores (spelled (x >= 0 ? 1 : e) / (1 + e) with
e = exp(-|x|) in both) are the same bits and the biased selection keys compare exactly; ids must then match
exactly and weights within 1e-6 relative (the k-term sums are added in different orders).
"""

import pytest
import torch
from model_configs import BIASED_MODELS, MODEL_ROUTING, model_inputs
from test_route_reference import _assert_sglang_weights, extreme_logits

import flashinfer_moe
from flashinfer_moe import reference

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 4096, 65536]


def _poisoned(num_tokens, top_k):
    w = torch.full((num_tokens, top_k), float("nan"), device="cuda")
    ids = torch.full((num_tokens, top_k), -12345, dtype=torch.int32, device="cuda")
    return w, ids


def _compare(w, ids, w_ref, ids_ref, seed):
    mismatched = (ids != ids_ref).any(dim=1).nonzero().flatten()
    assert mismatched.numel() == 0, (
        f"seed {seed}: {mismatched.numel()} tokens with different ids, first {mismatched[:4].tolist()}: "
        f"{ids[mismatched[:4]].tolist()} vs {ids_ref[mismatched[:4]].tolist()}"
    )
    assert not torch.isnan(w).any(), f"seed {seed}: unwritten or NaN weights"
    rel = ((w.double() - w_ref.double()).abs() / w_ref.double().abs().clamp_min(1e-30)).max().item()
    assert rel <= 1e-6, f"seed {seed}: max relative weight error {rel:.3e}"


@pytest.mark.parametrize("name", sorted(MODEL_ROUTING))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(name, num_tokens, dtype, generator):
    logits, top_k, kwargs = model_inputs(name, num_tokens, dtype, "cuda", generator)
    w, ids = flashinfer_moe.route(logits, top_k, out=_poisoned(num_tokens, top_k), **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    torch.cuda.synchronize()
    _compare(w, ids, w_ref, ids_ref, generator.initial_seed())


@pytest.mark.parametrize(
    "num_experts, top_k, kwargs",
    [
        (512, 16, dict(scoring_func="softmax")),
        (1024, 32, dict(scoring_func="sigmoid", renormalize=False)),
        (96, 6, dict(scoring_func="sigmoid", num_expert_group=32, topk_group=3, with_bias=True)),
        (60, 4, dict(scoring_func="softmax", num_expert_group=4, topk_group=2)),
        (33, 3, dict(scoring_func="sigmoid", with_bias=True)),
        (2, 2, dict(scoring_func="softmax")),
        (64, 4, dict(scoring_func="sigmoid", num_expert_group=32, topk_group=2, with_bias=True)),  # groups of 2
    ],
)
@pytest.mark.parametrize("num_tokens", [1, 1000])
def test_kernel_odd_shapes(num_experts, top_k, kwargs, num_tokens, generator):
    kwargs = dict(kwargs)
    if kwargs.pop("with_bias", False):
        kwargs["correction_bias"] = (torch.rand(num_experts, generator=generator) - 0.5).cuda()
    logits = (torch.randn(num_tokens, num_experts, generator=generator) * 3).cuda()
    w, ids = flashinfer_moe.route(logits, top_k, out=_poisoned(num_tokens, top_k), **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    _compare(w, ids, w_ref, ids_ref, generator.initial_seed())


def test_ties_and_strided_rows(generator):
    # bf16 logits on a coarse grid: many exact ties, which must go to the lower index as in the reference.
    wide = (torch.randint(-4, 5, (513, 300), generator=generator).float() / 2).to(torch.bfloat16).cuda()
    logits = wide[:, 10:266]
    assert logits.stride() == (300, 1)
    kwargs = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
    w, ids = flashinfer_moe.route(logits, 8, **kwargs)
    w_ref, ids_ref = reference.route(logits.contiguous(), 8, **kwargs)
    _compare(w, ids, w_ref, ids_ref, generator.initial_seed())


def test_zero_tokens_launches_nothing():
    w, ids = flashinfer_moe.route(torch.randn(0, 256, device="cuda"), 8)
    assert w.shape == (0, 8) and ids.shape == (0, 8)


def test_cuda_graph_capture_and_replay(generator):
    logits, top_k, kwargs = model_inputs("deepseek_v3", 128, torch.bfloat16, "cuda", generator)
    out = _poisoned(128, top_k)
    flashinfer_moe.route(logits, top_k, out=out, **kwargs)  # warm-up: compile and load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashinfer_moe.route(logits, top_k, out=out, **kwargs)
    for _ in range(3):
        fresh, _, _ = model_inputs("deepseek_v3", 128, torch.bfloat16, "cuda", generator)
        logits.copy_(fresh)
        out[0].fill_(float("nan"))
        graph.replay()
        w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
        _compare(out[0], out[1], w_ref, ids_ref, generator.initial_seed())


def test_torch_compile(generator):
    logits, top_k, kwargs = model_inputs("qwen3", 64, torch.bfloat16, "cuda", generator)

    def layer(x):
        w, ids = flashinfer_moe.route(x * 1.0, top_k, **kwargs)
        return w * 2, ids

    compiled = torch.compile(layer, fullgraph=True)
    w, ids = compiled(logits)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    _compare(w / 2, ids, w_ref, ids_ref, generator.initial_seed())


def test_bias_on_other_device_is_rejected():
    with pytest.raises(ValueError, match="correction_bias must be on the same device"):
        flashinfer_moe.route(torch.randn(2, 8, device="cuda"), 2, correction_bias=torch.zeros(8))


def _extreme_inputs(num_tokens, num_experts, dtype, generator):
    """Logits from 0 down to -1e4 (see extreme_logits), with a few +-inf entries and the first rows all
    -inf, all +inf and one +inf among -inf; on the GPU in ``dtype``, and the same values in fp32 on the CPU."""
    logits = extreme_logits(num_tokens, num_experts, generator)
    u = torch.rand(num_tokens, num_experts, generator=generator)
    logits[u < 0.02] = -torch.inf
    logits[u > 0.99] = torch.inf
    logits[0], logits[1], logits[2] = -torch.inf, torch.inf, -torch.inf
    logits[2, 3] = torch.inf
    logits = logits.to(dtype)
    return logits.cuda(), logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2", "llama4"])
def test_kernel_extremes_scores_bit_equal(name, dtype, rng):
    # Without renormalisation the weights are the sigmoid scores times the scale: kernel and reference must
    # give the same bits at every magnitude (and the same ids, which the biased keys score + bias decide).
    seed, generator = rng
    num_experts, top_k, kwargs = MODEL_ROUTING[name]
    kwargs = dict(kwargs, renormalize=False)
    if name in BIASED_MODELS:
        kwargs["correction_bias"] = (torch.rand(num_experts, generator=generator) * 0.2 - 0.1).cuda()
    logits, logits_cpu = _extreme_inputs(4099, num_experts, dtype, generator)
    w, ids = flashinfer_moe.route(logits, top_k, out=_poisoned(4099, top_k), **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    _compare(w, ids, w_ref, ids_ref, seed)
    assert torch.equal(w, w_ref), f"seed {seed}: sigmoid scores differ from the reference's bits"
    _assert_sglang_weights(w.cpu(), logits_cpu, ids.cpu(), False, kwargs.get("routed_scaling_factor") or 1.0, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_kernel_extremes_renormalised(name, dtype, rng):
    # DeepSeek-V3 / Kimi-K2 routing on logits down to -1e4 and +-inf: every weight finite, ids equal to the
    # reference's, weights within 1e-6 of it and of SGLang's w / (sum + 1e-20) computed in float64.
    seed, generator = rng
    num_experts, top_k, kwargs = MODEL_ROUTING[name]
    kwargs = dict(kwargs, correction_bias=(torch.rand(num_experts, generator=generator) * 0.2 - 0.1).cuda())
    logits, logits_cpu = _extreme_inputs(4099, num_experts, dtype, generator)
    w, ids = flashinfer_moe.route(logits, top_k, out=_poisoned(4099, top_k), **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    _compare(w, ids, w_ref, ids_ref, seed)
    assert torch.isfinite(w).all(), f"seed {seed}"
    assert w[0].eq(0).all(), f"seed {seed}: every expert at -inf must give zero weights, got {w[0].tolist()}"
    _assert_sglang_weights(w.cpu(), logits_cpu, ids.cpu(), True, kwargs["routed_scaling_factor"], seed)
