"""NVFP4-weight grouped GEMMs and fused_moe(quant="nvfp4") on a GPU against float64 references on the dequantized
weights: odd row counts, every tile config, DeepSeek-V3 and Qwen3 shapes, and wgmma in the compiled kernel."""

import shutil
import subprocess

import pytest
import torch
from gemm_cases import contiguous_layout, owned_rows, rel_err
from nvfp4_cases import FP8, dequantized, grouped_reference, nvfp4_weights

import flashinfer_moe as fm
from flashinfer_moe import reference as ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
ACTS = [None, "silu", "clamped_silu"]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def random_nvfp4(num_experts, n, k, g, gated=False):
    """Random codes and scales made on the GPU (the shapes of whole models: no quantizer pass), sized so that
    a unit-size input gives a unit-size output."""
    gdev = torch.Generator(device=DEV).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    w = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, device=DEV, generator=gdev)
    s = (torch.rand(num_experts, n, k // 16, device=DEV, generator=gdev) + 0.5).to(FP8)
    gs = (torch.rand(num_experts, 2 if gated else 1, device=DEV, generator=gdev) + 0.5) / (3 * k**0.5)
    return w, s, gs if gated else gs[:, 0].contiguous()


@pytest.mark.parametrize(
    "dtype, act",
    [(torch.bfloat16, None), (torch.bfloat16, "silu"), (torch.bfloat16, "clamped_silu"), (torch.float16, "silu")],
)
@pytest.mark.parametrize(
    "counts, n, k", [([0, 1, 127, 64], 256, 384), ([1], 128, 96), ([300, 0, 0, 5, 129], 512, 1056)]
)
@pytest.mark.parametrize("block_rows", [1, 128])
def test_contiguous(rng, dtype, act, counts, n, k, block_rows):
    seed, g = rng
    layout = contiguous_layout(counts, block_rows, DEV)
    a = torch.randn(layout.num_rows, k, generator=g).to(dtype).to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(len(counts), n, k, g, gated=act is not None))
    out = torch.full((layout.num_rows, n // 2 if act else n), float("nan"), dtype=dtype, device=DEV)
    got = fm.grouped_gemm_nvfp4_contiguous(a, w, s, gs, layout, activation=act, out=out)
    torch.cuda.synchronize()
    counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    owned = owned_rows(counts_t, offsets, layout.num_rows)
    want = grouped_reference(a, w, s, gs, counts_t, offsets, act)
    if owned.any():
        assert rel_err(got.cpu()[owned], want.cpu()[owned]) < TOL[dtype], seed
    assert got.cpu()[~owned].isnan().all(), "rows no expert owns must keep the poison"


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("capacity", [1, 8, 127, 200])
def test_masked(rng, act, capacity):
    seed, g = rng
    num_experts, n, k = 6, 384, 512
    a = torch.randn(num_experts, capacity, k, generator=g).bfloat16().to(DEV)
    w, s, gs = random_nvfp4(num_experts, n, k, g, gated=act is not None)
    given = torch.tensor([capacity, 0, 1, capacity // 2, capacity + 5, 3], dtype=torch.int32)  # past C: clamped
    counts = given.clamp(max=capacity)
    out = torch.full((num_experts, capacity, n // 2 if act else n), float("nan"), dtype=torch.bfloat16, device=DEV)
    fm.grouped_gemm_nvfp4_masked(a, w, s, gs, given.to(DEV), activation=act, out=out)
    torch.cuda.synchronize()
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = grouped_reference(a, w, s, gs, counts, offsets, act).view(num_experts, capacity, -1).cpu()
    got = out.cpu()
    for e, c in enumerate(counts.tolist()):
        if c:
            assert rel_err(got[e, :c], want[e, :c]) < 1e-2, (seed, e)
        assert got[e, c:].isnan().all()


def _stored(w, wlayout):
    """``w`` as the kernel reads it in ``wlayout`` (plain, K-permuted, split bits) and the launch's flags."""
    if wlayout == "plain":
        return w, dict(kperm=False)
    split = wlayout == "split"
    return fm.pack_nvfp4_weights(w, split_bits=split).data, dict(kperm=True, split_bits=split)


@pytest.mark.parametrize("num_experts", [5, 33])
@pytest.mark.parametrize("wlayout", ["plain", "kperm", "split"])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize(
    "name", ["decode", "decode_gated", "mid64", "mid64_gated", "mid", "mid_gated", "prefill", "prefill_gated"]
)
def test_every_config(rng, name, swap, wlayout, num_experts):
    """Each tile config of the table, in both operand orders, on plain, K-permuted and split-bits weights, on a
    shape that is partial in every dimension (K-permuted weights come in whole 64-element spans). Both expert
    counts: below 32 and from 32 on the kernel compiles differently (``BLOCK_E``), which once decided whether
    ptxas serialized its wgmma."""
    from flashinfer_moe.moe import gemm_nvfp4_kernel as kernel

    seed, g = rng
    gated = name.endswith("gated")
    counts = torch.tensor([0, 1, 127, 33, 300] + [5, 0, 64] * ((num_experts - 5) // 3) + [2] * ((num_experts - 5) % 3))
    counts = counts.to(torch.int32)
    offsets = torch.cat((torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()))
    kperm = wlayout != "plain"
    rows, n, k = int(counts.sum()), 200, 320 if kperm else 224
    a = torch.randn(rows, k, generator=g).bfloat16().to(DEV)
    w, s, gs = random_nvfp4(num_experts, 2 * n if gated else n, k, g, gated=gated)
    out = torch.full((rows, n), float("nan"), device=DEV)
    table = kernel.CONFIGS_KPERM if kperm else {}
    cfg = dict(table.get(name, kernel.CONFIGS[name]), SWAP_AB=swap)
    act = 1 if gated else 0
    stored, flags = _stored(w, wlayout)
    kernel.launch(
        a,
        stored,
        s,
        gs,
        out,
        counts.to(DEV),
        offsets.to(DEV),
        act=act,
        alpha=1.702,
        limit=7.0,
        capacity=2**31 - 1,
        config=cfg,
        **flags,
    )
    torch.cuda.synchronize()
    want = grouped_reference(a, w, s, gs, counts, offsets, "silu" if gated else None)
    assert rel_err(out, want) < 5e-3, seed
    assert not out.isnan().any()


@pytest.mark.parametrize("wlayout", ["plain", "kperm", "split"])
@pytest.mark.parametrize("expand", [0, 2])  # the portable expansion and the GPU one (prmt lookup or split bits)
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("name", ["decode", "mid", "prefill"])
def test_every_code_expands_exactly(name, swap, expand, wlayout):
    """a = I: the output is the expanded weights themselves, every E2M1 code under every finite E4M3 scale
    (subnormals included), bit for bit the reference's dequantization (nothing flushed to zero; with split bits
    code 1 is a bf16 subnormal before its scale)."""
    from flashinfer_moe import reference_quant as rq
    from flashinfer_moe.moe import gemm_nvfp4_kernel as kernel

    k = 256
    n = 16 * 127  # every (code, scale) pair: 16 codes x 127 finite non-negative scales, and their signs
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16).view(1, n, k)
    scales = torch.arange(127, dtype=torch.uint8).repeat_interleave(16)[:, None].expand(n, k // 16)
    scales = scales.clone().view(FP8)[None]
    w = rq.pack_nibbles(codes)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    out = torch.full((k, n), float("nan"), device=DEV)
    counts, offsets = torch.tensor([k], dtype=torch.int32), torch.tensor([0, k], dtype=torch.int32)
    cfg = dict(kernel.CONFIGS[name], SWAP_AB=swap, EXPAND=expand)
    stored, flags = _stored(w, wlayout)
    kernel.launch(
        eye,
        stored.to(DEV),
        scales.to(DEV),
        torch.ones(1, device=DEV),
        out,
        counts.to(DEV),
        offsets.to(DEV),
        act=0,
        alpha=1.702,
        limit=7.0,
        capacity=2**31 - 1,
        config=cfg,
        **flags,
    )
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().t(), rq.dequantize_nvfp4(w, scales, 1.0)[0])


@pytest.mark.parametrize("packing", ["plain", "kperm", "split"])
@pytest.mark.parametrize(
    "num_experts, rows, n, k, act",
    [
        (8, 4096, 7168, 2048, None),
        (8, 4096, 4096, 7168, None),
        (8, 2048, 2048, 7168, "silu"),
        (32, 512, 7168, 2048, None),
    ],
)
def test_prefill_shapes(rng, num_experts, rows, n, k, act, packing):
    """The prefill tiles at the benchmark's sizes (up to 4096 rows an expert, 256-row tiles, the whole K loop),
    through the public op, on sampled rows of every expert against float64."""
    seed, g = rng
    gated = act is not None
    layout = contiguous_layout([rows] * num_experts, 1, DEV)
    a = torch.randn(layout.num_rows, k, generator=g).bfloat16().to(DEV)
    w, s, gs = random_nvfp4(num_experts, 2 * n if gated else n, k, g, gated=gated)
    stored = w if packing == "plain" else fm.pack_nvfp4_weights(w, split_bits=packing == "split")
    out = torch.full((layout.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    fm.grouped_gemm_nvfp4_contiguous(a, stored, s, gs, layout, activation=act, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), seed
    starts = layout.expert_offsets.tolist()
    for e in range(num_experts):
        picked = starts[e] + torch.cat((torch.randint(0, rows, (31,), generator=g), torch.tensor([rows - 1])))
        we = dequantized(w[e : e + 1], s[e : e + 1], gs[e : e + 1])[0]
        want = ref.activation(a[picked.to(DEV)].double() @ we.T, act)
        assert rel_err(out[picked.to(DEV)], want) < 1e-2, f"seed {seed}, expert {e}"


@pytest.mark.parametrize(
    "model, num_experts, top_k, hidden, inter",
    [
        ("deepseek_v3", 256, 8, 7168, 2048),
        ("qwen3_30b_a3b", 128, 8, 2048, 768),
        ("qwen3_235b_a22b", 128, 8, 4096, 1536),
    ],
)
@pytest.mark.parametrize("num_tokens", [1, 127])
@pytest.mark.parametrize("packed", ["plain", "kperm", "split"])
def test_fused_moe_model_shapes(rng, model, num_experts, top_k, hidden, inter, num_tokens, packed):
    seed, g = rng
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16().to(DEV)
    w13, s13, g13 = random_nvfp4(num_experts, 2 * inter, hidden, g, gated=True)
    w2, s2, g2 = random_nvfp4(num_experts, hidden, inter, g)
    weights, ids = fm.route(torch.randn(num_tokens, num_experts, generator=g).to(DEV), top_k)
    out = torch.full_like(x, float("nan"))
    kw = dict(quant="nvfp4", w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)
    if packed != "plain":  # K-permuted at load time (with split bits)
        split = packed == "split"
        w13p, w2p = fm.pack_nvfp4_weights(w13, split_bits=split), fm.pack_nvfp4_weights(w2, split_bits=split)
        fm.fused_moe(x, w13p, w2p, weights, ids, out=out, **kw)
    else:
        fm.fused_moe(x, w13, w2, weights, ids, out=out, **kw)
    # float64 model, expert by expert (only the routed ones are dequantized)
    xd, want = x.double(), torch.zeros(num_tokens, hidden, dtype=torch.float64, device=DEV)
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        w13e = dequantized(w13[e : e + 1], s13[e : e + 1], g13[e : e + 1])[0]
        w2e = dequantized(w2[e : e + 1], s2[e : e + 1], g2[e : e + 1])[0]
        h = ref.activation(xd[t] @ w13e.T, "silu")
        want.index_add_(0, t, (h @ w2e.T) * weights[t, j, None].double())
    assert not out.isnan().any()
    assert rel_err(out, want) < 2e-2, f"seed {seed} ({model}, T={num_tokens})"


def test_the_compiled_kernel_uses_wgmma():
    """On Hopper the kernels that the decode and prefill paths pick issue wgmma (HGMMA in the SASS), with the
    weights expanded in registers. Only the kernels compiled here are checked: other tests compile the
    non-swapped 16-row tile, which is mma.sync by design (wgmma's M is at least 64)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is Hopper's")
    if shutil.which("cuobjdump") is None:
        pytest.skip("cuobjdump is not on PATH")
    from flashinfer_moe.moe import gemm_nvfp4_kernel as kernel

    kernel.grouped_gemm_nvfp4_kernel.device_caches.clear()  # compile afresh: only this test's kernels
    g = torch.Generator().manual_seed(0)
    # 16 rows per expert: the decode class; 512: prefill.
    picked = set()
    for capacity, k in ((16, 1056), (512, 1056)):
        cfg = kernel.pick(4 * capacity, 4, capacity, False, k)
        assert cfg.get("SWAP_AB", True) or cfg["BLOCK_M"] >= 64, cfg
        picked.add(kernel.shape_class(4 * capacity, 4, capacity, False))
        a = torch.randn(4, capacity, k, generator=g).bfloat16().to(DEV)
        w, s, gs = random_nvfp4(4, 520, k, g)
        fm.grouped_gemm_nvfp4_masked(a, w, s, gs, torch.full((4,), capacity, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert picked == {"decode", "prefill"}
    new = [c for cache in kernel.grouped_gemm_nvfp4_kernel.device_caches.values() for c in cache[0].values()]
    assert len(new) == 2, [c.metadata.name for c in new]
    for c in new:
        path = f"/tmp/nvfp4_kernel_{id(c)}.cubin"
        with open(path, "wb") as f:
            f.write(c.asm["cubin"])
        sass = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
        assert "HGMMA" in sass, f"no wgmma in {c.metadata.name} ({c.metadata.num_warps} warps)"
