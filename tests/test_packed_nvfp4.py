"""K-permuted NVFP4 weights (``pack_nvfp4_weights``): the permutation itself, the in-place repacking, the
public GEMMs and fused_moe on the CPU path, the Triton kernel in Triton's interpreter, and bad input."""

import pytest
import torch
from checks import assert_error_names_argument
from gemm_cases import contiguous_layout, owned_rows, rel_err
from nvfp4_cases import FP8, dequantized, launch_kernel, nvfp4_weights

import flashinfer_moe as fm
from flashinfer_moe import reference as ref
from flashinfer_moe import reference_quant as rq
from flashinfer_moe.moe import packed_nvfp4


def test_permutation_gives_each_wgmma_thread_its_bytes_together():
    """Stored byte 8 q + 2 c + h of a 32-byte span is plain byte 8 c + 4 h + q: thread q's bytes q and q + 4
    of each of the four 16-element groups, in group order."""
    plain = torch.arange(64, dtype=torch.uint8).view(1, 1, 64)
    stored = fm.pack_nvfp4_weights(plain, split_bits=False).data.view(2, 4, 4, 2)  # [span, q, c, h]
    for span in range(2):
        for q in range(4):
            for c in range(4):
                for h in range(2):
                    assert stored[span, q, c, h] == 32 * span + 8 * c + 4 * h + q


def _pairs(words: torch.Tensor) -> list[torch.Tensor]:
    """The four bf16 pairs the GPU kernels make of split-bits words (int64 holding 32 bits), as written in
    ``moe.packed_nvfp4``'s docstring: an independent copy of the kernels' shifts and masks."""

    def rotl(y, r):
        return ((y << r) | (y >> (32 - r))) & 0xFFFFFFFF

    m = packed_nvfp4.PAIR_MASK
    p3 = ((words << 6) & 0x80C080C0) | (rotl(words, 14) & 0x01000100)
    return [words & m, (words << 4) & m, rotl(words, 10) & m, p3]


def _words(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.int32).reshape(-1).to(torch.int64) & 0xFFFFFFFF


def test_split_bits_pairs_are_the_k_permuted_codes():
    """Each byte value in each of the four positions of a word (the other bytes random): pair j of the split
    word holds byte j's codes, its low nibble's sign at bit 15 and magnitude at bits 8..6, its high nibble's at
    bits 31 and 24..22, and nothing else."""
    g = torch.Generator().manual_seed(0)
    kp = torch.randint(0, 256, (4, 256, 32), dtype=torch.uint8, generator=g)
    for j in range(4):
        kp.view(4, 256, 8, 4)[j, :, :, j] = torch.arange(256, dtype=torch.uint8)[:, None]
    split = packed_nvfp4._split_bits(kp, forward=True)
    bytes_ = kp.reshape(-1, 4).to(torch.int64)
    for j, pair in enumerate(_pairs(_words(split))):
        b = bytes_[:, j]
        want = ((b & 7) << 6) | ((b & 8) << 12) | ((b & 0x70) << 18) | ((b & 0x80) << 24)
        assert torch.equal(pair, want), j
    assert torch.equal(packed_nvfp4._split_bits(split, forward=False), kp)


def test_split_bits_expansion_is_exact_for_every_code_and_scale():
    """The GPU arithmetic, emulated: each half of a pair read as a bf16 (code 1 a subnormal), times the block
    scale times 2**118 rounded to bf16, rounded to bf16, is the weight times 2**-8 bit for bit, for every E2M1
    code under every finite E4M3 scale."""
    codes = torch.arange(16, dtype=torch.int64)
    pairs = ((codes & 7) << 6) | ((codes & 8) << 12)  # the low half's bits
    as_bf16 = (pairs.to(torch.int32) << 16).view(torch.float32)  # exact: a bf16 is the high half of an fp32
    scales = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # every finite non-negative E4M3
    factor = (scales * packed_nvfp4.SPLIT_BITS_SCALE).bfloat16().float()
    assert torch.equal(factor, scales * packed_nvfp4.SPLIT_BITS_SCALE), "2**118 times a scale must be a bf16"
    got = (as_bf16[:, None] * factor[None, :]).bfloat16().double()
    e2m1 = rq.dequantize_nvfp4(rq.pack_nibbles(codes.to(torch.uint8)[None]), torch.ones(1, 1).to(FP8), 1.0)[0]
    want = e2m1.double()[:, None] * scales.double()[None, :] / packed_nvfp4.SPLIT_BITS_UNSCALE
    assert torch.equal(got, want)


@pytest.mark.parametrize("split_bits", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 5, 96), (2, 7, 448)])
def test_pack_unpack_round_trip(rng, shape, split_bits):
    seed, g = rng
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    packed = fm.pack_nvfp4_weights(w, split_bits=split_bits)
    assert packed.shape == shape and packed.dtype == torch.uint8 and packed.split_bits == split_bits
    assert packed.layout == (packed_nvfp4.SPLIT_BITS if split_bits else packed_nvfp4.KPERM)
    assert torch.equal(packed.unpack(), w), seed
    if split_bits:  # the bytes of split bits are the K-permuted bytes' bits moved within each word
        kperm = fm.pack_nvfp4_weights(w, split_bits=False).data
        assert torch.equal(packed_nvfp4._split_bits(kperm, forward=True), packed.data), seed
        assert "split_bits=True" in repr(packed)


def test_split_bits_in_steps(monkeypatch):
    """A tensor of more words than one conversion step is converted in steps, the same as in one, also over its
    own memory."""
    w = torch.randint(0, 256, (3, 4, 64), dtype=torch.uint8)
    whole = packed_nvfp4._split_bits(w, forward=True)
    monkeypatch.setattr(packed_nvfp4, "_WORDS_PER_STEP", 5)
    assert torch.equal(packed_nvfp4._split_bits(w, forward=True), whole)
    assert torch.equal(packed_nvfp4._split_bits(whole, forward=False), w)
    inplace = w.clone()
    assert packed_nvfp4._split_bits(inplace, forward=True, in_place=True).data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace, whole)


@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 5, 96), (2, 7, 448)])
def test_pack_unpack_and_in_place_round_trip(rng, shape):
    seed, g = rng
    w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    assert fm.pack_nvfp4_weights(w).split_bits, "split bits are the default"
    packed = fm.pack_nvfp4_weights(w, split_bits=False)
    assert packed.shape == shape and packed.dtype == torch.uint8
    assert not torch.equal(packed.data, w) or shape[2] == 1, seed
    assert torch.equal(packed.unpack(), w), seed
    inplace = w.clone()
    packed_nvfp4.repack_nvfp4_in_place(inplace, pack=True, chunk_experts=2)
    assert torch.equal(inplace, packed.data), seed
    packed_nvfp4.repack_nvfp4_in_place(inplace, pack=False, chunk_experts=1)
    assert torch.equal(inplace, w), seed


def test_in_place_failure_restores_the_experts_done(monkeypatch):
    w = torch.randint(0, 256, (5, 3, 32), dtype=torch.uint8)
    before = w.clone()
    real, calls = packed_nvfp4._permute, []

    def failing(x, pack):
        calls.append(pack)
        if len(calls) == 3:
            raise MemoryError("out of memory (simulated)")
        return real(x, pack)

    monkeypatch.setattr(packed_nvfp4, "_permute", failing)
    with pytest.raises(MemoryError):
        packed_nvfp4.repack_nvfp4_in_place(w, pack=True, chunk_experts=2)
    assert torch.equal(w, before)


@pytest.mark.parametrize(
    "w, exc, name",
    [
        (torch.zeros(2, 4, 48, dtype=torch.uint8), ValueError, "w"),  # K = 96, not a multiple of 64
        (torch.zeros(2, 4, 32, dtype=torch.int8), TypeError, "w"),
        (torch.zeros(4, 32, dtype=torch.uint8), ValueError, "w"),
        (torch.zeros(0, 4, 32, dtype=torch.uint8), ValueError, "w"),
        (fm.pack_nvfp4_weights(torch.zeros(1, 1, 32, dtype=torch.uint8)), TypeError, "w"),
    ],
)
def test_pack_bad_input_names_the_argument(w, exc, name):
    assert_error_names_argument(lambda: fm.pack_nvfp4_weights(w), exc, name)


def test_pack_split_bits_must_be_a_bool():
    w = torch.zeros(1, 1, 32, dtype=torch.uint8)
    assert_error_names_argument(lambda: fm.pack_nvfp4_weights(w, split_bits=1), TypeError, "split_bits")


# ------------------------------------------------------------------------------ public API, CPU path


@pytest.mark.parametrize("split_bits", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gemms_take_packed_weights(rng, activation, split_bits):
    seed, g = rng
    n, k = 96, 192
    layout = contiguous_layout([3, 0, 6], 4, "cpu")
    a = torch.randn(layout.num_rows, k, generator=g).bfloat16()
    w, s, gs = nvfp4_weights(3, n, k, g, gated=activation is not None)
    plain = fm.grouped_gemm_nvfp4_contiguous(a, w, s, gs, layout, activation=activation, out_dtype=torch.float32)
    wp = fm.pack_nvfp4_weights(w, split_bits=split_bits)
    packed = fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, activation=activation, out_dtype=torch.float32)
    owned = owned_rows(layout.tokens_per_expert, layout.expert_offsets, layout.num_rows)
    assert torch.equal(packed[owned], plain[owned]), seed
    am = torch.randn(3, 5, k, generator=g).bfloat16()
    counts = torch.tensor([5, 1, 0], dtype=torch.int32)
    want = fm.grouped_gemm_nvfp4_masked(am, w, s, gs, counts, activation=activation, out_dtype=torch.float32)
    got = fm.grouped_gemm_nvfp4_masked(am, wp, s, gs, counts, activation=activation, out_dtype=torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :1], want[1, :1]), seed


@pytest.mark.parametrize("split_bits", [False, True])
def test_fused_moe_takes_packed_weights(rng, split_bits):
    seed, g = rng
    num_experts, top_k, h, inter = 5, 2, 128, 64
    x = torch.randn(9, h, generator=g).bfloat16()
    w13, s13, g13 = nvfp4_weights(num_experts, 2 * inter, h, g, gated=True)
    w2, s2, g2 = nvfp4_weights(num_experts, h, inter, g)
    weights, ids = fm.route(torch.randn(9, num_experts, generator=g), top_k)
    kw = dict(quant="nvfp4", w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)
    w13p, w2p = (fm.pack_nvfp4_weights(w, split_bits=split_bits) for w in (w13, w2))
    got = fm.fused_moe(x, w13p, w2p, weights, ids, **kw)
    want = ref.fused_moe(x, dequantized(w13, s13, g13), dequantized(w2, s2, g2), weights, ids)
    assert rel_err(got, want) < 2e-2, seed
    assert torch.equal(got, fm.fused_moe(x, w13, w2, weights, ids, **kw)), seed


def test_packed_weights_with_k_not_a_multiple_of_64_are_refused(generator):
    layout = contiguous_layout([2], 1, "cpu")
    a = torch.randn(layout.num_rows, 96, generator=generator).bfloat16()
    w, s, gs = nvfp4_weights(1, 32, 96, generator)
    fake = fm.PackedNvfp4Weights(w)  # as a checkpoint could hand over, bypassing pack_nvfp4_weights's check
    assert_error_names_argument(lambda: fm.grouped_gemm_nvfp4_contiguous(a, fake, s, gs, layout), ValueError, "w")


# ------------------------------------------------------------------------- the kernel, interpreted


@pytest.mark.parametrize("split_bits", [False, True])
def test_kernel_expands_permuted_codes_exactly(nvfp4_kernel, rng, split_bits):
    """a = I on K-permuted weights (with split bits): every code under random E4M3 scales, bit for bit with the
    reference."""
    seed, g = rng
    n, k = 16, 128
    codes = torch.randint(0, 16, (1, n, k), dtype=torch.uint8, generator=g)
    codes[0, 0, :16] = torch.arange(16, dtype=torch.uint8)
    w = rq.pack_nibbles(codes)
    s = torch.randint(0, 0x7F, (1, n, k // 16), dtype=torch.uint8, generator=g).view(FP8)
    eye = torch.eye(k, dtype=torch.float16)
    out = torch.full((k, n), float("nan"))
    counts, offsets = torch.tensor([k], dtype=torch.int32), torch.tensor([0, k], dtype=torch.int32)
    packed = fm.pack_nvfp4_weights(w, split_bits=split_bits).data
    launch_kernel(
        nvfp4_kernel,
        eye,
        packed,
        s,
        torch.ones(1),
        out,
        counts,
        offsets,
        0,
        2**31 - 1,
        BLOCK_M=32,
        BLOCK_N=16,
        kperm=True,
        split_bits=split_bits,
    )
    assert torch.equal(out.t(), rq.dequantize_nvfp4(w, s, 1.0)[0]), seed


@pytest.mark.parametrize("split_bits", [False, True])
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("k, block_k", [(192, 128), (128, 64)])  # 192: a last step of one span and zeros
def test_kernel_permuted_interpreted(rng, nvfp4_kernel, act, swap, k, block_k, split_bits):
    seed, g = rng
    n = 96
    counts = torch.tensor([5, 0, 11], dtype=torch.int32)
    offsets = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    a = torch.randn(24, k, generator=g).half()
    w, s, gs = nvfp4_weights(3, n, k, g, gated=act != 0)
    out = torch.full((24, n // 2 if act else n), float("nan"))
    packed = fm.pack_nvfp4_weights(w, split_bits=split_bits).data
    launch_kernel(
        nvfp4_kernel,
        a,
        packed,
        s,
        gs,
        out,
        counts,
        offsets,
        act,
        2**31 - 1,
        SWAP_AB=swap,
        BLOCK_K=block_k,
        kperm=True,
        split_bits=split_bits,
    )
    want = ref.grouped_gemm(a, dequantized(w, s, gs), counts, offsets, activation_kind=[None, "silu"][act])
    owned = owned_rows(counts, offsets, 24)
    assert rel_err(out[owned], want[owned]) < 1e-5, seed
    assert out[~owned].isnan().all()
