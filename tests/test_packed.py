"""Packed FP8 block-scaled weights (``pack_fp8_block_weights``) on the CPU tier: the layout byte by byte, the
round trip, the public GEMMs and fused_moe taking packed weights (the CPU path unpacks them), and bad input."""

import pytest
import torch
from checks import assert_error_names_argument, bits
from gemm_cases import FP8, contiguous_layout, make_activations, make_weights

import flashinfer_moe as fm


def _random_fp8(g, *shape):
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(FP8)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("shape", [(1, 256, 128), (3, 768, 384), (2, 512, 1024)])
def test_pack_layout_and_round_trip(rng, gated, shape):
    """Every stored 16-byte chunk against the documented layout, and unpack() giving back the bytes."""
    seed, g = rng
    w = _random_fp8(g, *shape)
    packed = fm.pack_fp8_block_weights(w, gated=gated, chunk_experts=2)
    e, n, k = shape
    assert packed.shape == shape and packed.gated is gated and packed.dtype == FP8
    assert tuple(packed.data.shape) == (e, n // 256, k // 128, 256, 128)
    assert torch.equal(bits(packed.unpack()), bits(w)), seed
    data, src = bits(packed.data), bits(w)
    inter = n // 2
    for t in range(n // 256):
        for r in range(256):
            if gated:  # per 128 output columns: 64 gate rows, their 64 up rows, the next 64 of each
                half, up, row = r // 128, (r // 64) % 2, r % 64
                source = up * inter + 128 * t + 64 * half + row
            else:
                source = 256 * t + r
            for c in range(8):
                stored = data[:, t, :, r, 16 * (c ^ (r % 8)) : 16 * (c ^ (r % 8)) + 16]  # [E, K / 128, 16]
                want = src[:, source].view(e, k // 128, 128)[:, :, 16 * c : 16 * c + 16]
                assert torch.equal(stored, want), (seed, t, r, c)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("activation", [None, "silu", "clamped_silu"])
def test_packed_weights_give_the_plain_result_on_cpu(rng, masked, activation):
    seed, g = rng
    num_experts, n, k = 3, 512, 256
    w, w_scale = make_weights("fp8_block", num_experts, n, k, g, "cpu")
    packed = fm.pack_fp8_block_weights(w, gated=activation is not None)
    if masked:
        a, a_scale = make_activations("fp8_block", (num_experts, 5), k, g, "cpu")
        groups, fn = torch.tensor([5, 0, 2], dtype=torch.int32), fm.grouped_gemm_fp8_block_masked
    else:
        groups = contiguous_layout([4, 0, 9], 1, "cpu")
        a, a_scale = make_activations("fp8_block", (groups.num_rows,), k, g, "cpu")
        fn = fm.grouped_gemm_fp8_block_contiguous
    cols = n // 2 if activation else n
    lead = tuple(a.shape[:-1])

    def zeros(quantize):  # slots of the masked layout past the counts are not written: same start on both sides
        if quantize:
            return torch.zeros(*lead, cols, dtype=FP8), torch.zeros(*lead, cols // 128)
        return torch.zeros(*lead, cols, dtype=torch.bfloat16)

    for quantize in (False, True) if activation else (False,):
        kw = dict(activation=activation, quantize_output=quantize)
        want = fn(a, a_scale, w, w_scale, groups, out=zeros(quantize), **kw)
        got = fn(a, a_scale, packed, w_scale, groups, out=zeros(quantize), **kw)
        for x, y in zip(got if quantize else (got,), want if quantize else (want,), strict=True):
            assert torch.equal(bits(x), bits(y)), (seed, quantize)


def test_fused_moe_takes_packed_weights_on_cpu(rng):
    seed, g = rng
    num_experts, top_k, h, inter, num_tokens = 8, 2, 256, 128, 5
    w13, s13 = make_weights("fp8_block", num_experts, 2 * inter, h, g, "cpu")
    w2, s2 = make_weights("fp8_block", num_experts, h, inter, g, "cpu")
    x = torch.randn(num_tokens, h, generator=g).bfloat16()
    weights, ids = fm.route(torch.randn(num_tokens, num_experts, generator=g), top_k)
    kw = dict(quant="fp8_block", w13_scale=s13, w2_scale=s2)
    p13, p2 = fm.pack_fp8_block_weights(w13, gated=True), fm.pack_fp8_block_weights(w2)
    got = fm.fused_moe(x, p13, p2, weights, ids, **kw)
    assert torch.equal(got, fm.fused_moe(x, w13, w2, weights, ids, **kw)), seed


def test_pack_bad_input_names_the_argument(generator):
    w = _random_fp8(generator, 2, 512, 256)
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w.float()), TypeError, "w")
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w[0]), ValueError, "w")
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w[:, :384]), ValueError, "w")  # N % 256
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w[:, :, :192]), ValueError, "w")  # K % 128
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w, gated=1), TypeError, "gated")
    assert_error_names_argument(lambda: fm.pack_fp8_block_weights(w, chunk_experts=0), ValueError, "chunk_experts")


def test_gemms_reject_packed_weights_they_cannot_use(generator):
    num_experts, n, k = 2, 512, 256
    w, w_scale = make_weights("fp8_block", num_experts, n, k, generator, "cpu")
    a, a_scale = make_activations("fp8_block", (num_experts, 4), k, generator, "cpu")
    counts = torch.tensor([4, 1], dtype=torch.int32)
    plain, gated = fm.pack_fp8_block_weights(w), fm.pack_fp8_block_weights(w, gated=True)
    masked = fm.grouped_gemm_fp8_block_masked
    # Packed for GEMM1 but called without an activation, and the other way round: the rows are in another order.
    assert_error_names_argument(lambda: masked(a, a_scale, gated, w_scale, counts), ValueError, "w")
    assert_error_names_argument(lambda: masked(a, a_scale, plain, w_scale, counts, activation="silu"), ValueError, "w")
    # K of the packed weights against a's.
    a2, a2_scale = make_activations("fp8_block", (num_experts, 4), 128, generator, "cpu")
    assert_error_names_argument(lambda: masked(a2, a2_scale, plain, w_scale, counts), ValueError, "w")
    # The per-tensor GEMM has no packed form.
    t_scale = torch.ones(num_experts)
    call = lambda: fm.grouped_gemm_fp8_tensor_masked(a, torch.ones(()), plain, t_scale, counts)  # noqa: E731
    assert_error_names_argument(call, TypeError, "w")
    # w_scale still has the shape of the plain weights' scales.
    assert_error_names_argument(lambda: masked(a, a_scale, plain, w_scale[:, :2], counts), ValueError, "w_scale")


def test_fused_moe_rejects_misused_packed_weights(generator):
    num_experts, h, inter = 4, 256, 128
    w13, s13 = make_weights("fp8_block", num_experts, 2 * inter, h, generator, "cpu")
    w2, s2 = make_weights("fp8_block", num_experts, h, inter, generator, "cpu")
    x = torch.randn(3, h, generator=generator).bfloat16()
    weights, ids = fm.route(torch.randn(3, num_experts, generator=generator), 2)
    p13, p2 = fm.pack_fp8_block_weights(w13, gated=True), fm.pack_fp8_block_weights(w2)
    kw = dict(quant="fp8_block", w13_scale=s13, w2_scale=s2)
    bad = fm.pack_fp8_block_weights(w13)  # not gated
    assert_error_names_argument(lambda: fm.fused_moe(x, bad, p2, weights, ids, **kw), ValueError, "w13")
    assert_error_names_argument(lambda: fm.fused_moe(x, p13, p13, weights, ids, **kw), ValueError, "w2")  # gated
    t_kw = dict(quant="fp8_tensor", w13_scale=torch.ones(num_experts), w2_scale=torch.ones(num_experts))
    assert_error_names_argument(lambda: fm.fused_moe(x, p13, p2, weights, ids, **t_kw), ValueError, "w13")


@pytest.mark.parametrize("pack", [True, False])
def test_repack_in_place_failing_midway_leaves_the_weights_as_they_were(rng, monkeypatch, pack):
    """An error in the third of five chunks (out of memory, say): the two chunks already converted are
    converted back before it propagates, so ``w`` holds the bytes it had."""
    from flashinfer_moe.moe import packed as packed_mod

    seed, g = rng
    w = _random_fp8(g, 9, 512, 256)
    if not pack:
        w = packed_mod.repack_in_place(w, gated=True, pack=True)
    before = bits(w).clone()
    target = "_swizzle" if pack else "_unpack"
    real, calls = getattr(packed_mod, target), []

    def fails_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("no memory for the third chunk")
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_mod, target, fails_third)
    with pytest.raises(torch.OutOfMemoryError, match="third chunk"):
        packed_mod.repack_in_place(w, gated=True, pack=pack, chunk_experts=2)
    assert len(calls) == 3
    assert torch.equal(bits(w), before), f"seed {seed}"
    monkeypatch.setattr(packed_mod, target, real)
    converted = packed_mod.repack_in_place(w, gated=True, pack=pack, chunk_experts=2)  # and it still works
    assert torch.equal(bits(packed_mod.repack_in_place(converted, gated=True, pack=not pack)), before)


def test_repack_in_place_says_what_is_left_when_restoring_fails(rng, monkeypatch):
    from flashinfer_moe.moe import packed as packed_mod

    _, g = rng
    w = _random_fp8(g, 5, 256, 128)
    real, calls = packed_mod._swizzle, []

    def fails_second(part):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("second chunk")
        return real(part)

    def unpack_fails(*args, **kwargs):
        raise torch.OutOfMemoryError("restoring")

    monkeypatch.setattr(packed_mod, "_swizzle", fails_second)
    monkeypatch.setattr(packed_mod, "_unpack", unpack_fails)
    with pytest.raises(RuntimeError, match=r"experts \[0, 2\) are left packed") as info:
        packed_mod.repack_in_place(w, gated=False, pack=True, chunk_experts=2)
    assert "second chunk" in str(info.value) and "restoring" in str(info.value.__cause__)
