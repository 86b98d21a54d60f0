"""W4A8 (NVFP4 weights, FP8 activations) on the CPU: the W4A8 words round trip, the kernel's expansion emulated on
them gives the rounding model (``w4a8_weight_values``) at every element, the CPU op against float64, its error
against W4A16's, and bad input."""

import pytest
import torch
from gemm_cases import contiguous_layout, rel_err
from nvfp4_cases import FP8, dequantized, fp8_rows, grouped_reference, nvfp4_weights, w4a8_reference

import flashinfer_moe as fm
from flashinfer_moe import reference_quant as rq
from flashinfer_moe.moe.gemm_nvfp4_w4a8 import w4a8_weight_values
from flashinfer_moe.moe.packed_nvfp4 import w4a8_words

# W4A8 against the float64 product of the FP8 activations and the exact NVFP4 weights: the E4M3 rounding of the
# folded weights (up to 2**-4 relative per weight, about 2% over a product); docs/perf.md has it measured.
W4A8_TOL = 0.06


@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 5, 96), (2, 7, 224)])
def test_words_round_trip(rng, shape):
    seed, g = rng
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    packed = fm.pack_nvfp4_weights(w, w4a8=True)
    assert packed.w4a8 and not packed.split_bits
    assert not torch.equal(packed.data, w) or w.numel() < 4, seed
    assert torch.equal(packed.unpack(), w), seed
    assert torch.equal(w4a8_words(w4a8_words(w, True), False), w), seed


def _table(scale_byte: int) -> list[int]:
    """The kernel's table of one scale byte: e4m3 bytes of |e2m1 m| x scale / 8."""
    s = torch.tensor([scale_byte], dtype=torch.uint8).view(FP8).float()
    mags = rq.e2m1_decode(torch.arange(8, dtype=torch.uint8))
    return (mags * s / 8).to(FP8).view(torch.uint8).tolist()


def test_expansion_emulated(rng):
    """Each word's bytes as expand8_e4m3 builds them (byte j of a: table[(y >> 4 j) & 7] | bit 8 j + 7 of y; of b:
    table'[(y >> 16 + 4 j) & 7] | bit 8 j + 3 of y, shifted to the top), at every element of a few rows with
    every positive finite scale byte, equal the rounding model's bytes."""
    seed, g = rng
    n, k = 8, 512
    w = torch.randint(0, 256, (1, n, k // 2), dtype=torch.uint8, generator=g)
    scale_bytes = torch.arange(n * k // 16, dtype=torch.int64).reshape(1, n, k // 16) % 0x7F  # every positive finite
    s = scale_bytes.to(torch.uint8).view(FP8)
    want = (w4a8_weight_values(w, s) / 8).to(FP8).view(torch.uint8)  # [1, n, k]
    data = fm.pack_nvfp4_weights(w, w4a8=True).data
    tables = {b: _table(b) for b in range(256)}
    for row in range(n):
        words = data[0, row].reshape(-1, 4).to(torch.int64)
        words = (words << torch.tensor([0, 8, 16, 24])).sum(-1).tolist()  # [K / 8], span d: 8 words
        for idx, y in enumerate(words):
            d, q, c = idx // 8, (idx % 8) // 2, idx % 2
            for j in range(4):
                for half in range(2):
                    kk = 64 * d + 32 * c + 16 * half + 4 * q + j
                    table = tables[int(scale_bytes[0, row, kk // 16])]
                    mag = (y >> (16 * half + 4 * j)) & 7
                    sign = (y >> (8 * j + (3 if half else 7))) & 1
                    assert table[mag] | (sign << 7) == int(want[0, row, kk]), (seed, row, kk)


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("per_row", [True, False])
def test_masked_cpu(rng, act, per_row):
    seed, g = rng
    num_experts, capacity, n, k = 3, 9, 128, 192
    gated = act is not None
    x = torch.randn(num_experts, capacity, k, generator=g)
    a, a_scale = fp8_rows(x)
    if not per_row:
        a_scale = a_scale.amax().reshape(1)
        a = (x / a_scale).to(FP8)
    w, s, gs = nvfp4_weights(num_experts, 2 * n if gated else n, k, g, gated=gated)
    wp = fm.pack_nvfp4_weights(w, w4a8=True)
    counts = torch.tensor([capacity, 0, 4], dtype=torch.int32)
    out = torch.full((num_experts, capacity, n), float("nan"))
    fm.grouped_gemm_nvfp4_masked(
        a, wp, s, gs, counts, a_scale=a_scale, activation=act, out_dtype=torch.float32, out=out
    )
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    model = w4a8_reference(a, a_scale, w, s, gs, counts, offsets, act).view(num_experts, capacity, -1)
    af = a.double() * (a_scale[..., None].double() if per_row else a_scale.double())
    exact = grouped_reference(af, w, s, gs, counts, offsets, act).view(num_experts, capacity, -1)
    for e, c in enumerate(counts.tolist()):
        if c:
            assert rel_err(out[e, :c], model[e, :c]) < 1e-5, seed
        assert out[e, c:].isnan().all()
    valid = torch.arange(capacity)[None, :] < counts[:, None]
    assert rel_err(out[valid], exact[valid]) < W4A8_TOL, seed


def test_contiguous_cpu_default_dtype(rng):
    seed, g = rng
    layout = contiguous_layout([2, 0, 5], 1, "cpu")
    k, n = 128, 64
    a, a_scale = fp8_rows(torch.randn(layout.num_rows, k, generator=g))
    w, s, gs = nvfp4_weights(3, n, k, g)
    got = fm.grouped_gemm_nvfp4_contiguous(a, fm.pack_nvfp4_weights(w, w4a8=True), s, gs, layout, a_scale=a_scale)
    assert got.dtype == torch.bfloat16
    counts, offsets = layout.tokens_per_expert, layout.expert_offsets
    want = w4a8_reference(a, a_scale, w, s, gs, counts, offsets, None)
    assert rel_err(got[:7], want[:7]) < 1e-2, seed


def test_error_against_w4a16(rng):
    """The W4A8 error budget split: FP8 activations alone, and with the folded weights (the documented
    numbers in docs/perf.md come from the GPU; this pins their order)."""
    seed, g = rng
    k, n, rows = 1024, 256, 64
    x = torch.randn(1, rows, k, generator=g, dtype=torch.float64)
    w, s, gs = nvfp4_weights(1, n, k, g)
    exact = x[0] @ dequantized(w, s, gs)[0].T
    a, a_scale = fp8_rows(x)
    counts, offsets = torch.tensor([rows], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    w4a8 = w4a8_reference(a, a_scale, w, s, gs, counts, offsets, None)
    fp8_only = (a.double() * a_scale[..., None].double())[0] @ dequantized(w, s, gs)[0].T
    assert rel_err(fp8_only, exact) < 0.04, seed
    assert rel_err(w4a8, exact) < 0.06, seed
    assert rel_err(w4a8, exact) > rel_err(fp8_only, exact), seed


def test_bad_input():
    k, n = 64, 64
    w = torch.zeros(2, n, k // 2, dtype=torch.uint8)
    s = torch.ones(2, n, k // 16).to(FP8)
    gs = torch.ones(2)
    wp = fm.pack_nvfp4_weights(w, w4a8=True)
    a = torch.zeros(2, 3, k).to(FP8)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="a_scale is required"):
        fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts)
    with pytest.raises(ValueError, match="a_scale must have shape"):
        fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts, a_scale=torch.ones(6))
    with pytest.raises(TypeError, match="a_scale"):
        fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts, a_scale=torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="w4a8=True"):
        fm.grouped_gemm_nvfp4_masked(a, fm.pack_nvfp4_weights(w), s, gs, counts, a_scale=torch.ones(1))
    with pytest.raises(ValueError, match="w4a8=True"):
        fm.grouped_gemm_nvfp4_masked(a, w, s, gs, counts, a_scale=torch.ones(1))
    with pytest.raises(ValueError, match="W4A8 words"):
        fm.grouped_gemm_nvfp4_masked(a.float().bfloat16(), wp, s, gs, counts)
    with pytest.raises(ValueError, match="a_scale is for float8_e4m3fn"):
        fm.grouped_gemm_nvfp4_masked(
            a.float().bfloat16(), fm.pack_nvfp4_weights(w), s, gs, counts, a_scale=torch.ones(1)
        )
    with pytest.raises(ValueError, match="w_block_scale must be non-negative"):
        neg = torch.ones(2, n, k // 16).neg().to(FP8)
        fm.grouped_gemm_nvfp4_masked(a, wp, neg, gs, counts, a_scale=torch.ones(1))
    with pytest.raises(ValueError, match="K a multiple of 64"):
        fm.pack_nvfp4_weights(torch.zeros(1, 4, 16, dtype=torch.uint8), w4a8=True)
    with pytest.raises(TypeError, match="w4a8 must be a bool"):
        fm.pack_nvfp4_weights(w, w4a8=1)
