"""Paged MLA decode: the split-KV schedule, the Triton kernels in Triton's interpreter (through the public
functions), the CPU path, and bad input. Shapes are tiny (few heads, short sequences) but the head dims are
MLA's; the GPU tier (test_mla_decode_gpu.py) runs the full mixes."""

from __future__ import annotations

import os

import pytest
import torch
from checks import assert_error_names_argument

from flashinfer_moe import reference_mla as ref
from flashinfer_moe.mla import decode as D

FP8 = torch.float8_e4m3fn
# Output tolerance per query dtype, on the largest error over max(1, the largest |output|): the output's rounding
# plus, on a GPU, the probabilities rounded to the query dtype before P . V.
OUT_TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
LSE_TOL = 2e-4
# FP8 pages under bf16 queries (up to 32 rows, or page 1) take the queries times the softmax scale in fp16
# (flashinfer_moe/mla/decode_kernel.py FP8_F16_MATH): one more rounding of 2^-11 relative per query element.
LSE_TOL_FP8_F16 = 1e-3


def lse_tol(case) -> float:
    return LSE_TOL_FP8_F16 if case["kv_cache"].dtype == FP8 else LSE_TOL


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(
    g,
    lens,
    s_q,
    heads,
    page,
    q_dtype,
    cache_dtype,
    *,
    split=False,
    kpe_dtype=None,
    share=True,
    device="cpu",
    layer_stride=False,
    runs=False,
):
    """Queries, a paged cache and a block table for sequences of ``lens`` tokens, pages shuffled over the
    pool (``runs``: in order, each sequence's pages a run of consecutive ids but for a few pages swapped with
    others, so that some 64-token tiles are runs and some not); ``share``: the second sequence's first page is the
    first's (a shared prefix). Cache entries that no
    sequence covers, and table entries past a sequence's pages, are poison (NaN rows, out-of-pool ids): a
    kernel that reads them gives NaN or faults. FP8 caches hold ``N(0, 1) / kv_scale``.

    Returns:
        dict with q_nope, q_pe, kv_cache, kpe_cache (None unless ``split``), block_table, seq_lens, kv_scale.
    """
    batch = len(lens)
    pages_of = [max(cdiv(n, page), 1) for n in lens]
    num_pages = sum(pages_of) + 2
    if runs:
        perm = list(range(num_pages))
        for _ in range(max(2, num_pages // 128)):
            i, j = torch.randint(0, num_pages, (2,), generator=g).tolist()
            perm[i], perm[j] = perm[j], perm[i]
    else:
        perm = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(pages_of) + 1
    table = torch.full((batch, max_pages), 2**30, dtype=torch.int32)
    valid = torch.zeros(num_pages, page, dtype=torch.bool)
    nxt = 0
    for b, n in enumerate(lens):
        ids = torch.tensor(perm[nxt : nxt + pages_of[b]], dtype=torch.int32)
        nxt += pages_of[b]
        if share and b == 1 and lens[0] >= page and n >= page:
            ids[0] = table[0, 0]  # the shared prefix page, full in both sequences
        table[b, : pages_of[b]] = ids
        fill = (n - torch.arange(pages_of[b]) * page).clamp(0, page)  # valid tokens per page
        valid[ids.long()] |= torch.arange(page)[None, :] < fill[:, None]
    width = 512 if split else 576
    kv_scale = 1.0 / 32 if cache_dtype == FP8 else None

    def pages(w, dtype):
        x = torch.randn(num_pages, page, w, generator=g, dtype=torch.float64)
        if dtype == FP8:
            x = (x / kv_scale).clamp(-448, 448)
        x[~valid] = float("nan")
        return x.to(dtype)

    kv = pages(width, cache_dtype)
    if layer_stride:  # one layer's slice of a [P, page, layers, W] pool: free page and token strides
        pool = torch.full((num_pages, page, 3, width), float("nan")).to(cache_dtype)
        pool[:, :, 1] = kv
        kv = pool[:, :, 1]
    kpe = pages(64, kpe_dtype or cache_dtype) if split else None
    return dict(
        q_nope=torch.randn(batch, s_q, heads, 512, generator=g).to(q_dtype).to(device),
        q_pe=torch.randn(batch, s_q, heads, 64, generator=g).to(q_dtype).to(device),
        kv_cache=kv.to(device),
        kpe_cache=kpe.to(device) if kpe is not None else None,
        block_table=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        kv_scale=kv_scale,
    )


def reference(case, sm_scale, causal=True, device="cpu"):
    """The float64 reference of a case, computed on ``device``."""
    kpe = case["kpe_cache"]
    return ref.mla_decode(
        case["q_nope"].to(device),
        case["q_pe"].to(device),
        case["kv_cache"].to(device),
        case["block_table"].to(device),
        case["seq_lens"],
        sm_scale,
        kpe_cache=None if kpe is None else kpe.to(device),
        kv_scale=case["kv_scale"],
        causal=causal,
    )


def assert_close(out, lse, want_out, want_lse, q_dtype, what, lse_tol=LSE_TOL, out_tol=None):
    """``out_tol``: the output's bound relative to its size, instead of the output dtype's (``OUT_TOL``)."""
    out, lse = out.double().to(want_out.device), lse.double().to(want_out.device)
    assert not out.isnan().any(), f"{what}: NaN in out"
    # Relative to the output's size: rounding the output alone to bf16 costs half an ulp, 0.016 at |out| in [4, 8).
    scale = max(1.0, want_out.abs().max().item())
    err = (out - want_out).abs().max().item()
    tol = OUT_TOL[q_dtype] if out_tol is None else out_tol
    assert err < tol * scale, f"{what}: out error {err} (max |out| {scale:.3g})"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), f"{what}: -inf LSEs differ"
    seen = ~torch.isneginf(want_lse)
    assert (out[~seen] == 0).all(), f"{what}: a query that sees nothing must give 0"
    lse_err = (lse[seen] - want_lse[seen]).abs().max().item() if seen.any() else 0.0
    assert lse_err < lse_tol * max(1.0, want_lse[seen].abs().max().item()), f"{what}: LSE error {lse_err}"


def run_decode(case, sm_scale, *, causal=True, num_sms=3, scale_tensor=False):
    """``mla_decode`` with a plan for ``num_sms`` (few, so that sequences split) into NaN-poisoned buffers."""
    q = case["q_nope"]
    plan = D.mla_decode_plan(case["seq_lens"], q.shape[1], q.shape[2], num_sms=num_sms, kv_dtype=case["kv_cache"].dtype)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device)
    scale = case["kv_scale"]
    if scale_tensor and scale is not None:
        scale = torch.tensor([scale], device=q.device)
    got = D.mla_decode(
        q,
        case["q_pe"],
        case["kv_cache"],
        case["block_table"],
        case["seq_lens"],
        sm_scale,
        kpe_cache=case["kpe_cache"],
        kv_scale=scale,
        causal=causal,
        plan=plan,
        out=out,
        lse=lse,
    )
    assert got[0] is out and got[1] is lse
    return out, lse


# ---------------------------------------------------------------------------------------------- schedule


def walk(sched: torch.Tensor, lens: list[int], num_programs: int):
    """The pieces the attention programs process, as ``(program, seq, first token, end token, slot or None)``,
    following the kernel's loop over ``sched``."""
    batch = len(lens)
    s = sched.tolist()
    chunk, total = s[0], s[1]
    starts, ends, splits, slot = (s[2 + i * batch : 2 + (i + 1) * batch] for i in range(4))
    first = s[2 + 4 * batch :]
    pieces = []
    for p in range(num_programs):
        cursor, end, b = p * chunk, min(p * chunk + chunk, total), first[p]
        while cursor < end:
            piece_end = min(end, ends[b])
            lo = max(cursor - starts[b] - D.OVERHEAD, 0) * D.UNIT
            hi = min(max(piece_end - starts[b] - D.OVERHEAD, 0) * D.UNIT, max(lens[b], 0))
            where = None if splits[b] == 1 else slot[b] + p - starts[b] // chunk
            pieces.append((p, b, lo, hi, where))
            cursor, b = piece_end, b + 1
    return pieces


@pytest.fixture
def interpreted(monkeypatch):
    """The public functions run the Triton kernels (interpreted on CPU tensors without a GPU)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter was not selected before the kernel module was imported")
    monkeypatch.setattr(D, "_plan_op", D._plan_cuda)
    monkeypatch.setattr(D, "_decode_op", D._decode_cuda)


@pytest.mark.parametrize(
    "lens, programs",
    [
        ([1, 63, 64, 65, 700], 5),
        ([0], 1),
        ([0, 0, 3], 4),
        ([5000], 7),
        ([64] * 37, 6),
        ([1, 2, 3], 40),
        ([4096] * 128, 132),
        ([4096] * 100, 132),
        ([4096] * 127 + [4097], 132),
        ([16384] * 128, 132),
        ([32768] * 128, 132),
        ([4096] * 256, 132),
    ],
)
def test_schedule_covers_every_token_once(interpreted, lens, programs):
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = D.make_plan(seq_lens, 1, 4, programs, 16)  # the Triton plan kernel
    want = ref.mla_decode_split_plan(seq_lens, programs, D.UNIT, D.OVERHEAD, D.SNAP)
    batch = len(lens)
    assert plan.sched[0] == want["chunk"] and plan.sched[1] == want["total"]
    for i, key in enumerate(("starts", "ends", "splits", "slot")):
        assert plan.sched[2 + i * batch : 2 + (i + 1) * batch].tolist() == want[key].tolist(), key
    assert plan.sched[2 + 4 * batch :].tolist() == want["first_seq"].tolist()
    pieces = walk(plan.sched, lens, programs)
    used_slots = [w for *_, w in pieces if w is not None]
    assert len(used_slots) == len(set(used_slots)) and all(0 <= w < plan.part_out.shape[0] for w in used_slots)
    for b, n in enumerate(lens):
        mine = sorted((lo, hi) for _, pb, lo, hi, _ in pieces if pb == b)
        assert len(mine) == plan.sched[2 + 2 * batch + b], (b, mine)  # every piece of a split sequence is written
        covered = [t for lo, hi in mine for t in range(lo, hi)]
        assert covered == list(range(max(n, 0))), (b, mine)


@pytest.mark.parametrize(
    "lens, programs, chunk",
    [
        ([4096] * 128, 132, 66),  # whole sequences: 66 units against the balanced 64
        ([4096] * 256, 132, 132),  # two a program: 132 against 128
        ([16384] * 128, 132, 258),  # 258 against 250: SNAP's bound
        ([32768] * 128, 132, 499),  # 514 against 499: past it, balanced
        ([4096] * 100, 132, 50),  # whole sequences would leave 32 programs idle
        ([4096] * 127 + [4097], 132, 65),  # costs differ: balanced
        ([64] * 37, 6, 21),  # 7 of 3 units a program against 19
    ],
)
def test_schedule_takes_whole_equal_sequences(lens, programs, chunk):
    """Equal sequences go whole to programs where that costs at most SNAP units more than balanced chunks: no
    sequence is split then (the reference schedule; the kernel's equals it above)."""
    s = ref.mla_decode_split_plan(torch.tensor(lens), programs, D.UNIT, D.OVERHEAD, D.SNAP)
    assert s["chunk"] == chunk
    whole = s["chunk"] % (s["ends"][0] - s["starts"][0]) == 0 and len(set(lens)) == 1
    assert bool((s["splits"] == 1).all()) == bool(whole), s["splits"].tolist()


# -------------------------------------------------------------------------------------- kernels, interpreted


# (lens, s_q, heads, page, q dtype, cache dtype, split layout, rope dtype, causal)
KERNEL_CASES = {
    "page1": ([1, 63, 64, 65, 150], 1, 3, 1, torch.float16, torch.float16, False, None, True),
    "page16-sq2": ([1, 63, 64, 65, 150], 2, 2, 16, torch.float16, torch.float16, False, None, True),
    "page32-bf16-sq4": ([4, 63, 65, 130], 4, 2, 32, torch.bfloat16, torch.bfloat16, False, None, True),
    "page64-noncausal": ([1, 64, 65, 200], 2, 3, 64, torch.float16, torch.float16, False, None, False),
    "page128-split": ([0, 63, 129, 260], 1, 2, 128, torch.bfloat16, torch.bfloat16, True, None, True),
    "fp8-page64": ([1, 63, 64, 65, 150], 2, 2, 64, torch.bfloat16, FP8, False, None, True),
    "fp8-bf16rope-page16": ([2, 64, 65, 140], 1, 3, 16, torch.bfloat16, FP8, True, torch.bfloat16, True),
    "fp8-fp8rope-page32": ([33, 100], 4, 2, 32, torch.float16, FP8, True, FP8, True),
    "heads16-sq2": ([1, 65, 130], 2, 16, 16, torch.float16, torch.float16, False, None, True),
    "heads16-sq4": ([3, 64, 100], 4, 16, 32, torch.float16, FP8, False, None, True),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_decode_kernel_interpreted(rng, interpreted, name):
    lens, s_q, heads, page, q_dtype, cache_dtype, split, kpe_dtype, causal = KERNEL_CASES[name]
    seed, g = rng
    case = make_case(
        g,
        lens,
        s_q,
        heads,
        page,
        q_dtype,
        cache_dtype,
        split=split,
        kpe_dtype=kpe_dtype,
        layer_stride=name == "page16-sq2",
    )
    sm_scale = 0.1
    out, lse = run_decode(case, sm_scale, causal=causal, scale_tensor=name.startswith("fp8-bf16"))
    assert_close(out, lse, *reference(case, sm_scale, causal), q_dtype, f"{name} seed {seed}")


@pytest.mark.parametrize("name", ["fp8-page64", "page16-sq2", "page1"])
def test_decode_kernel_prefetch_interpreted(rng, interpreted, monkeypatch, name):
    """The register double-buffered tile loop (``PREFETCH``), on the cases whose unmasked stretches are 0, 1
    and many tiles long."""
    for key, config in D.CONFIGS.items():
        monkeypatch.setitem(D.CONFIGS, key, dict(config, PREFETCH=1))
    test_decode_kernel_interpreted(rng, None, name)


def test_graph_style_replan_in_place(rng, interpreted):
    """One plan refilled in place (``out=plan``) serves new lengths of the same batch, as a replayed graph does."""
    seed, g = rng
    case = make_case(g, [70, 3, 129], 1, 2, 16, torch.float16, torch.float16)
    plan = D.mla_decode_plan(case["seq_lens"], 1, 2, num_sms=2)
    buffers = (plan.sched.data_ptr(), plan.part_out.data_ptr())
    for lens in ([70, 3, 129], [1, 0, 5], [64, 2, 100]):  # within the table's pages
        case["seq_lens"].copy_(torch.tensor(lens))
        assert D.mla_decode_plan(case["seq_lens"], 1, 2, out=plan) is plan
        out, lse = D.mla_decode(
            case["q_nope"],
            case["q_pe"],
            case["kv_cache"],
            case["block_table"],
            case["seq_lens"],
            0.2,
            plan=plan,
            return_lse=True,
        )
        assert_close(out, lse, *reference(case, 0.2), torch.float16, f"lens {lens} seed {seed}")
    assert (plan.sched.data_ptr(), plan.part_out.data_ptr()) == buffers


# The GPU tier's graph test (test_mla_decode_gpu.py): table capacity per sequence (page 64) and the lengths the
# captured plan + decode replay with. Every replay length must fit its row: past it the table holds poisoned
# page ids, which the kernel would follow to an illegal address.
GRAPH_CAPACITY = [16384, 16384, 4097, 65, 64, 3000, 2000, 9000]
GRAPH_REPLAYS = (
    GRAPH_CAPACITY,
    [1] * 8,
    [5, 16384, 0, 65, 64, 3000, 1, 9000],
    [16000, 2, 4097, 63, 1, 64, 2000, 8999],
)


@pytest.mark.parametrize("lens", GRAPH_REPLAYS, ids=range(len(GRAPH_REPLAYS)))
def test_gpu_graph_replay_lengths_fit_the_table(lens):
    """The CPU path's own check (``seq_lens must fit the block table``) on one row at a time: a tiny cache of
    each capacity, the replay length against it."""
    for n, cap in zip(lens, GRAPH_CAPACITY, strict=True):
        pages = cdiv(cap, 64)
        table = torch.zeros(1, pages, dtype=torch.int32)
        D._table(table, torch.tensor([n], dtype=torch.int32), torch.zeros(1, 1, 1, 512), 64, validate=True)


def test_kernel_stops_at_the_end_of_the_table_row(rng, interpreted):
    """Lengths past a sequence's table row (no host check inside a graph): the kernel reads only the row's
    pages, as if the length were the row's capacity, and never the next row or past the table."""
    seed, g = rng
    case = make_case(g, [40, 48, 30], 1, 2, 16, torch.float16, torch.float16, share=False)
    table = case["block_table"][:, :3].contiguous()  # 48 tokens per row, no poisoned padding column
    kv = case["kv_cache"]
    q = case["q_nope"]
    plan = D.mla_decode_plan(case["seq_lens"], 1, 2, num_sms=2)
    too_long = torch.tensor([40, 70, 30], dtype=torch.int32)
    D.mla_decode_plan(too_long, 1, 2, out=plan)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:3], float("nan"))
    args = (q, case["q_pe"], kv, kv[..., 512:], table, too_long, plan.sched, plan.part_out, plan.part_lse, out, lse)
    D._decode_cuda(*args, 0.2, None, 1.0, True, plan.num_programs, plan.block_m, 16, 4, 1, 0)
    clamped = dict(case, block_table=table, seq_lens=torch.tensor([40, 48, 30], dtype=torch.int32))
    want_out, want_lse = reference(clamped, 0.2)
    assert_close(out, lse, want_out, want_lse, torch.float16, f"seed {seed}")


# ----------------------------------------------------------------------------------------------- CPU path


@pytest.mark.parametrize("cache_dtype, split", [(torch.bfloat16, False), (FP8, True)])
def test_cpu_path_matches_reference(rng, cache_dtype, split):
    seed, g = rng
    case = make_case(g, [0, 1, 63, 64, 65, 300], 2, 4, 32, torch.bfloat16, cache_dtype, split=split)
    want_out, want_lse = reference(case, 0.07)
    out, lse = D.mla_decode(
        case["q_nope"],
        case["q_pe"],
        case["kv_cache"],
        case["block_table"],
        case["seq_lens"],
        0.07,
        kpe_cache=case["kpe_cache"],
        kv_scale=case["kv_scale"],
        return_lse=True,
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, lse, want_out, want_lse, torch.bfloat16, f"seed {seed}")
    plain = D.mla_decode(
        case["q_nope"],
        case["q_pe"],
        case["kv_cache"],
        case["block_table"],
        case["seq_lens"],
        0.07,
        kpe_cache=case["kpe_cache"],
        kv_scale=case["kv_scale"],
    )
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_opcheck_cpu(generator):
    case = make_case(generator, [3, 20], 2, 2, 16, torch.bfloat16, torch.bfloat16, share=False)
    case["block_table"] = case["block_table"].clamp(max=case["kv_cache"].shape[0] - 1)
    plan = D.mla_decode_plan(case["seq_lens"], 2, 2)
    torch.library.opcheck(
        torch.ops.flashinfer_moe.mla_decode_plan_.default, (case["seq_lens"], plan.sched, plan.num_programs)
    )
    kv = case["kv_cache"].nan_to_num()
    args = (
        case["q_nope"],
        case["q_pe"],
        kv,
        kv[..., 512:],
        case["block_table"],
        case["seq_lens"],
        plan.sched,
        plan.part_out,
        plan.part_lse,
        torch.empty(2, 2, 2, 512, dtype=torch.bfloat16),
        torch.empty(2, 2, 2),
        0.1,
        None,
        1.0,
        True,
        plan.num_programs,
        16,
        64,
        4,
        2,
        0,
    )
    torch.library.opcheck(torch.ops.flashinfer_moe.mla_decode_.default, args)


# ---------------------------------------------------------------------------------------------- bad input


def _bad_inputs():
    def mutate(**changes):
        return changes

    f16 = torch.float16
    return {
        "q_nope head dim": (mutate(q_nope=torch.zeros(2, 1, 2, 256, dtype=f16)), ValueError, "q_nope"),
        "q_nope dtype": (mutate(q_nope=torch.zeros(2, 1, 2, 512)), TypeError, "q_nope"),
        "s_q 9": (mutate(q_nope=torch.zeros(2, 9, 2, 512, dtype=f16)), ValueError, "q_nope"),
        "q_pe rope dim": (mutate(q_pe=torch.zeros(2, 1, 2, 32, dtype=f16)), ValueError, "q_pe"),
        "q_pe dtype": (mutate(q_pe=torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16)), TypeError, "q_pe"),
        "page size 8": (mutate(kv_cache=torch.zeros(4, 8, 576, dtype=f16)), ValueError, "kv_cache"),
        "cache width": (mutate(kv_cache=torch.zeros(4, 16, 512, dtype=f16)), ValueError, "kv_cache"),
        "cache dtype": (mutate(kv_cache=torch.zeros(4, 16, 576, dtype=torch.bfloat16)), TypeError, "kv_cache"),
        "cache strided": (mutate(kv_cache=torch.zeros(4, 16, 1152, dtype=f16)[..., ::2]), ValueError, "kv_cache"),
        "kpe shape": (
            mutate(kv_cache=torch.zeros(4, 16, 512, dtype=f16), kpe_cache=torch.zeros(4, 16, 32, dtype=f16)),
            ValueError,
            "kpe_cache",
        ),
        "kpe dtype": (
            mutate(kv_cache=torch.zeros(4, 16, 512, dtype=f16), kpe_cache=torch.zeros(4, 16, 64, dtype=FP8)),
            TypeError,
            "kpe_cache",
        ),
        "table dtype": (mutate(block_table=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "block_table"),
        "table rows": (mutate(block_table=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "block_table"),
        "table too small": (mutate(seq_lens=torch.tensor([5, 65], dtype=torch.int32)), ValueError, "seq_lens"),
        "seq_lens dtype": (mutate(seq_lens=torch.tensor([5, 6])), TypeError, "seq_lens"),
        "seq_lens batch": (mutate(seq_lens=torch.tensor([5], dtype=torch.int32)), ValueError, "seq_lens"),
        "sm_scale": (mutate(sm_scale=-1.0), ValueError, "sm_scale"),
        "fp8 without scale": (mutate(kv_cache=torch.zeros(4, 16, 576, dtype=FP8)), ValueError, "kv_scale"),
        "fp8 scale shape": (
            mutate(kv_cache=torch.zeros(4, 16, 576, dtype=FP8), kv_scale=torch.ones(2)),
            ValueError,
            "kv_scale",
        ),
        "out dtype": (mutate(out=torch.zeros(2, 1, 2, 512)), ValueError, "out"),
        "lse shape": (mutate(lse=torch.zeros(2, 2)), ValueError, "lse"),
        "causal": (mutate(causal=1), TypeError, "causal"),
        "plan type": (mutate(plan="auto"), TypeError, "plan"),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_argument(name):
    changes, exc, arg = BAD[name]
    f16 = torch.float16
    args = dict(
        q_nope=torch.zeros(2, 1, 2, 512, dtype=f16),
        q_pe=torch.zeros(2, 1, 2, 64, dtype=f16),
        kv_cache=torch.zeros(4, 16, 576, dtype=f16),
        block_table=torch.zeros(2, 4, dtype=torch.int32),
        seq_lens=torch.tensor([5, 64], dtype=torch.int32),
        sm_scale=0.1,
    )
    args.update(changes)
    pos = [args.pop(k) for k in ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "sm_scale")]
    assert_error_names_argument(lambda: D.mla_decode(*pos, **args), exc, arg)


def test_plan_bad_input_and_mismatch():
    lens = torch.tensor([3, 4], dtype=torch.int32)
    assert_error_names_argument(lambda: D.mla_decode_plan(lens, 9, 16), ValueError, "s_q")
    assert_error_names_argument(lambda: D.mla_decode_plan(lens.long(), 1, 16), TypeError, "seq_lens")
    assert_error_names_argument(lambda: D.mla_decode_plan(lens, 1, 0), ValueError, "num_heads")
    assert_error_names_argument(lambda: D.mla_decode_plan(lens, 1, 16, max_splits=0), ValueError, "max_splits")
    plan = D.mla_decode_plan(lens, 1, 16)
    assert_error_names_argument(lambda: D.mla_decode_plan(lens, 2, 16, out=plan), ValueError, "out")
    q = torch.zeros(2, 2, 16, 512, dtype=torch.float16)

    def call():
        kv = torch.zeros(4, 16, 576, dtype=torch.float16)
        q_pe = torch.zeros(2, 2, 16, 64, dtype=torch.float16)
        return D.mla_decode(q, q_pe, kv, torch.zeros(2, 4, dtype=torch.int32), lens, 0.1, plan=plan)

    assert_error_names_argument(call, ValueError, "plan")
    assert D.mla_decode_plan(lens, 1, 16, max_splits=3).num_programs <= 3
    assert_error_names_argument(lambda: D.mla_decode_plan(lens, 1, 16, kv_dtype="fp8"), TypeError, "kv_dtype")


# ----------------------------------------------------------------------------------- TMA tile loads


# (lens, s_q, heads, page, q dtype, cache dtype, split layout, rope dtype): 16-, 32- and 64-row blocks
# (transposed products for the first two), pages 64 and 128, FP8 pages with a bf16 rope.
TMA_CASES = {
    "rows16-page64": ([1, 63, 64, 65, 200], 2, 3, 64, torch.bfloat16, torch.bfloat16, False, None),
    "rows32-page128-split": ([0, 63, 129, 260], 2, 9, 128, torch.float16, torch.float16, True, None),
    "rows64-page64": ([1, 64, 130], 2, 20, 64, torch.float16, torch.float16, False, None),
    "rows16-fp8-bf16rope": ([2, 64, 65, 140], 1, 3, 64, torch.bfloat16, FP8, True, torch.bfloat16),
    "rows64-fp8-page128": ([5, 128, 300], 1, 33, 128, torch.bfloat16, FP8, False, None),
}


@pytest.mark.parametrize("path", ["tma", "gathered"])
@pytest.mark.parametrize("name", list(TMA_CASES))
def test_decode_tma_tiles_interpreted(rng, interpreted, monkeypatch, name, path):
    """Pages of at least a tile in a contiguous pool take the TMA tile loads (``flashinfer_moe/mla/decode_tma.py``,
    emulated by the interpreter; forced for FP8 pages); the gathered loads, forced, on the same cases."""
    from flashinfer_moe.mla import decode_kernel

    lens, s_q, heads, page, q_dtype, cache_dtype, split, kpe_dtype = TMA_CASES[name]
    seed, g = rng
    case = make_case(g, lens, s_q, heads, page, q_dtype, cache_dtype, split=split, kpe_dtype=kpe_dtype)
    taken = []
    descriptors = decode_kernel.descriptors
    monkeypatch.setattr(decode_kernel, "descriptors", lambda *a: taken.append(a[2]) or descriptors(*a))
    if path == "gathered":
        monkeypatch.setattr(D, "TMA_CONFIGS", {})
    else:  # FP8 pages, which the default keeps on the gathered loads, with the bf16 configuration
        block_m = D.block_m_for(s_q * heads)
        monkeypatch.setitem(D.TMA_CONFIGS, (block_m, cache_dtype == FP8), D.TMA_CONFIGS[(block_m, False)])
    out, lse = run_decode(case, 0.1, scale_tensor=split)
    assert_close(out, lse, *reference(case, 0.1), q_dtype, f"{name} {path} seed {seed}")
    assert bool(taken) == (path == "tma"), taken


def test_tma_layout():
    """Pages of at least a tile, contiguous in a token-major pool (also one layer of an interleaved pool, and
    the rope view of the one-tensor layout), 16-byte aligned: TMA; page-strided pools, misaligned bases, small
    pages: the gathered loads."""
    pool = torch.zeros(6, 64, 3, 576, dtype=torch.bfloat16)
    layer = pool[:, :, 1]
    assert D.tma_layout(layer, layer[..., 512:], 64)
    assert D.tma_layout(layer, layer[..., 512:], 32)
    split = torch.zeros(6, 128, 512, dtype=FP8), torch.zeros(6, 128, 64, dtype=torch.bfloat16)
    assert D.tma_layout(*split, 64)
    small = torch.zeros(6, 32, 576, dtype=torch.bfloat16)
    assert not D.tma_layout(small, small[..., 512:], 64)
    by_page = torch.zeros(6, 2, 64, 576, dtype=torch.bfloat16)[:, 1]  # [P, layers, page, W]: pages apart
    assert not D.tma_layout(by_page, by_page[..., 512:], 64)
    flat = torch.zeros(6 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(6, 64, 576)
    assert not D.tma_layout(flat, flat[..., 512:], 64)
    odd_rope = torch.zeros(6, 64, 512, dtype=torch.bfloat16), torch.zeros(6, 64, 65, dtype=torch.bfloat16)[..., 1:]
    assert not D.tma_layout(*odd_rope, 64)  # rope rows 130 bytes apart
