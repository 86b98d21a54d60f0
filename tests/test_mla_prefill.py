"""MLA prefill (new tokens' non-absorbed causal attention) and the LSE merge on the CPU tier: the Triton kernels
in Triton's interpreter and the public ops' CPU path, against the float64 references; bad input."""

import math
import os

import pytest
import torch
from checks import assert_error_names_argument

import flashinfer_moe as fm
from flashinfer_moe import reference_mla as ref

SCALE = 192**-0.5
# The kernel tests run interpreted on CPU tensors without a GPU, compiled on CUDA tensors with one.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter was not selected before the kernel module was imported")
    from flashinfer_moe.mla import prefill_kernel

    return prefill_kernel


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def qkv(g, t, h, dtype, fused=False):
    """q `[T, H, 192]`, k `[T, H, 192]`, v `[T, H, 128]`; ``fused``: slices of one `[T, H, 512]` projection
    output (token and head strides that are not the tensors' own)."""
    if fused:
        x = torch.randn(t, h, 512, generator=g).to(dtype)
        return x[..., :192], x[..., 192:384], x[..., 384:]
    return (
        torch.randn(t, h, 192, generator=g).to(dtype),
        torch.randn(t, h, 192, generator=g).to(dtype),
        torch.randn(t, h, 128, generator=g).to(dtype),
    )


def max_err(got, want):
    return (got.double() - want.double()).abs().max().item()


# ------------------------------------------------------------------------------ the kernels, interpreted


# Triton 3.6's interpreter computes tl.dot on bf16 operands from their raw bits: fp16 here, bf16 on the GPU tier.
@pytest.mark.parametrize("lens", [[1, 5, 17], [33], [0, 2, 0, 19]])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_prefill_kernel_interpreted(rng, kernels, lens, causal, fused):
    seed, g = rng
    t, h = sum(lens), 3
    q, k, v, cu = (x.to(DEV) for x in (*qkv(g, t, h, torch.float16, fused), cu_of(lens)))
    out = torch.full((t, h, 128), float("nan"), dtype=torch.float16, device=DEV)
    lse = torch.full((t, h), float("nan"), device=DEV)
    kernels.launch(q, k, v, cu, out, lse, SCALE, max(lens) + 3, causal)  # max_seqlen may exceed the longest
    want, want_lse = ref.prefill_attention(q, k, v, cu, SCALE, causal)
    assert not out.isnan().any() and not lse.isnan().any(), seed
    assert max_err(out, want) < 4e-3, seed
    assert max_err(lse, want_lse) < 1e-4, seed


def test_prefill_kernel_interpreted_blocks(rng, kernels):
    """A sequence over several row and key blocks, the diagonal block not the first key block."""
    seed, g = rng
    q, k, v, cu = (x.to(DEV) for x in (*qkv(g, 50, 2, torch.float16), cu_of([50])))
    out = torch.full((50, 2, 128), float("nan"), dtype=torch.float16, device=DEV)
    lse = torch.full((50, 2), float("nan"), device=DEV)
    config = kernels.PrefillConfig(32, 16, 4, 1)
    kernels.launch(q, k, v, cu, out, lse, SCALE, 50, True, config)
    want, want_lse = ref.prefill_attention(q, k, v, cu, SCALE)
    assert max_err(out, want) < 4e-3 and max_err(lse, want_lse) < 1e-4, seed


def test_prefill_configs_are_valid(kernels):
    for config in kernels.CONFIGS:
        assert config.BLOCK_M % config.BLOCK_N == 0
    with pytest.raises(ValueError):
        kernels.PrefillConfig(64, 128)


def merge_inputs(g, t, h, d, dtype):
    out_a, out_b = (torch.randn(t, h, d, generator=g).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, generator=g) * 4 for _ in range(2))
    lse_a[0] = float("-inf")  # an empty prefix: its rows hold garbage
    out_a[0] = float("nan")
    lse_b[1, 0] = float("-inf")
    out_b[1, 0] = float("inf")
    lse_a[2, :] = lse_b[2, :] = float("-inf")  # both sides empty
    lse_a[3, 0], lse_b[3, 0] = 80.0, -80.0  # one side dominating
    return out_a, lse_a, out_b, lse_b


def check_merge(got, got_lse, inputs, seed, tol):
    want, want_lse = ref.merge_attn_states(*inputs)
    assert not got.isnan().any() and not got_lse.isnan().any(), seed
    assert max_err(got, want) < tol, seed
    finite = want_lse.isfinite()
    assert torch.equal(got_lse.isneginf(), want_lse.isneginf()), seed
    assert max_err(got_lse[finite], want_lse[finite]) < 1e-5, seed
    assert torch.equal(got[2], torch.zeros_like(got[2])), seed
    # An empty side returns the other as it was, LSE included.
    assert torch.allclose(got[0].double(), inputs[2][0].double(), atol=tol), seed
    assert torch.equal(got_lse[0], inputs[3][0]), seed


@pytest.mark.parametrize("d", [128, 512, 24])
def test_merge_kernel_interpreted(rng, kernels, d):
    seed, g = rng
    inputs = tuple(x.to(DEV) for x in merge_inputs(g, 9, 3, d, torch.float16))
    out = torch.full((9, 3, d), float("nan"), dtype=torch.float16, device=DEV)
    out_lse = torch.full((9, 3), float("nan"), device=DEV)
    kernels.launch_merge(*inputs, out, out_lse)
    check_merge(out, out_lse, inputs, seed, 2e-3)


# ------------------------------------------------------------------------------- public ops, CPU path


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_mla_prefill_cpu(rng, dtype, tol):
    seed, g = rng
    lens = [1, 5, 17]
    q, k, v = qkv(g, sum(lens), 2, dtype)
    out = torch.full((23, 2, 128), float("nan"), dtype=dtype)
    lse = torch.full((23, 2), float("nan"))
    got, got_lse = fm.mla_prefill(q, k, v, cu_of(lens), 17, SCALE, out=out, lse=lse)
    assert got is out and got_lse is lse
    want, want_lse = ref.prefill_attention(q, k, v, cu_of(lens), SCALE)
    assert max_err(got, want) < tol and max_err(got_lse, want_lse) < 1e-4, seed


def test_merge_cpu(rng):
    seed, g = rng
    inputs = merge_inputs(g, 5, 2, 128, torch.bfloat16)
    got, got_lse = fm.merge_attn_states(*inputs)
    assert got.dtype == torch.bfloat16 and got_lse.dtype == torch.float32
    check_merge(got, got_lse, inputs, seed, 2e-2)


def test_merge_is_attention_over_the_union(rng):
    """Two halves of a key set, merged, equal the attention over all of it."""
    seed, g = rng
    q, k, v = qkv(g, 12, 2, torch.float64)
    full, full_lse = ref.prefill_attention(q, k, v, cu_of([12]), SCALE, causal=False)
    scores = torch.einsum("thd,shd->hts", q, k) * SCALE
    parts = []
    for keys in (slice(0, 5), slice(5, 12)):
        s = scores[..., keys]
        parts += [(torch.softmax(s, -1) @ v[keys].transpose(0, 1)).transpose(0, 1), torch.logsumexp(s, -1).T]
    got, got_lse = fm.merge_attn_states(*(p.float() for p in parts))
    assert max_err(got, full) < 1e-5 and max_err(got_lse, full_lse) < 1e-5, seed


def test_prefill_empty_batch():
    q = torch.zeros(0, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(0, 2, 128, dtype=torch.bfloat16)
    out, lse = fm.mla_prefill(q, q, v, torch.zeros(2, dtype=torch.int32), 0, SCALE)
    assert out.shape == (0, 2, 128) and lse.shape == (0, 2)


def test_prefill_bad_input(generator):
    g = generator
    q, k, v = qkv(g, 6, 2, torch.bfloat16)
    cu = cu_of([2, 4])

    def call(**kw):
        args = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=4, sm_scale=SCALE)
        args.update(kw)
        return lambda: fm.mla_prefill(**args)

    assert_error_names_argument(call(q=q[..., :128]), ValueError, "q")
    assert_error_names_argument(call(k=torch.zeros(6, 2, 256, dtype=torch.bfloat16)), ValueError, "k")
    assert_error_names_argument(call(v=torch.zeros(6, 2, 192, dtype=torch.bfloat16)), ValueError, "v")
    assert_error_names_argument(call(k=k.half()), TypeError, "k")
    assert_error_names_argument(call(q=q.float(), k=k.float(), v=v.float()), TypeError, "q")
    assert_error_names_argument(call(v=v[:5]), ValueError, "v")
    assert_error_names_argument(call(cu_seqlens=cu.long()), TypeError, "cu_seqlens")
    assert_error_names_argument(
        call(cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32)), ValueError, "cu_seqlens"
    )
    assert_error_names_argument(call(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "cu_seqlens")
    assert_error_names_argument(call(max_seqlen=3), ValueError, "max_seqlen")
    assert_error_names_argument(call(max_seqlen=4.0), TypeError, "max_seqlen")
    assert_error_names_argument(call(sm_scale=-1.0), ValueError, "sm_scale")
    assert_error_names_argument(call(out=torch.empty(6, 2, 128)), TypeError, "out")
    assert_error_names_argument(call(lse=torch.empty(6, 3)), ValueError, "lse")


def test_merge_bad_input(generator):
    a = torch.randn(4, 2, 128, generator=generator)
    la = torch.randn(4, 2, generator=generator)
    assert_error_names_argument(lambda: fm.merge_attn_states(a, la, a.half(), la), TypeError, "out_b")
    assert_error_names_argument(lambda: fm.merge_attn_states(a, la, a[:3], la[:3]), ValueError, "out_b")
    assert_error_names_argument(lambda: fm.merge_attn_states(a, la.double(), a, la), TypeError, "lse_a")
    assert_error_names_argument(lambda: fm.merge_attn_states(a, la[:, :1], a, la), ValueError, "lse_a")
    assert_error_names_argument(lambda: fm.merge_attn_states(a[0], la[0], a[0], la[0]), ValueError, "out_a")
    assert_error_names_argument(
        lambda: fm.merge_attn_states(a, la, a, la, out=torch.empty(4, 2, 128, dtype=torch.bfloat16)), TypeError, "out"
    )


def test_causal_flops_counts_visible_pairs(kernels):
    assert kernels.causal_flops([3], 1) == 2 * 6 * 320
    assert math.isclose(kernels.causal_flops([4096], 128, causal=False), 2 * 4096**2 * 128 * 320)
