"""Packed FP8 block-scaled weights on a GPU: our Hopper kernels give bit for bit what they give from the plain
weights (the same bytes reach shared memory, through a bulk copy instead of the tensor TMA), and the public
GEMMs and fused_moe agree with the float64 reference, on Hopper and on the unpacking fallback."""

import pytest
import torch
from gemm_cases import FP8, contiguous_layout, make_activations, make_weights, owned_rows, reference, rel_err

import flashinfer_moe as fm
from flashinfer_moe import reference as ref
from flashinfer_moe.moe.gemm_sm90 import PACKED_CONFIGS

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _poisoned(shape, dtype):
    if dtype == FP8:
        return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV).view(FP8)  # NaN in e4m3fn
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _raw(t):
    """``t``'s bits (the NaN poison compares equal to itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("our wgmma kernels are built for sm_90 only")
    from flashinfer_moe.moe import gemm_sm90

    return gemm_sm90


def _problem(g, masked, k, n):
    """``(a, a_scale, groups for launch, rows)``; contiguous with more tiles than SMs."""
    if masked:
        num_experts, capacity = 5, 131
        counts = torch.tensor([131, 0, 1, 500, 70], dtype=torch.int32, device=DEV)  # 500 > C: clamped
        a, a_scale = make_activations("fp8_block", (num_experts * capacity,), k, g, DEV)
        return a, a_scale, (counts, None, capacity), num_experts
    layout = contiguous_layout([0, 1, 127, 300, 64, 700, 129, 1000, 3], 128, DEV)
    a, a_scale = make_activations("fp8_block", (layout.num_rows,), k, g, DEV)
    return a, a_scale, (layout.tokens_per_expert, layout.expert_offsets, None), 9


@pytest.mark.parametrize("config", PACKED_CONFIGS)
@pytest.mark.parametrize("act", [None, "silu", "clamped_silu"])
@pytest.mark.parametrize("k", [128, 640])
@pytest.mark.parametrize("masked", [False, True])
def test_wgmma_packed_weights_bit_identical(rng, config, act, k, masked):
    """Every output byte, rows of no expert (poisoned) included: bf16 without an activation; with one bf16 and
    e4m3 with its scales (wg128w stores those two asynchronously, from stages the loads share)."""
    gemm_sm90 = _sm90()
    seed, g = rng
    n = 768
    a, a_scale, groups, num_experts = _problem(g, masked, k, n)
    w, w_scale = make_weights("fp8_block", num_experts, n, k, g, DEV)
    packed = fm.pack_fp8_block_weights(w, gated=act is not None).data
    rows, cols = a.shape[0], n // 2 if act else n
    order = gemm_sm90.DEFAULT_ORDERS[config]
    first = {}
    for dtype, scaled in [(torch.bfloat16, False)] + ([(FP8, True)] if act else []):
        results = []
        for weights, is_packed in ((w, False), (packed, True)):
            out = _poisoned((rows, cols), dtype)
            scale = torch.full((rows, cols // 128), float("nan"), device=DEV) if scaled else None
            kw = dict(activation=act, out_scale=scale, packed=is_packed)
            gemm_sm90.launch(a, a_scale, weights, w_scale, out, *groups, config, *order, **kw)
            results.append((out.cpu(), None if scale is None else scale.cpu()))
        (plain, plain_s), (got, got_s) = results
        assert torch.equal(_raw(got), _raw(plain)), (seed, dtype)
        if scaled:
            assert torch.equal(_raw(got_s), _raw(plain_s)), seed
        first.setdefault("bf16", plain)
    # The plain result is right, so that the equality means something.
    counts, offsets = groups[0].cpu(), groups[1]
    if offsets is None:
        counts = counts.clamp(max=groups[2])
        offsets = torch.arange(num_experts, dtype=torch.int32, device=DEV) * groups[2]
    owned = owned_rows(counts, offsets.cpu(), rows)
    want = reference(a, a_scale, w, w_scale, counts, offsets.cpu(), act).cpu()
    assert rel_err(first["bf16"][owned], want[owned]) < 2e-2, seed


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_public_gemms_take_packed_weights(rng, monkeypatch, masked, act, backend):
    """Against the float64 reference; ``triton`` makes the Hopper kernels decline, so the packed weights are
    unpacked per call (the path every other GPU takes). Masked: replayed in a CUDA graph with new counts."""
    seed, g = rng
    monkeypatch.setenv("FLASHINFER_MOE_GEMM_BACKEND", backend)
    num_experts, n, k = 6, 512, 384
    w, w_scale = make_weights("fp8_block", num_experts, n, k, g, DEV)
    packed = fm.pack_fp8_block_weights(w, gated=act is not None)
    if not masked:
        layout = contiguous_layout([3, 0, 200, 1, 64, 129], 1, DEV)
        a, a_scale = make_activations("fp8_block", (layout.num_rows,), k, g, DEV)
        got = fm.grouped_gemm_fp8_block_contiguous(a, a_scale, packed, w_scale, layout, activation=act)
        want = reference(a, a_scale, w, w_scale, layout.tokens_per_expert, layout.expert_offsets, act)
        assert rel_err(got, want) < 2e-2, seed
        return
    capacity = 40
    a, a_scale = make_activations("fp8_block", (num_experts, capacity), k, g, DEV)
    counts = torch.tensor([40, 0, 3, 17, 1, 39], dtype=torch.int32, device=DEV)
    out = torch.zeros(num_experts, capacity, n // 2 if act else n, dtype=torch.bfloat16, device=DEV)
    fm.grouped_gemm_fp8_block_masked(a, a_scale, packed, w_scale, counts, activation=act, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.grouped_gemm_fp8_block_masked(a, a_scale, packed, w_scale, counts, activation=act, out=out)
    for new in ([1, 40, 0, 5, 33, 2], [0, 0, 40, 40, 7, 1]):
        counts.copy_(torch.tensor(new, dtype=torch.int32))
        out.zero_()
        graph.replay()
        offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
        flat = a.view(-1, k), a_scale.view(-1, k // 128)
        want = reference(*flat, w, w_scale, counts.cpu(), offsets, act)
        owned = owned_rows(counts.cpu(), offsets, num_experts * capacity)
        got = out.view(num_experts * capacity, -1).cpu()
        assert rel_err(got[owned], want.cpu()[owned]) < 2e-2, (seed, new)
        assert (got[~owned] == 0).all(), "slots past the counts must not be written"


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_fused_moe_with_packed_weights(rng, num_tokens):
    seed, g = rng
    num_experts, top_k, h, inter = 16, 4, 1024, 384
    x = torch.randn(num_tokens, h, generator=g).bfloat16().to(DEV)
    w13, s13 = make_weights("fp8_block", num_experts, 2 * inter, h, g, DEV)
    w2, s2 = make_weights("fp8_block", num_experts, h, inter, g, DEV)
    weights, ids = fm.route(torch.randn(num_tokens, num_experts, generator=g).to(DEV), top_k)
    kw = dict(quant="fp8_block", w13_scale=s13, w2_scale=s2)
    p13, p2 = fm.pack_fp8_block_weights(w13, gated=True), fm.pack_fp8_block_weights(w2)
    got = fm.fused_moe(x, p13, p2, weights, ids, **kw)
    want = ref.fused_moe(x, w13, w2, weights, ids, **kw)
    assert rel_err(got, want) < 3e-2, seed  # the bound of test_gemm_gpu.test_fused_moe, same reason
