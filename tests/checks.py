"""Assertions shared by the test modules."""

import pytest
import torch


def assert_error_names_argument(call, exc: type[Exception], name: str) -> None:
    """``call()`` raises ``exc`` whose message names the argument ``name`` (as a word, or indexed as
    ``name[...]`` at the start) and says what it got."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name} ") or f" {name} " in message or message.startswith(f"{name}["), message
    assert "got" in message, message


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, one-byte types (FP8, packed FP4) as raw bytes, for exact comparisons."""
    t = t.detach().cpu()
    return t.view(torch.uint8) if t.element_size() == 1 else t


def randn(g: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)
