"""Argument checks shared by the public wrappers: each error names the argument, what was expected and
what was given."""

from __future__ import annotations

import math

import torch


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def ndim(name: str, t: torch.Tensor, expected: int, shape_doc: str) -> None:
    if t.dim() != expected:
        raise ValueError(f"{name} must be {expected}-D {shape_doc}, got shape {tuple(t.shape)}")


def dtype_in(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")


def same_device(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.device != other.device:
        raise ValueError(f"{name} must be on the same device as {other_name} ({other.device}), got {t.device}")


def integer(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {tuple(t.stride())}")


def finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def positive_float(name: str, value: object, expected: str = "a float") -> float:
    """A Python number that must be positive and finite (a scale, a clamp limit) as a float; ``expected`` is
    what the ``TypeError`` says the argument must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive finite number, got {number}")
    return number
