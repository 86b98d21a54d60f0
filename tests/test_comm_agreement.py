"""Collective argument agreement (CPU tier, gloo): MoEAllToAll built with arguments that differ between ranks,
or that are bad on one rank only, raises on EVERY rank (naming the argument and the ranks) instead of one rank
failing alone while the others wait; validate_collectively on its own (several differing keys, missing keys,
tensors, a check that fails otherwise); and afterwards, in the same processes, matching arguments still build a
communicator whose dispatch and combine are right (so every failed construction left the ranks in step).
Many cases run in one spawned job per world size: a spawn costs seconds."""

import math

import pytest
import torch
from checks import assert_error_names_argument
from launcher import run_ranks

from flashinfer_moe.comm import MoEAllToAll
from flashinfer_moe.comm.agreement import _canonical, _display, _mismatches, _ranks, validate_collectively

NUM_EXPERTS, TOP_K = 12, 2  # 12 experts: divisible by 1, 2 and 3 ranks
TIMEOUT_S = 120  # nothing may hang: a rank left waiting fails the test within this


def _build(**kw):
    args = dict(num_experts=NUM_EXPERTS, top_k=TOP_K, hidden_size=64, max_tokens_per_rank=8, backend="nccl") | kw
    return MoEAllToAll(None, **args)


def _outcome(call):
    """``("ok", value)`` or ``(exception type name, message)``: what the rank saw, for the test to check."""
    try:
        value = call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", value if not isinstance(value, MoEAllToAll) else "built"


def _dispatch_combine(rank: int, world: int) -> bool:
    """A communicator built with matching arguments works: every rank sends its rows out and gets each token
    back once per rank it went to (the rows returned unchanged), summed in fp32."""
    comm = _build(hidden_size=48)
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = 5 + rank
    h = torch.randn(tokens, 48, generator=g).bfloat16()
    ids = torch.rand(tokens, NUM_EXPERTS, generator=g).argsort(-1)[:, :TOP_K].int()
    ids[0] = -1  # a token sent nowhere
    got = comm.dispatch(h, ids, torch.rand(tokens, TOP_K, generator=g))
    out = comm.combine(got.hidden_states, got.handle)
    per_rank = NUM_EXPERTS // world
    destinations = torch.stack([((ids >= d * per_rank) & (ids < (d + 1) * per_rank)).any(-1) for d in range(world)])
    want = (h.float() * destinations.sum(0, keepdim=True).T.float()).bfloat16()
    comm.close()
    return torch.equal(out, want) and got.hidden_states.shape[0] == sum(got.handle.recv_counts)


def _cases(rank: int, world: int) -> dict:
    last = world - 1
    out = {
        # Valid on every rank, different between ranks.
        "hidden differs": _outcome(lambda: _build(hidden_size=512 if rank == 1 else 256)),
        "dtype differs": _outcome(lambda: _build(dtype=torch.float16 if rank == 0 else torch.bfloat16)),
        # Bad on one rank only.
        "hidden zero": _outcome(lambda: _build(hidden_size=0 if rank == last else 64)),
        "dtype not float": _outcome(lambda: _build(dtype=torch.int32 if rank == 1 else torch.bfloat16)),
        "mode": _outcome(lambda: _build(mode="fast" if rank == 0 else "low_latency")),
        # validate_collectively itself.
        "several keys": _outcome(
            lambda: validate_collectively(
                None,
                "Thing",
                {
                    "same": 7,
                    "b": rank % 2,
                    "f": 0.3 if rank == 0 else 0.1 + 0.2,  # floats compared exactly
                    "n": None,
                    "dt": torch.float64 if rank == last else torch.float32,
                    "dev": torch.device("cpu"),
                },
            )
        ),
        "missing key": _outcome(
            lambda: validate_collectively(None, "Thing", {"a": 1, "extra": 2} if rank == 0 else {"a": 1})
        ),
        "agree": _outcome(
            lambda: validate_collectively(
                None,
                "Thing",
                {"t": 30 if rank == 0 else 30.0, "v": True if rank == 0 else 1, "nan": math.nan, "s": (1, "x")},
                lambda: rank * 10,
            )
        ),
        "no check": _outcome(lambda: validate_collectively(None, "Thing", {"a": 1})),
        "tensor": _outcome(
            lambda: validate_collectively(None, "Thing", {"t": torch.ones(2) if rank == 0 else 1.0, "u": rank})
        ),
        "runtime error": _outcome(lambda: validate_collectively(None, "Thing", {}, _boom if rank == last else None)),
    }
    # After every failed construction the ranks are still in step: a working communicator.
    out["dispatch combine"] = _dispatch_combine(rank, world)
    return out


def _boom():
    raise RuntimeError("boom")


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


@pytest.mark.parametrize("world", [2, 3])
def test_disagreement_raises_on_every_rank(world):
    results = run_ranks(_cases, world, timeout_s=TIMEOUT_S)
    last = world - 1
    others = [r for r in range(world) if r != 1]
    for rank, got in enumerate(results):
        where = f"rank {rank} of {world}"
        assert got["hidden differs"] == (
            "ValueError",
            f"MoEAllToAll: hidden_size must be the same on every rank, got 256 on rank(s) {_ranks_text(others)} "
            "and 512 on rank(s) 1",
        ), where
        assert got["dtype differs"] == (
            "ValueError",
            "MoEAllToAll: dtype must be the same on every rank, got torch.float16 on rank(s) 0 and torch.bfloat16 "
            f"on rank(s) {_ranks_text(range(1, world))}",
        ), where

        kind, message = got["hidden zero"]
        assert kind == "ValueError" and message.startswith("hidden_size "), (where, message)
        own = "hidden_size must be >= 1, got 0"
        if rank == last:
            assert message == f"{own} (on rank {last} of {world})", message
        else:
            assert message == f"{own} (on rank {last} of {world}; this rank's arguments were valid)", message

        kind, message = got["dtype not float"]
        assert kind == "TypeError" and message.startswith("dtype must be a floating torch.dtype, got torch.int32")
        assert message.endswith(f"(on rank 1 of {world})" if rank == 1 else f"(on rank 1 of {world}; this rank's "
                                "arguments were valid)"), message  # fmt: skip

        # Bad on rank 0 and different on every other rank: the bad argument is what every rank reports.
        kind, message = got["mode"]
        assert kind == "ValueError" and message.startswith("mode must be 'high_throughput' or 'low_latency', got "
                                                           "'fast' (on rank 0 of "), message  # fmt: skip

        kind, message = got["several keys"]
        clauses = [
            f"b must be the same on every rank, got 0 on rank(s) {_ranks_text(range(0, world, 2))} and 1 on rank(s) 1",
            "f must be the same on every rank, got 0.3 on rank(s) 0 and 0.30000000000000004 on rank(s) "
            + _ranks_text(range(1, world)),
            f"dt must be the same on every rank, got torch.float32 on rank(s) {_ranks_text(range(last))} and "
            f"torch.float64 on rank(s) {last}",
        ]
        assert (kind, message) == ("ValueError", "Thing: " + "; ".join(clauses)), where

        assert got["missing key"] == (
            "ValueError",
            "Thing: extra must be the same on every rank, got 2 on rank(s) 0 and no such argument on rank(s) "
            + _ranks_text(range(1, world)),
        ), where
        assert got["agree"] == ("ok", rank * 10), where
        assert got["no check"] == ("ok", None), where

        kind, message = got["tensor"]
        assert kind == "TypeError" and message.startswith("t must be a plain value"), message
        assert "got a tensor of shape (2,) (on rank 0 of" in message, message

        if rank == last:  # the rank's own exception, unchanged
            assert got["runtime error"] == ("RuntimeError", "boom"), where
        else:
            assert got["runtime error"] == (
                "RuntimeError",
                f"Thing: rank {last} of {world} failed while checking its arguments: RuntimeError: boom",
            ), where

        assert got["dispatch combine"] is True, where


def _single(rank: int, world: int) -> dict:
    """A group of one rank: the same errors, and no collective at all."""
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("validate_collectively used a collective in a group of one rank")

    real, dist.all_gather_object = dist.all_gather_object, no_collective
    try:
        out = {
            "hidden zero": _outcome(lambda: _build(hidden_size=0)),
            "tensor": _outcome(lambda: validate_collectively(None, "Thing", {"t": torch.ones(1)})),
            "agree": _outcome(lambda: validate_collectively(None, "Thing", {"a": 1.5}, lambda: "checked")),
            "built": _outcome(lambda: _build(mode="low_latency")),
        }
    finally:
        dist.all_gather_object = real
    out["dispatch combine"] = _dispatch_combine(rank, world)
    return out


def test_group_of_one_rank_needs_no_collective():
    (got,) = run_ranks(_single, 1, timeout_s=TIMEOUT_S)
    assert got["hidden zero"] == ("ValueError", "hidden_size must be >= 1, got 0 (on rank 0 of 1)")
    assert got["tensor"][0] == "TypeError" and got["tensor"][1].endswith("(on rank 0 of 1)"), got["tensor"]
    assert got["agree"] == ("ok", "checked")
    assert got["built"] == ("ok", "built")
    assert got["dispatch combine"] is True


# ------------------------------------------------------------------------------- the message, in-process


def _gathered(values_by_rank: list[dict]) -> list[list]:
    return [[(k, _canonical(v), _display(v)) for k, v in values.items()] for values in values_by_rank]


def test_mismatch_message_lists_values_and_rank_ranges():
    by_rank = [{"x": 1 if r in (0, 1, 2, 3, 5) else 2, "same": "a", "y": [r // 4]} for r in range(8)]
    assert _mismatches(_gathered(by_rank)) == [
        "x must be the same on every rank, got 1 on rank(s) 0-3, 5 and 2 on rank(s) 4, 6, 7",
        "y must be the same on every rank, got [0] on rank(s) 0-3 and [1] on rank(s) 4-7",
    ]
    many = [{"k": r} for r in range(20)]  # a different value on every rank: the first values, then a count
    (clause,) = _mismatches(_gathered(many))
    assert clause.startswith(
        "k must be the same on every rank, got 0 on rank(s) 0, 1 on rank(s) 1, "
    ) and clause.endswith(" and 12 more value(s) on the other ranks"), clause
    assert _ranks([0, 1, 3, 4, 5, 9]) == "0, 1, 3-5, 9"
    # Numbers by value (as Python compares them), floats exactly, NaN equal to NaN, dtypes and devices by name.
    assert _canonical(30) == _canonical(30.0) and _canonical(True) == _canonical(1)
    assert _canonical(0.1 + 0.2) != _canonical(0.3) and _canonical(math.nan) == _canonical(float("nan"))
    assert _canonical(torch.bfloat16) == ("dtype", "torch.bfloat16") and _canonical("1") != _canonical(1)


def test_arguments_of_validate_collectively():
    assert_error_names_argument(lambda: validate_collectively(None, "Thing", [("a", 1)]), TypeError, "args")
    assert_error_names_argument(lambda: validate_collectively(None, 3, {}), TypeError, "what")
