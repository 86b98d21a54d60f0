"""``MLAAttention`` on a GPU: prefill over cached prefixes (long and empty ones, pages shared between sequences,
bf16 and FP8 caches, page sizes 1 and 64) against float64 full attention in the non-absorbed form; 128 heads."""

import pytest
import torch
from test_mla_attention import FP8, Layer, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "heads, lens, prefix_lens, page, kv_dtype, rope_dtype, shared",
    [
        (16, [1, 63, 64, 65, 300], [0, 1000, 64, 4097, 5], 64, torch.bfloat16, None, False),
        (16, [1, 63, 64, 65, 300], [0, 1000, 64, 4097, 5], 1, FP8, torch.bfloat16, False),
        (16, [200, 31, 129], [2048, 2048, 2100], 64, FP8, None, True),
        (128, [256, 1, 255], [512, 0, 1024], 64, torch.bfloat16, None, True),
    ],
)
def test_prefill_with_prefix(rng, heads, lens, prefix_lens, page, kv_dtype, rope_dtype, shared):
    seed, g = rng
    layer = Layer(g, heads, lens, prefix_lens, page, kv_dtype, rope_dtype, torch.bfloat16, device="cuda", shared=shared)
    t = sum(lens)
    out = torch.full((t, heads, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = layer.prefill(out=out, return_lse=True)
    assert got is out and not out.isnan().any() and lse.isfinite().all(), seed
    assert rel_err(got, layer.reference()) < 2e-2, seed


def test_prefill_without_prefix_4096_tokens(rng):
    seed, g = rng
    layer = Layer(g, 128, [4096], [0], 64, torch.bfloat16, None, torch.bfloat16, device="cuda")
    got = layer.attn.prefill(layer.q, layer.k, layer.v, layer.cu, 4096)
    heads = torch.tensor([3, 64, 120], device="cuda")
    from flashinfer_moe import reference_mla as ref

    want, _ = ref.prefill_attention(layer.q[:, heads], layer.k[:, heads], layer.v[:, heads], layer.cu, 192**-0.5)
    assert rel_err(got[:, heads], want) < 1e-2, seed
