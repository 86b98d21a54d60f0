"""Collective argument agreement: every rank of a group checks its own arguments, then one small all-gather
tells every rank whether any rank's arguments were bad or whether the ranks disagree, so that all ranks raise
the same error together instead of one rank raising alone while the others wait in the next collective (or
a transfer of mismatched sizes aborting one process and corrupting another).

:func:`validate_collectively` is collective: every rank of the group calls it at the same point.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = ["validate_collectively"]

T = TypeVar("T")

_MISSING = ("missing",)  # the canonical form of a key that a rank's dict lacks
_MAX_GROUPS = 8  # distinct values listed per key in a mismatch message; the rest are counted
_MAX_REPR = 200


def _canonical(value: object) -> object:
    """A picklable, comparable form of one argument: builtins only, equal exactly when the values are the same
    argument (numbers compared by value as Python does, so ``30``, ``30.0`` agree and ``True``, ``1`` do; floats
    exactly; every NaN equals every NaN). Never raises: a value of another type is compared by its type and repr."""
    if value is None:
        return None
    if isinstance(value, int):  # bool too: True agrees with 1, as in Python
        return ("num", value)
    if isinstance(value, float):
        return ("nan",) if math.isnan(value) else ("num", value)
    if isinstance(value, (str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, torch.dtype):
        return ("dtype", str(value))
    if isinstance(value, torch.device):
        return ("device", str(value))
    if isinstance(value, (tuple, list)):
        return ("seq", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("map", tuple(sorted((repr(k), _canonical(v)) for k, v in value.items())))
    return ("other", f"{type(value).__module__}.{type(value).__qualname__}", _display(value))


def _display(value: object) -> str:
    """How a value is written in a mismatch message."""
    if value is _MISSING:
        return "no such argument"
    text = repr(str(value)) if isinstance(value, torch.device) else repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    """``0, 2`` / ``0, 1`` / ``0-5, 7``: runs of three or more consecutive ranks are written as a range."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def _mismatches(gathered_args: list[list[tuple[str, object, str]]]) -> list[str]:
    """One clause per key whose value is not the same on every rank. Keys in the order of their first
    appearance, ranks ascending and each rank's keys in its dict's order: the same order on every rank."""
    keys: list[str] = []
    per_rank: list[dict[str, tuple[object, str]]] = []
    for entries in gathered_args:
        mine = {}
        for key, canon, shown in entries:
            if key not in mine and key not in keys:
                keys.append(key)
            mine[key] = (canon, shown)
        per_rank.append(mine)
    clauses = []
    for key in keys:
        groups: list[tuple[object, str, list[int]]] = []  # (canonical, shown, ranks), by first rank
        for rank, mine in enumerate(per_rank):
            canon, shown = mine.get(key, (_MISSING, _display(_MISSING)))
            for group in groups:
                if group[0] == canon:
                    group[2].append(rank)
                    break
            else:
                groups.append((canon, shown, [rank]))
        if len(groups) == 1:
            continue
        listed = [f"{shown} on rank(s) {_ranks(ranks)}" for _, shown, ranks in groups[:_MAX_GROUPS]]
        if len(groups) > _MAX_GROUPS:
            listed.append(f"{len(groups) - _MAX_GROUPS} more value(s) on the other ranks")
        values = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
        clauses.append(f"{key} must be the same on every rank, got {values}")
    return clauses


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, TypeError):
        return "TypeError"
    if isinstance(exc, ValueError):
        return "ValueError"
    return f"{type(exc).__name__}"


def validate_collectively(group, what: str, args: dict[str, object], check: Callable[[], T] | None = None) -> T | None:
    """Checks this rank's arguments, then agrees with every rank of ``group`` that all ranks' arguments are
    valid and the same. Collective: every rank of ``group`` calls it at the same point, before any other
    collective that depends on the arguments.

    1. ``check()`` runs here (where given); a ``ValueError``/``TypeError`` it raises is caught.
    2. One ``all_gather_object`` over ``group`` exchanges each rank's error (or None) and a normalized form of
       ``args`` (no collective at all in a group of one rank).
    3. If any rank's check failed, every rank raises that exception's type: the rank that failed with its own
       message plus ``" (on rank R of W)"``, every other rank with the message of the lowest rank that failed
       plus ``" (on rank R of W; this rank's arguments were valid)"``. So the argument's name stays the first
       word of the message on every rank. Another exception from ``check()`` is re-raised on its rank, and
       the other ranks raise ``RuntimeError`` naming that rank, so that none waits.
    4. Else, if some keys of ``args`` differ between ranks (a key that a rank lacks differs too), every rank
       raises ``ValueError``: ``"{what}: {key} must be the same on every rank, got 256 on rank(s) 0, 2 and 512
       on rank(s) 1"``, one such clause per differing key, joined by ``"; "``.

    Args:
        group: the ``torch.distributed`` process group (None: the default group). With NCCL the exchange
            uses the current CUDA device.
        what: what is being built, e.g. ``"MoEAllToAll"`` (starts the mismatch message).
        args: the arguments that must agree, by name: None, bool, int, float (compared exactly), str,
            ``torch.dtype``, ``torch.device``, and tuples, lists and dicts of these; not tensors (a tensor
            value is an error of this rank, raised as ``TypeError`` on every rank like a failed check).
        check: validates this rank's arguments; raises ``ValueError``/``TypeError`` naming the argument.

    Returns:
        What ``check()`` returned (None without ``check``).
    """
    if not isinstance(what, str):
        raise TypeError(f"what must be a str, got {type(what).__name__}")
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict of argument names to values, got {type(args).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group must come from an initialized torch.distributed, got no process group")
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    # 1. This rank's own checks. Nothing here may raise before the exchange, or the other ranks would wait.
    result, failure, error = None, None, None
    if check is not None:
        try:
            result = check()
        except Exception as exc:  # ValueError/TypeError: the arguments; anything else: reported, then re-raised
            failure = exc
            error = (_error_kind(exc), str(exc))
    entries = []
    for key, value in args.items():
        if isinstance(value, torch.Tensor) and error is None:
            error = (
                "TypeError",
                f"{key} must be a plain value (int, float, str, dtype, ...) that every rank can compare, "
                f"got a tensor of shape {tuple(value.shape)}",
            )
        entries.append((str(key), _canonical(value), _display(value)))

    # 2. One small collective (none in a group of one).
    if world == 1:
        gathered = [(error, entries)]
    else:
        gathered = [None] * world
        dist.all_gather_object(gathered, (error, entries), group=group)

    # 3. A rank whose arguments are invalid: every rank raises.
    failed = [r for r, (err, _) in enumerate(gathered) if err is not None]
    if failed:
        if error is not None:
            kind, message = error
            suffix = f" (on rank {rank} of {world})"
            if failure is not None and kind not in ("ValueError", "TypeError"):
                raise failure  # not an argument error: this rank's own exception, as it was
            cls = TypeError if kind == "TypeError" else ValueError
            raise cls(message + suffix) from failure
        first = failed[0]
        kind, message = gathered[first][0]
        suffix = f" (on rank {first} of {world}; this rank's arguments were valid)"
        if kind == "TypeError":
            raise TypeError(message + suffix)
        if kind == "ValueError":
            raise ValueError(message + suffix)
        raise RuntimeError(f"{what}: rank {first} of {world} failed while checking its arguments: {kind}: {message}")

    # 4. Arguments that differ between ranks.
    clauses = _mismatches([e for _, e in gathered])
    if clauses:
        raise ValueError(f"{what}: " + "; ".join(clauses))
    return result
