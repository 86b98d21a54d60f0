"""Public ops on meta tensors (``torch.device("meta")``): outputs of the right shapes, dtypes and device, through
the custom ops' fake implementations, with no kernel, no host sync and no CUDA call (this tier's torch may have
no CUDA at all). Each result is compared with the same call on CPU tensors."""

from __future__ import annotations

import pytest
import torch

import flashinfer_moe as fm

META = torch.device("meta")
T, E, K, H, I = 5, 16, 2, 256, 128


def _spec(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, fm.ExpertLayout):
        return _spec((x.tokens_per_expert, x.expert_offsets, x.row_of, x.source_of, x.status))
    return tuple(_spec(v) for v in x)


def _devices(x) -> set[str]:
    if isinstance(x, torch.Tensor):
        return {x.device.type}
    if isinstance(x, fm.ExpertLayout):
        return {x.device.type}
    return set().union(*(_devices(v) for v in x))


def _inputs(device: torch.device, generator: torch.Generator) -> dict:
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).int()
    x = torch.randn(T, H, generator=generator).bfloat16()
    made = dict(
        logits=torch.randn(T, E, generator=generator),
        bias=torch.randn(E, generator=generator),
        ids=ids,
        weights=torch.rand(T, K, generator=generator),
        x=x,
        w13=(torch.randn(E, 2 * I, H, generator=generator) / 16).bfloat16(),
        w2=(torch.randn(E, H, I, generator=generator) / 16).bfloat16(),
    )
    return {k: v.to(device) for k, v in made.items()}


CASES = {
    "route softmax": lambda d: fm.route(d["logits"], K),
    "route sigmoid groups bias": lambda d: fm.route(
        d["logits"], K, scoring_func="sigmoid", num_expert_group=4, topk_group=2, correction_bias=d["bias"]
    ),
    "moe_align_contiguous": lambda d: fm.moe_align_contiguous(d["ids"], E, 16),
    "moe_align_masked": lambda d: fm.moe_align_masked(d["ids"], E, 4),
    "quantize_fp8_per_token_group": lambda d: fm.quantize_fp8_per_token_group(d["x"]),
    "quantize_fp8_per_tensor": lambda d: fm.quantize_fp8_per_tensor(d["x"]),
    "quantize_nvfp4": lambda d: fm.quantize_nvfp4(d["x"]),
    "permute": lambda d: fm.permute(d["x"], fm.moe_align_contiguous(d["ids"], E, 16)),
    "permute_fp8_per_token_group masked": lambda d: fm.permute_fp8_per_token_group(
        d["x"], fm.moe_align_masked(d["ids"], E, 4)
    ),
    "combine": lambda d: fm.combine(
        fm.permute(d["x"], layout := fm.moe_align_contiguous(d["ids"], E, 16)), d["weights"], layout
    ),
    "grouped_gemm_bf16_contiguous silu": lambda d: fm.grouped_gemm_bf16_contiguous(
        fm.permute(d["x"], layout := fm.moe_align_contiguous(d["ids"], E, 16)), d["w13"], layout, activation="silu"
    ),
    "fused_moe": lambda d: fm.fused_moe(d["x"], d["w13"], d["w2"], d["weights"], d["ids"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_public_op_on_meta_tensors(case, generator):
    on_cpu = CASES[case](_inputs(torch.device("cpu"), generator))
    on_meta = CASES[case](_inputs(META, generator))
    assert _devices(on_meta) == {"meta"}
    assert _spec(on_meta) == _spec(on_cpu)


def test_route_on_meta_returns_meta_outputs_of_the_right_shapes():
    weights, ids = fm.route(torch.empty(4, 256, device=META), 8)
    assert (weights.shape, weights.dtype, weights.device) == ((4, 8), torch.float32, META)
    assert (ids.shape, ids.dtype, ids.device) == ((4, 8), torch.int32, META)


def test_moe_layer_on_meta():
    layer = fm.MoELayer(E, K, H, I, device=META, quant="fp8_block")
    out = layer(torch.empty(T, H, dtype=torch.bfloat16, device=META))
    assert (out.shape, out.dtype, out.device) == ((T, H), torch.bfloat16, META)


def test_bad_meta_input_still_names_the_argument():
    with pytest.raises(TypeError, match="topk_ids"):
        fm.moe_align_contiguous(torch.empty(T, K, device=META), E)  # float ids
    with pytest.raises(ValueError, match="top_k"):
        fm.route(torch.empty(T, E, device=META), E + 1)


def test_expert_layout_repr_is_short_and_reads_no_tensor():
    ids = torch.randint(0, E, (T, K), dtype=torch.int32)
    assert repr(fm.moe_align_contiguous(ids, E, 16)) == (
        f"ExpertLayout(kind='contiguous', E={E}, T={T}, k={K}, rows=160, block_rows=16, device=cpu)"
    )
    assert repr(fm.moe_align_masked(ids.to(META), E, 4)) == (
        f"ExpertLayout(kind='masked', E={E}, T={T}, k={K}, rows={E * 4}, capacity=4, device=meta)"
    )
