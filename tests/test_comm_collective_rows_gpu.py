"""The collective all-to-all's CUDA kernels (pack, count, unpack, combine: ``csrc/comm/collective.cu``) against
the torch code they replace (the CPU path), on one GPU: W simulated ranks pack their tokens, the exchange is done
by slicing, the receivers unpack, compute rows (NaN in the low-latency padding rows), send them back and sum. Every
field bit-equal between the two paths, the combine also against a float64 sum; and the whole collective path on a
one-rank NCCL group."""

import os

import pytest
import torch
from launcher import run_ranks

from flashinfer_moe.comm import collective_rows as R

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 24


def _rank_inputs(g, tokens, hidden, dtype, top_k, groups, ids_dtype):
    h = torch.randn(tokens, hidden, generator=g)
    h = h.to(dtype) if dtype != torch.float8_e4m3fn else (4 * h).clamp(-448, 448).to(dtype)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=g).argsort(-1)[:, :top_k]
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.2, -1, ids)  # some pairs nowhere
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.05, NUM_EXPERTS + 3, ids)  # out of range: nowhere
    w = torch.rand(tokens, top_k, generator=g)
    s = torch.rand(groups, tokens, generator=g).t() + 0.5 if groups else None  # column-major, as quantize's
    # Rows of a wider tensor: the kernels must not read inputs as dense rows unless they are.
    h = torch.cat([h, h[:, :1]], 1).cuda()[:, :hidden] if tokens > 1 else h.cuda()
    return h, ids.to(ids_dtype).cuda(), w.cuda(), s.cuda() if s is not None else None


def _fields(fmt, send, rows):
    """The defined fields of ``rows`` of a packed buffer (the bytes between fields are unspecified)."""
    k = fmt.top_k
    out = [send[rows, : fmt.hidden_bytes], send[rows, fmt.ids_at : fmt.ids_at + 4 * k]]
    out.append(send[rows, fmt.weights_at : fmt.weights_at + 4 * k])
    if fmt.scale_bytes:
        out.append(send[rows, fmt.scales_at : fmt.scales_at + fmt.scale_bytes])
    return out


@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
@pytest.mark.parametrize(
    "world, tokens, hidden, dtype, top_k, groups",
    [
        (1, [7], 64, torch.bfloat16, 4, 0),
        (2, [1, 0], 7168, torch.float8_e4m3fn, 8, 56),
        (3, [300, 5, 129], 67, torch.float8_e4m3fn, 3, 1),  # rows over a 256-token round; an odd byte count
        (4, [33, 0, 257, 1], 96, torch.float32, 1, 0),
        (8, [520, 3, 0, 64, 65, 1, 9, 100], 128, torch.float16, 8, 2),
    ],
)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_kernels_equal_torch_path(monkeypatch, mode, world, tokens, hidden, dtype, top_k, groups, ids_dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    per_rank = NUM_EXPERTS // world
    m = max(tokens)
    inputs = [_rank_inputs(g, t, hidden, dtype, top_k, groups, ids_dtype) for t in tokens]
    elem = torch.empty(0, dtype=dtype).element_size()
    fmt = R.Format(hidden * elem, top_k, 4 * groups)
    group = dict(world=world, num_experts=NUM_EXPERTS, per_rank=per_rank)
    back_dtype = dtype if dtype in (torch.float32, torch.float16) else torch.bfloat16  # what combine moves
    both = {}
    for kernels in (True, False):
        monkeypatch.setattr(R, "_use_kernels", lambda t, world, k=kernels: k)
        packed = []
        for h, ids, w, s in inputs:
            counts = R.count(fmt, h, ids, w, s, **group).tolist()
            if mode == "low_latency":
                offsets, rows, pad = [d * m for d in range(world)], world * m, m
            else:
                offsets, rows, pad = [sum(counts[:d]) for d in range(world)], sum(counts), 0
            send, slot = R.pack(fmt, h, ids, w, s, **group, offsets=offsets, rows=rows, pad_to=pad)
            packed.append((counts, offsets, send, slot, pad))
        # The exchange: rank r receives every source's block for r, sources ascending.
        received, outs = [], []
        for r in range(world):
            ll = mode == "low_latency"
            recv = torch.cat([send[o[r] : o[r] + (m if ll else c[r])] for c, o, send, _, _ in packed])
            received.append(recv)
            outs.append(R.unpack(fmt, recv, dtype, first=r * per_rank, per_rank=per_rank, count_experts=True))
        # Each rank's rows for what it received (NaN in padding rows: nothing may read them), sent back.
        comp = []
        for r in range(world):
            hid, local, _, _, _ = outs[r]
            y = hid.float() * (1 + (local >= 0).float() @ torch.arange(1, top_k + 1, device="cuda").float())[:, None]
            y = torch.where((local >= 0).any(-1, keepdim=True), y, float("nan")).to(back_dtype)
            comp.append(y)
        results = []
        for src, (counts, offsets, _, slot, _) in enumerate(packed):
            blocks = []
            for d in range(world):  # rank d's rows for src lie after those for the sources before it
                before = sum(m if mode == "low_latency" else packed[q][0][d] for q in range(src))
                blocks.append(comp[d][before : before + (m if mode == "low_latency" else counts[d])])
            back = torch.cat(blocks)
            results.append(R.combine_rows(back, slot, offsets))
        both[kernels] = (packed, outs, results)

    for r in range(world):
        (kc, ko, ks, kslot, _), (tc, to, ts, tslot, _) = both[True][0][r], both[False][0][r]
        assert kc == tc and ko == to, f"seed {seed}, rank {r}: counts"
        assert torch.equal(kslot, tslot), f"seed {seed}, rank {r}: slots"
        for d in range(world):
            n = m if mode == "low_latency" else kc[d]
            real = torch.arange(ko[d], ko[d] + kc[d], device="cuda")
            for a, b in zip(_fields(fmt, ks, real), _fields(fmt, ts, real), strict=True):
                assert torch.equal(a, b), f"seed {seed}, rank {r} -> {d}: rows"
            pad = torch.arange(ko[d] + kc[d], ko[d] + n, device="cuda")
            for a, b in zip(_fields(fmt, ks, pad)[1:3], _fields(fmt, ts, pad)[1:3], strict=True):
                assert torch.equal(a, b), f"seed {seed}, rank {r} -> {d}: padding rows"
        # Received rows: hidden states and scales of padding rows (low-latency) are unspecified.
        sizes = [kc[r] if mode == "high_throughput" else m for kc, *_ in both[True][0]]
        real = torch.cat([torch.arange(sum(sizes[:q]), sum(sizes[:q]) + both[True][0][q][0][r]) for q in range(world)])
        for i, (a, b) in enumerate(zip(both[True][1][r], both[False][1][r], strict=True)):
            if a is not None:
                a, b = (a, b) if i in (1, 2, 4) else (a[real.cuda()], b[real.cuda()])
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"seed {seed}, rank {r}: unpacked {i}"
        got, want = both[True][2][r], both[False][2][r]
        assert not got.isnan().any(), f"seed {seed}, rank {r}: a padding row leaked into the combine"
        assert torch.equal(got, want), f"seed {seed}, rank {r}: combine"
        # float64: each token's expert rows over the ranks it went to.
        h, ids, _, _ = inputs[r]
        ref = torch.zeros(h.shape[0], hidden, dtype=torch.float64, device="cuda")
        mag = torch.zeros_like(ref)
        for d in range(world):
            mine = (ids >= d * per_rank) & (ids < (d + 1) * per_rank)
            factor = 1 + (mine.double() * torch.arange(1, top_k + 1, device="cuda").double()).sum(-1)
            row = (h.double() * factor[:, None]).to(back_dtype).double()
            ref += torch.where(mine.any(-1, keepdim=True), row, 0.0)
            mag += torch.where(mine.any(-1, keepdim=True), row.abs(), 0.0)
        # Terms rounded to bf16 as the reference's are (fp32 rows: one ulp apart), summed in fp32, the sum rounded.
        assert bool(((got.double() - ref).abs() <= 2**-7 * mag).all()), f"seed {seed}, rank {r}: float64"


def _one_rank(rank, world, seed, mode, fp8):
    from flashinfer_moe.comm.collective import CollectiveAllToAll

    g = torch.Generator().manual_seed(seed)
    tokens, hidden, k = 37, 256, 6
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    comm = CollectiveAllToAll(None, num_experts=16, top_k=k, hidden_size=hidden, max_tokens_per_rank=40, dtype=dtype,
                              mode=mode)  # fmt: skip
    for _ in range(2):  # epochs advance; nothing is reset between calls
        h, ids, w, s = _rank_inputs(g, tokens, hidden, dtype, k, 2 if fp8 else 0, torch.int32)
        ids = torch.where(ids >= 16, -1, ids)
        sent = (ids >= 0).any(-1)
        n = int(sent.sum())
        got = comm.dispatch(h, ids, w, scales=s)
        # One rank: the sent tokens in order, then (low-latency) padding rows.
        assert torch.equal(got.hidden_states[:n].view(torch.uint8), h[sent].view(torch.uint8)), f"seed {seed}"
        assert torch.equal(got.topk_ids[:n], ids[sent]), f"seed {seed}"
        assert torch.equal(got.topk_weights[:n], w[sent]), f"seed {seed}"
        if fp8:
            assert torch.equal(got.scales[:n], s[sent]), f"seed {seed}"
        assert bool((got.topk_ids[n:] == -1).all()), f"seed {seed}: padding rows"
        y = got.hidden_states.float().to(torch.bfloat16)
        y[n:] = float("nan")  # padding rows: nothing may read them
        out = comm.combine(y, got.handle)
        want = torch.where(sent[:, None], h.float().to(torch.bfloat16), 0)
        assert torch.equal(out, want), f"seed {seed}: combine"
    return True


@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
@pytest.mark.parametrize("fp8", [False, True])
def test_collective_path_one_rank_nccl(mode, fp8):
    """The whole collective path (NCCL, one rank) with its kernels: every sent token comes back as itself."""
    seed = int.from_bytes(os.urandom(4), "little")
    assert run_ranks(_one_rank, 1, seed, mode, fp8, backend="nccl") == [True]


def test_groups_past_the_kernels_take_the_torch_code():
    """More ranks than the kernels take (their first rows go by value): the torch code, same rows."""
    world, per_rank, tokens, top_k = R.MAX_RANKS + 2, 2, 9, 4
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ids = torch.rand(tokens, world * per_rank, generator=g).argsort(-1)[:, :top_k].int().cuda()
    h = torch.randn(tokens, 32, generator=g).bfloat16().cuda()
    w = torch.rand(tokens, top_k, generator=g).cuda()
    fmt = R.Format(64, top_k, 0)
    group = dict(world=world, num_experts=world * per_rank, per_rank=per_rank)
    counts = R.count(fmt, h, ids, w, None, **group)
    offsets = [int(x) for x in counts.cumsum(0) - counts]
    send, slot = R.pack(fmt, h, ids, w, None, **group, offsets=offsets, rows=int(counts.sum()))
    goes = R.destinations(ids, world * per_rank, per_rank, world)
    assert torch.equal(slot, torch.where(goes, goes.long().cumsum(0) - 1, -1))
    for t, d in goes.nonzero().tolist():
        assert torch.equal(send[offsets[d] + slot[t, d], :64], h[t].view(torch.uint8))
