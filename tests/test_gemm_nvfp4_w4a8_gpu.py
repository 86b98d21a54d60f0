"""The Hopper kernel's W4A8 mode (NVFP4 weights in W4A8 words, FP8 activations; moe/gemm_nvfp4_w4a8.py) against
float64 references: the rounding model the kernel computes (weights folded to e4m3 with their block scales), at
masked capacities across every tile it takes (and the 32-token tail beside the 128-token tile), rows per expert 0,
1 and 127, the contiguous layout with padding and fewer rows than experts, per-row and per-tensor activation
scales, every activation, bf16 and fp32 output, DeepSeek-V3 and Qwen3 shapes, and every E2M1 code under every
positive finite E4M3 scale bit for bit; and its error against the exact product, which docs/perf.md documents."""

import pytest
import torch
from gemm_cases import contiguous_layout, owned_rows, rel_err
from nvfp4_cases import FP8, every_code_weights, fp8_rows, grouped_reference, nvfp4_weights, w4a8_reference

import flashinfer_moe as fm
from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90
from flashinfer_moe.moe.gemm_nvfp4_w4a8 import w4a8_weight_values

pytestmark = pytest.mark.gpu
DEV = "cuda"
# Against the rounding model: the summation order, and the FP8 wgmma's accumulation.
OUT_TOL = {torch.bfloat16: 1e-2, torch.float32: 3e-3}
# Against the exact product of the FP8 activations and the NVFP4 weights (the folded weights' E4M3 rounding).
W4A8_TOL = 0.06


@pytest.fixture(autouse=True)
def _hopper():
    """On sm_90a only."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is sm_90a")


def _activations(x, per_row):
    a, a_scale = fp8_rows(x)
    if not per_row:
        a_scale = a_scale.amax().reshape(1)
        a = (x.float() / a_scale).to(FP8)
    return a, a_scale


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, "silu", "clamped_silu"])
@pytest.mark.parametrize("capacity", [1, 5, 8, 16, 31, 64, 100, 127, 128, 300])
@pytest.mark.parametrize("k", [320, 512])
def test_masked(rng, k, capacity, act, out_dtype, per_row):
    """n = 192: the second CTA column's second warpgroup has no rows; K = 320: a partial stage; from 100 rows the
    128-token tile (300: three tiles a group, the last one's 44 rows on the 32-token tail and past it)."""
    seed, g = rng
    num_experts, n = 5, 192
    gated = act is not None
    a, a_scale = _activations(torch.randn(num_experts, capacity, k, generator=g).to(DEV), per_row)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, w4a8=True)
    given = torch.tensor([capacity, 0, 1, capacity // 2, capacity + 5], dtype=torch.int32)  # past C: clamped
    counts = given.clamp(max=capacity)
    out = torch.full((num_experts, capacity, n), float("nan"), dtype=out_dtype, device=DEV)
    act_code = {None: 0, "silu": 1, "clamped_silu": 2}[act]
    assert sm90.usable(a.view(-1, k), wp.data, out.view(-1, n), None, capacity, act_code, True, a8=True)
    fm.grouped_gemm_nvfp4_masked(
        a, wp, s, gs, given.to(DEV), a_scale=a_scale, activation=act, out_dtype=out_dtype, out=out
    )
    torch.cuda.synchronize()
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = w4a8_reference(a.cpu(), a_scale.cpu(), w.cpu(), s.cpu(), gs.cpu(), counts, offsets, act)
    want = want.view(num_experts, capacity, -1)
    af = a.cpu().double() * (a_scale.cpu().double()[..., None] if per_row else a_scale.cpu().double())
    exact = grouped_reference(af, w.cpu(), s.cpu(), gs.cpu(), counts, offsets, act).view(num_experts, capacity, -1)
    got = out.cpu()
    for e, c in enumerate(counts.tolist()):
        if c:
            assert rel_err(got[e, :c], want[e, :c]) < OUT_TOL[out_dtype], (seed, e)
        assert got[e, c:].isnan().all(), "slots past the count must keep the poison"
    # (over every row at once: a single row's error after a gated activation is too noisy to bound)
    valid = torch.arange(capacity)[None, :] < counts[:, None]
    assert rel_err(got[valid], exact[valid]) < W4A8_TOL, seed


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize(
    "counts", [[0, 1, 7, 33, 0, 2], [3], [0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 3], [200, 5, 130], [0, 300, 1, 513, 0]]
)
def test_contiguous(rng, counts, block_rows, act):
    seed, g = rng
    n, k = 256, 448
    gated = act is not None
    layout = contiguous_layout(counts, block_rows, DEV)
    a, a_scale = _activations(torch.randn(layout.num_rows, k, generator=g).to(DEV), True)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(len(counts), 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, w4a8=True)
    out = torch.full((layout.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert sm90.usable(a, wp.data, out, layout.expert_offsets, 2**31 - 1, int(gated), True, a8=True)
    fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, a_scale=a_scale, activation=act, out=out)
    torch.cuda.synchronize()
    counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    owned = owned_rows(counts_t, offsets, layout.num_rows)
    want = w4a8_reference(a.cpu(), a_scale.cpu(), w.cpu(), s.cpu(), gs.cpu(), counts_t, offsets, act)
    if owned.any():
        assert rel_err(out.cpu()[owned], want[owned]) < 1e-2, seed
    assert out.cpu()[~owned].isnan().all(), "rows no expert owns must keep the poison"


@pytest.mark.parametrize("num_experts", [4, 2, 1])
def test_every_code_and_scale_bit_exact(num_experts):
    """a = I (64, 128 or 256 rows an expert: the 64-token tile and the 128-token one, looping), per-tensor scale
    1: the output is the folded weights themselves, every E2M1 code under every positive finite E4M3 scale (zero
    and subnormals included), bit for bit the rounding model."""
    k = 256
    w, scales, n = every_code_weights(k)
    wp = fm.pack_nvfp4_weights(w.expand(num_experts, -1, -1).contiguous().to(DEV), w4a8=True)
    rows = k // num_experts
    eye = torch.eye(k, device=DEV).to(FP8).view(num_experts, rows, k)
    out = torch.full((num_experts, rows, n), float("nan"), device=DEV)
    counts = torch.full((num_experts,), rows, dtype=torch.int32, device=DEV)
    s = scales.expand(num_experts, -1, -1).contiguous().to(DEV)
    ones = torch.ones(num_experts, device=DEV)
    fm.grouped_gemm_nvfp4_masked(
        eye, wp, s, ones, counts, a_scale=torch.ones(1, device=DEV), out_dtype=torch.float32, out=out
    )
    torch.cuda.synchronize()
    want = w4a8_weight_values(w, scales)[0].T.contiguous()  # [K, n]
    assert torch.equal(out.cpu().reshape(k, n), want)


@pytest.mark.parametrize(
    "n, k, act", [(4096, 7168, "silu"), (7168, 2048, None), (1536, 2048, "silu"), (2048, 768, None)]
)
def test_model_shapes(rng, n, k, act):
    """DeepSeek-V3's GEMM1 (2 I, H) = (4096, 7168) gated and GEMM2 (H, I) = (7168, 2048), and Qwen3-30B-A3B's
    (1536, 2048) and (2048, 768), masked 64 rows."""
    seed, g = rng
    num_experts, capacity = 3, 64
    a, a_scale = _activations(torch.randn(num_experts, capacity, k, generator=g).to(DEV), True)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, n, k, g, gated=act is not None))
    counts = torch.tensor([64, 3, 41], dtype=torch.int32)
    out = fm.grouped_gemm_nvfp4_masked(
        a, fm.pack_nvfp4_weights(w, w4a8=True), s, gs, counts.to(DEV), a_scale=a_scale, activation=act
    )
    torch.cuda.synchronize()
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = w4a8_reference(a.cpu(), a_scale.cpu(), w.cpu(), s.cpu(), gs.cpu(), counts, offsets, act)
    want = want.view(num_experts, capacity, -1)
    for e, c in enumerate(counts.tolist()):
        assert rel_err(out.cpu()[e, :c], want[e, :c]) < 1e-2, (seed, e)
