"""Random grouped-GEMM problems and their float64 references, shared by the CPU, interpreter and GPU tests."""

import torch

from flashinfer_moe import reference as ref

FP8 = torch.float8_e4m3fn
# (operand kind, relative-error tolerance against the float64 reference of the same quantized inputs).
KINDS = (("bf16", 1e-2), ("fp16", 1e-2), ("fp8_block", 2e-2), ("fp8_tensor", 2e-2))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def contiguous_layout(counts: list[int], block_rows: int, device):
    """A contiguous ExpertLayout with exactly ``counts[e]`` rows for expert ``e`` (one token per pair)."""
    import flashinfer_moe as fm

    ids = torch.cat(
        [torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)] + [torch.empty(0, dtype=torch.int32)]
    )
    ids = ids[torch.randperm(ids.numel())].reshape(-1, 1).to(device)
    return fm.moe_align_contiguous(ids, len(counts), block_rows)


def make_weights(kind: str, num_experts: int, n: int, k: int, g: torch.Generator, device, a_mode: str = "tensor"):
    """``(w, w_scale)`` of ``kind`` with a spread of magnitudes across blocks and experts."""
    w = torch.randn(num_experts, n, k, generator=g) / k**0.5
    w = w * (0.5 + torch.rand(num_experts, 1, 1, generator=g))
    if kind in ("bf16", "fp16"):
        return w.to(device=device, dtype=torch.bfloat16 if kind == "bf16" else torch.float16), None
    if kind == "fp8_block":
        q, s = ref.quantize_fp8_block_weights(w)
        return q.to(device), s.to(device)
    scale = w.abs().amax(dim=(1, 2)) / 448
    q = (w / scale[:, None, None]).clamp(-448, 448).to(FP8)
    return q.to(device), scale.float().to(device)


def make_activations(kind: str, rows_shape, k: int, g: torch.Generator, device, a_mode: str = "tensor"):
    """``(a, a_scale)`` with ``rows_shape`` leading dims; per-tensor FP8 takes ``a_mode`` tensor/row/group."""
    x = torch.randn(*rows_shape, k, generator=g) * (0.5 + torch.rand(*rows_shape, 1, generator=g))
    if kind in ("bf16", "fp16"):
        return x.to(device=device, dtype=torch.bfloat16 if kind == "bf16" else torch.float16), None
    if kind == "fp8_block" or a_mode == "group":
        q, s = ref.quantize_fp8_per_token_group(x)
        return q.to(device), s.to(device)
    if a_mode == "row":
        s = x.abs().amax(dim=-1).clamp(min=1e-6) / 448
        return (x / s.unsqueeze(-1)).to(FP8).to(device), s.float().to(device)
    q, s = ref.quantize_fp8_per_tensor(x)
    return q.to(device), s.to(device)


def reference(a, a_scale, w, w_scale, counts, offsets, activation=None, alpha=1.702, limit=7.0):
    """float64 result `[rows, N']` on the flattened rows (rows no expert owns are zero)."""
    flat = a.reshape(-1, a.shape[-1])
    if a_scale is not None and a_scale.numel() > 1:
        # per row: [...] -> [rows]; per row and 128 channels: [..., K / 128] -> [rows, K / 128]
        a_scale = a_scale.reshape(-1) if a_scale.dim() == a.dim() - 1 else a_scale.reshape(flat.shape[0], -1)
    return ref.grouped_gemm(
        flat,
        w,
        counts.cpu(),
        offsets.cpu(),
        a_scale=a_scale,
        w_scale=w_scale,
        activation_kind=activation,
        alpha=alpha,
        limit=limit,
    )


def owned_rows(counts, offsets, total: int) -> torch.Tensor:
    """`[total]` bool: the rows some expert owns."""
    mask = torch.zeros(total, dtype=torch.bool)
    for c, o in zip(counts.tolist(), offsets.tolist(), strict=False):
        mask[o : o + c] = True
    return mask
