"""MoEAllToAll: the backend decision, exact dispatch/combine on both backends and both modes against a
reference built from every rank's inputs, bad input, and (multigpu tier) the P2P kernels: FP8 rows, CUDA-graph
replay, a rank that never arrives (CommTimeoutError naming it, then recover() and a correct call in the same
processes), and the symmetric workspace mapped, closed and mapped again."""

import os
import time

import pytest
import torch
from launcher import run_ranks

from flashinfer_moe import CommTimeoutError, reference
from flashinfer_moe.comm import MoEAllToAll

NUM_EXPERTS, TOP_K, GROUP = 16, 4, 32


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _inputs(
    seed: int, world: int, tokens: list[int], kind: str, hidden: int, fp8: bool, num_experts: int = NUM_EXPERTS
):
    """Every rank's inputs from one seed, so that each rank can build the reference for all. ``num_experts``
    must be the communicator's (launch/a2a_shared_gpu.py builds one per world size)."""
    g = torch.Generator().manual_seed(seed)
    per_rank = num_experts // world
    out = []
    for t in tokens:
        h = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
        h = h.to(torch.float8_e4m3fn) if fp8 else h
        if kind == "one_rank":  # every pair to the experts of the last rank
            ids = (world - 1) * per_rank + torch.rand(t, per_rank, generator=g).argsort(-1)[:, :TOP_K] % per_rank
        else:
            ids = torch.rand(t, num_experts, generator=g).argsort(-1)[:, :TOP_K]
            ids = torch.where(torch.rand(t, TOP_K, generator=g) < 0.2, -1, ids)  # some pairs nowhere
        weights = torch.rand(t, TOP_K, generator=g)
        scales = torch.rand(t, -(-hidden // GROUP), generator=g) + 0.5
        out.append((h, ids.to(torch.int32), weights, scales))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _expert_rows(x, ids, weights, first: int, per_rank: int) -> torch.Tensor:
    """What a rank computes for received rows (bf16): sum over its local pairs of w * x * (global expert + 1)."""
    mine = (ids >= first) & (ids < first + per_rank)
    terms = torch.where(mine, weights * (ids + 1).float(), 0.0)
    factor = terms[:, :1].clone()
    for j in range(1, terms.shape[1]):  # a fixed order: the same bits on a CPU and a GPU
        factor = factor + terms[:, j : j + 1]
    return (x.to(torch.bfloat16).float() * factor).to(torch.bfloat16)


def _check_call(comm, rank, world, inputs, device, mode) -> None:
    """One dispatch + combine on ``comm``, every output compared exactly with the reference."""
    per_rank = comm.experts_per_rank
    first = rank * per_rank
    m = comm.max_tokens_per_rank
    h, ids, w, s = (t.to(device) for t in inputs[rank])
    got = comm.dispatch(h, ids, w, scales=s)
    for src, (src_h, src_ids, src_w, src_s) in enumerate(inputs):
        here = ((src_ids >= first) & (src_ids < first + per_rank)).any(-1)
        n = int(here.sum())
        start = (
            src * m
            if mode == "low_latency"
            else sum(int(((x[1] >= first) & (x[1] < first + per_rank)).any(-1).sum()) for x in inputs[:src])
        )
        rows = slice(start, start + n)
        local = torch.where((src_ids >= first) & (src_ids < first + per_rank), src_ids - first, -1)[here]
        assert torch.equal(_bits(got.hidden_states[rows]), _bits(src_h[here])), f"rank {rank}: rows from {src}"
        assert torch.equal(got.topk_ids[rows].cpu(), local.int()), f"rank {rank}: ids from {src}"
        assert torch.equal(got.topk_weights[rows].cpu(), src_w[here]), f"rank {rank}: weights from {src}"
        assert torch.equal(got.scales[rows].cpu(), src_s[here]), f"rank {rank}: scales from {src}"
        if mode == "low_latency":  # the rest of the block is padding
            pad = slice(start + n, start + m)
            assert (got.topk_ids[pad] == -1).all() and (got.topk_weights[pad] == 0).all(), f"rank {rank}: padding"
    if mode == "low_latency":
        assert got.hidden_states.shape[0] == world * m
        want = reference.moe_align_masked(got.topk_ids.cpu(), per_rank, comm.capacity)
        assert torch.equal(got.layout.row_of.cpu(), want.row_of), f"rank {rank}: layout"
        assert torch.equal(got.tokens_per_expert.cpu(), want.tokens_per_expert), f"rank {rank}: tokens_per_expert"
        owned = want.source_of >= 0
        src_rows = want.source_of[owned].long() // comm.top_k
        flat = got.expert_hidden_states.reshape(-1, comm.hidden_size)
        assert torch.equal(_bits(flat[owned.to(flat.device)]), _bits(got.hidden_states.cpu()[src_rows]))
    else:
        local_ids = got.topk_ids.cpu()
        counts = torch.bincount(local_ids[local_ids >= 0].long(), minlength=per_rank).int()
        assert torch.equal(got.tokens_per_expert.cpu(), counts), f"rank {rank}: tokens_per_expert"
        assert got.hidden_states.shape[0] == sum(got.handle.recv_counts)

    global_ids = got.topk_ids + first * (got.topk_ids >= 0)
    y = _expert_rows(got.hidden_states, global_ids, got.topk_weights, first, per_rank).to(device)
    out = comm.combine(y, got.handle)
    h0, ids0, w0, _ = inputs[rank]
    acc = torch.zeros(h0.shape[0], comm.hidden_size)
    for dst in range(world):  # fp32, ranks ascending, only the ranks the token went to
        lo = dst * per_rank
        here = ((ids0 >= lo) & (ids0 < lo + per_rank)).any(-1)
        acc[here] += _expert_rows(h0, ids0, w0, lo, per_rank).float()[here]
    assert torch.equal(out.cpu(), acc.to(torch.bfloat16)), f"rank {rank}: combine"


def _exact(rank, world, seed, tokens, kind, mode, backend, hidden=64, fp8=False, calls=3):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=hidden, max_tokens_per_rank=max(tokens),
        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, mode=mode, backend=backend,
        scale_groups=-(-hidden // GROUP),
    )  # fmt: skip
    for call in range(calls):  # epochs advance, payload regions alternate; nothing is reset in between
        _check_call(comm, rank, world, _inputs(seed + call, world, tokens, kind, hidden, fp8), device, mode)
    comm.close()
    return comm.backend, comm.fallback_reason


# ------------------------------------------------------------------------------------------------ CPU tier


@pytest.mark.parametrize(
    "mode, backend, fp8, hidden",
    [(mode, backend, False, 64) for mode in ("high_throughput", "low_latency") for backend in ("auto", "nccl")]
    # Low-latency FP8 rows into the expert-major layout: even widths through the permute kernel, odd ones bytewise.
    + [("low_latency", "nccl", True, 64), ("low_latency", "nccl", True, 67)],
)
def test_cpu_dispatch_combine_exact(mode, backend, fp8, hidden):
    seed = _seed()
    results = run_ranks(_exact, 4, seed, [5, 0, 7, 33], "random", mode, backend, hidden, fp8)
    for chosen, reason in results:
        assert chosen == "nccl", f"seed {seed}"
        if backend == "auto":  # every rank says why it is not P2P
            assert reason and "CUDA is not available" in reason, reason
        else:
            assert reason is None


def test_cpu_all_pairs_to_one_rank():
    results = run_ranks(_exact, 4, _seed(), [4, 9, 1, 0], "one_rank", "high_throughput", "auto", 64, False, 1)
    assert [r[0] for r in results] == ["nccl"] * 4


def _p2p_without_gpu(rank, world):
    try:
        MoEAllToAll(None, num_experts=8, top_k=2, hidden_size=16, max_tokens_per_rank=4, backend="p2p")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_p2p_backend_without_gpu_raises_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    for message in run_ranks(_p2p_without_gpu, 2):
        assert message.startswith("backend='p2p' needs a CUDA GPU") and "got none" in message, message


def _bad_input(rank, world):
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, max_tokens_per_rank=4, scale_groups=2
    )
    h, ids, w = torch.randn(3, 64).bfloat16(), torch.zeros(3, TOP_K, dtype=torch.int32), torch.rand(3, TOP_K)
    got = comm.dispatch(h, ids, w)  # one good call, for a handle
    calls_before = comm._impl.epoch

    def build(**kw):
        args = dict(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, max_tokens_per_rank=4) | kw
        return MoEAllToAll(None, **args)

    cases = {
        "experts not divisible": (lambda: build(num_experts=9, top_k=2), "num_experts"),
        "bad mode": (lambda: build(mode="fast"), "mode"),
        "bad backend": (lambda: build(backend="mpi"), "backend"),
        "T above max_tokens_per_rank": (lambda: comm.dispatch(torch.randn(5, 64).bfloat16(), ids, w), "hidden_states"),
        "hidden size": (lambda: comm.dispatch(torch.randn(3, 32).bfloat16(), ids, w), "hidden_states"),
        "dtype": (lambda: comm.dispatch(h.float(), ids, w), "hidden_states"),
        "id out of range": (lambda: comm.dispatch(h, ids + NUM_EXPERTS, w), "topk_ids"),
        "id below -1": (lambda: comm.dispatch(h, ids - 2, w), "topk_ids"),
        "ids float": (lambda: comm.dispatch(h, ids.float(), w), "topk_ids"),
        "weights shape": (lambda: comm.dispatch(h, ids, w[:, :2]), "topk_weights"),
        "scales width": (lambda: comm.dispatch(h, ids, w, scales=torch.rand(3, 3)), "scales"),
        "combine dtype": (lambda: comm.combine(got.hidden_states.float(), got.handle), "x"),
        "combine hidden size": (lambda: comm.combine(got.hidden_states[:, :32], got.handle), "x"),
    }
    failures = []
    for name, (call, arg) in cases.items():
        try:
            call()
            failures.append(f"{name}: no error")
        except (ValueError, TypeError) as exc:
            if not (str(exc).startswith(f"{arg} ") or f" {arg} " in str(exc)) or "got" not in str(exc):
                failures.append(f"{name}: {exc}")
    if comm._impl.epoch != calls_before:
        failures.append("a rejected call started a collective")
    return failures


def test_bad_input_raises_on_every_rank_before_any_collective():
    assert run_ranks(_bad_input, 2) == [[], []]


# ------------------------------------------------------------------------------------------ multigpu tier


def _gpus() -> int:
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs two GPUs")
    return world


@pytest.mark.multigpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
@pytest.mark.parametrize("backend", ["p2p", "nccl"])
def test_gpu_dispatch_combine_exact(backend, mode, fp8):
    world, seed = _gpus(), _seed()
    results = run_ranks(_exact_shapes, world, seed, mode, backend, fp8, backend="nccl", timeout_s=600)
    assert results == [[backend] * 4] * world, f"seed {seed}"


def _exact_shapes(rank, world, seed, mode, backend, fp8):
    cases = [  # 68-wide rows are not whole 16-byte vectors: the byte-wise copy and the scalar combine
        ([5, 0, 7, 33], "random", 64),
        ([5, 0, 7, 33], "random", 7168),
        ([5, 0, 7, 33], "random", 68),
        ([4, 9, 1, 0], "one_rank", 64),
    ]
    return [_exact(rank, world, seed, t[:world], kind, mode, backend, hidden, fp8)[0] for t, kind, hidden in cases]


def _auto(rank, world, seed, force):
    if force:
        os.environ["FLASHINFER_MOE_PROBE_FORCE"] = force
    from flashinfer_moe.comm.p2p_check import pair_attributes

    fit = all(
        pair_attributes(rank, peer).can_access_peer and pair_attributes(rank, peer).native_atomics
        for peer in range(world)
        if peer != rank
    )
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, max_tokens_per_rank=8, timeout_s=2,
        scale_groups=64 // GROUP,
    )  # fmt: skip
    # One seed for every rank: each builds the reference from all ranks' inputs.
    _check_call(comm, rank, world, _inputs(seed, world, [8] * world, "random", 64, False), "cuda", comm.mode)
    comm.close()
    return fit, comm.backend, comm.fallback_reason


@pytest.mark.multigpu
@pytest.mark.parametrize("force", [None, "timeout", "fail"])
def test_gpu_auto_decision(force):
    """Auto takes P2P exactly when every pair is fit; a live check forced to fail sends every rank to NCCL."""
    world = _gpus()
    results = run_ranks(_auto, world, _seed(), force, backend="nccl")
    fit = all(r[0] for r in results)
    for _, backend, reason in results:
        if fit and force is None:
            assert backend == "p2p" and reason is None, reason
        else:
            assert backend == "nccl" and reason, reason
            if force:
                assert "live flag check" in reason and ("TIMEOUT" if force == "timeout" else "wrong payload") in reason


def _graph(rank, world, seed):
    """Low-latency P2P dispatch + combine captured once in a CUDA graph and replayed on fresh inputs: the
    replays equal eager calls made right after them."""
    m = 16
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=256, max_tokens_per_rank=m, mode="low_latency",
        backend="p2p", dtype=torch.float8_e4m3fn, scale_groups=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + rank)

    def fresh():
        ids = torch.rand(m, NUM_EXPERTS, generator=g).argsort(-1)[:, :TOP_K].int()
        ids[: m // 4] = -1  # some tokens go nowhere
        return (
            torch.randn(m, 256, generator=g).to(torch.float8_e4m3fn).cuda(),
            ids.cuda(),
            torch.rand(m, TOP_K, generator=g).cuda(),
            torch.rand(m, 2, generator=g).cuda(),
        )

    h, ids, w, s = fresh()

    def layer():
        got = comm.dispatch(h, ids, w, scales=s)
        y = got.hidden_states.to(torch.bfloat16) * 2
        return got.hidden_states, got.topk_ids, got.tokens_per_expert, comm.combine(y, got.handle)

    layer()  # warm-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for _ in range(4):
        for dst, src in zip((h, ids, w, s), fresh(), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured]
        eager = layer()
        torch.cuda.synchronize()
        comm.check()
        # Rows past a source's count in its block are padding: ids -1, their values unspecified.
        valid = (eager[1] >= 0).any(-1)
        assert torch.equal(replayed[1], eager[1]), f"rank {rank}: replayed dispatch ids"
        assert torch.equal(_bits(replayed[0][valid]), _bits(eager[0][valid])), f"rank {rank}: replayed dispatch rows"
        assert torch.equal(replayed[2], eager[2]), f"rank {rank}: replayed tokens_per_expert"
        assert torch.equal(replayed[3], eager[3]), f"rank {rank}: replayed combine"
        want = (h.to(torch.bfloat16).float() * 2 * (ids >= 0).any(-1, keepdim=True)).to(torch.bfloat16)
        sent = torch.zeros_like(want, dtype=torch.float32)
        for dst in range(world):  # each rank the token went to returns 2 * x once
            lo = dst * (NUM_EXPERTS // world)
            here = ((ids >= lo) & (ids < lo + NUM_EXPERTS // world)).any(-1, keepdim=True)
            sent += torch.where(here, want.float(), 0.0)
        assert torch.equal(eager[3], sent.to(torch.bfloat16)), f"rank {rank}: combine of 2 * x"
    comm.close()
    return True


@pytest.mark.multigpu
def test_gpu_low_latency_p2p_graph_replay():
    world = _gpus()
    assert run_ranks(_graph, world, _seed(), backend="nccl") == [True] * world


def _timeout(rank, world, seed, budget, mode, fallback):
    comm = MoEAllToAll(
        None, num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, max_tokens_per_rank=8, mode=mode,
        backend="p2p", timeout_s=budget, fallback_on_timeout=fallback, scale_groups=64 // GROUP,
    )  # fmt: skip
    _check_call(comm, rank, world, _inputs(seed, world, [8] * world, "random", 64, False), "cuda", mode)
    outcome = None
    if rank == world - 1:
        time.sleep(budget + 4)  # this rank skips the call; the others give up meanwhile
    else:
        h, ids, w, s = (t.cuda() for t in _inputs(1, world, [8] * world, "random", 64, False)[rank])
        start = time.monotonic()
        try:
            comm.dispatch(h, ids, w, scales=s)
            comm.check()  # low-latency calls report here
            outcome = "no error"
        except CommTimeoutError as exc:
            outcome = (time.monotonic() - start, exc.peers, exc.phase, str(exc))
        # The process and its GPU stay usable.
        assert torch.equal((h.float() * 2).cpu(), h.float().cpu() * 2)
    comm.recover()  # every rank, the one that skipped too
    # Afterwards: correct calls in the same processes, on P2P or (policy) on NCCL. One seed for every rank.
    for call in range(2):
        inputs = _inputs(seed + 1 + call, world, [8, 3, 0, 5][:world], "random", 64, False)
        _check_call(comm, rank, world, inputs, "cuda", mode)
    comm.close()
    return outcome, comm.backend, comm.fallback_reason


@pytest.mark.multigpu
@pytest.mark.parametrize("fallback", [False, True], ids=["recover", "fallback"])
@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
def test_gpu_p2p_timeout_then_successful_call(mode, fallback):
    world, budget = _gpus(), 2.0
    results = run_ranks(_timeout, world, _seed(), budget, mode, fallback, backend="nccl")
    for rank, (outcome, backend, reason) in enumerate(results):
        if rank < world - 1:
            assert isinstance(outcome, tuple), f"rank {rank}: {outcome}"
            elapsed, peers, phase, message = outcome
            assert peers == (world - 1,) and phase == "dispatch", message
            assert f"waiting for rank {world - 1}" in message and "recover()" in message, message
            assert budget <= elapsed < budget + 5, f"rank {rank} raised after {elapsed:.1f} s"
        assert backend == ("nccl" if fallback else "p2p"), (rank, backend, reason)
        if fallback:
            assert reason and "P2P" in reason and "timed out" in reason, reason


def _workspace(rank, world):
    import ctypes

    from flashinfer_moe.comm._kernels import comm_lib
    from flashinfer_moe.comm.workspace import SymmetricWorkspace

    lib, seen = comm_lib(), []
    for handle_type in ("ipc", "auto", "ipc"):  # mapped, closed, and mapped again
        ws = SymmetricWorkspace(None, 1 << 20, handle_type=handle_type)
        assert len(ws.ptrs) == world and ws.ptr_table.tolist() == ws.ptrs and ws.handle_type in ("ipc", "fabric")
        mark = (ctypes.c_int32 * 4)(rank, world, len(seen), 12345)
        peer = (rank + 1) % world  # each rank writes into the next one's buffer, through its mapping
        assert lib.fim_ws_copy(ws.device, ws.ptrs[peer] + 64 * rank, ctypes.addressof(mark), 16) == 0
        torch.distributed.barrier()
        got = (ctypes.c_int32 * 4)()
        src = (rank - 1) % world
        assert lib.fim_ws_copy(ws.device, ctypes.addressof(got), ws.local_ptr + 64 * src, 16) == 0
        assert list(got) == [src, world, len(seen), 12345], list(got)
        torch.distributed.barrier()
        ws.close()
        ws.close()  # idempotent
        assert ws.closed and ws.ptr_table is None
        seen.append(ws.handle_type)
    return seen


@pytest.mark.multigpu
def test_gpu_symmetric_workspace_close_and_reopen():
    world = _gpus()
    for seen in run_ranks(_workspace, world, backend="nccl"):
        assert seen[0] == seen[2] == "ipc" and seen[1] in ("ipc", "fabric")
