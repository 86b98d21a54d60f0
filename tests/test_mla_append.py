"""MLA KV append on the CPU tier: every page size and layout, bf16/fp16/FP8 pages, against an independent
per-token expectation; FP8 rounding and saturation; padding slots; bad input."""

import pytest
import torch
from checks import assert_error_names_argument, bits

import flashinfer_moe as fm

FP8 = torch.float8_e4m3fn
PAGE_SIZES = (1, 16, 32, 64, 128)
# (latent pages, rope pages; None: the one-tensor [P, page, 576] layout)
LAYOUTS = [
    (torch.bfloat16, None),
    (torch.float16, None),
    (FP8, None),
    (torch.bfloat16, torch.bfloat16),
    (FP8, FP8),
    (FP8, torch.bfloat16),
    (FP8, torch.float16),
]


def make_cache(num_pages, page, kv_dtype, rope_dtype, device="cpu"):
    """Caches filled with a sentinel byte pattern, so that every write and every untouched slot shows."""
    width = 576 if rope_dtype is None else 512

    def filled(shape, dtype):
        return torch.full(shape, 0x5A, dtype=torch.uint8, device=device).view(dtype)[..., : shape[-1]]

    kv = filled((num_pages, page, width * (2 if kv_dtype != FP8 else 1)), kv_dtype)
    kpe = None if rope_dtype is None else filled((num_pages, page, 64 * (2 if rope_dtype != FP8 else 1)), rope_dtype)
    return kv, kpe


def stored(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """One row as a cache of ``dtype`` holds it (written out here, apart from the library's reference)."""
    if dtype != FP8:
        return x.to(dtype)
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    return (x.float() * inv).clamp(-448.0, 448.0).to(FP8)


def expected(ckv, kpe, slots, kv, kpe_cache, scale):
    kv, kpe_cache = kv.clone(), None if kpe_cache is None else kpe_cache.clone()
    page = kv.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        p, o = divmod(slot, page)
        if kpe_cache is None:
            kv[p, o, :512] = stored(ckv[t], kv.dtype, scale)
            kv[p, o, 512:] = stored(kpe[t], kv.dtype, scale)
        else:
            kv[p, o] = stored(ckv[t], kv.dtype, scale)
            kpe_cache[p, o] = stored(kpe[t], kpe_cache.dtype, scale)
    return kv, kpe_cache


def rows(g, n, dtype, spread=3.0):
    return (torch.randn(n, 512, generator=g) * spread).to(dtype), (torch.randn(n, 64, generator=g) * spread).to(dtype)


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("kv_dtype, rope_dtype", LAYOUTS)
def test_append_every_page_size_and_layout(rng, page, kv_dtype, rope_dtype):
    seed, g = rng
    n = 7
    num_pages = -(-2 * n // page) + 1
    kv, kpe_cache = make_cache(num_pages, page, kv_dtype, rope_dtype)
    ckv, kpe = rows(g, n, torch.bfloat16)
    slots = torch.randperm(num_pages * page, generator=g)[:n]
    if n > 2:
        slots[2] = -1  # padding
    scale = 0.02 if FP8 in (kv_dtype, rope_dtype) else None
    want_kv, want_kpe = expected(ckv, kpe, slots, kv, kpe_cache, scale or 1.0)
    fm.mla_append_kv(ckv, kpe, slots, kv, kpe_cache=kpe_cache, kv_scale=scale)
    assert torch.equal(bits(kv), bits(want_kv)), seed
    if kpe_cache is not None:
        assert torch.equal(bits(kpe_cache), bits(want_kpe)), seed


@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_append_converts_source_types(rng, src):
    seed, g = rng
    kv, _ = make_cache(2, 16, torch.bfloat16, None)
    ckv, kpe = rows(g, 5, src)
    slots = torch.tensor([3, 31, 0, 17, 8], dtype=torch.int32)
    want, _ = expected(ckv, kpe, slots, kv, None, 1.0)
    fm.mla_append_kv(ckv, kpe, slots, kv)
    assert torch.equal(bits(kv), bits(want)), seed


def test_fp8_rounding_and_saturation():
    """Ties round to even, values past 448 * scale saturate (where .to(float8_e4m3fn) alone gives NaN)."""
    values = torch.tensor([1.0625, 1.1875, 1000.0, -1e6, 464.0, 0.0, -0.0, 3 * 2.0**-10], dtype=torch.float32)
    want = torch.tensor([1.0, 1.25, 448.0, -448.0, 448.0, 0.0, -0.0, 2.0**-8], dtype=torch.float32)
    ckv = torch.zeros(1, 512)
    ckv[0, : values.numel()] = values
    kv, _ = make_cache(1, 1, FP8, None)
    fm.mla_append_kv(ckv, torch.zeros(1, 64), torch.tensor([0]), kv, kv_scale=1.0)
    assert torch.equal(kv[0, 0, : values.numel()].float(), want)
    assert torch.equal(kv[0, 0, :8].float().signbit(), want.signbit())
    # With a scale: stored = e4m3(x * (1 / scale)), real = stored * scale.
    fm.mla_append_kv(ckv * 0.5, torch.zeros(1, 64), torch.tensor([0]), kv, kv_scale=torch.tensor([0.5]))
    assert torch.equal(kv[0, 0, :3].float(), want[:3])


def test_strided_cache_and_rows(rng):
    """One layer's pages inside a [layers, P, page, 576] pool; rows with a stride wider than their width."""
    seed, g = rng
    pool = torch.zeros(3, 4, 16, 576, dtype=torch.bfloat16)
    layer = pool[1]
    src = torch.randn(6, 600, generator=g).bfloat16()
    ckv, kpe = src[:, :512], src[:, 520:584]
    slots = torch.tensor([0, 63, 5, 16, -3, 40])
    want, _ = expected(ckv, kpe, slots, layer, None, 1.0)
    fm.mla_append_kv(ckv, kpe, slots, layer)
    assert torch.equal(layer, want), seed
    assert not pool[0].any() and not pool[2].any(), seed


def test_append_nothing():
    kv, _ = make_cache(2, 16, torch.bfloat16, None)
    before = kv.clone()
    fm.mla_append_kv(torch.zeros(0, 512), torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), kv)
    fm.mla_append_kv(torch.zeros(2, 512), torch.zeros(2, 64), torch.tensor([-1, -7]), kv)
    assert torch.equal(bits(kv), bits(before))


def test_append_bad_input(generator):
    ckv, kpe = rows(generator, 4, torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 3])
    kv, _ = make_cache(2, 16, torch.bfloat16, None)
    kv8, kpe8 = make_cache(2, 16, FP8, FP8)

    def call(**kw):
        args = dict(ckv=ckv, kpe=kpe, slots=slots, kv_cache=kv)
        args.update(kw)
        return lambda: fm.mla_append_kv(**args)

    assert_error_names_argument(call(ckv=ckv[:, :256]), ValueError, "ckv")
    assert_error_names_argument(call(kpe=kpe[:3]), ValueError, "kpe")
    assert_error_names_argument(call(kpe=kpe.half()), TypeError, "kpe")
    assert_error_names_argument(call(ckv=ckv.long(), kpe=kpe.long()), TypeError, "ckv")
    assert_error_names_argument(call(slots=slots.float()), TypeError, "slots")
    assert_error_names_argument(call(slots=slots[:3]), ValueError, "slots")
    assert_error_names_argument(call(slots=torch.tensor([0, 1, 2, 32])), ValueError, "slots")
    assert_error_names_argument(call(kv_cache=torch.zeros(2, 8, 576, dtype=torch.bfloat16)), ValueError, "kv_cache")
    assert_error_names_argument(call(kv_cache=torch.zeros(2, 16, 512, dtype=torch.bfloat16)), ValueError, "kv_cache")
    assert_error_names_argument(call(kv_cache=torch.zeros(2, 16, 576)), TypeError, "kv_cache")
    assert_error_names_argument(call(kv_cache=kv.transpose(0, 1)), ValueError, "kv_cache")
    assert_error_names_argument(call(kv_cache=kv.mT.contiguous().mT), ValueError, "kv_cache")
    assert_error_names_argument(call(kv_cache=kv8, kpe_cache=kpe8[:1]), ValueError, "kpe_cache")
    bf16_two = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    assert_error_names_argument(call(kv_cache=bf16_two, kpe_cache=kpe8), TypeError, "kpe_cache")
    assert_error_names_argument(call(kv_cache=kv8, kpe_cache=kpe8), ValueError, "kv_scale")
    assert_error_names_argument(call(kv_scale=1.0), ValueError, "kv_scale")
    assert_error_names_argument(call(kv_cache=kv8, kpe_cache=kpe8, kv_scale=-1.0), ValueError, "kv_scale")
    assert_error_names_argument(call(kv_cache=kv8, kpe_cache=kpe8, kv_scale=torch.ones(2)), ValueError, "kv_scale")
