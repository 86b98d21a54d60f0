"""Paged MLA decode on a GPU against the float64 reference: the full length mixes (1 .. 16384 in one batch),
every page size, 128 heads, s_q up to 8, bf16/fp16/FP8 caches in both layouts, CUDA-graph replay of plan +
decode with changed lengths, and the FP8 cache's accuracy against the bf16 one."""

from __future__ import annotations

import pytest
import torch
from test_mla_decode import (
    FP8,
    GRAPH_CAPACITY,
    GRAPH_REPLAYS,
    assert_close,
    lse_tol,
    make_case,
    reference,
    run_decode,
)

from flashinfer_moe import reference_mla as ref
from flashinfer_moe.mla import decode as D
from flashinfer_moe.mla import decode_sm90

pytestmark = pytest.mark.gpu
DEV = "cuda"
MIX = [1, 63, 64, 65, 4097, 16384]
SM_SCALE = 192**-0.5


@pytest.fixture(autouse=True)
def exact_products(monkeypatch):
    """The FP8 pages' products as exact as the bf16 output tolerance asks: the E4M3 softmax weights (the default
    at 17-32 rows with bf16 queries) have their own bound, in test_mla_decode_pv8_gpu.py."""
    monkeypatch.setenv("FLASHINFER_MOE_MLA_FP8_PV", "0")


def _backend(monkeypatch, backend: str, case) -> None:
    """``triton`` keeps the call on the Triton kernel; ``auto`` must take a CUDA one on Hopper (bf16/fp16 pages, and
    FP8 pages of both kinds' rows); ``wide``: FP8 pages of up to 32 rows on the 64-row CUDA kernel, not the
    narrow one."""
    if backend == "triton":
        monkeypatch.setenv("FLASHINFER_MOE_MLA_BACKEND", "triton")
        return
    if backend == "wide":
        monkeypatch.setattr(decode_sm90, "NARROW_MAX_ROWS", 0)
    ckv, kpe = D._caches(case["kv_cache"], case["kpe_cache"], case["q_nope"])
    if torch.cuda.get_device_capability() == (9, 0) and (ckv.dtype != FP8 or kpe.dtype == FP8):
        assert decode_sm90.usable(case["q_nope"], ckv, kpe, decode_sm90.BLOCK_M), "the CUDA kernel must take it"


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("page", D.PAGE_SIZES)
@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_full_mix_every_page_size(rng, monkeypatch, page, s_q, backend):
    seed, g = rng
    case = make_case(g, MIX, s_q, 16, page, torch.bfloat16, torch.bfloat16, device=DEV)
    _backend(monkeypatch, backend, case)
    out, lse = run_decode(case, SM_SCALE, num_sms=None)
    assert_close(
        out, lse, *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case)
    )


def _assert_tma_equals_cp_async(monkeypatch, case, seed) -> None:
    """Decodes ``case`` with the tiles by TMA / bulk copies wherever the kernels can take them (``TMA_MIN_PAGE`` and
    ``BULK_MIN_PAGE`` 1) and by cp.async token rows (0): the first against float64, the two bit-equal."""
    _backend(monkeypatch, "auto", case)
    got = {}
    for tma in (True, False):
        monkeypatch.setattr(decode_sm90, "TMA_MIN_PAGE", 1 if tma else 0)
        monkeypatch.setattr(decode_sm90, "BULK_MIN_PAGE", 1 if tma else 0)
        got[tma] = run_decode(case, SM_SCALE, num_sms=None)
    assert_close(
        *got[True], *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case)
    )
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1]), f"seed {seed}"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("page", D.PAGE_SIZES)
def test_tma_tiles_equal_cp_async_tiles(rng, monkeypatch, page, split):
    """The 64-row kernel's tiles by TMA (at every page size here; by default from TMA_MIN_PAGE on) and by cp.async
    token rows fill the same images, so the outputs are bit-equal; both against float64 on the full length mix
    (rows past each sequence's end poisoned with NaN), 64 heads x 2 new tokens, one- and two-tensor caches."""
    seed, g = rng
    case = make_case(g, MIX, 2, 64, page, torch.bfloat16, torch.bfloat16, split=split, device=DEV)
    _assert_tma_equals_cp_async(monkeypatch, case, seed)


@pytest.mark.parametrize("page", D.PAGE_SIZES)
@pytest.mark.parametrize("heads, s_q", [(128, 1), (33, 3), (16, 1)])
def test_fp8_bulk_tiles_equal_cp_async_tiles(rng, monkeypatch, page, heads, s_q):
    """FP8 pages of the one-tensor cache, on the 64-row kernel with its producer warpgroup (more than 32 rows) and on
    the narrow kernel (16 rows): a tile by bulk copies (one at pages of 64 tokens and up; below that one a page on
    the 64-row kernel, token rows on the narrow one), its rows past the sequence's end (NaN in the poisoned pool, or
    not copied) cleared while widening, against the cp.async token rows: bit-equal, and against float64."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, FP8, device=DEV)
    monkeypatch.setattr(decode_sm90, "NARROW_RS", False)  # the narrow kernel with fp16 stages (bulk or token rows)
    _assert_tma_equals_cp_async(monkeypatch, case, seed)


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (16, 2), (5, 3), (7, 1)])
@pytest.mark.parametrize("num_sms", [None, 3])
def test_fp8_narrow_two_stages_equal_one(rng, monkeypatch, page, heads, s_q, num_sms):
    """The narrow kernel (FP8 pages, up to 32 rows) with its tiles by bulk copies (the one-tensor cache, pages of 64
    tokens and up) and two fp16 stages with half-tile raw buffers, and with one stage and whole-tile ones: the same
    products in the same order, so bit-equal outputs and LSE, on the full length mix with NaN-poisoned pools,
    planned for every SM or for 3 (each CTA then walks many sequences, so the stages' phases carry across
    pieces), and the first against float64."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, FP8, device=DEV)
    _backend(monkeypatch, "auto", case)
    monkeypatch.setattr(decode_sm90, "NARROW_RS", False)
    got = {}
    for stages in (2, 1):
        monkeypatch.setattr(decode_sm90, "NARROW_STAGES", stages)
        got[stages] = run_decode(case, SM_SCALE, num_sms=num_sms)
    assert_close(*got[2], *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case))
    assert torch.equal(got[2][0], got[1][0]) and torch.equal(got[2][1], got[1][1]), f"seed {seed}"


@pytest.mark.parametrize("page, split", [(1, False), (16, True), (64, False), (128, False), (64, True)])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (16, 2), (32, 1), (5, 3), (7, 1), (10, 3)])
@pytest.mark.parametrize("num_sms", [None, 3])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_narrow_without_images(rng, monkeypatch, page, split, heads, s_q, num_sms, q_dtype):
    """The narrow kernel without fp16 images (FP8 pages, bf16 queries; scores by FP8 wgmma with the queries in two
    FP8 parts, values widened in registers; tiles by TMA for the one-tensor cache from page 64 on, else by cp.async
    token rows) against float64 on the full length mix with NaN-poisoned pools, planned for every SM or for 3, and
    against the kernel with fp16 stages, which rounds the queries otherwise: equal outputs would mean that the call
    fell back to it (as fp16 queries do)."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, q_dtype, FP8, split=split, device=DEV)
    _backend(monkeypatch, "auto", case)
    got = {}
    for rs in (True, False):
        monkeypatch.setattr(decode_sm90, "NARROW_RS", rs)
        got[rs] = run_decode(case, SM_SCALE, num_sms=num_sms)
    want = reference(case, SM_SCALE, device=DEV)
    for rs in (True, False):
        assert_close(*got[rs], *want, q_dtype, f"seed {seed}, NARROW_RS {rs}", lse_tol=lse_tol(case))
    if q_dtype == torch.bfloat16:
        assert not torch.equal(got[True][0], got[False][0]), f"seed {seed}: the same output as the fp16 stages"


def _tiles_by_kind(case, page) -> tuple[int, int]:
    """The whole 64-token tiles of ``case`` whose pages' block-table entries are consecutive (runs), and the others."""
    runs = others = 0
    table = case["block_table"].cpu()
    for b, n in enumerate(case["seq_lens"].tolist()):
        for t0 in range(0, n - 63, 64):
            entries = table[b, t0 // page : (t0 + 64 + page - 1) // page]
            consecutive = torch.equal(entries - entries[0], torch.arange(len(entries), dtype=entries.dtype))
            runs, others = runs + consecutive, others + (not consecutive)
    return runs, others


@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize(
    "cache, heads, s_q, split, backend",
    [
        (torch.bfloat16, 16, 1, False, "auto"),
        (torch.bfloat16, 64, 2, True, "auto"),
        (torch.float16, 128, 1, False, "auto"),
        (FP8, 128, 1, False, "auto"),  # the producer warpgroup: a run tile as one bulk copy
        (FP8, 33, 3, False, "auto"),
        (FP8, 16, 1, False, "wide"),  # up to 32 rows on the 64-row kernel: consumer 1 copies
        (FP8, 64, 1, True, "auto"),  # two tensors: no run tiles (not one contiguous range)
        (FP8, 16, 1, False, "auto"),  # the narrow kernel without fp16 images: pages 16, 32 by 16-row TMA boxes
        (FP8, 7, 3, False, "auto"),  # the same, 32 rows (21 used)
        (FP8, 16, 2, True, "auto"),  # the same, two tensors: token rows
    ],
)
@pytest.mark.parametrize("num_sms", [None, 3])
def test_run_tiles_equal_token_rows(rng, monkeypatch, page, cache, heads, s_q, split, backend, num_sms):
    """Pages in order but for a few swapped ones (so that some whole tiles are runs of consecutive pages and some
    not, the shared prefix page breaking one too): run tiles (TMA boxes of the tile's 64 rows, or one bulk copy; in
    the narrow FP8 kernel at pages 16 and 32, a warp's 16 rows by TMA boxes, beside token rows where a sequence ends)
    fill the same images as token rows, so the outputs are bit-equal; both against float64. Planned for every SM or
    for 3 (each CTA then walks many sequences, so the stages' barriers carry across pieces)."""
    seed, g = rng
    q_dtype = torch.float16 if cache == torch.float16 else torch.bfloat16
    case = make_case(g, MIX, s_q, heads, page, q_dtype, cache, split=split, runs=True, device=DEV)
    runs, others = _tiles_by_kind(case, page)
    assert runs > 0 and others > 0, (runs, others)
    _backend(monkeypatch, backend, case)
    got = {}
    for run_tiles in (True, False):
        monkeypatch.setattr(decode_sm90, "RUN_TILES", run_tiles)
        got[run_tiles] = run_decode(case, SM_SCALE, num_sms=num_sms)
    assert_close(*got[True], *reference(case, SM_SCALE, device=DEV), q_dtype, f"seed {seed}", lse_tol=lse_tol(case))
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1]), f"seed {seed}"


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (32, 1), (7, 2)])
def test_fp8_narrow_without_images_tma_equals_cp_async(rng, monkeypatch, page, heads, s_q):
    """The narrow kernel without fp16 images with its tiles by TMA (rows past a sequence's end as the poisoned
    page holds them, masked) and by cp.async token rows (zeros there): bit-equal, and against float64."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, FP8, device=DEV)
    _assert_tma_equals_cp_async(monkeypatch, case, seed)


def _rising_case(g, heads, s_q, page, cache_dtype=FP8):
    """A case whose scores jump late in each sequence: every token's latent is 0.25 sign(u) (plus noise 0.05)
    and the last one that all new tokens see 0.5 sign(u), with head h's queries f_h u (f_h from 0.7 to 1.3), so the
    jump is about 7-14 (log2 of the softmax's factor) above the running maximum depending on the head: below the
    kernels' slack of 8 (P above 1) and past it (the maxima move while the earlier tokens still carry most of the
    weight)."""
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, cache_dtype, device="cpu")
    scale = case["kv_scale"] or 1.0  # bf16 caches have none
    kv = case["kv_cache"].double()
    u = torch.randn(512, generator=g, dtype=torch.float64)
    table = case["block_table"]
    for b, n in enumerate(MIX):
        t = torch.arange(n)
        pid, slot = table[b, t // page].long(), t % page
        level = torch.full((n, 1), 0.25, dtype=torch.float64)
        level[max(n - s_q, 0)] = 0.5
        lat = level * u.sign() + 0.05 * torch.randn(n, 512, generator=g, dtype=torch.float64)
        kv[pid, slot, :512] = lat / scale
        kv[pid, slot, 512:] = 0.1 * torch.randn(n, 64, generator=g, dtype=torch.float64) / scale
    f = torch.linspace(0.7, 1.3, heads, dtype=torch.float64)[None, None, :, None]
    q = f * u + 0.02 * torch.randn(len(MIX), s_q, heads, 512, generator=g, dtype=torch.float64)
    case.update(
        kv_cache=kv.to(cache_dtype).to(DEV),
        q_nope=q.to(torch.bfloat16).to(DEV),
        q_pe=(0.1 * case["q_pe"]).to(DEV),
        block_table=table.to(DEV),
        seq_lens=case["seq_lens"].to(DEV),
    )
    return case


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (32, 1), (16, 2), (7, 3)])
@pytest.mark.parametrize("num_sms", [None, 3])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_narrow_rising_maxima(rng, monkeypatch, page, heads, s_q, num_sms, q_dtype):
    """The narrow kernels (bf16 queries: without fp16 images; fp16: fp16 stages) where a sequence's last scores jump
    above all before by less and by more than the running maxima's slack: against float64."""
    seed, g = rng
    case = _rising_case(g, heads, s_q, page)
    case["q_nope"], case["q_pe"] = case["q_nope"].to(q_dtype), case["q_pe"].to(q_dtype)
    _backend(monkeypatch, "auto", case)
    got = run_decode(case, SM_SCALE, num_sms=num_sms)
    assert_close(*got, *reference(case, SM_SCALE, device=DEV), q_dtype, f"seed {seed}", lse_tol=lse_tol(case))


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("heads, s_q", [(64, 1), (33, 3), (128, 1)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("num_sms", [None, 3])
def test_rising_maxima_64_rows(rng, page, heads, s_q, cache_dtype, num_sms):
    """The 64-row kernel (bf16 pages; FP8 pages with its producer) where a sequence's last scores jump above all
    before by less and by more than the running maxima's slack: against float64."""
    seed, g = rng
    case = _rising_case(g, heads, s_q, page, cache_dtype)
    got = run_decode(case, SM_SCALE, num_sms=num_sms)
    assert_close(*got, *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (16, 2), (32, 1), (64, 1), (128, 1)])
def test_equal_lengths_go_whole(rng, cache_dtype, heads, s_q):
    """Equal lengths, as many sequences as programs (three programs of 3, 3 and 1 sequences at 128 rows): the plan
    takes them whole, and every kernel (narrow FP8, 64-row) against float64."""
    seed, g = rng
    lens, sms = [700] * 7, 7
    case = make_case(g, lens, s_q, heads, 64, torch.bfloat16, cache_dtype, device=DEV)
    plan = D.mla_decode_plan(case["seq_lens"], s_q, heads, num_sms=sms, kv_dtype=cache_dtype)
    assert plan.sched[2 + 2 * len(lens) : 2 + 3 * len(lens)].tolist() == [1] * len(lens), "a sequence was split"
    got = run_decode(case, SM_SCALE, num_sms=sms)
    assert_close(*got, *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case))


# Rows (heads x s_q) across the kernels' bounds: FP8 up to 32 rows on the narrow kernel, more on the 64-row one with
# its producer warpgroup (64: one full row block, 99: a partial second one); bf16 on the 64-row one throughout.
@pytest.mark.parametrize("heads, s_q", [(128, 1), (128, 2), (64, 2), (32, 2), (33, 3), (32, 1), (16, 8), (3, 5)])
@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp8-bf16rope"])
@pytest.mark.parametrize("page", [1, 64])
def test_heads_and_caches(rng, heads, s_q, cache, page):
    seed, g = rng
    cache_dtype = FP8 if cache.startswith("fp8") else torch.bfloat16
    split = cache == "fp8-bf16rope"
    case = make_case(
        g,
        [1, 65, 700, 3000],
        s_q,
        heads,
        page,
        torch.bfloat16,
        cache_dtype,
        split=split,
        kpe_dtype=torch.bfloat16 if split else None,
        device=DEV,
    )
    if torch.cuda.get_device_capability() == (9, 0):  # which kernel takes it (flashinfer_moe/mla/decode_sm90.py)
        ckv, kpe = D._caches(case["kv_cache"], case["kpe_cache"], case["q_nope"])
        want = not split  # FP8 latent beside bf16 rope stays on Triton; all else takes a CUDA kernel
        assert decode_sm90.usable(case["q_nope"], ckv, kpe, decode_sm90.BLOCK_M) == want
    out, lse = run_decode(case, SM_SCALE, num_sms=None, scale_tensor=split)
    assert_close(
        out, lse, *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case)
    )


@pytest.mark.parametrize("backend", ["auto", "wide"])
@pytest.mark.parametrize("heads, s_q", [(16, 1), (16, 2), (13, 2), (1, 1), (8, 4), (3, 5)])
@pytest.mark.parametrize("page", D.PAGE_SIZES)
def test_fp8_up_to_32_rows(rng, monkeypatch, page, heads, s_q, backend):
    """FP8 pages with up to 32 (new token, head) rows, the narrow kernel's (16 or 32 rows as wgmma's N side), at
    every page size over the full length mix; ``wide``: the same calls on the 64-row kernel."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, FP8, device=DEV)
    _backend(monkeypatch, backend, case)
    out, lse = run_decode(case, SM_SCALE, num_sms=None, scale_tensor=heads % 2 == 1)
    assert_close(
        out, lse, *reference(case, SM_SCALE, device=DEV), torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case)
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_fp8_up_to_32_rows_fp16_split(rng, causal, num_sms):
    """The narrow kernel with fp16 queries, causal or not, with one program (nothing split), a few (everything
    split) and the device's count."""
    seed, g = rng
    case = make_case(g, [0, 1, 63, 64, 65, 4097], 4, 7, 16, torch.float16, FP8, device=DEV)
    out, lse = run_decode(case, SM_SCALE, causal=causal, num_sms=num_sms or D._sm_count(0))
    assert_close(
        out, lse, *reference(case, SM_SCALE, causal, device=DEV), torch.float16, f"seed {seed}", lse_tol=lse_tol(case)
    )


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_sms", [None, 1, 7])
def test_fp16_split_counts_and_masks(rng, monkeypatch, causal, num_sms, backend):
    """fp16 queries; one program (nothing split), a few (everything split), the device's count."""
    seed, g = rng
    case = make_case(g, [0, 1, 63, 64, 65, 4097], 4, 8, 16, torch.float16, torch.float16, split=True, device=DEV)
    _backend(monkeypatch, backend, case)
    out, lse = run_decode(case, SM_SCALE, causal=causal, num_sms=num_sms or D._sm_count(0))
    assert_close(
        out, lse, *reference(case, SM_SCALE, causal, device=DEV), torch.float16, f"seed {seed}", lse_tol=lse_tol(case)
    )


@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16])
def test_cuda_graph_replays_plan_and_decode_with_new_lengths(rng, cache_dtype):
    seed, g = rng
    longest = GRAPH_CAPACITY  # the block table's capacity per sequence
    case = make_case(g, longest, 2, 16, 64, torch.bfloat16, cache_dtype, device=DEV)
    seq_lens = case["seq_lens"]
    scale = torch.tensor([case["kv_scale"]], device=DEV) if cache_dtype == FP8 else None
    q = case["q_nope"]
    plan = D.mla_decode_plan(seq_lens, 2, 16, kv_dtype=cache_dtype)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=DEV)

    def step():
        D.mla_decode_plan(seq_lens, 2, 16, kv_dtype=cache_dtype, out=plan)
        D.mla_decode(
            q,
            case["q_pe"],
            case["kv_cache"],
            case["block_table"],
            seq_lens,
            SM_SCALE,
            kv_scale=scale,
            plan=plan,
            out=out,
            lse=lse,
        )

    step()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    for lens in GRAPH_REPLAYS:
        # A length past its table row would send the kernel to a poisoned page id (an illegal address).
        assert all(n <= c for n, c in zip(lens, longest, strict=True)), f"replay lengths {lens} exceed {longest}"
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(
            out,
            lse,
            *reference(case, SM_SCALE, device=DEV),
            torch.bfloat16,
            f"lens {lens} seed {seed}",
            lse_tol=lse_tol(case),
        )


def _fp8_pages(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    scale = kv.float().abs().amax().item() / 448
    return (kv.float() / scale).to(FP8), scale


@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_cache_accuracy_against_bf16(rng, heads):
    """The FP8 cache (per-tensor scale from the amax) against the bf16 cache it was quantized from: the error
    of both paths against the float64 attention over the bf16 values. Measured on N(0, 1) data: relative L2
    error 2-5% (the quantization's own; the kernel's arithmetic adds < 1% of it). Bound: 8%, and within 1.1x
    of the reference computed in float64 on the same FP8 values."""
    seed, g = rng
    case = make_case(g, [4097, 16384, 700, 65], 1, heads, 64, torch.bfloat16, torch.bfloat16, device=DEV)
    exact, _ = reference(case, SM_SCALE, device=DEV)
    bf16_out, _ = run_decode(case, SM_SCALE, num_sms=None)
    kv8, scale = _fp8_pages(case["kv_cache"].nan_to_num())
    case8 = dict(case, kv_cache=kv8, kv_scale=scale)
    fp8_out, _ = run_decode(case8, SM_SCALE, num_sms=None)
    fp8_exact, _ = reference(case8, SM_SCALE, device=DEV)

    def rel(x):
        return ((x.double() - exact).norm() / exact.norm()).item()

    print(
        f"\nheads {heads}: rel L2 error vs float64 of the bf16 cache: bf16 path {rel(bf16_out):.4f}, "
        f"fp8 path {rel(fp8_out):.4f} (fp8 values in float64: {rel(fp8_exact):.4f})"
    )
    assert rel(bf16_out) < 0.01, seed
    assert rel(fp8_out) < 0.08 and rel(fp8_out) < 1.1 * rel(fp8_exact) + 0.005, seed


def test_validate_reads_lengths_on_request():
    case = make_case(torch.Generator().manual_seed(0), [5, 64], 1, 2, 16, torch.bfloat16, torch.bfloat16, device=DEV)
    case["seq_lens"][1] = 10_000
    with pytest.raises(ValueError, match="seq_lens must fit the block table"):
        D.mla_decode(
            case["q_nope"], case["q_pe"], case["kv_cache"], case["block_table"], case["seq_lens"], 0.1, validate=True
        )


def test_reference_runs_on_device():
    """The float64 reference used above agrees with itself on CPU (guards the device handling of the oracle)."""
    case = make_case(torch.Generator().manual_seed(1), [3, 70], 2, 2, 16, torch.bfloat16, FP8, device=DEV)
    a = reference(case, 0.1, device=DEV)
    b = reference(case, 0.1)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-9, atol=1e-9)
    assert ref.LATENT == 512


# ------------------------------------------------------------------------------------- TMA tile loads


def _old_path(monkeypatch):
    """The gathered pointer loads forced where the layout would take the TMA ones."""
    monkeypatch.setattr(D, "TMA_CONFIGS", {})


def _two_paths(case, monkeypatch, **kw):
    """``(new, old)``: the TMA loads (FP8 pages, which the default keeps on the gathered loads, forced with the
    bf16 configuration) and the gathered loads; both on the Triton kernel."""
    monkeypatch.setenv("FLASHINFER_MOE_MLA_BACKEND", "triton")
    ckv, kpe = D._caches(case["kv_cache"], case["kpe_cache"], case["q_nope"])
    block_m = D.block_m_for(case["q_nope"].shape[1] * case["q_nope"].shape[2])
    monkeypatch.setitem(D.TMA_CONFIGS, (block_m, ckv.dtype == FP8), D.TMA_CONFIGS[(block_m, False)])
    assert D.tma_layout(ckv, kpe, D.TMA_CONFIGS[(block_m, False)]["BLOCK_N"]), "the case must take the TMA path"
    new = run_decode(case, SM_SCALE, num_sms=None, **kw)
    with monkeypatch.context() as m:
        _old_path(m)
        old = run_decode(case, SM_SCALE, num_sms=None, **kw)
    return new, old


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("layout", ["one-tensor", "two-tensor"])
def test_tma_tiles_full_mix(rng, monkeypatch, page, s_q, heads, layout):
    """The TMA tile loads (transposed products for 16 heads, plain ones for 128) on the full length mix, both
    cache layouts, against float64; the gathered path on the same case too."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, torch.bfloat16, torch.bfloat16, split=layout == "two-tensor", device=DEV)
    want = reference(case, SM_SCALE, device=DEV)
    (out, lse), (old_out, old_lse) = _two_paths(case, monkeypatch)
    assert_close(out, lse, *want, torch.bfloat16, f"tma, seed {seed}", lse_tol=lse_tol(case))
    assert_close(old_out, old_lse, *want, torch.bfloat16, f"gathered, seed {seed}", lse_tol=lse_tol(case))


@pytest.mark.parametrize("heads, s_q", [(16, 1), (16, 2), (32, 1), (128, 1), (64, 2), (3, 5)])
@pytest.mark.parametrize("cache", ["fp8", "fp8-bf16rope", "fp16"])
def test_tma_tiles_fp8_fp16_and_row_blocks(rng, monkeypatch, heads, s_q, cache):
    """FP8 pages (one tensor; latent with a bf16 rope; TMA forced), fp16, every row block (16, 32, 64 rows)."""
    seed, g = rng
    q_dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    cache_dtype = FP8 if cache.startswith("fp8") else q_dtype
    split = cache == "fp8-bf16rope"
    case = make_case(
        g, [1, 63, 64, 65, 700, 4097], s_q, heads, 64, q_dtype, cache_dtype, split=split,
        kpe_dtype=torch.bfloat16 if split else None, device=DEV,
    )  # fmt: skip
    want = reference(case, SM_SCALE, device=DEV)
    (out, lse), (old_out, old_lse) = _two_paths(case, monkeypatch, scale_tensor=split)
    assert_close(out, lse, *want, q_dtype, f"tma, seed {seed}", lse_tol=lse_tol(case))
    assert_close(old_out, old_lse, *want, q_dtype, f"gathered, seed {seed}", lse_tol=lse_tol(case))


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_tma_refused_layouts_still_decode(rng, monkeypatch, backend):
    """A page-strided pool (one layer's pages interleaved with another's) and a misaligned base, page 64: the
    gathered loads (Triton), or the CUDA kernel where it takes them (the page-strided pool), against float64."""
    seed, g = rng
    if backend == "triton":
        monkeypatch.setenv("FLASHINFER_MOE_MLA_BACKEND", "triton")
    case = make_case(g, [1, 64, 65, 3000], 2, 16, 64, torch.bfloat16, torch.bfloat16, device=DEV)
    kv = case["kv_cache"]
    pool = torch.full((kv.shape[0], 2, 64, 576), float("nan"), dtype=kv.dtype, device=DEV)
    pool[:, 1] = kv
    flat = torch.full((kv.numel() + 1,), float("nan"), dtype=kv.dtype, device=DEV)
    flat[1:] = kv.reshape(-1)
    for name, cache in (("page-strided", pool[:, 1]), ("misaligned", flat[1:].view(kv.shape))):
        assert not D.tma_layout(cache, cache[..., 512:], 64), name
        out, lse = run_decode(dict(case, kv_cache=cache), SM_SCALE, num_sms=None)
        assert_close(
            out,
            lse,
            *reference(case, SM_SCALE, device=DEV),
            torch.bfloat16,
            f"{name}, seed {seed}",
            lse_tol=lse_tol(case),
        )


@pytest.mark.parametrize("cache, heads, split", [("bf16", 16, False), ("bf16", 128, True), ("fp16", 32, True)])
def test_tma_cuda_graph_replays_with_new_lengths(rng, monkeypatch, cache, heads, split):
    """Plan + decode captured once, the TMA path (descriptors baked into the graph), replayed with new lengths."""
    seed, g = rng
    monkeypatch.setenv("FLASHINFER_MOE_MLA_BACKEND", "triton")
    dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    case = make_case(g, GRAPH_CAPACITY, 1, heads, 64, dtype, dtype, split=split, device=DEV)
    ckv, kpe = D._caches(case["kv_cache"], case["kpe_cache"], case["q_nope"])
    assert D.tma_layout(ckv, kpe, 64)
    seq_lens = case["seq_lens"]
    q = case["q_nope"]
    plan = D.mla_decode_plan(seq_lens, 1, heads)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=DEV)

    def step():
        D.mla_decode_plan(seq_lens, 1, heads, out=plan)
        D.mla_decode(
            q, case["q_pe"], case["kv_cache"], case["block_table"], seq_lens, SM_SCALE, kpe_cache=case["kpe_cache"],
            plan=plan, out=out, lse=lse,
        )  # fmt: skip

    step()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    for lens in GRAPH_REPLAYS:
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(
            out, lse, *reference(case, SM_SCALE, device=DEV), dtype, f"lens {lens} seed {seed}", lse_tol=lse_tol(case)
        )
