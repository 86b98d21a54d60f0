"""CPU tier for the layout, permute and combine references: hand-checked layouts, layouts against a brute-force
construction, combine against float64, and the argument checks."""

import math

import pytest
import torch
from checks import assert_error_names_argument, bits, randn

from flashinfer_moe import ExpertLayout, reference
from flashinfer_moe import reference_quant as rq

FP8 = torch.float8_e4m3fn
LAYOUT_TENSORS = ("tokens_per_expert", "expert_offsets", "row_of", "source_of", "status")


def static_rows(num_tokens, top_k, num_experts, block_rows):
    """The documented static row count of a contiguous layout."""
    pairs = num_tokens * top_k
    return pairs + min(num_experts, pairs) * (block_rows - 1)


# ------------------------------------------------------------------------------------------ hand-checked

IDS = [[0, 2], [2, -1], [3, 0]]  # E = 4, T = 3, k = 2; expert 1 gets nothing, one id is off this GPU


@pytest.mark.parametrize(
    "block_rows, offsets, row_of, source_of",
    [
        # R = 6 + 4 * 0 = 6: one trailing row past expert_offsets[E] = 5
        (1, [0, 2, 2, 4, 5], [[0, 2], [3, -1], [4, 1]], [0, 5, 1, 2, 4, -1]),
        # R = 6 + 4 * 3 = 18: padding inside each expert's tile, then 6 trailing rows
        (4, [0, 4, 4, 8, 12], [[0, 4], [5, -1], [8, 1]], [0, 5, -1, -1, 1, 2, -1, -1, 4, -1, -1, -1] + [-1] * 6),
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_align_hand_checked(block_rows, offsets, row_of, source_of, id_dtype):
    layout = reference.moe_align_contiguous(torch.tensor(IDS, dtype=id_dtype), 4, block_rows)
    assert isinstance(layout, ExpertLayout) and layout.kind == "contiguous"
    assert all(getattr(layout, f).dtype == torch.int32 for f in LAYOUT_TENSORS)
    assert (layout.num_experts, layout.block_rows, layout.capacity) == (4, block_rows, 0)
    assert (layout.num_tokens, layout.top_k, layout.num_rows) == (3, 2, len(source_of))
    assert layout.rows_shape == (len(source_of),) and layout.num_rows == static_rows(3, 2, 4, block_rows)
    assert layout.tokens_per_expert.tolist() == [2, 0, 2, 1]
    assert layout.expert_offsets.tolist() == offsets
    assert layout.row_of.tolist() == row_of
    assert layout.source_of.tolist() == source_of
    assert layout.status.tolist() == [0, 0] and layout.overflow.dim() == 0


def test_masked_hand_checked(rng):
    seed, g = rng
    ids = torch.tensor(IDS)
    h = randn(g, 3, 5) + 10  # never zero
    layout = reference.moe_align_masked(ids, 4, 1)
    assert layout.kind == "masked" and layout.rows_shape == (4, 1) and layout.num_rows == 4
    assert (layout.block_rows, layout.capacity) == (1, 1)
    assert all(getattr(layout, f).dtype == torch.int32 for f in LAYOUT_TENSORS)
    assert layout.tokens_per_expert.tolist() == [1, 0, 1, 1]
    assert layout.overflow.item() == 2 and layout.status.tolist() == [2, 0]  # pairs 5 (expert 0), 2 (expert 2)
    assert layout.expert_offsets.tolist() == [0, 1, 2, 3, 4]
    assert layout.row_of.tolist() == [[0, 2], [-1, -1], [3, -1]]
    assert layout.source_of.tolist() == [0, -1, 1, 4]
    out = reference.permute(h, layout)
    assert out.shape == (4, 1, 5), f"seed={seed}"
    assert torch.equal(out[0, 0], h[0]) and torch.equal(out[2, 0], h[0]) and torch.equal(out[3, 0], h[2])
    assert (out[1] == 0).all()

    layout = reference.moe_align_masked(ids, 4, 3)
    assert layout.tokens_per_expert.tolist() == [2, 0, 2, 1] and layout.overflow.item() == 0
    assert layout.expert_offsets.tolist() == [0, 3, 6, 9, 12]
    assert layout.row_of.tolist() == [[0, 6], [7, -1], [9, 1]]
    assert layout.source_of.tolist() == [0, 5, -1, -1, -1, -1, 1, 2, -1, 4, -1, -1]
    out = reference.permute(h, layout)
    assert torch.equal(out[0, 1], h[2]) and torch.equal(out[2, 1], h[1]) and (out[0, 2] == 0).all()


# ----------------------------------------------------------------------------------------- brute force


def random_ids(g, num_tokens, top_k, num_experts, kind):
    if kind == "one_expert":
        return torch.full((num_tokens, top_k), num_experts - 1, dtype=torch.int32)
    # distinct experts per token; "holes": the lower half becomes -1, so those experts get nothing
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :top_k] % num_experts
    ids = torch.where(ids < num_experts // 2, -1, ids) if kind == "holes" else ids
    return ids.to(torch.int32)


def brute_force(ids, num_experts, block_rows):
    """Contiguous layout by hand: experts in order, pairs in ascending t*k+j, pad to block_rows, then -1s."""
    flat = ids.reshape(-1).tolist()
    source, row_of, offsets = [], [-1] * len(flat), [0]
    for e in range(num_experts):
        members = [i for i, x in enumerate(flat) if x == e]
        for i in members:
            row_of[i] = len(source)
            source.append(i)
        source += [-1] * (-len(members) % block_rows)
        offsets.append(len(source))
    source += [-1] * (static_rows(*ids.shape, num_experts, block_rows) - len(source))
    return offsets, row_of, source


SHAPES = [(1, 1, 4), (3, 2, 4), (1000, 4, 16), (37, 8, 9)]  # (T, k, E)
KINDS = ["spread", "holes", "one_expert"]


@pytest.mark.parametrize("num_tokens, top_k, num_experts", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_rows", [1, 4, 128])
def test_align_against_brute_force(rng, num_tokens, top_k, num_experts, kind, block_rows):
    seed, g = rng
    ids = random_ids(g, num_tokens, top_k, num_experts, kind)
    layout = reference.moe_align_contiguous(ids.long() if block_rows == 4 else ids, num_experts, block_rows)
    offsets, row_of, source = brute_force(ids, num_experts, block_rows)
    msg = f"seed={seed}"
    assert layout.num_rows == len(source) == static_rows(num_tokens, top_k, num_experts, block_rows), msg
    assert layout.expert_offsets.tolist() == offsets, msg
    assert layout.row_of.reshape(-1).tolist() == row_of, msg
    assert layout.source_of.tolist() == source, msg
    assert layout.tokens_per_expert.tolist() == [(ids == e).sum().item() for e in range(num_experts)], msg
    assert layout.status.tolist() == [0, 0], msg


@pytest.mark.parametrize("num_tokens, top_k, num_experts", SHAPES)
@pytest.mark.parametrize("capacity_kind", ["tight", "zero", "roomy"])
def test_masked_overflow_against_brute_force(rng, num_tokens, top_k, num_experts, capacity_kind):
    seed, g = rng
    msg = f"seed={seed}"
    ids = random_ids(g, num_tokens, top_k, num_experts, "holes")
    capacity = {"tight": max(1, num_tokens * top_k // (2 * num_experts)), "zero": 0, "roomy": num_tokens * top_k}
    capacity = capacity[capacity_kind]
    hidden = randn(g, num_tokens, 24) + 5
    layout = reference.moe_align_masked(ids, num_experts, capacity)
    out = reference.permute(hidden, layout)
    assert out.shape == (num_experts, capacity, 24) and layout.rows_shape == (num_experts, capacity), msg
    _, _, source = brute_force(ids, num_experts, 1)
    expected = torch.zeros(num_experts, capacity, 24)
    row_of = torch.full((num_tokens * top_k,), -1, dtype=torch.int32)
    source_of = torch.full((num_experts * capacity,), -1, dtype=torch.int32)
    seen, dropped = [0] * num_experts, 0
    for i in (i for i in source if i >= 0):
        e = int(ids.view(-1)[i])
        if seen[e] < capacity:
            expected[e, seen[e]] = hidden[i // top_k]
            row_of[i] = e * capacity + seen[e]
            source_of[e * capacity + seen[e]] = i
            seen[e] += 1
        else:
            dropped += 1
    assert torch.equal(out, expected), msg
    assert layout.tokens_per_expert.tolist() == seen, msg
    assert layout.overflow.item() == dropped and layout.status.tolist() == [dropped, 0], msg
    assert layout.expert_offsets.tolist() == [e * capacity for e in range(num_experts + 1)], msg
    assert torch.equal(layout.row_of.view(-1), row_of) and torch.equal(layout.source_of, source_of), msg
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    kept = (row_of >= 0).view(num_tokens, top_k)
    ref = (weights.double() * kept).sum(-1, keepdim=True) * hidden.double()  # dropped pairs add nothing
    assert rel_err(reference.combine(out, weights, layout), ref, ref) < 1e-5, msg


# ----------------------------------------------------------------------------- permute and combine

TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out, ref, magnitude):
    """Max error over the max of ``magnitude``, the sum of the absolute terms (so cancellation cannot inflate it)."""
    return ((out.double() - ref).abs().max() / magnitude.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("num_tokens, top_k, num_experts", SHAPES)
@pytest.mark.parametrize("hidden_size", [1, 72, 200])
@pytest.mark.parametrize("dtype", list(TOLS))
@pytest.mark.parametrize("kind", ["holes", "one_expert"])
def test_permute_combine_against_float64(rng, num_tokens, top_k, num_experts, hidden_size, dtype, kind):
    seed, g = rng
    msg = f"seed={seed}"
    ids = random_ids(g, num_tokens, top_k, num_experts, kind)
    hidden = randn(g, num_tokens, hidden_size, dtype=dtype)
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    residual = randn(g, num_tokens, hidden_size, dtype=dtype)
    # "Expert e" multiplies by 2**e (exact in every dtype), so that a row read from the wrong expert shows.
    factor = torch.where(ids >= 0, 2.0 ** ids.double(), 0) * weights.double()  # [T, k]
    ref = factor.sum(-1, keepdim=True) * hidden.double()
    ref_full = ref * 1.5 + residual.double()
    magnitude = ref.abs() * 1.5 + residual.double().abs()  # factor >= 0: |ref| is the sum of |terms|

    layout = reference.moe_align_contiguous(ids, num_experts, 4)
    y = reference.permute(hidden, layout)
    assert y.dtype == dtype and y.shape == (static_rows(num_tokens, top_k, num_experts, 4), hidden_size), msg
    assert (y[layout.source_of < 0] == 0).all(), msg  # the reference zeroes rows that hold no pair
    rows = torch.arange(y.shape[0])
    expert_of_row = torch.searchsorted(layout.expert_offsets.long(), rows, right=True) - 1
    y = (y.double() * 2.0 ** expert_of_row.clamp(max=num_experts - 1).unsqueeze(-1)).to(dtype)
    out = reference.combine(y, weights, layout)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden_size) and rel_err(out, ref, ref) < TOLS[dtype], msg
    out = reference.combine(y, weights, layout, routed_scaling_factor=1.5, residual=residual, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, ref_full, magnitude) < TOLS[torch.float32], msg

    capacity = max(1, int(layout.tokens_per_expert.max()))  # room for everyone
    masked = reference.moe_align_masked(ids, num_experts, capacity)
    assert masked.overflow.item() == 0, msg
    assert torch.equal(masked.tokens_per_expert, layout.tokens_per_expert), msg
    ym = reference.permute(hidden, masked)
    assert (
        ym.shape == (num_experts, capacity, hidden_size) and (ym.view(-1, hidden_size)[masked.source_of < 0] == 0).all()
    )
    ym = (ym.double() * 2.0 ** torch.arange(num_experts).double().view(-1, 1, 1)).to(dtype)
    out = reference.combine(ym, weights, masked, routed_scaling_factor=1.5, residual=residual)
    assert out.dtype == dtype and rel_err(out, ref_full, magnitude) < TOLS[dtype], msg


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("hidden_size", [16, 160])
def test_fused_permutes_place_the_quantized_tokens(rng, masked, hidden_size):
    seed, g = rng
    msg = f"seed={seed}"
    ids = random_ids(g, 37, 4, 9, "holes")
    hidden = randn(g, 37, hidden_size) * torch.exp(randn(g, 37, 1) * 3)
    layout = reference.moe_align_masked(ids, 9, 6) if masked else reference.moe_align_contiguous(ids, 9, 8)
    token = torch.where(layout.source_of >= 0, layout.source_of // 4, 0).long()  # token of each row
    owned = (layout.source_of >= 0).view(layout.rows_shape)

    def expect(rows):  # rows [T, ...] placed by source_of, zero where no pair
        placed = torch.where(
            (layout.source_of >= 0).view(-1, *[1] * (rows.dim() - 1)), rows.view(torch.uint8)[token], 0
        )
        return placed.view(*layout.rows_shape, *rows.shape[1:])

    q, s = reference.permute_fp8_per_token_group(hidden, layout, 16, scale_pow2=True)
    q_ref, s_ref = rq.quantize_fp8_per_token_group(hidden, 16, scale_pow2=True)
    assert torch.equal(q.view(torch.uint8), expect(q_ref)) and torch.equal(s[owned], s_ref[token[owned.view(-1)]]), msg
    assert (s[~owned] == 0).all(), msg
    q, scale = reference.permute_fp8_per_tensor(hidden, layout)
    q_ref, scale_ref = rq.quantize_fp8_per_tensor(hidden)
    assert torch.equal(q.view(torch.uint8), expect(q_ref)) and scale.dim() == 0 and torch.equal(scale, scale_ref), msg
    packed, bs, gs = reference.permute_nvfp4(hidden, layout, 0.02)
    p_ref, bs_ref, gs_ref = rq.quantize_nvfp4(hidden, 0.02)
    assert torch.equal(packed, expect(p_ref)) and torch.equal(bs.view(torch.uint8), expect(bs_ref)), msg
    assert gs.dim() == 0 and gs.item() == gs_ref.item(), msg


def test_combine_skips_minus_one_even_if_row_or_weight_is_not_finite():
    # Pair (0, 0) has id -1 and a NaN weight; rows 1-3 hold no pair and are not finite (contents unspecified).
    layout = reference.moe_align_contiguous(torch.tensor([[-1, 1], [-1, -1]]), 2)
    assert layout.row_of.tolist() == [[-1, 0], [-1, -1]] and layout.source_of.tolist() == [1, -1, -1, -1]
    y = torch.tensor([[2.0, 2.0, 2.0], [math.inf, math.nan, -math.inf], [math.nan] * 3, [math.inf] * 3])
    weights = torch.tensor([[math.nan, 0.5], [math.inf, math.nan]])
    out = reference.combine(y, weights, layout)
    assert out.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    out = reference.combine(y, weights, layout, routed_scaling_factor=2.0, residual=torch.ones(2, 3))
    assert out.tolist() == [[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]]
    # Masked: the second pair to expert 0 overflows (no slot) and its weight is inf; the free slot is NaN.
    masked = reference.moe_align_masked(torch.tensor([[0], [0], [1]]), 3, 1)
    assert masked.row_of.tolist() == [[0], [-1], [1]] and masked.overflow.item() == 1
    ym = torch.tensor([[[4.0]], [[8.0]], [[math.nan]]])
    out = reference.combine(ym, torch.tensor([[0.25], [math.inf], [0.5]]), masked)
    assert out.tolist() == [[1.0], [0.0], [4.0]]


# ------------------------------------------------------------------------------------------- bad input

_ids = torch.tensor(IDS)
_layout = reference.moe_align_contiguous(_ids, 4)  # R = 6
_masked = reference.moe_align_masked(_ids, 4, 2)
_meta = torch.device("meta")
BAD = {
    "ids dtype": (lambda: reference.moe_align_contiguous(_ids.float(), 4), TypeError, "topk_ids"),
    "ids not tensor": (lambda: reference.moe_align_contiguous(IDS, 4), TypeError, "topk_ids"),
    "ids 1-D": (lambda: reference.moe_align_contiguous(_ids.view(-1), 4), ValueError, "topk_ids"),
    "ids too large": (lambda: reference.moe_align_contiguous(_ids, 3), ValueError, "topk_ids"),
    "ids below -1": (lambda: reference.moe_align_contiguous(_ids - 1, 8), ValueError, "topk_ids"),
    "masked ids too large": (lambda: reference.moe_align_masked(_ids, 3, 2), ValueError, "topk_ids"),
    "block_rows": (lambda: reference.moe_align_contiguous(_ids, 4, 0), ValueError, "block_rows"),
    "num_experts": (lambda: reference.moe_align_contiguous(_ids, 4.0), TypeError, "num_experts"),
    "num_experts 0": (lambda: reference.moe_align_masked(_ids.clamp(max=-1), 0, 2), ValueError, "num_experts"),
    "capacity negative": (lambda: reference.moe_align_masked(_ids, 4, -1), ValueError, "capacity"),
    "capacity float": (lambda: reference.moe_align_masked(_ids, 4, 2.0), TypeError, "capacity"),
    "hidden tokens": (lambda: reference.permute(torch.ones(4, 8), _layout), ValueError, "hidden"),
    "hidden 1-D": (lambda: reference.permute(torch.ones(3), _layout), ValueError, "hidden"),
    "hidden masked tokens": (lambda: reference.permute(torch.ones(2, 8), _masked), ValueError, "hidden"),
    "hidden device": (lambda: reference.permute(torch.ones(3, 8, device=_meta), _masked), ValueError, "hidden"),
    "layout type": (lambda: reference.permute(torch.ones(3, 8), {"row_of": _ids}), TypeError, "layout"),
    "fp8 group hidden": (
        lambda: reference.permute_fp8_per_token_group(torch.ones(3, 100), _layout),
        ValueError,
        "x",
    ),
    "nvfp4 hidden K": (lambda: reference.permute_nvfp4(torch.ones(3, 24), _layout), ValueError, "x"),
    "y rows": (lambda: reference.combine(torch.ones(5, 8), torch.ones(3, 2), _layout), ValueError, "y"),
    "y masked shape": (lambda: reference.combine(torch.ones(4, 3, 8), torch.ones(3, 2), _masked), ValueError, "y"),
    "y device": (
        lambda: reference.combine(torch.ones(6, 8, device=_meta), torch.ones(3, 2), _layout),
        ValueError,
        "y",
    ),
    "weights shape": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 3), _layout),
        ValueError,
        "topk_weights",
    ),
    "weights tokens": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(4, 2), _layout),
        ValueError,
        "topk_weights",
    ),
    "weights 1-D": (lambda: reference.combine(torch.ones(6, 8), torch.ones(6), _layout), ValueError, "topk_weights"),
    "weights dtype": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 2, dtype=torch.int32), _layout),
        TypeError,
        "topk_weights",
    ),
    "weights device": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 2, device=_meta), _layout),
        ValueError,
        "topk_weights",
    ),
    "combine layout type": (lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 2), None), TypeError, "layout"),
    "residual shape": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 2), _layout, residual=torch.ones(3, 7)),
        ValueError,
        "residual",
    ),
    "residual device": (
        lambda: reference.combine(torch.ones(6, 8), torch.ones(3, 2), _layout, residual=torch.ones(3, 8, device=_meta)),
        ValueError,
        "residual",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    assert_error_names_argument(*BAD[case])


# ------------------------------------------------------------------------------------------ CPU vs CUDA


def _fields(layout):
    return tuple(getattr(layout, f) for f in LAYOUT_TENSORS)


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit(rng):
    seed, g = rng
    x = randn(g, 37, 512) * torch.exp(randn(g, 37, 1) * 3)
    ids = (torch.rand(37, 16, generator=g).argsort(-1)[:, :4] - 2).clamp(min=-1).int()
    w = torch.rand(37, 4, generator=g)
    y = reference.permute(x, reference.moe_align_contiguous(ids, 16, 8))
    ym = reference.permute(x, reference.moe_align_masked(ids, 16, 5))

    def contiguous(d):
        return reference.moe_align_contiguous(ids.to(d), 16, 8)

    def masked(d):
        return reference.moe_align_masked(ids.to(d), 16, 5)

    calls = {
        "align": lambda d: _fields(contiguous(d)),
        "align masked": lambda d: _fields(masked(d)),
        "permute": lambda d: reference.permute(x.to(d), contiguous(d)),
        "permute fp8 group": lambda d: reference.permute_fp8_per_token_group(x.to(d), contiguous(d)),
        "permute fp8 tensor": lambda d: reference.permute_fp8_per_tensor(x.to(d), masked(d)),
        "permute nvfp4": lambda d: reference.permute_nvfp4(x.to(d), contiguous(d)),
        "combine": lambda d: reference.combine(
            y.to(d), w.to(d), contiguous(d), routed_scaling_factor=2.5, residual=x.to(d)
        ),
        "masked": lambda d: reference.permute(x.to(d), masked(d)),
        "combine masked": lambda d: reference.combine(ym.to(d), w.to(d), masked(d), out_dtype=torch.bfloat16),
    }
    for name, call in calls.items():
        cpu, cuda = call("cpu"), call("cuda")
        cpu, cuda = (cpu, cuda) if isinstance(cpu, tuple) else ((cpu,), (cuda,))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(cpu, cuda, strict=True)), f"{name} seed={seed}"
