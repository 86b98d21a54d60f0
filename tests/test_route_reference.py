"""CPU tier for routing: the reference against hand-checked cases and properties, and the public op on CPU."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_configs import BIASED_MODELS, MODEL_ROUTING, model_inputs

import flashinfer_moe
from flashinfer_moe import reference


def test_softmax_hand_checked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = reference.route(logits, 2, scoring_func="softmax", renormalize=False)
    p = [math.exp(v) for v in (1.0, 3.0, 2.0, 0.0)]
    total = sum(p)
    assert ids.tolist() == [[1, 2]]
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(w, torch.tensor([[p[1] / total, p[2] / total]]), rtol=1e-6, atol=0)
    w, _ = reference.route(logits, 2, scoring_func="softmax", renormalize=True)
    torch.testing.assert_close(w, torch.tensor([[p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]]), rtol=1e-6, atol=0)


def test_sigmoid_llama4_hand_checked():
    logits = torch.tensor([[-1.0, 0.5, 4.0, 0.25]])
    w, ids = reference.route(logits, 1, scoring_func="sigmoid", renormalize=False)
    assert ids.tolist() == [[2]]
    torch.testing.assert_close(w, torch.tensor([[1 / (1 + math.exp(-4.0))]]), rtol=1e-6, atol=0)


def test_grouped_bias_hand_checked():
    # 8 experts in 4 groups of 2; sigmoid(0) = 0.5 everywhere, so the bias alone decides the selection
    # while the weights stay the unbiased 0.5.
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0.0, 0.1, 0.3, 0.3, 0.5, -0.4, 0.2, 0.25])
    # group scores (sum of two best of score + bias): g0 1.1, g1 1.6, g2 1.1, g3 1.45 -> keep g1, g3
    w, ids = reference.route(
        logits,
        3,
        scoring_func="sigmoid",
        num_expert_group=4,
        topk_group=2,
        correction_bias=bias,
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    # candidates 2 (0.8), 3 (0.8), 6 (0.7), 7 (0.75): tie 2/3 goes to the lower index
    assert ids.tolist() == [[2, 3, 7]]
    torch.testing.assert_close(w, torch.full((1, 3), 2.5 / 3), rtol=1e-6, atol=0)


def test_grouped_without_bias_uses_group_max():
    logits = torch.tensor([[5.0, -9.0, 1.0, 1.5, 4.0, 4.5]])  # groups of 2: maxes 5, 1.5, 4.5
    _, ids = reference.route(logits, 2, num_expert_group=3, topk_group=2)
    assert ids.tolist() == [[0, 5]]  # expert 4 (4.0) beats 1 but 0 and 5 are the two best in kept groups


def test_ties_go_to_lower_index_and_signed_zero_ties():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, -0.0, 0.0]])
    _, ids = reference.route(logits, 4)
    assert ids.tolist() == [[1, 2, 3, 0]]
    _, ids = reference.route(logits[:, 4:], 2)
    assert ids.tolist() == [[0, 1]]


def _check_properties(logits, top_k, kwargs, w, ids):
    """Invariants of any correct routing, checked from the fp32 scores."""
    logits = logits.float()
    num_tokens, num_experts = logits.shape
    bias = kwargs.get("correction_bias")
    if kwargs.get("scoring_func", "softmax") == "softmax":
        scores = torch.softmax(logits.double(), -1)
    else:
        scores = torch.sigmoid(logits.double())
    keys = logits.double() if bias is None else scores + bias.double()
    assert ids.shape == (num_tokens, top_k) and w.shape == (num_tokens, top_k)
    assert ((ids >= 0) & (ids < num_experts)).all()
    for row in ids.tolist():
        assert len(set(row)) == top_k, row
    chosen = keys.gather(1, ids.long())
    # descending selection order
    assert (chosen[:, :-1] >= chosen[:, 1:] - 1e-6).all()
    expected_w = scores.gather(1, ids.long())
    if kwargs.get("renormalize", True):
        expected_w = expected_w / expected_w.sum(-1, keepdim=True)
    expected_w = expected_w * (kwargs.get("routed_scaling_factor") or 1.0)
    torch.testing.assert_close(w.double(), expected_w, rtol=1e-5, atol=1e-7)
    groups = kwargs.get("num_expert_group") or 1
    allowed = torch.ones_like(keys, dtype=torch.bool)
    if groups > 1:
        gs = num_experts // groups
        grouped = keys.view(num_tokens, groups, gs)
        if bias is None or gs < 2:
            gscore = grouped.amax(-1)
        else:
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        used = torch.zeros(num_tokens, groups, dtype=torch.bool)
        used.scatter_(1, (ids.long() // gs), True)
        assert (used.sum(-1) <= kwargs["topk_group"]).all()
        # every used group is among the topk_group best (up to rounding) ...
        kth_best = gscore.sort(-1, descending=True).values[:, kwargs["topk_group"] - 1]
        worst_used = torch.where(used, gscore, torch.inf).amin(-1)
        assert (worst_used >= kth_best - 1e-6).all()
        # ... and groups clearly above the cut were eligible
        allowed = (gscore > kth_best.unsqueeze(1) + 1e-6).repeat_interleave(gs, dim=1)
    # nothing left out scores better than the worst chosen one (within the eligible experts)
    mask = allowed.clone()
    mask.scatter_(1, ids.long(), False)
    best_left = torch.where(mask, keys, -torch.inf).amax(-1)
    assert (chosen[:, -1] >= best_left - 1e-6).all()


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 9),
    groups_and_size=st.sampled_from([(1, 8), (1, 33), (4, 4), (8, 8), (3, 5), (2, 1), (16, 2)]),
    data=st.data(),
)
def test_reference_properties(num_tokens, groups_and_size, data):
    groups, group_size = groups_and_size
    num_experts = groups * group_size
    scoring = data.draw(st.sampled_from(["softmax", "sigmoid"]))
    use_bias = data.draw(st.booleans())
    topk_group = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, min(topk_group * group_size, 16)))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # coarse values make exact ties common, which the properties must survive
    logits = torch.randint(-8, 9, (num_tokens, num_experts), generator=g).float() / 4
    kwargs = dict(
        scoring_func=scoring,
        renormalize=data.draw(st.booleans()),
        routed_scaling_factor=data.draw(st.sampled_from([None, 2.5])),
    )
    if groups > 1:
        kwargs.update(num_expert_group=groups, topk_group=topk_group)
    if use_bias:
        kwargs["correction_bias"] = torch.randint(-4, 5, (num_experts,), generator=g).float() / 16
    w, ids = reference.route(logits, top_k, **kwargs)
    _check_properties(logits, top_k, kwargs, w, ids)


@pytest.mark.parametrize("name", sorted(MODEL_ROUTING))
@pytest.mark.parametrize("num_tokens", [1, 3, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_models_cpu_op_matches_reference_and_properties(name, num_tokens, dtype, generator):
    logits, top_k, kwargs = model_inputs(name, num_tokens, dtype, "cpu", generator)
    w, ids = flashinfer_moe.route(logits, top_k, **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    assert torch.equal(ids, ids_ref), f"seed {generator.initial_seed()}"
    assert torch.equal(w, w_ref), f"seed {generator.initial_seed()}"
    _check_properties(logits, top_k, kwargs, w, ids)


def test_out_buffers_are_written_and_returned(generator):
    logits, top_k, kwargs = model_inputs("deepseek_v3", 5, torch.float32, "cpu", generator)
    w_out = torch.full((5, top_k), float("nan"))
    ids_out = torch.full((5, top_k), -7, dtype=torch.int32)
    w, ids = flashinfer_moe.route(logits, top_k, out=(w_out, ids_out), **kwargs)
    assert w is w_out and ids is ids_out
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    assert torch.equal(ids_out, ids_ref) and torch.equal(w_out, w_ref)


def test_strided_rows_accepted(generator):
    wide = torch.randn(6, 40, generator=generator)
    logits = wide[:, 3:35]
    w, ids = flashinfer_moe.route(logits, 4)
    w_ref, ids_ref = reference.route(logits.contiguous(), 4)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_zero_tokens():
    w, ids = flashinfer_moe.route(torch.randn(0, 16), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)


def test_opcheck_cpu(generator):
    logits, top_k, kwargs = model_inputs("deepseek_v3", 4, torch.float32, "cpu", generator)
    args = (
        logits,
        kwargs["correction_bias"],
        torch.empty(4, top_k),
        torch.empty(4, top_k, dtype=torch.int32),
        top_k,
        "sigmoid",
        True,
        8,
        4,
        2.5,
    )
    torch.library.opcheck(torch.ops.flashinfer_moe.route_.default, args)


BAD_INPUTS = [
    (lambda: dict(router_logits=[[1.0]], top_k=1), TypeError, "router_logits must be a torch.Tensor"),
    (lambda: dict(router_logits=torch.randn(8), top_k=1), ValueError, "router_logits must be 2-D"),
    (lambda: dict(router_logits=torch.randn(2, 3, 8), top_k=1), ValueError, "got shape (2, 3, 8)"),
    (lambda: dict(router_logits=torch.randn(2, 8).double(), top_k=1), TypeError, "got float64"),
    (lambda: dict(router_logits=torch.randint(0, 3, (2, 8)), top_k=1), TypeError, "router_logits must have dtype"),
    (lambda: dict(router_logits=torch.randn(8, 2).t(), top_k=1), ValueError, "last dimension"),
    (lambda: dict(router_logits=torch.randn(2, 8), top_k=9), ValueError, "top_k must be <= 8, got 9"),
    (lambda: dict(router_logits=torch.randn(2, 8), top_k=0), ValueError, "top_k must be >= 1, got 0"),
    (lambda: dict(router_logits=torch.randn(2, 64), top_k=33), ValueError, "top_k must be <= 32"),
    (lambda: dict(router_logits=torch.randn(2, 8), top_k=2.0), TypeError, "top_k must be an int"),
    (lambda: dict(router_logits=torch.randn(2, 2048), top_k=2), ValueError, "num_experts) must be <= 1024"),
    (lambda: dict(router_logits=torch.randn(2, 8), top_k=2, scoring_func="relu"), ValueError, "'relu'"),
    (
        lambda: dict(router_logits=torch.randn(2, 10), top_k=2, num_expert_group=4, topk_group=1),
        ValueError,
        "num_expert_group must divide the number of experts 10, got 4",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, num_expert_group=4, topk_group=5),
        ValueError,
        "topk_group must be <= 4, got 5",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, num_expert_group=4),
        ValueError,
        "topk_group must be given",
    ),
    (lambda: dict(router_logits=torch.randn(2, 8), top_k=2, topk_group=2), ValueError, "topk_group must be None"),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=5, num_expert_group=4, topk_group=2),
        ValueError,
        "top_k must be <= topk_group * experts per group = 4, got 5",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 128), top_k=2, num_expert_group=64, topk_group=2),
        ValueError,
        "num_expert_group must be <= 32",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, correction_bias=torch.zeros(7)),
        ValueError,
        "correction_bias must have shape (8,), got (7,)",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, correction_bias=torch.zeros(8, dtype=torch.int64)),
        TypeError,
        "correction_bias must be a float tensor",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, correction_bias=torch.zeros(8, device="meta")),
        ValueError,
        "correction_bias must be on the same device as router_logits (cpu), got meta",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, routed_scaling_factor=float("inf")),
        ValueError,
        "routed_scaling_factor must be a positive finite number",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, routed_scaling_factor=0.0),
        ValueError,
        "routed_scaling_factor must be a positive finite number, got 0.0",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, routed_scaling_factor=-2.5),
        ValueError,
        "routed_scaling_factor must be a positive finite number, got -2.5",
    ),
    (
        lambda: dict(router_logits=torch.randn(2, 8), top_k=2, out=(torch.empty(2, 2), torch.empty(2, 2))),
        TypeError,
        "out[1] (topk_ids) must be torch.int32",
    ),
    (
        lambda: dict(
            router_logits=torch.randn(2, 8), top_k=2, out=(torch.empty(2, 3), torch.empty(2, 2, dtype=torch.int32))
        ),
        ValueError,
        "out[0] (topk_weights) must have shape (2, 2), got (2, 3)",
    ),
]


@pytest.mark.parametrize("make, exc, message", BAD_INPUTS)
def test_bad_input(make, exc, message):
    kwargs = make()
    logits = kwargs.pop("router_logits")
    top_k = kwargs.pop("top_k")
    with pytest.raises(exc) as info:
        flashinfer_moe.route(logits, top_k, **kwargs)
    assert message in str(info.value)


# ---- Routing at the extremes: sigmoid scores that underflow, infinite logits -------------------------------

DSV3_E, DSV3_K, DSV3_KWARGS = MODEL_ROUTING["deepseek_v3"]


def _sglang_weights(logits, ids, renormalize, scale):
    """SGLang's (and DeepSeek-V3's) sigmoid weights in float64: sig[ids] / (sum + 1e-20) * scale."""
    sig = torch.sigmoid(logits.double()).gather(1, ids.long())
    if renormalize:
        sig = sig / (sig.sum(dim=-1, keepdim=True) + 1e-20)
    return sig * scale


def _assert_sglang_weights(w, logits, ids, renormalize, scale, seed):
    """Finite, and within 1e-6 relative of the float64 formula. The absolute slack covers scores that are
    fp32 subnormals (logits in [-104, -87]) or 0 (below -104): 16 subnormal ulps (2**-145) of a score,
    divided by the 1e-20 that then dominates the denominator, about 6e-24 of weight."""
    assert torch.isfinite(w).all(), f"seed {seed}: non-finite weights at rows {(~torch.isfinite(w)).any(1).nonzero()}"
    ref = _sglang_weights(logits, ids, renormalize, scale)
    atol = abs(scale) * 2.0**-145 / (1e-20 if renormalize else 1.0)
    err = (w.double() - ref).abs() - 1e-6 * ref.abs()
    row, col = divmod(err.argmax().item(), w.shape[1])
    assert (err <= atol).all(), (
        f"seed {seed}: token {row}, weight {w[row, col].item()!r} vs SGLang's {ref[row, col].item()!r}; "
        f"the logits of its experts {logits[row].float().gather(0, ids[row].long()).tolist()}"
    )


def extreme_logits(num_tokens, num_experts, generator):
    """`[T, E]` fp32 logits from 0 down to -1e4: each token's logits lie in [-1.05 m, -m], its magnitude m
    log-uniform in [1e-2, 1e4] (so whole tokens sit in [-1e4, -30], around -36 where the 1e-20 starts to
    matter, -88 where 1 / (1 + exp(-x)) underflows, -104 where exp(x) does); a quarter of the tokens spread
    uniformly over [-1e4, 0] instead, and the last tokens are all -1e4, all -30 and all -100."""
    mag = torch.pow(10.0, torch.rand(num_tokens, 1, generator=generator) * 6 - 2)
    logits = -mag * (1 + 0.05 * torch.rand(num_tokens, num_experts, generator=generator))
    spread = num_tokens // 4
    logits[:spread] = -torch.rand(spread, num_experts, generator=generator) * 1e4
    logits[-3:] = torch.tensor([[-1e4], [-30.0], [-100.0]])
    return logits


def test_sigmoid_underflow_hand_checked():
    # sigmoid(-80) ~ 1.8e-35, sigmoid(-81) ~ 6.6e-36 (normal floats): their sum is far below 1e-20, so the
    # weights are about sig * 1e20, not the 0.73 / 0.27 of a plain w / sum.
    def expected(a, b):
        s0, s1 = math.exp(a), math.exp(b)  # sigmoid(x) = exp(x) / (1 + exp(x)) ~ exp(x) here
        return torch.tensor([[s0 / (s0 + s1 + 1e-20), s1 / (s0 + s1 + 1e-20)]])

    logits = torch.tensor([[-81.0, -80.0, -200.0, -1e4]])
    w, ids = reference.route(logits, 2, scoring_func="sigmoid", renormalize=True)
    assert ids.tolist() == [[1, 0]]
    torch.testing.assert_close(w, expected(-80.0, -81.0), rtol=1e-6, atol=0)
    # below -88.7, 1 / (1 + exp(-x)) is 0 and a plain w / sum 0 / 0; exp(x) / (1 + exp(x)) is a subnormal
    # float here (relative precision ~2e-5 at these magnitudes)
    w, ids = reference.route(torch.tensor([[-93.0, -200.0, -92.0]]), 2, scoring_func="sigmoid")
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, expected(-92.0, -93.0), rtol=5e-5, atol=0)
    # all four scores 0 in fp32 (below -104): weights 0 / (0 + 1e-20) = 0, as SGLang's
    w, ids = reference.route(torch.tensor([[-1e4, -500.0, -105.0, -3e3]]), 2, scoring_func="sigmoid")
    assert ids.tolist() == [[2, 1]] and w.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sigmoid_extremes_match_sglang_formula(dtype, rng):
    seed, generator = rng
    num_tokens = 515
    logits = extreme_logits(num_tokens, DSV3_E, generator).to(dtype)
    bias = torch.rand(DSV3_E, generator=generator) * 0.2 - 0.1
    kwargs = dict(DSV3_KWARGS, correction_bias=bias)
    w, ids = flashinfer_moe.route(logits, DSV3_K, **kwargs)
    w_ref, ids_ref = reference.route(logits, DSV3_K, **kwargs)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref), f"seed {seed}"
    assert ((ids >= 0) & (ids < DSV3_E)).all() and all(len(set(r)) == DSV3_K for r in ids.tolist())
    _assert_sglang_weights(w, logits, ids, True, kwargs["routed_scaling_factor"], seed)
    # tokens all at -1e4: every score is 0 (exp(-1e4) is 0 in fp32, and in float64), so every weight is 0
    assert w[-3].eq(0).all(), f"seed {seed}: {w[-3].tolist()}"
    # Llama4-style (no renormalisation): the weights are the scores themselves
    w, ids = flashinfer_moe.route(logits, 4, scoring_func="sigmoid", renormalize=False)
    _assert_sglang_weights(w, logits, ids, False, 1.0, seed)


@pytest.mark.parametrize(
    "name, renormalize", [("deepseek_v3", True), ("kimi_k2", True), ("llama4", False), ("deepseek_v3", False)]
)
def test_sigmoid_infinite_logits(name, renormalize, rng):
    seed, generator = rng
    num_experts, top_k, kwargs = MODEL_ROUTING[name]
    kwargs = dict(kwargs, renormalize=renormalize)
    if name in BIASED_MODELS:
        kwargs["correction_bias"] = torch.rand(num_experts, generator=generator) * 0.2 - 0.1
    num_tokens = 64
    logits = extreme_logits(num_tokens, num_experts, generator)
    u = torch.rand(num_tokens, num_experts, generator=generator)
    logits[u < 0.3] = -torch.inf  # masked experts
    logits[u > 0.97] = torch.inf
    logits[0] = -torch.inf  # a token with every expert masked
    logits[1] = torch.inf
    logits[2, :] = -torch.inf
    logits[2, 5] = torch.inf  # one expert left, at +inf
    w, ids = flashinfer_moe.route(logits, top_k, **kwargs)
    w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref), f"seed {seed}"
    assert all(len(set(r)) == top_k for r in ids.tolist())
    scale = kwargs.get("routed_scaling_factor") or 1.0
    _assert_sglang_weights(w, logits, ids, renormalize, scale, seed)
    assert w[0].eq(0).all()  # sigmoid(-inf) = 0 exactly, and 0 / (0 + 1e-20) = 0
    one = scale / (top_k + 1e-20) if renormalize else scale  # every score 1
    torch.testing.assert_close(w[1], torch.full((top_k,), one), rtol=1e-6, atol=0)
    if "correction_bias" not in kwargs:  # without a bias the +inf expert is chosen first
        assert ids[2, 0].item() == 5 and w[2, 0].item() == pytest.approx(scale)


def test_softmax_renormalises_with_plain_sum_and_masked_experts(rng):
    # SGLang's softmax top-k renormalises with w / sum (no 1e-20); the top logit's softmax is >= 1/E, so
    # the sum is never 0 for finite logits. Masked (-inf) experts get 0 and never a NaN.
    seed, generator = rng
    logits = torch.randn(33, 128, generator=generator) * 4
    logits[torch.rand(33, 128, generator=generator) < 0.5] = -torch.inf
    logits[:, 7] = 1.0  # at least one finite expert per token
    logits[0, 8:] = -torch.inf  # a token with fewer finite experts than k
    w, ids = flashinfer_moe.route(logits, 8, scoring_func="softmax", renormalize=True)
    assert torch.isfinite(w).all(), f"seed {seed}"
    p = torch.softmax(logits.double(), dim=-1).gather(1, ids.long())
    torch.testing.assert_close(w.double(), p / p.sum(-1, keepdim=True), rtol=1e-6, atol=1e-30)
