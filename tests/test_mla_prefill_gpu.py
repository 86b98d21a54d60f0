"""MLA prefill and the LSE merge on a GPU: DeepSeek-V3's shapes (128 heads, T = 4096), ragged mixes, every
kernel config, bf16 and fp16, against float64 references; CUDA-graph capture."""

import pytest
import torch

import flashinfer_moe as fm
from flashinfer_moe import reference_mla as ref
from flashinfer_moe.mla import prefill_kernel

pytestmark = pytest.mark.gpu
SCALE = 192**-0.5
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative (Frobenius) error of the output


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def qkv(g, t, h, dtype):
    return tuple(torch.randn(t, h, d, generator=g).to(dtype).cuda() for d in (192, 192, 128))


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def check(q, k, v, cu, out, lse, causal, heads, seed):
    """Output and LSE of ``heads`` against the float64 reference; every row written."""
    assert not out.isnan().any() and not lse.isnan().any(), seed
    idx = torch.tensor(heads, device="cuda")
    want, want_lse = ref.prefill_attention(q[:, idx], k[:, idx], v[:, idx], cu, SCALE, causal)
    assert rel_err(out[:, idx], want) < TOL[q.dtype], seed
    assert (lse[:, idx].double() - want_lse).abs().max().item() < 1e-3, seed


@pytest.mark.parametrize("causal", [True, False])
def test_deepseek_v3_prefill(rng, causal):
    seed, g = rng
    t, h = 4096, 128
    q, k, v = qkv(g, t, h, torch.bfloat16)
    out = torch.full((t, h, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((t, h), float("nan"), device="cuda")
    fm.mla_prefill(q, k, v, cu_of([t]), t, SCALE, causal=causal, out=out, lse=lse)
    check(q, k, v, cu_of([t]), out, lse, causal, [0, 37, 127], seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 1000, 2049, 17], [1024] * 4 + [4096], [5, 0, 130]])
def test_ragged(rng, dtype, lens):
    seed, g = rng
    t, h = sum(lens), 16
    q, k, v = qkv(g, t, h, dtype)
    out = torch.full((t, h, 128), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((t, h), float("nan"), device="cuda")
    fm.mla_prefill(q, k, v, cu_of(lens), max(lens), SCALE, out=out, lse=lse)
    check(q, k, v, cu_of(lens), out, lse, True, list(range(h)), seed)


@pytest.mark.parametrize("config", prefill_kernel.CONFIGS, ids=str)
def test_every_config(rng, config):
    seed, g = rng
    lens = [1, 200, 77, 513]
    t, h = sum(lens), 4
    q, k, v = qkv(g, t, h, torch.bfloat16)
    out = torch.full((t, h, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((t, h), float("nan"), device="cuda")
    prefill_kernel.launch(q, k, v, cu_of(lens), out, lse, SCALE, max(lens), True, config)
    check(q, k, v, cu_of(lens), out, lse, True, list(range(h)), seed)


def test_strided_projection_slices(rng):
    """q, k, v as slices of one fused projection output `[T, H, 512]`."""
    seed, g = rng
    x = torch.randn(700, 8, 512, generator=g).bfloat16().cuda()
    q, k, v = x[..., :192], x[..., 192:384], x[..., 384:]
    out, lse = fm.mla_prefill(q, k, v, cu_of([300, 400]), 400, SCALE)
    check(q, k, v, cu_of([300, 400]), out, lse, True, list(range(8)), seed)


def test_graph_replay():
    g = torch.Generator().manual_seed(5)
    q, k, v = qkv(g, 600, 8, torch.bfloat16)
    cu = cu_of([100, 500])
    out = torch.empty(600, 8, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(600, 8, device="cuda")
    fm.mla_prefill(q, k, v, cu, 512, SCALE, out=out, lse=lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.mla_prefill(q, k, v, cu, 512, SCALE, out=out, lse=lse)
    cu.copy_(cu_of([350, 250]))  # new lengths, same buffers
    q.copy_(torch.randn(600, 8, 192, generator=g))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(q, k, v, cu_of([350, 250]), out, lse, True, list(range(8)), 5)


@pytest.mark.parametrize("d, dtype", [(128, torch.bfloat16), (512, torch.bfloat16), (128, torch.float32)])
def test_merge(rng, d, dtype):
    seed, g = rng
    t, h = 4096, 16
    out_a, out_b = (torch.randn(t, h, d, generator=g).to(dtype).cuda() for _ in range(2))
    lse_a, lse_b = ((torch.randn(t, h, generator=g) * 5).cuda() for _ in range(2))
    lse_a[::3] = float("-inf")
    out_a[::3] = float("nan")
    lse_b[1::7, 2] = float("-inf")
    lse_a[4::9] = lse_b[4::9] = float("-inf")
    out = torch.full((t, h, d), float("nan"), dtype=dtype, device="cuda")
    out_lse = torch.full((t, h), float("nan"), device="cuda")
    fm.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse)
    want, want_lse = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and not out_lse.isnan().any(), seed
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - want).abs().max().item() < tol * 4, seed
    assert torch.equal(out_lse.isneginf(), want_lse.isneginf()), seed
    finite = want_lse.isfinite()
    assert (out_lse[finite].double() - want_lse[finite]).abs().max().item() < 1e-5, seed


def test_merge_strided_inputs(rng):
    """Partial outputs that are head-major views (e.g. a transposed GEMM result)."""
    seed, g = rng
    a = torch.randn(16, 300, 128, generator=g).bfloat16().cuda().transpose(0, 1)  # [T, H, D], head stride > token
    b = torch.randn(300, 16, 128, generator=g).bfloat16().cuda()
    la = torch.randn(16, 300, generator=g).cuda().T
    lb = torch.randn(300, 16, generator=g).cuda()
    got, got_lse = fm.merge_attn_states(a, la, b, lb)
    want, want_lse = ref.merge_attn_states(a, la, b, lb)
    assert (got.double() - want).abs().max().item() < 4e-2, seed
    assert (got_lse.double() - want_lse).abs().max().item() < 1e-5, seed
