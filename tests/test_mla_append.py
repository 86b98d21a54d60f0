"""MLA KV append on the CPU tier: every page size and layout, bf16/fp16/FP8 pages, against an independent
per-token expectation; FP8 rounding and saturation; padding slots; bad input. The rope rotation fused into the
append: both pairings, every source and table type, one rounding to FP8, positions out of range."""

import pytest
import torch
from checks import assert_error_names_argument, bits

import flashinfer_moe as fm
from flashinfer_moe import reference_mla as ref

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


# ------------------------------------------------------------------------------------- rope fused into append


def cos_sin_table(g, max_pos, dtype=torch.float32):
    """A [max_pos, 64] table of 32 cosines then 32 sines of random angles."""
    theta = torch.rand(max_pos, 32, generator=g, dtype=torch.float64) * 6.3
    return torch.cat([theta.cos(), theta.sin()], 1).to(dtype)


def rotated(kpe, positions, table, interleaved):
    """The rotation written out apart from the library's reference: pairs as complex128 numbers times
    ``cos + i sin`` (products of float32 values are exact in float64), then rounded to float32."""
    x = kpe.double()
    cs = table[positions.long()].double()
    cis = torch.complex(cs[:, :32], cs[:, 32:])
    if interleaved:
        z = torch.complex(x[:, 0::2], x[:, 1::2]) * cis
        return torch.stack([z.real, z.imag], -1).flatten(1).float()
    z = torch.complex(x[:, :32], x[:, 32:]) * cis
    return torch.cat([z.real, z.imag], 1).float()


def append_rope_case(g, n, page, kv_dtype, rope_dtype, src=torch.bfloat16, table_dtype=torch.float32, spread=3.0):
    num_pages = -(-2 * n // page) + 1
    kv, kpe_cache = make_cache(num_pages, page, kv_dtype, rope_dtype)
    ckv, kpe = rows(g, n, src, spread)
    slots = torch.randperm(num_pages * page, generator=g)[:n]
    slots[1::5] = -1  # padding
    max_pos = 3 * n + 5
    positions = torch.randint(0, max_pos, (n,), generator=g)
    positions[slots < 0] = max_pos + 7  # padding tokens' positions are never read
    table = cos_sin_table(g, max_pos, table_dtype)
    return kv, kpe_cache, ckv, kpe, slots, positions, table


@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kv_dtype, rope_dtype", LAYOUTS)
def test_append_rope_layouts_pairings(rng, n, interleaved, kv_dtype, rope_dtype):
    seed, g = rng
    kv, kpe_cache, ckv, kpe, slots, positions, table = append_rope_case(g, n, 16, kv_dtype, rope_dtype)
    scale = 0.02 if FP8 in (kv_dtype, rope_dtype) else None
    keep = slots >= 0
    rope_rows = torch.zeros(n, 64)
    rope_rows[keep] = rotated(kpe[keep], positions[keep], table, interleaved)
    want_kv, want_kpe = expected(ckv, rope_rows, slots, kv, kpe_cache, scale or 1.0)
    fm.mla_append_kv(
        ckv, kpe, slots, kv, kpe_cache=kpe_cache, kv_scale=scale, positions=positions, cos_sin_cache=table,
        rope_interleaved=interleaved,
    )  # fmt: skip
    assert torch.equal(bits(kv), bits(want_kv)), seed
    if kpe_cache is not None:
        assert torch.equal(bits(kpe_cache), bits(want_kpe)), seed


@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_append_rope_source_and_table_types(rng, src, table_dtype):
    """Every source type with every table type; int32 positions; a table with a row stride past 64."""
    seed, g = rng
    n = 33
    kv, _, ckv, kpe, slots, positions, table = append_rope_case(g, n, 64, torch.bfloat16, None, src, table_dtype)
    wide = torch.zeros(table.shape[0], 80, dtype=table_dtype)
    wide[:, 3:67] = table
    table = wide[:, 3:67]
    keep = slots >= 0
    rope_rows = torch.zeros(n, 64)
    rope_rows[keep] = rotated(kpe[keep], positions[keep], table, True)
    want, _ = expected(ckv, rope_rows, slots, kv, None, 1.0)
    fm.mla_append_kv(ckv, kpe, slots.int(), kv, positions=positions.int(), cos_sin_cache=table)
    assert torch.equal(bits(kv), bits(want)), seed


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_pairing_conventions(interleaved):
    """cos 0, sin 1 turns each pair (a, b) into (-b, a): which channels pair up, seen directly."""
    x = torch.arange(1, 65, dtype=torch.float32)[None]
    table = torch.cat([torch.zeros(1, 32), torch.ones(1, 32)], 1)
    kv, _ = make_cache(1, 1, torch.float16, None)
    fm.mla_append_kv(
        torch.zeros(1, 512), x, torch.tensor([0]), kv, positions=torch.tensor([0]), cos_sin_cache=table,
        rope_interleaved=interleaved,
    )  # fmt: skip
    if interleaved:
        want = torch.stack([-x[0, 1::2], x[0, 0::2]], -1).flatten()
    else:
        want = torch.cat([-x[0, 32:], x[0, :32]])
    assert torch.equal(kv[0, 0, 512:].float(), want)
    assert not kv[0, 0, :512].any()


def test_rope_fp8_rounds_once():
    """The rotated value goes to FP8 from fp32, not through the source type: a + b = 1.0625 + 2**-12 is above
    e4m3's midpoint between 1 and 1.125 (so 1.125), but bf16 would round it to the midpoint itself first
    (then 1.0, ties to even)."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 1.0625, 2.0**-12  # a, b: exact in bf16
    table = torch.zeros(1, 64)
    table[0, :32], table[0, 32:] = 1.0, -1.0  # cos 1, sin -1: (a + b, b - a)
    kv, _ = make_cache(1, 1, FP8, None)
    fm.mla_append_kv(
        torch.zeros(1, 512, dtype=torch.bfloat16), x, torch.tensor([0]), kv, kv_scale=1.0,
        positions=torch.tensor([0]), cos_sin_cache=table,
    )  # fmt: skip
    two_step = torch.tensor(1.0625 + 2.0**-12).bfloat16().float().to(FP8).float().item()
    assert two_step == 1.0
    assert kv[0, 0, 512].float().item() == 1.125
    assert kv[0, 0, 513].float().item() == -1.0  # -1.06225...: below the midpoint either way


def test_rope_positions_out_of_range(rng):
    """On CPU tensors a written token's position outside [0, max_pos) raises (a padding token's is not read);
    the reference the GPU kernel matches skips such a token, leaving its slot as it was."""
    seed, g = rng
    n, max_pos = 9, 20
    kv, _ = make_cache(2, 16, torch.bfloat16, None)
    ckv, kpe = rows(g, n, torch.bfloat16)
    slots = torch.arange(n) * 3
    table = cos_sin_table(g, max_pos)
    for bad in (max_pos, max_pos + 1000, -1):
        positions = torch.randint(0, max_pos, (n,), generator=g)
        positions[4] = bad
        before = kv.clone()
        with pytest.raises(ValueError, match=f"positions must be in .*got {bad}"):
            fm.mla_append_kv(ckv, kpe, slots, kv, positions=positions, cos_sin_cache=table)
        assert torch.equal(bits(kv), bits(before)), seed
        padded = slots.clone()
        padded[4] = -1
        fm.mla_append_kv(ckv, kpe, padded, kv, positions=positions, cos_sin_cache=table)
        ref.append_kv_rope(ckv, kpe, slots, before, positions, table)
        assert torch.equal(bits(kv), bits(before)), seed
        sentinel = make_cache(1, 1, torch.bfloat16, None)[0][0, 0]
        assert torch.equal(bits(kv[0, 12]), bits(sentinel)) and kv[0, 9].ne(sentinel).any(), seed


def test_append_rope_opcheck(generator):
    kv, _, ckv, kpe, slots, positions, table = append_rope_case(generator, 7, 16, torch.bfloat16, None)
    for interleaved in (True, False):
        args = (ckv, kpe, slots, kv, None, None, positions, table, interleaved)
        torch.library.opcheck(torch.ops.flashinfer_moe.mla_append_kv_.default, args)


def test_append_rope_bad_input(generator):
    n = 4
    ckv, kpe = rows(generator, n, torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 3])
    kv, _ = make_cache(2, 16, torch.bfloat16, None)
    positions, table = torch.tensor([0, 1, 2, 3]), cos_sin_table(generator, 8)

    def call(**kw):
        args = dict(positions=positions, cos_sin_cache=table)
        args.update(kw)
        return lambda: fm.mla_append_kv(ckv, kpe, slots, kv, **args)

    assert_error_names_argument(call(cos_sin_cache=None), ValueError, "positions")
    assert_error_names_argument(call(positions=None), ValueError, "cos_sin_cache")
    assert_error_names_argument(call(positions=positions.float()), TypeError, "positions")
    assert_error_names_argument(call(positions=positions[:3]), ValueError, "positions")
    assert_error_names_argument(call(positions=positions[None]), ValueError, "positions")
    assert_error_names_argument(call(positions=positions.to("meta")), ValueError, "positions")
    assert_error_names_argument(call(positions=[0, 1, 2, 3]), TypeError, "positions")
    assert_error_names_argument(call(positions=torch.tensor([0, 1, 8, 3])), ValueError, "positions")
    assert_error_names_argument(call(cos_sin_cache=table.long()), TypeError, "cos_sin_cache")
    assert_error_names_argument(call(cos_sin_cache=table[:, :32]), ValueError, "cos_sin_cache")
    assert_error_names_argument(call(cos_sin_cache=table[0]), ValueError, "cos_sin_cache")
    assert_error_names_argument(call(cos_sin_cache=table.mT.contiguous().mT), ValueError, "cos_sin_cache")
    assert_error_names_argument(call(cos_sin_cache=table.to("meta")), ValueError, "cos_sin_cache")
    assert_error_names_argument(call(rope_interleaved=1), TypeError, "rope_interleaved")
