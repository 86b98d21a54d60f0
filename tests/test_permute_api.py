"""CPU tier for the public layout, permute, combine and quantizer API: bit-equal to the references on the rows
that hold a pair, ``out=`` buffers written only there, argument checks, and torch.compile."""

import math
import os

import pytest
import torch
from checks import assert_error_names_argument

import flashinfer_moe as fm
from flashinfer_moe import reference
from flashinfer_moe.layout import contiguous_rows

FP8 = torch.float8_e4m3fn
LAYOUT_TENSORS = ("tokens_per_expert", "expert_offsets", "row_of", "source_of", "status")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLS = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}  # by output dtype, see combine tests
ROUTING = {1: (1, 4), 3: (2, 5), 1000: (4, 16)}  # T -> (k, E)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    """Normal values with a random magnitude per row in [e**-4.5, e**4.5] (never all zero; sums of a few stay
    far from the float16 maximum)."""
    magnitude = torch.exp(torch.randn(*shape[:-1], 1, generator=g).clamp(-3, 3) * 1.5)
    return (torch.randn(*shape, generator=g) * magnitude).to(dtype)


def random_ids(g, num_tokens, top_k, num_experts, kind="holes", dtype=torch.int32):
    if kind == "one_expert":
        return torch.full((num_tokens, top_k), num_experts - 1, dtype=dtype)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :top_k]
    if kind == "holes":  # a quarter of the pairs off this GPU; the lowest experts get nothing
        ids = torch.where((ids < num_experts // 4) | (torch.rand(ids.shape, generator=g) < 0.25), -1, ids)
    return ids.to(dtype)


def make_layouts(g, num_tokens, kind, block_rows=8):
    """(public, reference) layouts from the same random ids; masked capacities are tight (T=1000 overflows)."""
    top_k, num_experts = ROUTING[num_tokens]
    ids = random_ids(g, num_tokens, top_k, num_experts)
    if kind == "contiguous":
        args = (num_experts, block_rows)
        return fm.moe_align_contiguous(ids, *args), reference.moe_align_contiguous(ids, *args)
    args = (num_experts, max(1, num_tokens * top_k // (2 * num_experts)))
    return fm.moe_align_masked(ids, *args), reference.moe_align_masked(ids, *args)


def bits(t):
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def poisoned(shape, dtype):
    """NaN (float) or all-ones bytes (FP8 NaN, uint8 0xFF)."""
    t = torch.empty(shape, dtype=dtype)
    if t.element_size() > 1:
        return t.fill_(math.nan)
    t.view(torch.uint8).fill_(0xFF)
    return t


def check_rows(got, want, poison, layout, msg):
    """``got`` equals ``want`` bit for bit on the rows holding a pair and still holds ``poison`` elsewhere."""
    owned = (layout.source_of >= 0).view(layout.rows_shape)
    assert got.shape == want.shape and got.dtype == want.dtype, msg
    assert torch.equal(bits(got[owned]), bits(want[owned])), msg
    assert torch.equal(bits(got[~owned]), bits(poison[~owned])), msg


# ---------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 1, 4), (3, 2, 4), (1000, 4, 16), (37, 8, 9)])
@pytest.mark.parametrize("kind", ["spread", "holes", "one_expert"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_layout_fields_equal_reference(rng, num_tokens, top_k, num_experts, kind, id_dtype):
    seed, g = rng
    ids = random_ids(g, num_tokens, top_k, num_experts, kind, id_dtype)
    cases = [("contiguous", 1), ("contiguous", 128), ("masked", 1), ("masked", num_tokens * top_k)]
    for layout_kind, arg in cases:
        msg = f"{layout_kind} {arg} seed={seed}"
        if layout_kind == "contiguous":
            got, want = (f(ids, num_experts, arg) for f in (fm.moe_align_contiguous, reference.moe_align_contiguous))
            assert got.num_rows == contiguous_rows(num_tokens, top_k, num_experts, arg), msg
        else:
            got, want = fm.moe_align_masked(ids, num_experts, arg), reference.moe_align_masked(ids, num_experts, arg)
            assert got.rows_shape == (num_experts, arg) and got.overflow.dim() == 0, msg
            assert got.overflow.dtype == torch.int32 and got.overflow.item() == want.overflow.item(), msg
        assert isinstance(got, fm.ExpertLayout), msg
        for field in ("kind", "num_experts", "block_rows", "capacity", "rows_shape", "num_tokens", "top_k"):
            assert getattr(got, field) == getattr(want, field), f"{field} {msg}"
        for field in LAYOUT_TENSORS:
            t = getattr(got, field)
            assert t.dtype == torch.int32 and torch.equal(t, getattr(want, field)), f"{field} {msg}"


def test_masked_overflow_is_counted():
    ids = torch.tensor([[0, 1], [0, 1], [0, -1], [2, 0]], dtype=torch.int64)
    layout = fm.moe_align_masked(ids, 3, 2)
    assert layout.status.tolist() == [2, 0] and layout.overflow.item() == 2  # pairs 4 and 7 (expert 0)
    assert layout.tokens_per_expert.tolist() == [2, 2, 1]
    assert layout.row_of.tolist() == [[0, 2], [1, 3], [-1, -1], [4, -1]]
    assert layout.source_of.tolist() == [0, 2, 1, 3, 6, -1]


def test_empty_batch_and_zero_capacity(rng):
    seed, g = rng
    layout = fm.moe_align_contiguous(torch.zeros(0, 2, dtype=torch.int32), 4, 8)
    assert layout.num_rows == 0 and layout.expert_offsets.tolist() == [0] * 5
    empty = torch.zeros(0, 64)
    assert fm.permute(empty, layout).shape == (0, 64)
    assert [t.shape for t in fm.permute_nvfp4(empty, layout)[:2]] == [(0, 32), (0, 4)]
    assert fm.combine(torch.zeros(0, 64), torch.zeros(0, 2), layout).shape == (0, 64)
    masked = fm.moe_align_masked(torch.tensor([[0, 1], [1, 2]]), 4, 0)
    assert masked.rows_shape == (4, 0) and masked.overflow.item() == 4 and masked.tokens_per_expert.tolist() == [0] * 4
    hidden = randn(g, 2, 64)
    assert fm.permute(hidden, masked).shape == (4, 0, 64)
    out = fm.combine(torch.zeros(4, 0, 64), torch.rand(2, 2, generator=g), masked, residual=hidden)
    assert torch.equal(out, hidden), f"seed={seed}"


# ---------------------------------------------------------------------------------------------- permute


@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 1000])
@pytest.mark.parametrize("hidden_size", [1, 72, 200])
def test_permute_equals_reference(rng, layout_kind, dtype, num_tokens, hidden_size):
    seed, g = rng
    msg = f"seed={seed}"
    layout, ref_layout = make_layouts(g, num_tokens, layout_kind)
    hidden = randn(g, num_tokens, hidden_size, dtype=dtype)
    want = reference.permute(hidden, ref_layout)
    poison = poisoned(want.shape, dtype)
    out = poison.clone()
    assert fm.permute(hidden, layout, out=out) is out, msg
    check_rows(out, want, poison, layout, msg)
    got = fm.permute(hidden, layout)
    owned = (layout.source_of >= 0).view(layout.rows_shape)
    assert got.shape == want.shape and torch.equal(bits(got[owned]), bits(want[owned])), msg
    # A hidden whose rows are strided (a slice of a wider tensor) gives the same rows.
    wide = torch.cat((hidden, hidden), dim=1)[:, hidden_size:]
    assert torch.equal(bits(fm.permute(wide, layout)[owned]), bits(want[owned])), msg


@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 1000])
@pytest.mark.parametrize("hidden_size", [128, 384])
@pytest.mark.parametrize("group_size, scale_pow2", [(128, False), (32, True)])
def test_permute_fp8_per_token_group_equals_reference(
    rng, layout_kind, dtype, num_tokens, hidden_size, group_size, scale_pow2
):
    seed, g = rng
    msg = f"seed={seed}"
    layout, ref_layout = make_layouts(g, num_tokens, layout_kind)
    hidden = randn(g, num_tokens, hidden_size, dtype=dtype)
    q_ref, s_ref = reference.permute_fp8_per_token_group(hidden, ref_layout, group_size, scale_pow2=scale_pow2)
    q_poison, s_poison = poisoned(q_ref.shape, FP8), poisoned(s_ref.shape, torch.float32)
    q, s = q_poison.clone(), s_poison.clone()
    result = fm.permute_fp8_per_token_group(hidden, layout, group_size=group_size, scale_pow2=scale_pow2, out=(q, s))
    assert result[0] is q and result[1] is s, msg
    check_rows(q, q_ref, q_poison, layout, msg)
    check_rows(s, s_ref, s_poison, layout, msg)
    q, s = fm.permute_fp8_per_token_group(hidden, layout, group_size=group_size, scale_pow2=scale_pow2)
    owned = (layout.source_of >= 0).view(layout.rows_shape)
    assert torch.equal(bits(q[owned]), bits(q_ref[owned])) and torch.equal(s[owned], s_ref[owned]), msg


SCALES = {"amax": None, "float": 0.0375, "tensor": "tensor 0-d", "tensor [1]": "tensor [1]"}


def scale_arg(which, value=0.0375):
    given = SCALES[which]
    if given == "tensor 0-d":
        return torch.tensor(value)
    return torch.tensor([value]) if given == "tensor [1]" else given


@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 1000])
@pytest.mark.parametrize("hidden_size", [72, 384])
@pytest.mark.parametrize("scale", list(SCALES))
def test_permute_fp8_per_tensor_equals_reference(rng, layout_kind, dtype, num_tokens, hidden_size, scale):
    seed, g = rng
    msg = f"seed={seed}"
    layout, ref_layout = make_layouts(g, num_tokens, layout_kind)
    hidden = randn(g, num_tokens, hidden_size, dtype=dtype)
    q_ref, scale_ref = reference.permute_fp8_per_tensor(hidden, ref_layout, scale_arg(scale))
    poison = poisoned(q_ref.shape, FP8)
    q = poison.clone()
    got_q, got_scale = fm.permute_fp8_per_tensor(hidden, layout, scale_arg(scale), out=q)
    assert got_q is q and got_scale.dim() == 0 and got_scale.dtype == torch.float32, msg
    assert torch.equal(got_scale, scale_ref), msg
    check_rows(q, q_ref, poison, layout, msg)


@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 1000])
@pytest.mark.parametrize("hidden_size", [128, 384])
@pytest.mark.parametrize("scale", list(SCALES))
def test_permute_nvfp4_equals_reference(rng, layout_kind, dtype, num_tokens, hidden_size, scale):
    seed, g = rng
    msg = f"seed={seed}"
    layout, ref_layout = make_layouts(g, num_tokens, layout_kind)
    hidden = randn(g, num_tokens, hidden_size, dtype=dtype)
    given = scale_arg(scale, 0.0125)
    p_ref, bs_ref, gs_ref = reference.permute_nvfp4(hidden, ref_layout, given)
    p_poison, bs_poison = poisoned(p_ref.shape, torch.uint8), poisoned(bs_ref.shape, FP8)
    packed, block_scales = p_poison.clone(), bs_poison.clone()
    result = fm.permute_nvfp4(hidden, layout, given, out=(packed, block_scales))
    assert result[0] is packed and result[1] is block_scales, msg
    assert result[2].dim() == 0 and result[2].dtype == torch.float32 and torch.equal(result[2], gs_ref), msg
    check_rows(packed, p_ref, p_poison, layout, msg)
    check_rows(block_scales, bs_ref, bs_poison, layout, msg)


# ---------------------------------------------------------------------------------------------- combine


def combine64(y, weights, layout, rsf, residual):
    rows = y.reshape(-1, y.shape[-1]).double()
    index = layout.row_of.long()
    picked = rows[index.clamp(min=0)] if rows.shape[0] else rows.new_zeros(*index.shape, y.shape[-1])
    terms = torch.where((index >= 0).unsqueeze(-1), weights.double().unsqueeze(-1) * picked, 0.0)
    out = terms.sum(1) * (1.0 if rsf is None else rsf)
    return out if residual is None else out + residual.double()


@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 1000])
@pytest.mark.parametrize("hidden_size", [1, 72, 200])
@pytest.mark.parametrize("options", ["plain", "rsf residual", "out_dtype out"])
def test_combine_equals_reference(rng, layout_kind, dtype, num_tokens, hidden_size, options):
    seed, g = rng
    msg = f"seed={seed}"
    layout, ref_layout = make_layouts(g, num_tokens, layout_kind)
    y = randn(g, *layout.rows_shape, hidden_size, dtype=dtype)
    y[(layout.source_of < 0).view(layout.rows_shape)] = math.nan  # rows holding no pair are never read
    weights = torch.rand(*layout.row_of.shape, generator=g) + 0.05
    out_dtype = torch.float32 if options == "out_dtype out" else dtype
    kwargs = {}
    if options != "plain":
        kwargs = dict(routed_scaling_factor=2.5, residual=randn(g, num_tokens, hidden_size, dtype=out_dtype))
    if options == "out_dtype out":
        kwargs["out_dtype"] = out_dtype
    want = reference.combine(y, weights, ref_layout, **kwargs)
    if options == "out_dtype out":
        out = poisoned((num_tokens, hidden_size), out_dtype)
        assert fm.combine(y, weights, layout, out=out, **kwargs) is out, msg
    else:
        out = fm.combine(y, weights, layout, **kwargs)
    assert out.dtype == out_dtype and out.shape == (num_tokens, hidden_size), msg
    assert torch.equal(out, want), msg
    rsf, residual = kwargs.get("routed_scaling_factor"), kwargs.get("residual")
    exact = combine64(y, weights, layout, rsf, residual)
    # Errors are measured against the sum of the absolute terms, which cancellation cannot shrink.
    magnitude = combine64(y.abs(), weights, layout, rsf, None if residual is None else residual.abs())
    err = ((out.double() - exact).abs().max() / magnitude.max().clamp(min=1e-30)).item()
    assert torch.isfinite(out).all() and err < TOLS[out_dtype], f"{msg} err={err}"


def test_combine_weights_of_other_float_dtypes_are_converted(rng):
    seed, g = rng
    layout, _ = make_layouts(g, 3, "contiguous")
    y = randn(g, layout.num_rows, 40)
    weights = torch.rand(3, 2, generator=g, dtype=torch.float64)
    want = fm.combine(y, weights.float(), layout)
    for w in (weights, weights.bfloat16()):
        assert torch.equal(fm.combine(y, w, layout), fm.combine(y, w.float(), layout)), f"seed={seed}"
    assert torch.equal(fm.combine(y, weights, layout), want), f"seed={seed}"


# ------------------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("shape, group", [((1, 128), 128), ((3, 256), 128), ((2, 5, 384), 128), ((5, 96), 32)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_pow2", [False, True])
def test_quantize_fp8_per_token_group_equals_reference(rng, shape, group, dtype, scale_pow2):
    seed, g = rng
    x = randn(g, *shape, dtype=dtype)
    q_ref, s_ref = reference.quantize_fp8_per_token_group(x, group, scale_pow2=scale_pow2)
    q, s = fm.quantize_fp8_per_token_group(x, group, scale_pow2=scale_pow2)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref), f"seed={seed}"
    out = (poisoned(q_ref.shape, FP8), poisoned(s_ref.shape, torch.float32))
    q, s = fm.quantize_fp8_per_token_group(x, group, scale_pow2=scale_pow2, out=out)
    assert q is out[0] and s is out[1] and torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref), f"seed={seed}"


@pytest.mark.parametrize("shape", [(), (7,), (3, 100), (2, 3, 40), (2, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", list(SCALES))
def test_quantize_fp8_per_tensor_equals_reference(rng, shape, dtype, scale):
    seed, g = rng
    x = (torch.randn(shape, generator=g) * 30).to(dtype)
    q_ref, s_ref = reference.quantize_fp8_per_tensor(x, scale_arg(scale))
    q, s = fm.quantize_fp8_per_tensor(x, scale_arg(scale))
    assert s.dim() == 0 and s.dtype == torch.float32 and torch.equal(s, s_ref), f"seed={seed}"
    assert q.shape == x.shape and torch.equal(bits(q), bits(q_ref)), f"seed={seed}"
    out = poisoned(shape, FP8)
    q, _ = fm.quantize_fp8_per_tensor(x, scale_arg(scale), out=out)
    assert q is out and torch.equal(bits(q), bits(q_ref)), f"seed={seed}"


@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((2, 130, 70), (64, 32))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_block_weights_equals_reference(rng, shape, block, dtype):
    seed, g = rng
    w = randn(g, *shape, dtype=dtype)
    q_ref, s_ref = reference.quantize_fp8_block_weights(w, block)
    q, s = fm.quantize_fp8_block_weights(w, block)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref), f"seed={seed}"
    q, s = fm.quantize_fp8_block_weights(w.transpose(-1, -2).contiguous().transpose(-1, -2), block)  # strided
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(s, s_ref), f"seed={seed}"


NVFP4_SHAPES = [(1, 16), (3, 48), (2, 5, 160), (32,)]


@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", list(SCALES))
def test_quantize_nvfp4_equals_reference(rng, shape, dtype, scale):
    seed, g = rng
    x = randn(g, *shape, dtype=dtype)
    given = scale_arg(scale, 0.02)
    p_ref, bs_ref, gs_ref = reference.quantize_nvfp4(x, given)
    packed, bs, gs = fm.quantize_nvfp4(x, given)
    assert gs.dim() == 0 and gs.dtype == torch.float32 and torch.equal(gs, gs_ref), f"seed={seed}"
    assert torch.equal(packed, p_ref) and torch.equal(bits(bs), bits(bs_ref)), f"seed={seed}"
    out = (poisoned(p_ref.shape, torch.uint8), poisoned(bs_ref.shape, FP8))
    packed, bs, _ = fm.quantize_nvfp4(x, given, out=out)
    assert packed is out[0] and bs is out[1], f"seed={seed}"
    assert torch.equal(packed, p_ref) and torch.equal(bits(bs), bits(bs_ref)), f"seed={seed}"


@pytest.mark.parametrize("shape", NVFP4_SHAPES, ids=str)
@pytest.mark.parametrize("scale", ["float", "tensor", "tensor [1]"])
def test_dequantize_nvfp4_equals_reference(rng, shape, scale):
    seed, g = rng
    packed, bs, _ = reference.quantize_nvfp4(randn(g, *shape))
    given = scale_arg(scale, 0.75)
    want = reference.dequantize_nvfp4(packed, bs, given)
    assert torch.equal(fm.dequantize_nvfp4(packed, bs, given), want), f"seed={seed}"
    out = poisoned(want.shape, torch.float32)
    assert fm.dequantize_nvfp4(packed, bs, given, out=out) is out and torch.equal(out, want), f"seed={seed}"


# ------------------------------------------------------------------------------------------- bad input

_ids = torch.tensor([[0, 2], [2, -1], [3, 0]])  # T = 3, k = 2, E = 4
_h = torch.ones(3, 128)
_L = fm.moe_align_contiguous(_ids, 4, 4)  # R = 18
_M = fm.moe_align_masked(_ids, 4, 2)
_w = torch.ones(3, 2)
_y = torch.ones(18, 8)
_meta = torch.device("meta")
_p, _bs = torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 2).to(FP8)
V, T = ValueError, TypeError
BAD = {
    "hidden 3-D": (lambda: fm.permute(torch.ones(3, 128, 1), _L), V, "hidden"),
    "hidden int": (lambda: fm.permute(torch.ones(3, 8, dtype=torch.int32), _L), T, "hidden"),
    "hidden float64": (lambda: fm.permute_fp8_per_token_group(_h.double(), _L), T, "hidden"),
    "hidden list": (lambda: fm.permute(_h.tolist(), _L), T, "hidden"),
    "hidden T": (lambda: fm.permute(torch.ones(4, 8), _L), V, "hidden"),
    "hidden masked T": (lambda: fm.permute_nvfp4(torch.ones(2, 32), _M), V, "hidden"),
    "hidden device": (lambda: fm.permute(torch.ones(3, 8, device=_meta), _L), V, "hidden"),
    "layout dict": (lambda: fm.permute(_h, {"row_of": _ids}), T, "layout"),
    "layout fp8": (lambda: fm.permute_fp8_per_tensor(_h, _ids), T, "layout"),
    "ids float": (lambda: fm.moe_align_contiguous(_ids.float(), 4), T, "topk_ids"),
    "ids list": (lambda: fm.moe_align_masked(_ids.tolist(), 4, 2), T, "topk_ids"),
    "ids 1-D": (lambda: fm.moe_align_contiguous(_ids.view(-1), 4), V, "topk_ids"),
    "ids too large": (lambda: fm.moe_align_contiguous(_ids, 3), V, "topk_ids"),
    "ids below -1": (lambda: fm.moe_align_masked(_ids - 1, 8, 2), V, "topk_ids"),
    "num_experts 1025": (lambda: fm.moe_align_contiguous(_ids, 1025), V, "num_experts"),
    "num_experts float": (lambda: fm.moe_align_masked(_ids, 4.0, 2), T, "num_experts"),
    "block_rows 0": (lambda: fm.moe_align_contiguous(_ids, 4, 0), V, "block_rows"),
    "capacity -1": (lambda: fm.moe_align_masked(_ids, 4, -1), V, "capacity"),
    "group_size 100": (lambda: fm.permute_fp8_per_token_group(_h, _L, group_size=100), V, "group_size"),
    "group_size 512": (lambda: fm.permute_fp8_per_token_group(torch.ones(3, 512), _L, group_size=512), V, "group_size"),
    "group_size 4": (lambda: fm.quantize_fp8_per_token_group(_h, 4), V, "group_size"),
    "quantize group_size 100": (lambda: fm.quantize_fp8_per_token_group(_h, 100), V, "group_size"),
    "H % group_size": (lambda: fm.permute_fp8_per_token_group(torch.ones(3, 200), _L), V, "hidden"),
    "quantize K % group_size": (lambda: fm.quantize_fp8_per_token_group(torch.ones(3, 200)), V, "x"),
    "nvfp4 H % 16": (lambda: fm.permute_nvfp4(torch.ones(3, 72), _L), V, "hidden"),
    "quantize nvfp4 K % 16": (lambda: fm.quantize_nvfp4(torch.ones(2, 24)), V, "x"),
    "scale dtype": (lambda: fm.permute_fp8_per_tensor(_h, _L, torch.tensor(1.0).half()), T, "scale"),
    "scale device": (lambda: fm.permute_fp8_per_tensor(_h, _L, torch.ones((), device=_meta)), V, "scale"),
    "scale two": (lambda: fm.permute_fp8_per_tensor(_h, _L, torch.ones(2)), V, "scale"),
    "scale str": (lambda: fm.quantize_fp8_per_tensor(_h, "1.0"), T, "scale"),
    "global dtype": (lambda: fm.permute_nvfp4(_h, _L, torch.tensor(1.0).double()), T, "global_scale"),
    "global device": (lambda: fm.permute_nvfp4(_h, _M, torch.ones(1, device=_meta)), V, "global_scale"),
    "global two": (lambda: fm.quantize_nvfp4(_h, torch.ones(1, 2)), V, "global_scale"),
    "out shape": (lambda: fm.permute(_h, _L, out=torch.empty(17, 128)), V, "out"),
    "out masked shape": (lambda: fm.permute(_h, _M, out=torch.empty(8, 128)), V, "out"),
    "out dtype": (lambda: fm.permute(_h, _L, out=torch.empty(18, 128, dtype=torch.bfloat16)), T, "out"),
    "out strided": (lambda: fm.permute(_h, _L, out=torch.empty(128, 18).t()), V, "out"),
    "out device": (lambda: fm.permute(_h, _L, out=torch.empty(18, 128, device=_meta)), V, "out"),
    "out not a pair": (lambda: fm.permute_fp8_per_token_group(_h, _L, out=torch.empty(18, 128)), T, "out"),
    "out q dtype": (
        lambda: fm.permute_fp8_per_token_group(_h, _L, out=(torch.empty(18, 128), torch.empty(18, 1))),
        T,
        "out",
    ),
    "out scales shape": (
        lambda: fm.permute_fp8_per_token_group(_h, _L, out=(torch.empty(18, 128).to(FP8), torch.empty(18, 2))),
        V,
        "out",
    ),
    "out fp8 tensor strided": (
        lambda: fm.permute_fp8_per_tensor(_h, _L, out=torch.empty(128, 18).to(FP8).t()),
        V,
        "out",
    ),
    "out nvfp4 scales dtype": (
        lambda: fm.permute_nvfp4(_h, _L, out=(torch.empty(18, 64, dtype=torch.uint8), torch.empty(18, 8))),
        T,
        "out",
    ),
    "quantize out shape": (lambda: fm.quantize_fp8_per_tensor(_h, out=torch.empty(3, 64).to(FP8)), V, "out"),
    "y shape": (lambda: fm.combine(torch.ones(17, 8), _w, _L), V, "y"),
    "y masked shape": (lambda: fm.combine(torch.ones(4, 3, 8), _w, _M), V, "y"),
    "y contiguous layout as masked": (lambda: fm.combine(torch.ones(4, 2, 8), _w, _L), V, "y"),
    "y int": (lambda: fm.combine(torch.ones(18, 8, dtype=torch.int32), _w, _L), T, "y"),
    "y device": (lambda: fm.combine(torch.ones(18, 8, device=_meta), _w, _L), V, "y"),
    "combine layout": (lambda: fm.combine(_y, _w, None), T, "layout"),
    "weights shape": (lambda: fm.combine(_y, torch.ones(3, 3), _L), V, "topk_weights"),
    "weights T": (lambda: fm.combine(_y, torch.ones(2, 2), _L), V, "topk_weights"),
    "weights int": (lambda: fm.combine(_y, _w.int(), _L), T, "topk_weights"),
    "weights device": (lambda: fm.combine(_y, torch.ones(3, 2, device=_meta), _L), V, "topk_weights"),
    "residual dtype": (lambda: fm.combine(_y, _w, _L, residual=torch.ones(3, 8).bfloat16()), T, "residual"),
    "residual not out_dtype": (
        lambda: fm.combine(_y.bfloat16(), _w, _L, residual=torch.ones(3, 8).bfloat16(), out_dtype=torch.float32),
        T,
        "residual",
    ),
    "residual shape": (lambda: fm.combine(_y, _w, _L, residual=torch.ones(3, 7)), V, "residual"),
    "residual device": (lambda: fm.combine(_y, _w, _L, residual=torch.ones(3, 8, device=_meta)), V, "residual"),
    "out_dtype int": (lambda: fm.combine(_y, _w, _L, out_dtype=torch.int32), T, "out_dtype"),
    "out_dtype float64": (lambda: fm.combine(_y, _w, _L, out_dtype=torch.float64), T, "out_dtype"),
    "rsf nan": (lambda: fm.combine(_y, _w, _L, routed_scaling_factor=math.nan), V, "routed_scaling_factor"),
    "rsf inf": (lambda: fm.combine(_y, _w, _L, routed_scaling_factor=-math.inf), V, "routed_scaling_factor"),
    "rsf str": (lambda: fm.combine(_y, _w, _L, routed_scaling_factor="2.5"), T, "routed_scaling_factor"),
    "rsf bool": (lambda: fm.combine(_y, _w, _L, routed_scaling_factor=True), T, "routed_scaling_factor"),
    "combine out shape": (lambda: fm.combine(_y, _w, _L, out=torch.empty(3, 9)), V, "out"),
    "combine out dtype": (lambda: fm.combine(_y, _w, _L, out=torch.empty(3, 8).half()), T, "out"),
    "combine out strided": (lambda: fm.combine(_y, _w, _L, out=torch.empty(8, 3).t()), V, "out"),
    "dequant block_scales shape": (lambda: fm.dequantize_nvfp4(_p, torch.ones(2, 3).to(FP8), 1.0), V, "block_scales"),
    "dequant block_scales dtype": (lambda: fm.dequantize_nvfp4(_p, torch.ones(2, 2), 1.0), T, "block_scales"),
    "dequant packed dtype": (lambda: fm.dequantize_nvfp4(_p.to(torch.int8), _bs, 1.0), T, "packed"),
    "dequant packed K": (lambda: fm.dequantize_nvfp4(torch.zeros(2, 12, dtype=torch.uint8), _bs, 1.0), V, "packed"),
    "dequant global dtype": (lambda: fm.dequantize_nvfp4(_p, _bs, torch.tensor(1.0).half()), T, "global_scale"),
    "dequant out shape": (lambda: fm.dequantize_nvfp4(_p, _bs, 1.0, out=torch.empty(2, 16)), V, "out"),
    "quantize x int": (lambda: fm.quantize_nvfp4(torch.ones(2, 32, dtype=torch.int32)), T, "x"),
    "block w 1-D": (lambda: fm.quantize_fp8_block_weights(torch.ones(128)), V, "w"),
    "block (0, 128)": (lambda: fm.quantize_fp8_block_weights(torch.ones(4, 4), (0, 128)), V, "block"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    assert_error_names_argument(*BAD[case])


# Every scale that may be given as a Python number: zero would saturate every value, a negative one flip the
# signs, NaN or inf poison the output. (A tensor's value is not checked: that would sync the GPU.)
NUMBER_SCALES = {
    "quantize_fp8_per_tensor": (lambda v: fm.quantize_fp8_per_tensor(_h, v), "scale"),
    "permute_fp8_per_tensor": (lambda v: fm.permute_fp8_per_tensor(_h, _L, v), "scale"),
    "permute_fp8_per_tensor masked": (lambda v: fm.permute_fp8_per_tensor(_h, _M, scale=v), "scale"),
    "quantize_nvfp4": (lambda v: fm.quantize_nvfp4(_h, v), "global_scale"),
    "permute_nvfp4": (lambda v: fm.permute_nvfp4(_h, _L, v), "global_scale"),
    "dequantize_nvfp4": (lambda v: fm.dequantize_nvfp4(_p, _bs, v), "global_scale"),
    "combine": (lambda v: fm.combine(_y, _w, _L, routed_scaling_factor=v), "routed_scaling_factor"),
}
NOT_POSITIVE_FINITE = {"0": 0, "-1.0": -1.0, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0}


@pytest.mark.parametrize("value", list(NOT_POSITIVE_FINITE))
@pytest.mark.parametrize("case", list(NUMBER_SCALES))
def test_number_scale_must_be_positive_and_finite(case, value):
    call, name = NUMBER_SCALES[case]
    assert_error_names_argument(lambda: call(NOT_POSITIVE_FINITE[value]), ValueError, name)
    with pytest.raises(ValueError, match="must be a positive finite number"):
        call(NOT_POSITIVE_FINITE[value])


@pytest.mark.parametrize("value", [1e-50, 2.0**-127, 1e39, 10**400])
@pytest.mark.parametrize("case", [c for c in NUMBER_SCALES if c != "combine"])
def test_number_scale_must_be_a_normal_float32(case, value):
    """A scale travels as float32: one that would become 0, a subnormal or inf there is refused too."""
    call, name = NUMBER_SCALES[case]
    assert_error_names_argument(lambda: call(value), ValueError, name)


def test_number_scale_equals_the_same_tensor_scale():
    x = torch.randn(3, 128)
    for number in (0.5, 2, 2.0**-126):  # ints are numbers too; the smallest normal float32 is fine
        q, s = fm.quantize_fp8_per_tensor(x, number)
        q_t, s_t = fm.quantize_fp8_per_tensor(x, torch.tensor(float(number)))
        assert torch.equal(q.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(s, s_t), number
    packed, bs, gs = fm.quantize_nvfp4(x, 0.01)
    assert torch.equal(fm.dequantize_nvfp4(packed, bs, 0.01), fm.dequantize_nvfp4(packed, bs, gs))
    # A tensor scale is taken as given (its value is not read on the host).
    assert fm.quantize_fp8_per_tensor(x, torch.tensor(-1.0))[1].item() == -1.0


# --------------------------------------------------------------------------------------------- compile


def _moe_step(hidden, ids, weights):
    layout = fm.moe_align_contiguous(ids, 8, block_rows=4)
    q, scales = fm.permute_fp8_per_token_group(hidden, layout, group_size=64)
    y = (q.float().unflatten(-1, (-1, 64)) * scales.unsqueeze(-1)).flatten(-2)  # "experts": dequantize
    return fm.combine(y, weights, layout, routed_scaling_factor=1.5)


def test_torch_compile_fullgraph_matches_eager(rng):
    seed, g = rng
    compiled = torch.compile(_moe_step, fullgraph=True)
    for num_tokens in (5, 7):
        hidden = randn(g, num_tokens, 128)
        ids = random_ids(g, num_tokens, 2, 8)
        weights = torch.rand(num_tokens, 2, generator=g)
        assert torch.equal(compiled(hidden, ids, weights), _moe_step(hidden, ids, weights)), f"seed={seed}"


def test_torch_compile_combine_with_an_eager_layout(rng):
    seed, g = rng
    layout, _ = make_layouts(g, 3, "masked")
    y = randn(g, *layout.rows_shape, 64)
    weights, residual = torch.rand(3, 2, generator=g), randn(g, 3, 64)

    def step(y, weights, layout, residual):
        return fm.combine(y, weights, layout, routed_scaling_factor=0.5, residual=residual)

    got = torch.compile(step, fullgraph=True)(y, weights, layout, residual)
    assert torch.equal(got, step(y, weights, layout, residual)), f"seed={seed}"
