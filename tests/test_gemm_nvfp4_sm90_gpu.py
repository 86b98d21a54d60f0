"""The Hopper CUDA kernel of the NVFP4 grouped GEMM (moe/gemm_nvfp4_sm90.py) against float64 references on the
dequantized weights: masked capacities across every token tile, the prefill tiles included (and past them,
several tiles per group, one CTA after the other or side by side), the contiguous layout with and without padding,
partial K stages and idle warpgroups, every activation, bf16 and fp32 output, DeepSeek-V3's prefill shapes, and
every E2M1 code under every finite E4M3 scale bit for bit."""

import pytest
import torch
from gemm_cases import contiguous_layout, owned_rows, rel_err
from nvfp4_cases import every_code_weights, grouped_reference, nvfp4_weights

import flashinfer_moe as fm
from flashinfer_moe import reference_quant as rq
from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90

pytestmark = pytest.mark.gpu
DEV = "cuda"
OUT_TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-3}


@pytest.fixture(autouse=True)
def _hopper():
    """On sm_90a only."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is sm_90a")


def _assert_taken(a, w, out, offsets, capacity, act):
    act_code = {None: 0, "silu": 1, "clamped_silu": 2}[act]
    assert sm90.usable(
        a.reshape(-1, a.shape[-1]), w.data, out.view(-1, out.shape[-1]), offsets, capacity, act_code, True
    )


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, "silu", "clamped_silu"])
@pytest.mark.parametrize("capacity", [1, 5, 8, 16, 31, 64, 100, 128, 300, 600])
@pytest.mark.parametrize("k", [320, 512])
def test_masked(rng, k, capacity, act, out_dtype, split):
    """n = 192 output columns: the second CTA column's second warpgroup has no rows; K = 320: a partial stage (and,
    from 32-token tiles on, block scales by cp.async beside the TMA's boxes), K = 512: every box by TMA; K-permuted
    weights and split bits; from 100 rows the prefill tiles (128 tokens at 100 and 128 rows, 256 at 300 and 600: two
    and three CTAs along a group)."""
    seed, g = rng
    num_experts, n = 5, 192
    gated = act is not None
    a = torch.randn(num_experts, capacity, k, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, split_bits=split)
    given = torch.tensor([capacity, 0, 1, capacity // 2, capacity + 5], dtype=torch.int32)  # past C: clamped
    counts = given.clamp(max=capacity)
    out = torch.full((num_experts, capacity, n), float("nan"), dtype=out_dtype, device=DEV)
    _assert_taken(a, wp, out, None, capacity, act)
    fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, given.to(DEV), activation=act, out_dtype=out_dtype, out=out)
    torch.cuda.synchronize()
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = grouped_reference(a, w, s, gs, counts, offsets, act).view(num_experts, capacity, -1).cpu()
    got = out.cpu()
    for e, c in enumerate(counts.tolist()):
        if c:
            assert rel_err(got[e, :c], want[e, :c]) < OUT_TOL[out_dtype], (seed, e)
        assert got[e, c:].isnan().all(), "slots past the count must keep the poison"


# The last two have fewer rows than experts at block_rows 1 and 2 (the kernel's grid then has a CTA row per
# row, each serving the group that starts there): leading and trailing empty experts, padding rows, and a group
# of 20 rows (three 8-token tiles).
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("block_rows", [1, 2, 128])
@pytest.mark.parametrize(
    "counts",
    [
        [0, 1, 7, 33, 0, 2],
        [3],
        [70, 0, 0, 1],
        [0, 1, 0, 0, 2, 0, 0, 1, 0, 0, 0, 3],
        [0] * 10 + [20] + [0] * 19,
        [200, 5, 130],  # the 128-token prefill tile, two tiles a group
        [0, 300, 1, 513, 0],  # the 256-token prefill tile, looping over a group's tiles
        [1100, 300],  # the 256-token prefill tile, three CTAs along each group
    ],
)
def test_contiguous(rng, counts, block_rows, act, split):
    seed, g = rng
    n, k = 256, 448
    gated = act is not None
    layout = contiguous_layout(counts, block_rows, DEV)
    a = torch.randn(layout.num_rows, k, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(len(counts), 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, split_bits=split)
    out = torch.full((layout.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert sm90.usable(a, wp.data, out, layout.expert_offsets, 2**31 - 1, int(gated), True)
    fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, activation=act, out=out)
    torch.cuda.synchronize()
    counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    owned = owned_rows(counts_t, offsets, layout.num_rows)
    want = grouped_reference(a, w, s, gs, counts_t, offsets, act)
    if owned.any():
        assert rel_err(out.cpu()[owned], want.cpu()[owned]) < 1e-2, seed
    assert out.cpu()[~owned].isnan().all(), "rows no expert owns must keep the poison"


def test_deepseek_decode_shape(rng):
    """GEMM1 of a DeepSeek-V3 expert at decode: (2 I, H) = (4096, 7168), 16 rows per expert."""
    seed, g = rng
    num_experts, capacity, inter, hidden = 3, 16, 2048, 7168
    a = torch.randn(num_experts, capacity, hidden, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, 2 * inter, hidden, g, gated=True))
    counts = torch.tensor([16, 3, 11], dtype=torch.int32)
    out = torch.full((num_experts, capacity, inter), float("nan"), dtype=torch.bfloat16, device=DEV)
    fm.grouped_gemm_nvfp4_masked(a, fm.pack_nvfp4_weights(w), s, gs, counts.to(DEV), activation="silu", out=out)
    torch.cuda.synchronize()
    offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    want = grouped_reference(a, w, s, gs, counts, offsets, "silu").view(num_experts, capacity, -1).cpu()
    for e, c in enumerate(counts.tolist()):
        assert rel_err(out.cpu()[e, :c], want[e, :c]) < 1e-2, (seed, e)


@pytest.mark.parametrize("num_experts", [4, 2, 1])
@pytest.mark.parametrize("split", [False, True])
def test_every_code_expands_exactly(split, num_experts):
    """a = I (64 rows per expert and four experts, a decode tile; 128 and two, or 256 and one, the prefill tiles;
    covering K = 256): the output is the expanded weights themselves, every E2M1 code under every finite E4M3
    scale (subnormals and zero included) and their signs, bit for bit the reference's dequantization (with split
    bits, code 1 is a bf16 subnormal before its scale)."""
    k = 256
    w, scales, n = every_code_weights(k)
    wp = fm.pack_nvfp4_weights(w.expand(num_experts, -1, -1).contiguous().to(DEV), split_bits=split)
    rows = k // num_experts
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV).view(num_experts, rows, k)
    out = torch.full((num_experts, rows, n), float("nan"), device=DEV)
    counts = torch.full((num_experts,), rows, dtype=torch.int32, device=DEV)
    s = scales.expand(num_experts, -1, -1).contiguous().to(DEV)
    ones = torch.ones(num_experts, device=DEV)
    fm.grouped_gemm_nvfp4_masked(eye, wp, s, ones, counts, out_dtype=torch.float32, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().reshape(k, n).t(), rq.dequantize_nvfp4(w, scales, 1.0)[0])


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("capacity", [1, 8, 16, 64])
def test_split_bits_equal_k_permuted_bit_for_bit(rng, capacity, act):
    """Split bits only move where the kernel finds each code and scale the products by powers of two, so the
    outputs equal the K-permuted weights' bit for bit (DeepSeek-V3's GEMM2 shape, (7168, 2048), and GEMM1's)."""
    seed, g = rng
    num_experts, k = 4, 2048
    n = 2 * 2048 if act else 7168
    a = torch.randn(num_experts, capacity, k, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, n, k, g, gated=act is not None))
    counts = torch.tensor([capacity, 0, 1, max(1, capacity // 3)], dtype=torch.int32, device=DEV)
    outs = []
    for split in (False, True):
        out = torch.full((num_experts, capacity, n // 2 if act else n), float("nan"), dtype=torch.float32, device=DEV)
        wp = fm.pack_nvfp4_weights(w, split_bits=split)
        fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts, activation=act, out_dtype=torch.float32, out=out)
        outs.append(out.cpu())
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), seed


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("n", "k", "act"), [(4096, 7168, "silu"), (7168, 2048, None)])
def test_deepseek_prefill_shapes(rng, n, k, act, split):
    """DeepSeek-V3's GEMM1 (gated) and GEMM2 on the 256-token prefill tile, contiguous groups of 700, 0, 256 and 1
    rows (a mean of 240: one CTA along each group, looping over the first group's three tiles); every element within
    bf16's rounding of its row's scale."""
    seed, g = rng
    counts = [700, 0, 256, 1]
    layout = contiguous_layout(counts, 1, DEV)
    a = torch.randn(layout.num_rows, k, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(len(counts), n, k, g, gated=act is not None))
    wp = fm.pack_nvfp4_weights(w, split_bits=split)
    out = torch.full((layout.num_rows, n // 2 if act else n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert sm90.usable(a, wp.data, out, layout.expert_offsets, 2**31 - 1, int(act is not None), True)
    fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, activation=act, out=out)
    torch.cuda.synchronize()
    counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    want = grouped_reference(a, w, s, gs, counts_t, offsets, act).cpu()
    got = out.cpu().double()
    row_scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert ((got - want).abs() / row_scale).max().item() < 2e-2, seed
    assert rel_err(got, want) < 1e-2, seed


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("k", [128, 192, 448, 1088])
@pytest.mark.parametrize("tile", [128, 256])
@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
def test_prefill_tiles_many_groups(rng, layout_kind, tile, k, act, split):
    """The prefill tiles over more CTAs than any Hopper GPU has SMs (n = 1536 and 24 groups: several waves),
    groups of 0 to several tiles (a CTA looping over a group's tiles), and K of 1 to 9 stages of 128 (partial ones
    too): fewer stages than the ring holds (128-token tiles: 5), just as many, or more."""
    _many_groups(rng, layout_kind, tile, k, act, split)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("k", [192, 1088])
@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
@pytest.mark.parametrize("wide", [False, True])
def test_gated_128_tile_on_two_and_four_warpgroups(rng, monkeypatch, wide, layout_kind, k, split):
    """The gated 128-token tile with each of its warpgroup counts (two: a gate and an up warpgroup; four: two of
    each, their outputs exchanged in shared memory), whichever the launch's rule would pick for the shape."""
    monkeypatch.setattr(sm90, "gated_t128_wide", lambda *args: wide)
    _many_groups(rng, layout_kind, 128, k, "silu", split)


def _many_groups(rng, layout_kind, tile, k, act, split):
    seed, g = rng
    num_experts, n = 24, 1536
    gated = act is not None
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, split_bits=split)
    counts = torch.randint(0, 2 * tile, (num_experts,), generator=g)
    counts[torch.randperm(num_experts - 3, generator=g)[:5] + 3] = 0
    counts[0], counts[1] = tile + 1, 1
    if layout_kind == "contiguous":
        # The groups' mean at 0.9 tiles, so that the tile rule picks `tile`: group 2 fills up to it, after the
        # largest random groups were halved where the others alone pass it.
        target = int(0.9 * tile * num_experts)
        while int(counts.sum()) - int(counts[2]) > target:
            counts[int(torch.argmax(counts[3:])) + 3] //= 2
        counts[2] = target - (int(counts.sum()) - int(counts[2]))
        assert sm90.tile_for_layout(int(counts.sum()), num_experts, None) == tile
        layout = contiguous_layout(counts.tolist(), 1, DEV)
        a = torch.randn(layout.num_rows, k, generator=g).bfloat16().to(DEV)
        out = torch.full((layout.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert sm90.usable(a, wp.data, out, layout.expert_offsets, 2**31 - 1, int(gated), True)
        fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, activation=act, out=out)
        counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    else:
        capacity = tile if tile == 128 else 300  # one 128-token tile a group, or two 256-token tiles
        assert sm90.tile_for_layout(num_experts * capacity, num_experts, capacity) == tile
        a = torch.randn(num_experts, capacity, k, generator=g).bfloat16().to(DEV)
        out = torch.full((num_experts, capacity, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        _assert_taken(a, wp, out, None, capacity, act)
        fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts.to(DEV, torch.int32), activation=act, out=out)
        counts_t = counts.clamp(max=capacity).int()
        offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
        a, out = a.view(-1, k), out.view(-1, n)
    torch.cuda.synchronize()
    owned = owned_rows(counts_t, offsets, out.shape[0])
    want = grouped_reference(a, w, s, gs, counts_t, offsets, act).cpu()
    assert rel_err(out.cpu()[owned], want[owned]) < 1e-2, seed
    assert out.cpu()[~owned].isnan().all(), "rows no group owns must keep the poison"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("tile", [64, 128, 256])
@pytest.mark.parametrize("layout_kind", ["contiguous", "masked"])
def test_tail_launches(rng, monkeypatch, layout_kind, tile, act, split):
    """A tile's groups split between it and the tail launches (rests of 1 .. each tail's rows past the last whole
    tile, groups no larger than a tail, and past the largest): float64 reference, poisoned rows kept, and bit for
    bit the output of one launch of the tile alone (a tile changes no sum's order)."""
    seed, g = rng
    n, k = 384, 704
    capacity = None if layout_kind == "contiguous" else {64: 64, 128: 100, 256: 600}[tile]
    tails = sm90.tail_tiles_for(tile, capacity)
    assert tails and tails[-1] < tile
    edges = sorted({1, *tails, *(t + 1 for t in tails)})
    counts = [tile * (1 + e % 2) + r for e, r in enumerate(edges)] + edges + [0, tile - 1, 2 * tile]
    num_experts = len(counts) + 5
    counts += [int(torch.randint(1, tile, (1,), generator=g)) for _ in range(num_experts - len(counts) - 1)]
    gated = act is not None
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(num_experts, 2 * n if gated else n, k, g, gated=gated))
    wp = fm.pack_nvfp4_weights(w, split_bits=split)
    if capacity is None:
        counts.append(max(1, tile * num_experts - sum(counts)))  # the mean's tile is `tile`
        counts = counts[:num_experts]
        assert sm90.tile_for_layout(sum(counts), num_experts, None) == tile
        layout = contiguous_layout(counts, 1, DEV)
        a = torch.randn(layout.num_rows, k, generator=g).bfloat16().to(DEV)
        out = torch.full((layout.num_rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert sm90.usable(a, wp.data, out, layout.expert_offsets, 2**31 - 1, int(gated), True)

        def run(out):
            fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, activation=act, out=out)

        counts_t, offsets = layout.tokens_per_expert.cpu(), layout.expert_offsets.cpu()
    else:
        counts = (counts + [capacity + 5])[:num_experts]  # one count past the capacity (clamped)
        assert sm90.tile_for_layout(num_experts * capacity, num_experts, capacity) == tile
        a = torch.randn(num_experts, capacity, k, generator=g).bfloat16().to(DEV)
        out = torch.full((num_experts, capacity, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        _assert_taken(a, wp, out, None, capacity, act)
        counts_dev = torch.tensor(counts, dtype=torch.int32, device=DEV)

        def run(out):
            fm.grouped_gemm_nvfp4_masked(a, wp, s, gs, counts_dev, activation=act, out=out)

        counts_t = torch.tensor(counts).clamp(max=capacity).int()
        offsets = torch.arange(num_experts, dtype=torch.int32) * capacity
    run(out)
    whole = torch.full_like(out, float("nan"))
    monkeypatch.setattr(sm90, "tail_tiles_for", lambda tile, capacity: ())
    run(whole)
    torch.cuda.synchronize()
    a, out, whole = a.view(-1, k), out.view(-1, n), whole.view(-1, n)
    owned = owned_rows(counts_t, offsets, out.shape[0])
    want = grouped_reference(a, w, s, gs, counts_t, offsets, act).cpu()
    assert rel_err(out.cpu()[owned], want[owned]) < 1e-2, seed
    assert out.cpu()[~owned].isnan().all(), "rows no group owns must keep the poison"
    assert torch.equal(out[owned.to(DEV)], whole[owned.to(DEV)]), seed


def test_tail_launch_below_32_tokens_is_refused(rng, monkeypatch):
    """Tiles below 32 tokens cannot take a split (their kernels take every row): the launch says so instead of
    running the rows twice."""
    from flashinfer_moe._ops import KernelLaunchError

    _, g = rng
    counts = [70, 65, 40]
    layout = contiguous_layout(counts, 1, DEV)
    a = torch.randn(layout.num_rows, 128, generator=g).bfloat16().to(DEV)
    w, s, gs = (t.to(DEV) for t in nvfp4_weights(len(counts), 64, 128, g))
    wp = fm.pack_nvfp4_weights(w, split_bits=True)
    out = torch.empty(layout.num_rows, 64, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setattr(sm90, "tail_tiles_for", lambda tile, capacity: (16,))
    with pytest.raises(KernelLaunchError, match="grouped_gemm_nvfp4"):
        fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, out=out)


def test_backend_triton_turns_it_off(monkeypatch):
    monkeypatch.setenv("FLASHINFER_MOE_GEMM_BACKEND", "triton")
    a = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(1, 64, 32, dtype=torch.uint8, device=DEV)
    assert not sm90.usable(a, w, torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV), None, 64, 0, True)
