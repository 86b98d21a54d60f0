"""Grouped GEMMs and fused_moe on the CPU tier: the public wrappers (CPU path), the Triton kernel itself in
Triton's interpreter, and bad input."""

import functools
import math

import pytest
import torch
from checks import assert_error_names_argument
from gemm_cases import (
    FP8,
    contiguous_layout,
    make_activations,
    make_weights,
    owned_rows,
    reference,
    rel_err,
)

import flashinfer_moe as fm
from flashinfer_moe import reference as ref

GEMMS = {
    ("bf16", "contiguous"): fm.grouped_gemm_bf16_contiguous,
    ("bf16", "masked"): fm.grouped_gemm_bf16_masked,
    ("fp8_block", "contiguous"): fm.grouped_gemm_fp8_block_contiguous,
    ("fp8_block", "masked"): fm.grouped_gemm_fp8_block_masked,
    ("fp8_tensor", "contiguous"): fm.grouped_gemm_fp8_tensor_contiguous,
    ("fp8_tensor", "masked"): fm.grouped_gemm_fp8_tensor_masked,
}


def _call(kind, layout_kind, a, a_scale, w, w_scale, groups, **kw):
    fn = GEMMS[("bf16" if kind in ("bf16", "fp16") else kind, layout_kind)]
    if kind in ("bf16", "fp16"):
        return fn(a, w, groups, **kw)
    return fn(a, a_scale, w, w_scale, groups, **kw)


# ------------------------------------------------------------------------------ public API, CPU path


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8_block", "fp8_tensor"])
@pytest.mark.parametrize("activation", [None, "silu", "clamped_silu"])
@pytest.mark.parametrize("counts", [[3, 0, 1, 127], [1]])
def test_contiguous_cpu_matches_reference(rng, kind, activation, counts):
    seed, g = rng
    n, k = 256, 384
    layout = contiguous_layout(counts, 8, "cpu")
    a, a_scale = make_activations(kind, (layout.num_rows,), k, g, "cpu")
    w, w_scale = make_weights(kind, len(counts), n, k, g, "cpu")
    out_n = n // 2 if activation else n
    out = torch.full((layout.num_rows, out_n), float("nan"), dtype=torch.bfloat16 if kind != "fp16" else torch.float16)
    kw = {} if kind in ("bf16", "fp16") else {"out_dtype": out.dtype}
    got = _call(kind, "contiguous", a, a_scale, w, w_scale, layout, activation=activation, out=out, **kw)
    assert got is out
    owned = owned_rows(layout.tokens_per_expert, layout.expert_offsets, layout.num_rows)
    want = reference(a, a_scale, w, w_scale, layout.tokens_per_expert, layout.expert_offsets, activation)
    assert rel_err(got[owned], want[owned]) < 1e-2, seed
    assert got[~owned].isnan().all(), "rows no expert owns must not be written"


@pytest.mark.parametrize("kind", ["bf16", "fp8_block", "fp8_tensor"])
def test_masked_cpu_clamps_counts_to_capacity(rng, kind):
    seed, g = rng
    num_experts, capacity, n, k = 3, 5, 128, 256
    a, a_scale = make_activations(kind, (num_experts, capacity), k, g, "cpu", a_mode="row")
    w, w_scale = make_weights(kind, num_experts, n, k, g, "cpu")
    counts = torch.tensor([2, 0, 9], dtype=torch.int32)  # 9 > C: only C rows are computed
    got = _call(kind, "masked", a, a_scale, w, w_scale, counts)
    clamped = counts.clamp(max=capacity)
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = reference(a, a_scale, w, w_scale, clamped, offsets).view(num_experts, capacity, n)
    for e, c in enumerate(clamped.tolist()):
        assert rel_err(got[e, :c], want[e, :c]) < 1e-2 if c else True, seed


def test_quantize_output_cpu_is_the_group_quantizer(rng):
    seed, g = rng
    layout = contiguous_layout([4, 9], 1, "cpu")
    a, a_scale = make_activations("fp8_block", (layout.num_rows,), 256, g, "cpu")
    w, w_scale = make_weights("fp8_block", 2, 512, 256, g, "cpu")
    q, s = fm.grouped_gemm_fp8_block_contiguous(a, a_scale, w, w_scale, layout, activation="silu", quantize_output=True)
    assert q.dtype == FP8 and s.shape == (layout.num_rows, 2)
    y = reference(a, a_scale, w, w_scale, layout.tokens_per_expert, layout.expert_offsets, "silu")
    # The CPU path computes in fp32; quantizing the float64 reference can differ by one FP8 step.
    assert rel_err(ref.dequantize_fp8_per_token_group(q, s), y) < 4e-2, seed


@pytest.mark.parametrize("quant", [None, "fp8_block", "fp8_tensor"])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_fused_moe_cpu_matches_reference(rng, quant, num_tokens):
    seed, g = rng
    num_experts, top_k, h, inter = 6, 3, 256, 128
    x = torch.randn(num_tokens, h, generator=g).bfloat16()
    kind = quant or "bf16"
    w13, s13 = make_weights(kind, num_experts, 2 * inter, h, g, "cpu")
    w2, s2 = make_weights(kind, num_experts, h, inter, g, "cpu")
    weights, ids = fm.route(torch.randn(num_tokens, num_experts, generator=g), top_k)
    ids[0, -1] = -1  # a skipped slot
    got = fm.fused_moe(x, w13, w2, weights, ids, quant=quant, w13_scale=s13, w2_scale=s2, routed_scaling_factor=1.5)
    want = ref.fused_moe(x, w13, w2, weights, ids, quant=quant, w13_scale=s13, w2_scale=s2, routed_scaling_factor=1.5)
    assert got.shape == (num_tokens, h) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 2e-2, seed


# ------------------------------------------------------------------------- the kernel, interpreted


@pytest.fixture
def kernel():
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton interpreter was not selected before the kernel module was imported")
    from flashinfer_moe.moe import gemm_kernel

    return gemm_kernel


def _launch(kernel, a, w, out, out_scale, counts, offsets, a_scale, w_scale, a_mode, w_mode, act, capacity, cfg):
    kernel.launch(
        a,
        w,
        out,
        out_scale,
        counts,
        offsets,
        a_scale,
        w_scale,
        a_mode=a_mode,
        w_mode=w_mode,
        act=act,
        alpha=1.702,
        limit=7.0,
        capacity=capacity,
        config=cfg,
    )


_SMALL = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2, GROUP_M=2)
_SMALL_FP8 = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2, GROUP_M=3)


# Triton 3.6's interpreter computes tl.dot on bf16 operands from their raw bits, so the plain path is
# interpreted in fp16 (the same kernel code; bf16 itself is covered by the GPU tier).
@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("n, k", [(128, 96), (96, 200)])  # N not a multiple of BLOCK_N; K not of BLOCK_K
def test_kernel_fp16_interpreted(rng, kernel, act, n, k):
    seed, g = rng
    counts = torch.tensor([5, 0, 40, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 8, 8, 48, 56], dtype=torch.int32)  # padded starts, as block_rows=8 makes them
    a = torch.randn(60, k, generator=g).half()
    w = (torch.randn(4, n, k, generator=g) / k**0.5).half()
    out_n = n // 2 if act else n
    out = torch.full((60, out_n), float("nan"), dtype=torch.float32)
    _launch(kernel, a, w, out, None, counts, offsets, None, None, 0, 0, act, 2**31 - 1, _SMALL)
    want = reference(a, None, w, None, counts, offsets, [None, "silu", "clamped_silu"][act])
    owned = owned_rows(counts, offsets, 60)
    assert rel_err(out[owned], want[owned]) < 1e-5, seed
    assert out[~owned].isnan().all()


@pytest.mark.parametrize(
    "a_mode, w_mode, act",
    [(3, 2, 0), (3, 2, 1), (1, 1, 0), (2, 1, 1), (3, 1, 0), (1, 1, 2)],
    ids=["block", "block-silu", "tensor", "row-silu", "group-expert", "tensor-clamped"],
)
def test_kernel_fp8_interpreted(rng, kernel, a_mode, w_mode, act):
    seed, g = rng
    num_experts, capacity, n, k = 3, 37, 256, 256
    a_kind = {1: "tensor", 2: "row", 3: "group"}[a_mode]
    a, a_scale = make_activations("fp8_tensor", (num_experts, capacity), k, g, "cpu", a_mode=a_kind)
    w, w_scale = make_weights("fp8_block" if w_mode == 2 else "fp8_tensor", num_experts, n, k, g, "cpu")
    counts = torch.tensor([37, 0, 19], dtype=torch.int32)
    out_n = n // 2 if act else n
    out = torch.full((num_experts * capacity, out_n), float("nan"))
    flat_scale = a_scale.reshape(num_experts * capacity, -1) if a_mode == 3 else a_scale.reshape(-1)
    _launch(
        kernel,
        a.view(-1, k),
        w,
        out,
        None,
        counts,
        None,
        flat_scale,
        w_scale,
        a_mode,
        w_mode,
        act,
        capacity,
        _SMALL_FP8,
    )  # masked: offsets None, expert e at row e * C
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = reference(a, a_scale, w, w_scale, counts, offsets, [None, "silu", "clamped_silu"][act])
    owned = owned_rows(counts, offsets, num_experts * capacity)
    assert rel_err(out[owned], want[owned]) < 1e-5, seed
    assert out[~owned].isnan().all()


def test_kernel_quantized_output_interpreted(rng, kernel):
    seed, g = rng
    counts = torch.tensor([9, 30], dtype=torch.int32)
    offsets = torch.tensor([0, 9, 39], dtype=torch.int32)
    a, a_scale = make_activations("fp8_block", (39,), 256, g, "cpu")
    w, w_scale = make_weights("fp8_block", 2, 512, 256, g, "cpu")
    q = torch.zeros(39, 256, dtype=FP8)
    s = torch.zeros(39, 2)
    _launch(kernel, a, w, q, s, counts, offsets, a_scale, w_scale, 3, 2, 1, 2**31 - 1, _SMALL_FP8)
    y = reference(a, a_scale, w, w_scale, counts, offsets, "silu").float()
    want_q, want_s = ref.quantize_fp8_per_token_group(y)
    assert rel_err(s, want_s) < 1e-5, seed
    # The interpreter's float-to-FP8 conversion mis-rounds values that carry into the next binade (e.g. 7.9
    # becomes 4), a few percent of them; the GPU tier checks the exact conversion.
    same = (q.float() == want_q.float()).float().mean().item()
    assert same > 0.9, (seed, same)


@pytest.mark.parametrize("act", [1, 2])
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_gated_act_pass_interpreted(rng, kernel, act, quantize, masked):
    """The activation pass after Hopper's split GEMM1 (moe/act_kernel.py): the reference's activation and FP8
    convention on owned rows; padding (contiguous) and unused slots (masked, counts past capacity) untouched."""
    from flashinfer_moe.moe import act_kernel

    seed, g = rng
    n = 256
    if masked:
        capacity, counts = 7, torch.tensor([7, 0, 3, 50], dtype=torch.int32)  # 50 > C: clamped
        offsets, rows = None, 4 * 7
        starts = [e * capacity for e in range(4)]
        owned_counts = counts.clamp(max=capacity).tolist()
    else:
        capacity, counts = None, torch.tensor([5, 0, 17, 1], dtype=torch.int32)
        offsets = torch.tensor([0, 8, 8, 32, 33], dtype=torch.int32)  # padding after each expert
        rows, starts, owned_counts = 40, [0, 8, 8, 32], counts.tolist()
    owned = torch.zeros(rows, dtype=torch.bool)
    for start, c in zip(starts, owned_counts, strict=True):
        owned[start : start + c] = True
    x = (torch.randn(rows, 2 * n, generator=g) * 4).to(torch.bfloat16)
    if quantize:
        out = torch.full((rows, n), 0x7F, dtype=torch.uint8).view(FP8)
        out_scale = torch.full((rows, n // 128), float("nan"))
    else:
        out, out_scale = torch.full((rows, n), float("nan"), dtype=torch.bfloat16), None
    act_kernel.launch(x, out, out_scale, counts, offsets, capacity, act, 1.702, 7.0)
    y = ref.activation(x.double(), {1: "silu", 2: "clamped_silu"}[act]).float()
    if quantize:
        want_q, want_s = ref.quantize_fp8_per_token_group(y[owned])
        assert rel_err(out_scale[owned], want_s) < 1e-5, seed
        # As above: the interpreter's FP8 conversion mis-rounds a few percent of values.
        same = (out[owned].float() == want_q.float()).float().mean().item()
        assert same > 0.9, (seed, same)
        assert (out[~owned].view(torch.uint8) == 0x7F).all() and out_scale[~owned].isnan().all()
    else:
        assert rel_err(out[owned].float(), y[owned]) < 1e-2, seed
        assert out[~owned].isnan().all()


# ------------------------------------------------------------------------------------------ bad input


def _fp8_problem(g, rows=8, num_experts=2, n=256, k=256):
    layout = contiguous_layout([rows // 2, rows - rows // 2], 1, "cpu")
    a, a_scale = make_activations("fp8_block", (layout.num_rows,), k, g, "cpu")
    w, w_scale = make_weights("fp8_block", num_experts, n, k, g, "cpu")
    return a, a_scale, w, w_scale, layout


def test_bad_input_names_the_argument(generator):
    g = generator
    a, a_s, w, w_s, layout = _fp8_problem(g)
    f = fm.grouped_gemm_fp8_block_contiguous
    assert_error_names_argument(lambda: f(a, a_s, w[:, :, :128], w_s, layout), ValueError, "w")
    assert_error_names_argument(lambda: f(a, a_s, w, w_s[:, :1], layout), ValueError, "w_scale")
    assert_error_names_argument(lambda: f(a, a_s[:, :1], w, w_s, layout), ValueError, "a_scale")
    assert_error_names_argument(lambda: f(a, a_s.double(), w, w_s, layout), TypeError, "a_scale")
    assert_error_names_argument(lambda: f(a.float(), a_s, w, w_s, layout), TypeError, "a")
    assert_error_names_argument(lambda: f(a, a_s, w.float(), w_s, layout), TypeError, "w")
    assert_error_names_argument(lambda: f(a, a_s, w[:1], w_s[:1], layout), ValueError, "w")  # E disagrees
    assert_error_names_argument(lambda: f(a, a_s, w, w_s, "layout"), TypeError, "layout")
    assert_error_names_argument(lambda: f(a, a_s, w, w_s, layout, activation="gelu"), ValueError, "activation")
    assert_error_names_argument(
        lambda: f(a, a_s, w, w_s, layout, out=torch.empty(3, 3, dtype=torch.bfloat16)), ValueError, "out"
    )
    # K not a multiple of 128 where 128-wide blocks are required
    a2, s2 = ref.quantize_fp8_per_token_group(torch.randn(8, 192, generator=g), 64)
    w2, ws2 = ref.quantize_fp8_block_weights(torch.randn(2, 256, 192, generator=g))
    assert_error_names_argument(lambda: f(a2, s2, w2, ws2, layout), ValueError, "a")
    # quantized output needs 128-column groups
    w3, ws3 = make_weights("fp8_block", 2, 192, 256, g, "cpu")
    assert_error_names_argument(
        lambda: f(a, a_s, w3, ws3, layout, activation="silu", quantize_output=True), ValueError, "quantize_output"
    )
    t = fm.grouped_gemm_fp8_tensor_masked
    am, am_s = make_activations("fp8_tensor", (2, 4), 256, g, "cpu")
    wt, wt_s = make_weights("fp8_tensor", 2, 128, 256, g, "cpu")
    assert_error_names_argument(
        lambda: t(am, am_s, wt, wt_s, torch.ones(3, dtype=torch.int32)), ValueError, "tokens_per_expert"
    )
    assert_error_names_argument(lambda: t(am, am_s, wt, wt_s, torch.ones(2)), TypeError, "tokens_per_expert")
    assert_error_names_argument(
        lambda: t(am, am_s, wt, wt_s[:, None], torch.ones(2, dtype=torch.int32)), ValueError, "w_scale"
    )
    b = fm.grouped_gemm_bf16_contiguous
    ab = torch.randn(layout.num_rows, 64).bfloat16()
    assert_error_names_argument(lambda: b(ab, torch.randn(2, 32, 64).half(), layout), TypeError, "w")
    assert_error_names_argument(lambda: b(ab[:-1], torch.randn(2, 32, 64).bfloat16(), layout), ValueError, "a")


def test_fused_moe_bad_input(generator):
    g = generator
    x = torch.randn(3, 256, generator=g).bfloat16()
    w13, s13 = make_weights("fp8_block", 4, 256, 256, g, "cpu")
    w2, s2 = make_weights("fp8_block", 4, 256, 128, g, "cpu")
    weights, ids = fm.route(torch.randn(3, 4, generator=g), 2)
    f = fm.fused_moe
    assert_error_names_argument(lambda: f(x, w13, w2, weights, ids, quant="fp8"), ValueError, "quant")
    assert_error_names_argument(lambda: f(x, w13, w2, weights, ids, quant="fp8_block"), ValueError, "w13_scale")
    assert_error_names_argument(lambda: f(x, w13, w2, weights, ids), TypeError, "w13")  # FP8 without quant
    assert_error_names_argument(
        lambda: f(x, w13, w2[:, :128], weights, ids, quant="fp8_block", w13_scale=s13, w2_scale=s2), ValueError, "w2"
    )
    assert_error_names_argument(
        lambda: f(x[:, :128], w13, w2, weights, ids, quant="fp8_block", w13_scale=s13, w2_scale=s2), ValueError, "w13"
    )
    bad_ids = ids.clone()
    bad_ids[0, 0] = 4  # E in the weights disagrees with the ids
    with pytest.raises(ValueError, match="topk_ids"):
        f(x, w13, w2, weights, bad_ids, quant="fp8_block", w13_scale=s13, w2_scale=s2)
    assert_error_names_argument(
        lambda: f(x, w13, w2, weights, ids, quant="fp8_block", w13_scale=s13, w2_scale=s2, activation="relu"),
        ValueError,
        "activation",
    )


NOT_POSITIVE_FINITE = {"0": 0, "-1.0": -1.0, "nan": math.nan, "inf": math.inf}


def _gemm_calls(g):
    """``kw -> call`` for every grouped GEMM on small CPU operands, both layouts."""
    calls = {}
    for kind in ("bf16", "fp8_block", "fp8_tensor"):
        w, w_scale = make_weights(kind, 2, 256, 256, g, "cpu")
        layout = contiguous_layout([3, 5], 1, "cpu")
        a, a_scale = make_activations(kind, (layout.num_rows,), 256, g, "cpu")
        am, am_scale = make_activations(kind, (2, 4), 256, g, "cpu")
        counts = torch.tensor([1, 4], dtype=torch.int32)
        calls[f"{kind} contiguous"] = functools.partial(_call, kind, "contiguous", a, a_scale, w, w_scale, layout)
        calls[f"{kind} masked"] = functools.partial(_call, kind, "masked", am, am_scale, w, w_scale, counts)
    return calls


GEMM_CASES = [f"{kind} {layout}" for kind in ("bf16", "fp8_block", "fp8_tensor") for layout in ("contiguous", "masked")]


@pytest.mark.parametrize("value", list(NOT_POSITIVE_FINITE))
@pytest.mark.parametrize("case", GEMM_CASES)
def test_clamped_silu_limit_and_alpha_numbers(generator, case, value):
    """``limit`` must be positive and finite, ``alpha`` finite, in every grouped GEMM."""
    v, call = NOT_POSITIVE_FINITE[value], _gemm_calls(generator)[case]
    with pytest.raises(ValueError, match="must be a positive finite number"):
        call(activation="clamped_silu", limit=v)
    assert_error_names_argument(lambda: call(activation="clamped_silu", limit=v), ValueError, "limit")
    if not math.isfinite(v):
        assert_error_names_argument(lambda: call(activation="clamped_silu", alpha=v), ValueError, "alpha")


def _fused_problem(g, kind):
    x = torch.randn(3, 256, generator=g).bfloat16()
    w13, s13 = make_weights(kind, 4, 256, 256, g, "cpu")
    w2, s2 = make_weights(kind, 4, 256, 128, g, "cpu")
    weights, ids = fm.route(torch.randn(3, 4, generator=g), 2)
    return (x, w13, w2, weights, ids) if kind == "bf16" else (x, w13, w2, weights, ids, s13, s2)


@pytest.mark.parametrize("value", list(NOT_POSITIVE_FINITE))
def test_number_scales_of_fused_moe_and_layer(generator, value):
    """Static activation scales given as Python numbers, ``routed_scaling_factor`` and ``limit`` must be
    positive and finite (``alpha`` finite), refused before anything is computed."""
    v = NOT_POSITIVE_FINITE[value]
    x, w13, w2, weights, ids, s13, s2 = _fused_problem(generator, "fp8_tensor")
    kw = dict(quant="fp8_tensor", w13_scale=s13, w2_scale=s2)
    f = fm.fused_moe
    for name in ("a13_scale", "a2_scale", "routed_scaling_factor"):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            f(x, w13, w2, weights, ids, **kw, **{name: v})
        assert_error_names_argument(lambda name=name: f(x, w13, w2, weights, ids, **kw, **{name: v}), ValueError, name)
    x, w13, w2, weights, ids = _fused_problem(generator, "bf16")
    assert_error_names_argument(
        lambda: f(x, w13, w2, weights, ids, routed_scaling_factor=v), ValueError, "routed_scaling_factor"
    )
    assert_error_names_argument(
        lambda: fm.MoELayer(8, 2, 128, 128, routed_scaling_factor=v), ValueError, "routed_scaling_factor"
    )
    # limit positive and finite, alpha finite, as in the GEMMs
    act = dict(activation="clamped_silu")
    assert_error_names_argument(lambda: f(x, w13, w2, weights, ids, **act, limit=v), ValueError, "limit")
    assert_error_names_argument(lambda: fm.MoELayer(8, 2, 128, 128, **act, limit=v), ValueError, "limit")
    if not math.isfinite(v):
        assert_error_names_argument(lambda: f(x, w13, w2, weights, ids, **act, alpha=v), ValueError, "alpha")
        assert_error_names_argument(lambda: fm.MoELayer(8, 2, 128, 128, **act, alpha=v), ValueError, "alpha")


def test_fused_moe_number_activation_scales_equal_tensor_scales(generator):
    x, w13, w2, weights, ids, s13, s2 = _fused_problem(generator, "fp8_tensor")
    kw = dict(quant="fp8_tensor", w13_scale=s13, w2_scale=s2)
    by_number = fm.fused_moe(x, w13, w2, weights, ids, a13_scale=0.03, a2_scale=0.5, **kw)
    by_tensor = fm.fused_moe(x, w13, w2, weights, ids, a13_scale=torch.tensor(0.03), a2_scale=torch.tensor(0.5), **kw)
    assert torch.equal(by_number, by_tensor)


# ------------------------------------------------------------------ Hopper kernel choice (static, no GPU needed)


@pytest.mark.parametrize(
    "rows, experts, capacity, n, k, want",
    [
        (32 * 16, 32, 16, 4096, 7168, "wg64"),  # masked decode
        (256 * 4, 256, None, 4096, 7168, "wg64"),  # contiguous, few rows per expert
        (32 * 128, 32, 128, 4096, 7168, "wg128q"),  # masked, 128 rows
        (32 * 128, 32, None, 4096, 7168, "wg64"),  # contiguous of the same mean size: uneven when routed
        (256 * 192, 256, None, 7168, 2048, "wg64"),
        (256 * 193, 256, None, 7168, 2048, "wg128w"),
        (32 * 200, 32, 200, 4096, 7168, "wg128w"),  # masked above 128 rows
        (32 * 512, 32, None, 4096, 7168, "wg128w"),
        (32 * 512, 32, None, 7168, 2048, "wg128w"),
        (8 * 4096, 8, None, 7168, 2048, "coop_n2"),
        (2048 * 512, 2048, None, 4096, 7168, "coop"),  # more experts than the wgmma kernel's tables hold
        (2048 * 128, 2048, None, 4096, 7168, "coop"),
        (2048 * 16, 2048, 16, 4096, 7168, "pingpong"),  # more experts than the wgmma kernel's tables hold
    ],
)
def test_sm90_pick(rows, experts, capacity, n, k, want):
    from flashinfer_moe.moe import gemm_sm90

    config, swizzle, raster = gemm_sm90.pick(rows, experts, capacity, n, k)
    assert config == want
    assert config in gemm_sm90.CONFIGS and swizzle in (1, 2, 4, 8) and raster in gemm_sm90.RASTERS
    for name, (swizzle, raster) in gemm_sm90.DEFAULT_ORDERS.items():
        assert name in gemm_sm90.CONFIGS and swizzle in (1, 2, 4, 8) and raster in gemm_sm90.RASTERS


@pytest.mark.parametrize(
    "rows, experts, capacity, n, k, want",
    [
        (256 * 4, 256, None, 4096, 7168, "wg64"),  # DeepSeek-V3 GEMM1 at decode sizes
        (32 * 128, 32, 128, 4096, 7168, "wg128q"),
        (64 * 512, 64, None, 4096, 7168, "wg128w"),
        (8 * 4096, 8, None, 2 * 14336, 4096, None),  # Mixtral prefill: coop_n2, so GEMM + activation pass
        (2048 * 16, 2048, 16, 4096, 7168, None),  # more experts than our kernel takes
        (256 * 4, 256, None, 2 * 192, 7168, None),  # I = 192: 128-column output groups do not tile it
    ],
)
def test_sm90_pick_gated(monkeypatch, rows, experts, capacity, n, k, want):
    from flashinfer_moe.moe import gemm_sm90

    monkeypatch.setattr(gemm_sm90, "_headers_found", lambda: True)
    got = gemm_sm90.pick_gated(rows, experts, capacity, n, k)
    assert (got and got[0]) == want
    if want:
        assert got == gemm_sm90.pick(rows, experts, capacity, n, k) and want in gemm_sm90.GATED_CONFIGS
    monkeypatch.setattr(gemm_sm90, "FUSED_ACTIVATION", False)
    assert gemm_sm90.pick_gated(rows, experts, capacity, n, k) is None


def test_sm90_pick_gated_without_cutlass_headers(monkeypatch):
    from flashinfer_moe.moe import gemm_sm90

    monkeypatch.setattr(gemm_sm90, "_headers_found", lambda: False)
    assert gemm_sm90.pick(8 * 4096, 8, None, 2 * 14336, 4096)[0] == "coop_n2"
    assert gemm_sm90.pick_gated(8 * 4096, 8, None, 2 * 14336, 4096)[0] == "wg128w"


def test_sm90_launch_rejects_what_the_activation_epilogue_cannot_do():
    from flashinfer_moe.moe import gemm_sm90

    fp8 = torch.float8_e4m3fn
    a, a_scale = torch.zeros(4, 256, dtype=fp8), torch.ones(4, 2)
    w, w_scale = torch.zeros(2, 512, 256, dtype=fp8), torch.ones(2, 4, 2)
    counts = torch.tensor([2, 2], dtype=torch.int32)
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    args = (a, a_scale, w, w_scale, out, counts, None, 2)
    with pytest.raises(ValueError, match="activation must be one of"):
        gemm_sm90.launch(*args, "wg64", activation="gelu")
    for config in ("coop", "wg128"):  # CUTLASS's, and our 128-column tiles
        with pytest.raises(ValueError, match=f"got config='{config}', N=512"):
            gemm_sm90.launch(*args, config, activation="silu")
    with pytest.raises(ValueError, match="out must be bf16 without an activation"):
        gemm_sm90.launch(*args[:4], out.half(), *args[5:], "wg64", activation="silu")
    with pytest.raises(ValueError, match="e4m3 with out_scale"):  # FP8 output without its scales
        gemm_sm90.launch(*args[:4], out.to(fp8), *args[5:], "wg64", activation="silu")
