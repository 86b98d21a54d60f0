"""``MLAAttention`` on the CPU tier: prefill with and without a cached prefix (bf16 and FP8 caches, both
layouts, pages shared between sequences, empty prefixes) against float64 full attention in the non-absorbed
form; append then decode through the wrapper; bad input."""

import pytest
import torch
from checks import assert_error_names_argument

import flashinfer_moe as fm
from flashinfer_moe import reference_mla as ref

FP8 = torch.float8_e4m3fn
SCALE = 192**-0.5


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


class Layer:
    """Random MLA layer weights and a ragged batch of new tokens with cached prefixes, built the way an engine
    builds them: latent and rope rows, keys/values up-projected from the latent, the query absorbed."""

    def __init__(self, g, heads, lens, prefix_lens, page, kv_dtype, rope_dtype, dtype, device="cpu", shared=False):
        self.heads, self.lens, self.prefix_lens, self.page, self.dtype = heads, lens, prefix_lens, page, dtype
        t = sum(lens)
        self.w_uk = (torch.randn(heads, 128, 512, generator=g) / 512**0.5).to(dtype).to(device)
        self.w_uv = (torch.randn(heads, 512, 128, generator=g) / 512**0.5).to(dtype).to(device)
        self.cu = cu_of(lens).to(device)
        latent = torch.randn(t, 512, generator=g).to(dtype).to(device)
        k_pe = torch.randn(t, 64, generator=g).to(dtype).to(device)
        k_nope = torch.einsum("tc,hdc->thd", latent.double(), self.w_uk.double()).to(dtype)
        self.k = torch.cat([k_nope, k_pe[:, None].expand(t, heads, 64)], -1)
        self.v = torch.einsum("tc,hcd->thd", latent.double(), self.w_uv.double()).to(dtype)
        self.q = torch.randn(t, heads, 192, generator=g).to(dtype).to(device)
        self.q_absorbed = torch.einsum("thd,hdc->thc", self.q[..., :128].double(), self.w_uk.double()).to(dtype)
        # The prefixes' pages: sequence b's prefix fills pages_per[b] pages of a shuffled pool; with ``shared``,
        # every sequence's first pages are sequence 0's (a common system prompt).
        pages_per = [-(-n // page) for n in prefix_lens]
        num_pages = sum(pages_per) + 2
        order = torch.randperm(num_pages, generator=g)
        max_pages = max(max(pages_per), 1)
        table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
        used = 0
        for b, n_pages in enumerate(pages_per):
            table[b, :n_pages] = order[used : used + n_pages].int()
            used += n_pages
        if shared:
            common = min(pages_per)
            table[:, :common] = table[0, :common]
        self.block_table = table.to(device)
        width = 576 if rope_dtype is None else 512
        self.kv_cache = torch.zeros(num_pages, page, width, dtype=kv_dtype, device=device)
        self.kpe_cache = (
            None if rope_dtype is None else torch.zeros(num_pages, page, 64, dtype=rope_dtype, device=device)
        )
        self.kv_scale = 0.02 if FP8 in (kv_dtype, rope_dtype) else None
        self.attn = fm.MLAAttention(heads, SCALE, page, kv_dtype=kv_dtype, kv_scale=self.kv_scale)
        # Fill the prefixes through the wrapper (every position of every sequence's prefix pages).
        slots = torch.cat([self.slots_of(b, n) for b, n in enumerate(prefix_lens)])
        pre_latent = (torch.randn(len(slots), 512, generator=g) * 2).to(dtype).to(device)
        pre_rope = (torch.randn(len(slots), 64, generator=g) * 2).to(dtype).to(device)
        self.attn.append_kv(pre_latent, pre_rope, slots.to(device), self.kv_cache, kpe_cache=self.kpe_cache)

    def slots_of(self, b, n):
        pos = torch.arange(n)
        return self.block_table[b].cpu().long()[pos // self.page] * self.page + pos % self.page

    def prefill(self, **kw):
        args = dict(
            q_nope_absorbed=self.q_absorbed,
            q_pe=self.q[..., 128:],
            kv_cache=self.kv_cache,
            kpe_cache=self.kpe_cache,
            block_table=self.block_table,
            prefix_lens=torch.tensor(self.prefix_lens, dtype=torch.int32, device=self.q.device),
            w_uv=self.w_uv,
        )
        args.update(kw)
        return self.attn.prefill(self.q, self.k, self.v, self.cu, max(self.lens), **args)

    def reference(self):
        return ref.prefill_with_prefix(
            self.q,
            self.k,
            self.v,
            self.cu,
            SCALE,
            self.kv_cache,
            self.block_table,
            torch.tensor(self.prefix_lens),
            self.w_uk,
            self.w_uv,
            kpe_cache=self.kpe_cache,
            kv_scale=self.kv_scale,
        )


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize(
    "page, kv_dtype, rope_dtype, prefix_lens, shared",
    [
        (16, torch.bfloat16, None, [0, 20, 33], False),
        (1, FP8, torch.bfloat16, [7, 0, 19], False),
        (64, FP8, None, [70, 65, 0], False),
        (32, torch.bfloat16, torch.bfloat16, [40, 40, 45], True),
    ],
)
def test_prefill_with_prefix(rng, page, kv_dtype, rope_dtype, prefix_lens, shared):
    seed, g = rng
    layer = Layer(g, 3, [1, 5, 17], prefix_lens, page, kv_dtype, rope_dtype, torch.bfloat16, shared=shared)
    out = torch.full((23, 3, 128), float("nan"), dtype=torch.bfloat16)
    got, lse = layer.prefill(out=out, return_lse=True)
    assert got is out and lse.shape == (23, 3) and lse.isfinite().all(), seed
    assert rel_err(got, layer.reference()) < 2e-2, seed


def test_prefill_without_prefix_equals_new_token_attention(rng):
    seed, g = rng
    layer = Layer(g, 2, [1, 5, 17, 3], [0, 0, 0, 0], 16, torch.float16, None, torch.float16)
    got = layer.attn.prefill(layer.q, layer.k, layer.v, layer.cu, 17)
    want, _ = ref.prefill_attention(layer.q, layer.k, layer.v, layer.cu, SCALE)
    assert rel_err(got, want) < 2e-3, seed
    # All prefixes empty through the prefix path: the same (the decode part has LSE -inf everywhere).
    assert rel_err(layer.prefill(), want) < 2e-3, seed


def test_append_then_decode(rng):
    """Tokens appended through the wrapper, decoded through it (two-tensor FP8 cache, s_q = 2)."""
    seed, g = rng
    heads, page, lens = 2, 16, [3, 18]
    attn = fm.MLAAttention(heads, SCALE, page, kv_dtype=FP8, kv_scale=0.05)
    kv = torch.zeros(4, page, 512, dtype=FP8)
    kpe = torch.zeros(4, page, 64, dtype=torch.bfloat16)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b].long()[pos // page] * page + pos % page
        attn.append_kv(torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g), slots, kv, kpe_cache=kpe)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_nope = torch.randn(2, 2, heads, 512, generator=g).bfloat16()
    q_pe = torch.randn(2, 2, heads, 64, generator=g).bfloat16()
    plan = attn.plan(seq_lens, 2)
    out, lse = attn.decode(q_nope, q_pe, kv, table, seq_lens, kpe_cache=kpe, plan=plan, return_lse=True)
    want, want_lse = ref.mla_decode(q_nope, q_pe, kv, table, seq_lens, SCALE, kpe_cache=kpe, kv_scale=0.05)
    assert rel_err(out, want) < 2e-2 and (lse.double() - want_lse).abs().max() < 1e-3, seed


def test_append_with_rope_rotates_as_the_reference(rng):
    """The wrapper passes positions and the cos/sin table through: the cache holds the rotated rows."""
    seed, g = rng
    attn = fm.MLAAttention(2, SCALE, 16)
    kv, want = torch.zeros(3, 16, 576, dtype=torch.bfloat16), torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    ckv, kpe = torch.randn(5, 512, generator=g), torch.randn(5, 64, generator=g)
    slots, positions = torch.tensor([3, 17, 40, -1, 9]), torch.tensor([0, 5, 99, 7, 1])
    table = torch.randn(100, 64, generator=g)
    attn.append_kv(ckv, kpe, slots, kv, positions=positions, cos_sin_cache=table, rope_interleaved=False)
    ref.append_kv(ckv, ref.rotate_rope(kpe, positions, table, interleaved=False), slots, want)
    assert torch.equal(kv, want), seed
    assert not torch.equal(kv[..., 512:], torch.zeros_like(kv[..., 512:]))


def test_constructor_and_repr():
    attn = fm.MLAAttention(16, SCALE, 64)
    assert "num_heads=16" in repr(attn) and "bfloat16" in repr(attn)
    assert_error_names_argument(lambda: fm.MLAAttention(0, SCALE, 64), ValueError, "num_heads")
    assert_error_names_argument(lambda: fm.MLAAttention(16, 0.0, 64), ValueError, "sm_scale")
    assert_error_names_argument(lambda: fm.MLAAttention(16, SCALE, 8), ValueError, "page_size")
    assert_error_names_argument(lambda: fm.MLAAttention(16, SCALE, 64, kv_dtype=torch.float32), TypeError, "kv_dtype")
    assert_error_names_argument(lambda: fm.MLAAttention(16, SCALE, 64, kv_dtype=FP8), ValueError, "kv_scale")
    assert_error_names_argument(lambda: fm.MLAAttention(16, SCALE, 64, kv_scale=0.1), ValueError, "kv_scale")
    assert_error_names_argument(
        lambda: fm.MLAAttention(16, SCALE, 64, kv_dtype=FP8, kv_scale=float("inf")), ValueError, "kv_scale"
    )


def test_prefill_bad_input(generator):
    layer = Layer(generator, 2, [2, 3], [4, 0], 16, torch.bfloat16, None, torch.bfloat16)
    attn = layer.attn
    assert_error_names_argument(lambda: layer.prefill(w_uv=None), ValueError, "w_uv")
    assert_error_names_argument(lambda: layer.prefill(w_uv=layer.w_uv[:, :256]), ValueError, "w_uv")
    assert_error_names_argument(lambda: layer.prefill(w_uv=layer.w_uv.half()), TypeError, "w_uv")
    assert_error_names_argument(lambda: layer.prefill(q_pe=None), ValueError, "q_pe")
    assert_error_names_argument(
        lambda: layer.prefill(q_nope_absorbed=layer.q_absorbed[..., :256]), ValueError, "q_nope_absorbed"
    )
    assert_error_names_argument(lambda: layer.prefill(prefix_lens=torch.tensor([4])), TypeError, "prefix_lens")
    assert_error_names_argument(
        lambda: layer.prefill(prefix_lens=torch.tensor([4], dtype=torch.int32)), ValueError, "prefix_lens"
    )
    assert_error_names_argument(lambda: layer.prefill(block_table=layer.block_table[:1]), ValueError, "block_table")
    assert_error_names_argument(
        lambda: attn.prefill(layer.q, layer.k, layer.v, layer.cu, 3, w_uv=layer.w_uv), ValueError, "w_uv"
    )
    assert_error_names_argument(
        lambda: attn.prefill(layer.q[:, :1], layer.k[:, :1], layer.v[:, :1], layer.cu, 3), ValueError, "q"
    )
    other_page = fm.MLAAttention(2, SCALE, 32)
    assert_error_names_argument(
        lambda: other_page.append_kv(torch.zeros(1, 512), torch.zeros(1, 64), torch.zeros(1).long(), layer.kv_cache),
        ValueError,
        "kv_cache",
    )
    fp8_layer = fm.MLAAttention(2, SCALE, 16, kv_dtype=FP8, kv_scale=1.0)
    assert_error_names_argument(
        lambda: fp8_layer.append_kv(torch.zeros(1, 512), torch.zeros(1, 64), torch.zeros(1).long(), layer.kv_cache),
        TypeError,
        "kv_cache",
    )


def test_prefill_no_tokens():
    layer = Layer(torch.Generator().manual_seed(0), 2, [0, 0], [3, 0], 16, torch.bfloat16, None, torch.bfloat16)
    got = layer.prefill()
    assert got.shape == (0, 2, 128)
