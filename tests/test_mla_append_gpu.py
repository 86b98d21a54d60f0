"""MLA KV append on a GPU: the CUDA kernel bit-exact with the CPU reference for every page size, layout, source
type and alignment; slots past the cache skipped; CUDA-graph capture. With the rope rotation fused in, also
bit-exact: kernel and reference both form each rotated value from exact float64 products with one float64
rounding, then float32, then the cache's conversion, so no tolerance is needed."""

import pytest
import torch
from checks import bits
from test_mla_append import LAYOUTS, PAGE_SIZES, append_rope_case, cos_sin_table, make_cache

import flashinfer_moe as fm
from flashinfer_moe import reference_mla as ref

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
SOURCES = (torch.bfloat16, torch.float32, torch.float16)


def both(ckv, kpe, slots, kv, kpe_cache, scale):
    """(GPU result, CPU result) of the same append into copies of the same caches."""
    gpu = [kv.cuda(), None if kpe_cache is None else kpe_cache.cuda()]
    cpu = [kv.clone(), None if kpe_cache is None else kpe_cache.clone()]
    gscale = None if scale is None else torch.tensor([scale], device="cuda")
    fm.mla_append_kv(ckv.cuda(), kpe.cuda(), slots.cuda(), gpu[0], kpe_cache=gpu[1], kv_scale=gscale)
    fm.mla_append_kv(ckv, kpe, slots, cpu[0], kpe_cache=cpu[1], kv_scale=scale)
    return gpu, cpu


@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("kv_dtype, rope_dtype", LAYOUTS)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32, torch.float16])
def test_kernel_matches_reference(rng, page, kv_dtype, rope_dtype, src):
    seed, g = rng
    n = 300
    num_pages = -(-3 * n // page)
    kv, kpe_cache = make_cache(num_pages, page, kv_dtype, rope_dtype)
    ckv = (torch.randn(n, 512, generator=g) * 40).to(src)  # some values past 448 * scale: saturation
    kpe = (torch.randn(n, 64, generator=g) * 40).to(src)
    slots = torch.randperm(num_pages * page, generator=g)[:n]
    slots[::7] = -1
    scale = 0.05 if FP8 in (kv_dtype, rope_dtype) else None
    (gkv, gkpe), (ckv_ref, ckpe_ref) = both(ckv, kpe, slots, kv, kpe_cache, scale)
    assert torch.equal(bits(gkv), bits(ckv_ref)), seed
    if kpe_cache is not None:
        assert torch.equal(bits(gkpe), bits(ckpe_ref)), seed


@pytest.mark.parametrize("kv_dtype, rope_dtype", [(torch.bfloat16, None), (FP8, torch.bfloat16)])
def test_unaligned_rows_int32_slots_and_out_of_range(rng, kv_dtype, rope_dtype):
    """Rows that start off a 16-byte boundary take the element path; a slot past the cache is not written."""
    seed, g = rng
    n, page = 97, 16
    kv, kpe_cache = make_cache(20, page, kv_dtype, rope_dtype)
    src = torch.randn(n, 579, generator=g).bfloat16()
    ckv, kpe = src[:, 1:513], src[:, 515:579]
    slots = torch.randperm(20 * page - 1, generator=g)[:n].int()
    slots[5] = 20 * page + 3  # past the cache
    keep = slots.clone()
    keep[5] = -1
    scale = 0.03 if kv_dtype == FP8 else None
    gpu = [kv.cuda(), None if kpe_cache is None else kpe_cache.cuda()]
    fm.mla_append_kv(ckv.cuda(), kpe.cuda(), slots.cuda(), gpu[0], kpe_cache=gpu[1], kv_scale=scale)
    fm.mla_append_kv(ckv, kpe, keep, kv, kpe_cache=kpe_cache, kv_scale=scale)
    assert torch.equal(bits(gpu[0]), bits(kv)), seed
    if kpe_cache is not None:
        assert torch.equal(bits(gpu[1]), bits(kpe_cache)), seed


def test_strided_pool_layer():
    g = torch.Generator().manual_seed(3)
    pool = torch.zeros(3, 64, 64, 576, dtype=FP8, device="cuda")
    ckv, kpe = torch.randn(4096, 512, generator=g).cuda(), torch.randn(4096, 64, generator=g).cuda()
    slots = torch.randperm(64 * 64, generator=g)[:4096].cuda()
    fm.mla_append_kv(ckv, kpe, slots, pool[1], kv_scale=0.01)
    want = torch.zeros(64, 64, 576, dtype=FP8)
    fm.mla_append_kv(ckv.cpu(), kpe.cpu(), slots.cpu(), want, kv_scale=0.01)
    assert torch.equal(bits(pool[1]), bits(want))
    assert not bits(pool[0]).any() and not bits(pool[2]).any()


def test_graph_replay_with_new_slots():
    g = torch.Generator().manual_seed(4)
    kv = torch.zeros(16, 64, 576, dtype=torch.bfloat16, device="cuda")
    ckv, kpe = torch.zeros(32, 512, device="cuda"), torch.zeros(32, 64, device="cuda")
    slots = torch.zeros(32, dtype=torch.long, device="cuda")
    fm.mla_append_kv(ckv, kpe, slots, kv)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.mla_append_kv(ckv, kpe, slots, kv)
    want = torch.zeros(16, 64, 576, dtype=torch.bfloat16)
    for _ in range(3):
        ckv.copy_(torch.randn(32, 512, generator=g))
        kpe.copy_(torch.randn(32, 64, generator=g))
        new = torch.randperm(16 * 64, generator=g)[:32]
        slots.copy_(new)
        graph.replay()
        fm.mla_append_kv(ckv.cpu(), kpe.cpu(), new, want)
    torch.cuda.synchronize()
    assert torch.equal(kv.cpu(), want)


def cuda_or_none(t):
    return None if t is None else t.cuda()


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kv_dtype, rope_dtype", LAYOUTS)
@pytest.mark.parametrize("src", SOURCES)
def test_rope_kernel_matches_reference(rng, n, interleaved, kv_dtype, rope_dtype, src):
    """Rotation fused into the append; some positions past the table and negative (those tokens skipped, as
    the reference does), padding slots, values past 448 * scale (saturation)."""
    seed, g = rng
    page = PAGE_SIZES[(n + SOURCES.index(src)) % len(PAGE_SIZES)]
    table_dtype = (torch.float32, torch.bfloat16, torch.float16)[n % 3]
    case = append_rope_case(g, n, page, kv_dtype, rope_dtype, src, table_dtype, spread=40.0)
    kv, kpe_cache, ckv, kpe, slots, positions, table = case
    if n > 2:
        positions[2] = table.shape[0]
        positions[-1] = -3
    scale = 0.05 if FP8 in (kv_dtype, rope_dtype) else None
    gpu = [kv.cuda(), cuda_or_none(kpe_cache)]
    gscale = None if scale is None else torch.tensor([scale]).cuda()
    fm.mla_append_kv(
        ckv.cuda(), kpe.cuda(), slots.cuda(), gpu[0], kpe_cache=gpu[1], kv_scale=gscale,
        positions=positions.cuda(), cos_sin_cache=table.cuda(), rope_interleaved=interleaved,
    )  # fmt: skip
    tscale = None if scale is None else torch.tensor(scale)
    ref.append_kv_rope(ckv, kpe, slots, kv, positions, table, interleaved, kpe_cache, tscale)
    assert torch.equal(bits(gpu[0]), bits(kv)), seed
    if kpe_cache is not None:
        assert torch.equal(bits(gpu[1]), bits(kpe_cache)), seed


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_unaligned_rows_and_strided_table(rng, interleaved):
    """Rows off a 16-byte boundary (the element path, partner channels included), int32 positions and slots,
    a table row stride past 64; the public CPU op as the reference."""
    seed, g = rng
    n, page = 77, 32
    kv, _ = make_cache(8, page, FP8, None)
    src = torch.randn(n, 579, generator=g).half()
    ckv, kpe = src[:, 1:513], src[:, 515:579]
    slots = torch.randperm(8 * page, generator=g)[:n].int()
    positions = torch.randint(0, 50, (n,), generator=g).int()
    wide = torch.zeros(50, 70, dtype=torch.bfloat16)
    wide[:, 5:69] = cos_sin_table(g, 50, torch.bfloat16)
    table = wide[:, 5:69]
    gkv = kv.cuda()
    kw = dict(kv_scale=0.03, rope_interleaved=interleaved)
    fm.mla_append_kv(ckv.cuda(), kpe.cuda(), slots.cuda(), gkv, positions=positions.cuda(),
                     cos_sin_cache=wide.cuda()[:, 5:69], **kw)  # fmt: skip
    fm.mla_append_kv(ckv, kpe, slots, kv, positions=positions, cos_sin_cache=table, **kw)
    assert torch.equal(bits(gkv), bits(kv)), seed


def test_rope_graph_replay_with_new_positions():
    g = torch.Generator().manual_seed(5)
    n, max_pos = 48, 4096
    kv = torch.zeros(8, 64, 576, dtype=FP8, device="cuda")
    table = cos_sin_table(g, max_pos).cuda()
    ckv, kpe = torch.zeros(n, 512, device="cuda"), torch.zeros(n, 64, device="cuda")
    slots = torch.zeros(n, dtype=torch.long, device="cuda")
    positions = torch.zeros(n, dtype=torch.long, device="cuda")
    scale = torch.tensor([0.02], device="cuda")

    def call():
        fm.mla_append_kv(ckv, kpe, slots, kv, kv_scale=scale, positions=positions, cos_sin_cache=table)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    want = torch.zeros(8, 64, 576, dtype=FP8)
    # The eager call above wrote slot 0 (zero rows rotated: signed zeros where a cosine or sine is negative).
    fm.mla_append_kv(ckv.cpu(), kpe.cpu(), slots.cpu(), want, kv_scale=0.02, positions=positions.cpu(),
                     cos_sin_cache=table.cpu())  # fmt: skip
    for _ in range(3):
        ckv.copy_(torch.randn(n, 512, generator=g))
        kpe.copy_(torch.randn(n, 64, generator=g))
        new_slots = torch.randperm(8 * 64, generator=g)[:n]
        new_positions = torch.randint(0, max_pos, (n,), generator=g)
        slots.copy_(new_slots)
        positions.copy_(new_positions)
        graph.replay()
        fm.mla_append_kv(ckv.cpu(), kpe.cpu(), new_slots, want, kv_scale=0.02, positions=new_positions,
                         cos_sin_cache=table.cpu())  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(bits(kv.cpu()), bits(want))
