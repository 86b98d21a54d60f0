"""NVFP4-weight grouped GEMMs (W4A16) and fused_moe(quant="nvfp4") on the CPU tier: the public wrappers (CPU
path), the Triton kernel in Triton's interpreter, and bad input."""

import pytest
import torch
from checks import assert_error_names_argument
from gemm_cases import contiguous_layout, owned_rows, rel_err
from nvfp4_cases import FP8, dequantized, launch_kernel, nvfp4_weights

import flashinfer_moe as fm
from flashinfer_moe import reference as ref
from flashinfer_moe import reference_quant as rq

ACTS = [None, "silu", "clamped_silu"]
# (activation dtype, tolerance of the public CPU path against float64: the output is rounded once)
DTYPES = [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)]


def _reference(a, w, s, gs, counts, offsets, activation):
    return ref.grouped_gemm(
        a.reshape(-1, a.shape[-1]), dequantized(w, s, gs), counts.cpu(), offsets.cpu(), activation_kind=activation
    )


# ------------------------------------------------------------------------------ public API, CPU path


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("counts", [[3, 0, 1, 127], [1]])
def test_contiguous_cpu_matches_reference(rng, dtype, tol, activation, counts):
    seed, g = rng
    n, k = 192, 96
    layout = contiguous_layout(counts, 8, "cpu")
    a = torch.randn(layout.num_rows, k, generator=g).to(dtype)
    w, s, gs = nvfp4_weights(len(counts), n, k, g, gated=activation is not None)
    out = torch.full((layout.num_rows, n // 2 if activation else n), float("nan"), dtype=dtype)
    got = fm.grouped_gemm_nvfp4_contiguous(a, w, s, gs, layout, activation=activation, out=out)
    assert got is out
    owned = owned_rows(layout.tokens_per_expert, layout.expert_offsets, layout.num_rows)
    want = _reference(a, w, s, gs, layout.tokens_per_expert, layout.expert_offsets, activation)
    assert rel_err(got[owned], want[owned]) < tol, seed
    assert got[~owned].isnan().all(), "rows no expert owns must not be written"


@pytest.mark.parametrize("activation", [None, "silu"])
def test_masked_cpu_matches_reference_and_clamps_counts(rng, activation):
    seed, g = rng
    num_experts, capacity, n, k = 3, 5, 64, 160
    a = torch.randn(num_experts, capacity, k, generator=g).bfloat16()
    w, s, gs = nvfp4_weights(num_experts, n, k, g, gated=activation is not None)
    counts = torch.tensor([2, 0, 9], dtype=torch.int32)  # 9 > C: only C rows are computed
    out_n = n // 2 if activation else n
    out = torch.full((num_experts, capacity, out_n), float("nan"))
    got = fm.grouped_gemm_nvfp4_masked(a, w, s, gs, counts, activation=activation, out_dtype=torch.float32, out=out)
    assert got is out
    clamped = counts.clamp(max=capacity)
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = _reference(a, w, s, gs, clamped, offsets, activation).view(num_experts, capacity, out_n)
    for e, c in enumerate(clamped.tolist()):
        assert rel_err(got[e, :c], want[e, :c]) < 1e-5 if c else True, seed
        assert got[e, c:].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_cpu_matches_reference(rng, num_tokens, dtype):
    seed, g = rng
    num_experts, top_k, h, inter = 6, 3, 128, 96
    x = torch.randn(num_tokens, h, generator=g).to(dtype)
    w13, s13, g13 = nvfp4_weights(num_experts, 2 * inter, h, g, gated=True)
    w2, s2, g2 = nvfp4_weights(num_experts, h, inter, g)
    weights, ids = fm.route(torch.randn(num_tokens, num_experts, generator=g), top_k)
    ids[0, -1] = -1  # a skipped slot
    kw = dict(quant="nvfp4", w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)
    got = fm.fused_moe(x, w13, w2, weights, ids, routed_scaling_factor=1.5, **kw)
    # The float64 model of the same weights; the kernels round GEMM1's output to bf16, hence the tolerance.
    want = ref.fused_moe(
        x.bfloat16(), dequantized(w13, s13, g13), dequantized(w2, s2, g2), weights, ids, routed_scaling_factor=1.5
    )
    assert got.shape == (num_tokens, h) and got.dtype == dtype
    assert rel_err(got, want) < 2e-2, seed


# ------------------------------------------------------------------------- the kernel, interpreted


def test_kernel_expands_every_code_exactly(nvfp4_kernel, rng):
    """a = I: the output is the expanded weights themselves, every E2M1 code under E4M3 scales from the
    subnormal 2**-9 to 448, compared bit for bit with the reference dequantization."""
    seed, g = rng
    n, k = 48, 64
    codes = torch.randint(0, 16, (1, n, k), dtype=torch.uint8, generator=g)
    codes[0, 0, :16] = torch.arange(16, dtype=torch.uint8)
    w = rq.pack_nibbles(codes)
    scale_bits = torch.randint(0, 0x7F, (1, n, k // 16), dtype=torch.uint8, generator=g)  # no NaN (0x7F)
    scale_bits[0, :4, 0] = torch.tensor([1, 0x08, 0x7E, 0])  # smallest subnormal, smallest normal, 448, zero
    s = scale_bits.view(FP8)
    eye = torch.eye(k, dtype=torch.float16)
    out = torch.full((k, n), float("nan"))
    counts, offsets = torch.tensor([k], dtype=torch.int32), torch.tensor([0, k], dtype=torch.int32)
    launch_kernel(nvfp4_kernel, eye, w, s, torch.ones(1), out, counts, offsets, 0, 2**31 - 1, BLOCK_M=32, BLOCK_N=16)
    want = rq.dequantize_nvfp4(w, s, 1.0)[0]  # [N, K]
    assert torch.equal(out.t(), want), seed


@pytest.mark.parametrize("act", [0, 1, 2])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("n, k", [(96, 160), (64, 128)])  # N not a multiple of BLOCK_N; K not of BLOCK_K
def test_kernel_contiguous_interpreted(rng, nvfp4_kernel, act, swap, n, k):
    seed, g = rng
    counts = torch.tensor([5, 0, 17, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 8, 8, 32, 40], dtype=torch.int32)  # padded starts, as block_rows=8 makes them
    a = torch.randn(40, k, generator=g).half()  # fp16: the interpreter's bf16 dot reads raw bits (test_gemm.py)
    w, s, gs = nvfp4_weights(4, n, k, g, gated=act != 0)
    out = torch.full((40, n // 2 if act else n), float("nan"))
    launch_kernel(nvfp4_kernel, a, w, s, gs, out, counts, offsets, act, 2**31 - 1, SWAP_AB=swap)
    want = _reference(a, w, s, gs, counts, offsets, ACTS[act])
    owned = owned_rows(counts, offsets, 40)
    assert rel_err(out[owned], want[owned]) < 1e-5, seed
    assert out[~owned].isnan().all()


@pytest.mark.parametrize("act", [0, 1])
def test_kernel_masked_interpreted(rng, nvfp4_kernel, act):
    seed, g = rng
    num_experts, capacity, n, k = 3, 19, 64, 96
    a = torch.randn(num_experts * capacity, k, generator=g).half()
    w, s, gs = nvfp4_weights(num_experts, n, k, g, gated=act != 0)
    counts = torch.tensor([19, 0, 30], dtype=torch.int32)  # 30 > C: clamped
    out = torch.full((num_experts * capacity, n // 2 if act else n), float("nan"), dtype=torch.float16)
    launch_kernel(nvfp4_kernel, a, w, s, gs, out, counts, None, act, capacity, BLOCK_K=32)
    clamped = counts.clamp(max=capacity)
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = _reference(a, w, s, gs, clamped, offsets, ACTS[act])
    owned = owned_rows(clamped, offsets, num_experts * capacity)
    assert rel_err(out[owned], want[owned]) < 2e-3, seed
    assert out[~owned].isnan().all()


# ------------------------------------------------------------------------------------------ bad input


def _good(g, gated=False):
    layout = contiguous_layout([3, 2], 1, "cpu")
    a = torch.randn(layout.num_rows, 64, generator=g).bfloat16()
    w, s, gs = nvfp4_weights(2, 32, 64, g, gated=gated)
    return a, w, s, gs, layout


@pytest.mark.parametrize(
    "change, exc, name",
    [
        (lambda a, w, s, gs: (a, w, s.float(), gs), TypeError, "w_block_scale"),
        (lambda a, w, s, gs: (a, w, s[:, :, :2], gs), ValueError, "w_block_scale"),
        (lambda a, w, s, gs: (a, w, s[:, :16], gs), ValueError, "w_block_scale"),
        (lambda a, w, s, gs: (a, w, s, gs.double()), TypeError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, gs[:1]), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, gs[:, None].expand(-1, 2).contiguous()), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, torch.tensor([1.0, 0.0])), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, torch.tensor([-1.0, 1.0])), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, torch.tensor([1.0, float("inf")])), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w, s, torch.tensor([float("nan"), 1.0])), ValueError, "w_global_scale"),
        (lambda a, w, s, gs: (a, w[:, :, :16], s, gs), ValueError, "w"),
        (lambda a, w, s, gs: (a, w.view(torch.int8), s, gs), TypeError, "w"),
        (lambda a, w, s, gs: (a, w[0], s, gs), ValueError, "w"),
        (lambda a, w, s, gs: (a[:, :48], w[:, :, :24], s[:, :, :3], gs), ValueError, "a"),
        (lambda a, w, s, gs: (a.float(), w, s, gs), TypeError, "a"),
        (lambda a, w, s, gs: (a, w, s, [1.0, 1.0]), TypeError, "w_global_scale"),
    ],
    ids=[
        "scale-dtype",
        "scale-short-k",
        "scale-short-n",
        "global-dtype",
        "global-shape",
        "global-per-half-without-activation",
        "global-zero",
        "global-negative",
        "global-inf",
        "global-nan",
        "packed-short",
        "packed-dtype",
        "packed-2d",
        "k-not-multiple-of-32",
        "a-dtype",
        "global-not-a-tensor",
    ],
)
def test_bad_input_names_the_argument(generator, change, exc, name):
    a, w, s, gs, layout = _good(generator)
    a, w, s, gs = change(a, w, s, gs)
    assert_error_names_argument(lambda: fm.grouped_gemm_nvfp4_contiguous(a, w, s, gs, layout), exc, name)


def test_bad_masked_and_activation_input_names_the_argument(generator):
    a, w, s, gs, _ = _good(generator, gated=True)
    am = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    counts = torch.tensor([1, 2], dtype=torch.int32)
    gemm = fm.grouped_gemm_nvfp4_masked
    assert_error_names_argument(lambda: gemm(am, w, s, gs[:, 0], counts.long()), TypeError, "tokens_per_expert")
    assert_error_names_argument(lambda: gemm(am, w, s, gs[:, 0], counts, activation="gelu"), ValueError, "activation")
    assert_error_names_argument(lambda: gemm(a, w, s, gs, counts, activation="silu"), ValueError, "a")
    bad = torch.tensor([[1.0, 1.0], [1.0, -2.0]])
    assert_error_names_argument(lambda: gemm(am, w, s, bad, counts, activation="silu"), ValueError, "w_global_scale")
    out = torch.empty(2, 4, 32, dtype=torch.bfloat16)  # N, not N / 2
    assert_error_names_argument(lambda: gemm(am, w, s, gs, counts, activation="silu", out=out), ValueError, "out")


def test_fused_moe_bad_nvfp4_input_names_the_argument(generator):
    g = generator
    x = torch.randn(3, 64, generator=g).bfloat16()
    w13, s13, g13 = nvfp4_weights(4, 64, 64, g, gated=True)
    w2, s2, g2 = nvfp4_weights(4, 64, 32, g)
    weights, ids = fm.route(torch.randn(3, 4, generator=g), 2)
    kw = dict(quant="nvfp4", w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)

    def call(**changes):
        return lambda: fm.fused_moe(x, changes.pop("w13", w13), changes.pop("w2", w2), weights, ids, **(kw | changes))

    assert_error_names_argument(call(w13_global_scale=None), TypeError, "w13_global_scale")
    assert_error_names_argument(call(w2_scale=s2.float()), TypeError, "w2_scale")
    assert_error_names_argument(call(w2=w2[:, :32], w2_scale=s2[:, :32]), ValueError, "w2")
    assert_error_names_argument(call(w2_global_scale=-g2), ValueError, "w2_global_scale")
    assert_error_names_argument(call(w13=w13[:, :48], w13_scale=s13[:, :48]), ValueError, "w13")
    w13_fp8, w13_s = fm.quantize_fp8_block_weights(torch.randn(4, 64, 128))
    plain = dict(quant="fp8_block", w13_scale=w13_s, w2_scale=w13_s, w2_global_scale=g2)
    assert_error_names_argument(
        lambda: fm.fused_moe(x, w13_fp8, w13_fp8, weights, ids, **plain), ValueError, "w2_global_scale"
    )


def test_masked_on_meta_tensors_gives_meta_output(generator):
    w, s, gs = nvfp4_weights(2, 64, 64, generator, gated=True)
    meta = [t.to("meta") for t in (w, s, gs)]
    a = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="meta")
    counts = torch.empty(2, dtype=torch.int32, device="meta")
    out = fm.grouped_gemm_nvfp4_masked(a, *meta, counts, activation="silu")
    assert out.device.type == "meta" and out.shape == (2, 3, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("rows", "experts", "capacity", "tile"),
    [
        (12 * 5, 5, 12, 16),  # masked: the capacity's tile
        (100 * 5, 5, 100, 128),
        (3, 256, None, 8),  # contiguous, a mean of 1 row: doubled, still 8
        (256 * 8, 256, None, 16),  # a mean of 8 (top-8 of 256 at T = 256): doubled
        (256 * 16, 256, None, 32),  # 16: doubled
        (256 * 17, 256, None, 64),  # 17: doubled (beside the tail launch's 32)
        (256 * 32, 256, None, 64),  # 32: doubled
        (256 * 33, 256, None, 64),  # past 32: the mean's own
        (256 * 65, 256, None, 128),
        (256 * 48, 256, None, 64),
        (256 * 128, 256, None, 128),
        (8 * 4096, 8, None, 256),
    ],
)
def test_cuda_kernel_tile_for_layout(rows, experts, capacity, tile):
    """The Hopper CUDA kernel's token tile: the masked capacity's, or twice a contiguous layout's mean group up to
    CONTIGUOUS_DOUBLED_MAX_ROWS (routed groups are uneven), else its mean's."""
    from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90

    assert sm90.tile_for_layout(rows, experts, capacity) == tile


@pytest.mark.parametrize(
    ("tile", "capacity", "tails"),
    [
        (256, None, (32,)),
        (128, None, (32,)),
        (64, None, (32,)),
        (32, None, ()),
        (8, None, ()),
        (256, 600, (32, 64, 128)),
        (128, 128, (32,)),
        (64, 64, (32,)),
        (32, 32, ()),
    ],
)
def test_cuda_kernel_tail_tiles(tile, capacity, tails):
    """The tail launches beside the Hopper CUDA kernel's tile: 32 tokens beside tiles of 64 and more, 32, 64 and
    128 beside the masked layout's 256 (an expert-parallel decode fills far less than the capacity), none below 64
    (tiles of 8 and 16 cannot split)."""
    from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90

    assert sm90.tail_tiles_for(tile, capacity) == tails


@pytest.mark.parametrize(
    ("n_out", "ctas", "wide"),
    [
        # (output columns, CTAs along a column block): the masked shapes measured on an H200 (132 SMs).
        (768, 32, False),  # 192 CTAs of four warpgroups (2 waves) against 384 of two (3 shorter ones): 0.91x
        (768, 8, False),  # 48 against 96, both under a wave: 0.65x
        (768, 64, True),
        (768, 128, True),
        (1024, 32, True),  # 256 against 512: 2 waves against 4
        (1536, 8, True),  # 96 against 192: 1 wave against 2
        (1536, 32, True),
        (2048, 16, True),
        (2048, 32, True),
        (2048, 256, True),  # fused_moe of DeepSeek-V3 at 128 rows a group
    ],
)
def test_cuda_kernel_gated_128_tile_warpgroups(n_out, ctas, wide):
    """The gated 128-token tile takes four warpgroups where its grid's waves, each shorter than two of the
    two-warpgroup grid's, take no longer; two where four would leave a last wave mostly idle."""
    from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90

    assert sm90.gated_t128_wide(n_out, ctas, 132) is wide
