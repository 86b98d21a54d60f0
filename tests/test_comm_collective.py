"""The collective (NCCL / gloo) all-to-all: dispatch and combine exact against a reference built from every
rank's inputs, on 4 gloo processes (CPU tier) and on 2+ GPUs with NCCL (multigpu tier); a rank that never
arrives makes the others raise CommTimeoutError naming it, within the budget."""

import os
import time

import pytest
import torch
from launcher import run_ranks

from flashinfer_moe import CommTimeoutError, reference
from flashinfer_moe.comm.collective import CollectiveAllToAll

NUM_EXPERTS, TOP_K, HIDDEN, GROUP = 16, 4, 64, 32


def _inputs(seed: int, world: int, tokens: list[int], kind: str):
    """Every rank's inputs, drawn from one seed so that each rank can build the reference for all."""
    g = torch.Generator().manual_seed(seed)
    per_rank = NUM_EXPERTS // world
    out = []
    for t in tokens:
        hidden = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
        if kind == "one_rank":  # every pair to the experts of the last rank
            ids = (world - 1) * per_rank + torch.rand(t, per_rank, generator=g).argsort(-1)[:, :TOP_K] % per_rank
        else:
            ids = torch.rand(t, NUM_EXPERTS, generator=g).argsort(-1)[:, :TOP_K]
            ids = torch.where(torch.rand(t, TOP_K, generator=g) < 0.2, -1, ids)  # some pairs nowhere
        weights = torch.rand(t, TOP_K, generator=g)
        scales = torch.rand(t, HIDDEN // GROUP, generator=g) + 0.5
        out.append((hidden, ids.to(torch.int32), weights, scales))
    return out


def _expert_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, first: int, per_rank: int):
    """What a rank computes for received rows: sum over its local pairs of w * x * (global expert + 1)."""
    mine = (ids >= first) & (ids < first + per_rank)
    terms = torch.where(mine, weights * (ids + 1).float(), 0.0)
    factor = terms[:, :1].clone()
    for j in range(1, terms.shape[1]):  # added in a fixed order: the same bits on a CPU and a GPU
        factor = factor + terms[:, j : j + 1]
    return (x.float() * factor).to(x.dtype)


def _dispatch_combine(rank: int, world: int, seed: int, tokens: list[int], kind: str, backend: str):
    device = "cuda" if backend == "nccl" else "cpu"
    per_rank = NUM_EXPERTS // world
    all_inputs = _inputs(seed, world, tokens, kind)
    comm = CollectiveAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens_per_rank=max(tokens)
    )
    for rep in range(2):  # epochs advance; nothing is reset between calls
        h, ids, w, s = (t.to(device) for t in all_inputs[rank])
        got = comm.dispatch(h, ids if rep == 0 else ids.long(), w, scales=s)

        # Reference: the tokens of every source rank that have an expert here, ranks then tokens ascending.
        first = rank * per_rank
        rows = []
        for src_h, src_ids, src_w, src_s in all_inputs:
            here = ((src_ids >= first) & (src_ids < first + per_rank)).any(-1)
            rows.append((src_h[here], src_ids[here], src_w[here], src_s[here]))
        want_h, want_ids, want_w, want_s = (torch.cat(c) for c in zip(*rows, strict=True))
        want_local = torch.where((want_ids >= first) & (want_ids < first + per_rank), want_ids - first, -1)
        assert torch.equal(got.hidden_states.cpu(), want_h), f"rank {rank}: hidden_states"
        assert torch.equal(got.topk_ids.cpu(), want_local.int()), f"rank {rank}: topk_ids"
        assert torch.equal(got.topk_weights.cpu(), want_w), f"rank {rank}: topk_weights"
        assert torch.equal(got.scales.cpu(), want_s), f"rank {rank}: scales"
        counts = torch.bincount(want_local[want_local >= 0].long(), minlength=per_rank)
        assert torch.equal(got.tokens_per_expert.cpu(), counts.int()), f"rank {rank}: tokens_per_expert"

        y = _expert_rows(
            got.hidden_states, got.topk_ids + first * (got.topk_ids >= 0), got.topk_weights, first, per_rank
        )
        out = comm.combine(y, got.handle)
        # Reference: the rows every rank computed for this rank's tokens, summed in fp32 over ranks ascending.
        h0, ids0, w0, _ = all_inputs[rank]
        acc = torch.zeros(h0.shape[0], HIDDEN)
        for dst in range(world):
            lo = dst * per_rank
            here = ((ids0 >= lo) & (ids0 < lo + per_rank)).any(-1)
            part = _expert_rows(h0, ids0, w0, lo, per_rank).float()
            acc[here] += part[here]
        assert torch.equal(out.cpu(), acc.to(torch.bfloat16)), f"rank {rank}: combine"
    return comm.epoch


@pytest.mark.parametrize("kind, tokens", [("random", [5, 0, 7, 33]), ("one_rank", [4, 9, 1, 0])])
def test_dispatch_combine_exact_gloo(kind, tokens):
    seed = int.from_bytes(os.urandom(4), "little")
    epochs = run_ranks(_dispatch_combine, 4, seed, tokens, kind, "gloo")
    assert epochs == [4] * 4, f"seed {seed}"


def _low_latency(rank: int, world: int, seed: int, tokens: list[int], kind: str, capacity, backend: str):
    device = "cuda" if backend == "nccl" else "cpu"
    per_rank, m = NUM_EXPERTS // world, max(tokens)
    all_inputs = _inputs(seed, world, tokens, kind)
    comm = CollectiveAllToAll(
        None,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        max_tokens_per_rank=m,
        mode="low_latency",
        capacity=capacity,
    )
    h, ids, w, s = (t.to(device) for t in all_inputs[rank])
    got = comm.dispatch(h, ids, w, scales=s)
    first = rank * per_rank
    assert got.hidden_states.shape == (world * m, HIDDEN)
    for src, (src_h, src_ids, src_w, src_s) in enumerate(all_inputs):  # block src: its tokens, then padding
        here = ((src_ids >= first) & (src_ids < first + per_rank)).any(-1)
        n, block = int(here.sum()), slice(src * m, (src + 1) * m)
        want_local = torch.where((src_ids >= first) & (src_ids < first + per_rank), src_ids - first, -1)[here]
        assert torch.equal(got.hidden_states[block][:n].cpu(), src_h[here]), f"rank {rank} from {src}"
        assert torch.equal(got.topk_ids[block][:n].cpu(), want_local.int()), f"rank {rank} from {src}"
        assert torch.equal(got.topk_weights[block][:n].cpu(), src_w[here]), f"rank {rank} from {src}"
        assert torch.equal(got.scales[block][:n].cpu(), src_s[here]), f"rank {rank} from {src}"
        assert (got.topk_ids[block][n:] == -1).all() and (got.topk_weights[block][n:] == 0).all()
    # The masked layout of what arrived, and the rows in it.
    layout = got.layout
    want = reference.moe_align_masked(got.topk_ids.cpu(), per_rank, comm.capacity)
    assert torch.equal(layout.row_of.cpu(), want.row_of) and torch.equal(layout.status.cpu(), want.status)
    assert torch.equal(got.tokens_per_expert.cpu(), want.tokens_per_expert)
    owned = want.source_of >= 0
    rows = want.source_of[owned].long() // TOP_K
    flat_h = got.expert_hidden_states.reshape(-1, HIDDEN).cpu()
    assert torch.equal(flat_h[owned], got.hidden_states.cpu()[rows]), f"rank {rank}: expert_hidden_states"
    flat_s = got.expert_scales.reshape(-1, HIDDEN // GROUP).cpu()
    assert torch.equal(flat_s[owned], got.scales.cpu()[rows]), f"rank {rank}: expert_scales"
    # Combine: every rank returns its received rows unchanged; a token gets them back once per rank it
    # went to, summed in fp32.
    out = comm.combine(got.hidden_states, got.handle)
    h0, ids0, _, _ = all_inputs[rank]
    acc = torch.zeros(h0.shape[0], HIDDEN)
    for dst in range(world):
        lo = dst * per_rank
        here = ((ids0 >= lo) & (ids0 < lo + per_rank)).any(-1)
        acc[here] += h0[here].float()
    assert torch.equal(out.cpu(), acc.to(torch.bfloat16)), f"rank {rank}: low-latency combine"
    return int(layout.overflow)


@pytest.mark.parametrize("kind, tokens, capacity", [("random", [5, 0, 7, 33], None), ("one_rank", [4, 9, 1, 0], 3)])
def test_low_latency_exact_gloo(kind, tokens, capacity):
    seed = int.from_bytes(os.urandom(4), "little")
    overflow = run_ranks(_low_latency, 4, seed, tokens, kind, capacity, "gloo")
    assert overflow[:3] == [0, 0, 0], f"seed {seed}"  # only the last rank's experts receive pairs
    assert (overflow[3] > 0) == (capacity is not None), f"seed {seed}: overflow {overflow}"


def _missing_rank(rank: int, world: int, budget: float, backend: str = "gloo"):
    device = "cuda" if backend == "nccl" else "cpu"
    comm = CollectiveAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens_per_rank=8, timeout_s=budget
    )
    h = torch.randn(3, HIDDEN).to(torch.bfloat16).to(device)
    ids = torch.randint(0, NUM_EXPERTS, (3, TOP_K), dtype=torch.int32).to(device)
    w = torch.rand(3, TOP_K).to(device)
    comm.dispatch(h, ids, w)  # every rank once: the communicator is up (NCCL builds it on first use)
    if rank == world - 1:
        time.sleep(budget + 4)  # then this rank stops calling; it leaves after the others have given up
        return None
    start = time.monotonic()
    try:
        comm.dispatch(h, ids, w)
    except CommTimeoutError as exc:
        elapsed = time.monotonic() - start
        if device == "cuda":  # the process and its GPU stay usable after the communicator was aborted
            torch.cuda.synchronize()
            assert torch.equal((h.float() * 2).cpu(), h.float().cpu() * 2)
        time.sleep(2)  # rank 0 hosts the store: it stays until the others have asked it who came
        return (elapsed, exc.peers, exc.phase, exc.epoch, str(exc))
    return "no error"


@pytest.mark.parametrize(
    "world, backend",
    [(4, "gloo"), pytest.param(2, "nccl", marks=pytest.mark.multigpu)],
)
def test_rank_that_never_arrives_raises_comm_timeout(world, backend):
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip("needs two GPUs")
    budget = 2.0
    results = run_ranks(_missing_rank, world, budget, backend, backend=backend)
    for rank, result in enumerate(results[: world - 1]):
        assert isinstance(result, tuple), f"rank {rank}: {result}"
        elapsed, peers, phase, epoch, message = result
        assert peers == (world - 1,) and phase == "dispatch counts" and epoch == 2, message
        assert budget <= elapsed < budget + 5, f"rank {rank} raised after {elapsed:.1f} s"
        assert f"rank(s) {world - 1} did not arrive" in message


def _bad_input(rank: int, world: int):
    comm = CollectiveAllToAll(None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens_per_rank=4)
    h = torch.randn(3, HIDDEN).to(torch.bfloat16)
    ids = torch.zeros(3, TOP_K, dtype=torch.int32)
    w = torch.rand(3, TOP_K)
    cases = {
        "T above max_tokens_per_rank": (
            lambda: comm.dispatch(torch.randn(5, HIDDEN).bfloat16(), ids, w),
            "hidden_states",
        ),
        "hidden size": (lambda: comm.dispatch(torch.randn(3, 32).bfloat16(), ids, w), "hidden_states"),
        "dtype": (lambda: comm.dispatch(h.float(), ids, w), "hidden_states"),
        "id out of range": (lambda: comm.dispatch(h, ids + NUM_EXPERTS, w), "topk_ids"),
        "ids float": (lambda: comm.dispatch(h, ids.float(), w), "topk_ids"),
        "weights shape": (lambda: comm.dispatch(h, ids, w[:, :2]), "topk_weights"),
        "experts not divisible": (
            lambda: CollectiveAllToAll(None, num_experts=9, top_k=2, hidden_size=8, max_tokens_per_rank=1),
            "num_experts",
        ),
    }
    failures = []
    for name, (call, arg) in cases.items():
        try:
            call()
            failures.append(f"{name}: no error")
        except (ValueError, TypeError) as exc:
            if arg not in str(exc) or "got" not in str(exc):
                failures.append(f"{name}: {exc}")
    assert comm.epoch == 0, "a rejected call must not start a collective"
    return failures


def test_bad_input_raises_on_every_rank_before_any_collective():
    assert run_ranks(_bad_input, 2) == [[], []]


def _low_latency_graph(rank: int, world: int, seed: int):
    """dispatch + combine captured once in a CUDA graph, replayed on fresh inputs: equal to eager calls."""
    comm = CollectiveAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=HIDDEN, max_tokens_per_rank=16, mode="low_latency"
    )
    g = torch.Generator().manual_seed(seed + rank)

    def fresh():
        ids = torch.rand(16, NUM_EXPERTS, generator=g).argsort(-1)[:, :TOP_K].int()
        return (
            torch.randn(16, HIDDEN, generator=g).bfloat16().cuda(),
            ids.cuda(),
            torch.rand(16, TOP_K, generator=g).cuda(),
        )

    h, ids, w = fresh()

    def layer():
        got = comm.dispatch(h, ids, w)
        return got.expert_hidden_states, comm.combine(got.hidden_states, got.handle)

    layer()  # builds the communicator and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for _ in range(3):
        for dst, src in zip((h, ids, w), fresh(), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = layer()
        assert torch.equal(captured[1], eager[1]), f"rank {rank}: replayed combine differs from eager"
    return True


@pytest.mark.multigpu
def test_low_latency_exact_nccl_and_graph():
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs two GPUs")
    seed = int.from_bytes(os.urandom(4), "little")
    assert run_ranks(_low_latency, world, seed, [5, 0, 7, 33][:world], "random", None, "nccl", backend="nccl")
    assert run_ranks(_low_latency_graph, world, seed, backend="nccl") == [True] * world


@pytest.mark.multigpu
@pytest.mark.parametrize("kind", ["random", "one_rank"])
def test_dispatch_combine_exact_nccl(kind):
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs two GPUs")
    seed = int.from_bytes(os.urandom(4), "little")
    tokens = [5, 0, 7, 33][:world] if kind == "random" else [4, 9, 1, 0][:world]
    assert run_ranks(_dispatch_combine, world, seed, tokens, kind, "nccl", backend="nccl") == [4] * world
