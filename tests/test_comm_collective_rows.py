"""The collective all-to-all's rows on CPUs (the torch code, which the GPU tier holds the kernels to): the row
format, what pack writes where, unpack's fields, and combine's sum against float64 with NaN in rows no token
reads."""

import os

import pytest
import torch

from flashinfer_moe.comm import collective_rows as R


@pytest.mark.parametrize("hidden_bytes, top_k, scale_bytes", [(7168, 8, 224), (67, 3, 4), (1, 1, 0), (96, 13, 8)])
def test_format_fields_start_at_16_bytes(hidden_bytes, top_k, scale_bytes):
    f = R.Format(hidden_bytes, top_k, scale_bytes)
    starts = [0, f.ids_at, f.weights_at, f.scales_at, f.row_bytes]
    sizes = [hidden_bytes, 4 * top_k, 4 * top_k, scale_bytes]
    assert all(s % 16 == 0 for s in starts)
    assert all(starts[i] + sizes[i] <= starts[i + 1] < starts[i] + sizes[i] + 16 for i in range(4))


@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
@pytest.mark.parametrize("world, tokens, top_k", [(1, 5, 2), (3, 17, 4), (4, 0, 3), (5, 33, 1)])
def test_pack_unpack_combine(mode, world, tokens, top_k):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    per_rank, hidden, groups = 3, 24, 2
    experts = world * per_rank
    h = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :top_k].int()
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.3, -1, ids)
    w = torch.rand(tokens, top_k, generator=g)
    s = torch.rand(tokens, groups, generator=g)
    fmt = R.Format(2 * hidden, top_k, 4 * groups)
    group = dict(world=world, num_experts=experts, per_rank=per_rank)
    counts = R.count(fmt, h, ids, w, s, **group).tolist()
    goes = R.destinations(ids, experts, per_rank, world)
    assert counts == goes.sum(0).tolist(), f"seed {seed}"
    m = tokens + 2  # low-latency blocks with room to spare: padding rows in every block
    ll = mode == "low_latency"
    offsets = [d * m for d in range(world)] if ll else [sum(counts[:d]) for d in range(world)]
    rows = world * m if ll else sum(counts)
    send, slot = R.pack(fmt, h, ids, w, s, **group, offsets=offsets, rows=rows, pad_to=m if ll else 0)

    for d in range(world):
        sent = goes[:, d].nonzero().flatten()
        assert torch.equal(slot[:, d][sent], torch.arange(len(sent))), f"seed {seed}: slots to {d}"
        assert bool((slot[:, d][~goes[:, d]] == -1).all()), f"seed {seed}"
        got = R.unpack(fmt, send[offsets[d] : offsets[d] + (m if ll else counts[d])], torch.bfloat16,
                       first=d * per_rank, per_rank=per_rank, count_experts=True)  # fmt: skip
        hid, local, wts, scl, per_expert = got
        n = len(sent)
        assert torch.equal(hid[:n], h[sent]) and torch.equal(wts[:n], w[sent]) and torch.equal(scl[:n], s[sent])
        mine = (ids[sent] >= d * per_rank) & (ids[sent] < (d + 1) * per_rank)
        assert torch.equal(local[:n], torch.where(mine, ids[sent] - d * per_rank, -1)), f"seed {seed}"
        assert bool((local[n:] == -1).all()) and bool((wts[n:] == 0).all()), f"seed {seed}: padding rows"
        want = torch.bincount((ids[sent][mine] - d * per_rank).long(), minlength=per_rank).int()
        assert torch.equal(per_expert, want), f"seed {seed}"

    # Combine: rank d sends back row j of its block as (d + 2) * that row's hidden state; rows no token reads NaN.
    back = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16)
    for d in range(world):
        sent = goes[:, d].nonzero().flatten()
        back[offsets[d] : offsets[d] + len(sent)] = (h[sent].float() * (d + 2)).bfloat16()
    out = R.combine_rows(back, slot, offsets)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for d in range(world):
        ref += torch.where(goes[:, d : d + 1], (h.double() * (d + 2)).bfloat16().double(), 0.0)
    assert not out.isnan().any(), f"seed {seed}: a row no token reads leaked into the sum"
    assert bool(((out.double() - ref).abs() <= 2**-8 * ref.abs()).all()), f"seed {seed}"
