"""MoELayer(quant="nvfp4") with ModelOpt NVFP4 checkpoints (weight, weight_scale, weight_scale_2, input_scale per
expert and projection): loading as stored, forward against a float64 model of the dequantized experts, state_dict,
bad checkpoints. The CPU tier runs the reference inside the layer; the GPU tier (-m gpu) the Triton kernels."""

import pytest
import torch
from checks import assert_error_names_argument, bits
from nvfp4_cases import dequantized
from test_layer import ROUTING, hf_experts, hf_moe, make_layer, rel_error, routing_of

import flashinfer_moe
from flashinfer_moe import MoELayer, reference
from flashinfer_moe import reference_quant as rq

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def modelopt_checkpoint(experts: dict, g: torch.Generator) -> dict:
    """``experts`` (HF bf16 tensors) as ModelOpt stores NVFP4: per projection its own global scale (so gate and
    up differ), block scales, packed codes, and an input scale."""
    out = {}
    for key, w in experts.items():
        base = key.removesuffix("weight")
        gs = None
        if base.endswith("up_proj."):  # a global scale that is certainly not the gate's
            gs = float(out[base.replace("up_proj", "gate_proj") + "weight_scale_2"]) * 1.375
        packed, block, gs = rq.quantize_nvfp4(w.float(), gs)
        out[key], out[base + "weight_scale"], out[base + "weight_scale_2"] = packed, block, gs.reshape(())
        out[base + "input_scale"] = (torch.rand((), generator=g) + 0.1) / 2688
    return out


def dense_nvfp4(ckpt: dict, num_experts: int) -> list:
    """``(gate, up, down)`` per expert in float64, dequantized as stored."""
    return [
        tuple(
            dequantized(
                ckpt[f"{e}.{p}.weight"][None],
                ckpt[f"{e}.{p}.weight_scale"][None],
                ckpt[f"{e}.{p}.weight_scale_2"].reshape(1),
            )[0]
            for p in PROJECTIONS
        )
        for e in range(num_experts)
    ]


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("routing", sorted(ROUTING))
def test_modelopt_checkpoint_loads_as_stored_and_matches_the_dequantized_model(routing, num_tokens, rng):
    seed, g = rng
    num_experts, top_k, hidden, inter = 16, 4, 128, 96
    layer = make_layer(routing, num_experts, top_k, hidden, inter, "nvfp4", g)
    ckpt = modelopt_checkpoint(hf_experts(g, num_experts, hidden, inter), g)
    layer.load_expert_weights({"mlp.experts." + k: v for k, v in ckpt.items()}, prefix="mlp.experts.")
    for e in range(num_experts):
        gate, up, down = (f"{e}.{p}." for p in PROJECTIONS)
        assert torch.equal(layer.w13[e], torch.cat((ckpt[gate + "weight"], ckpt[up + "weight"])))
        assert torch.equal(bits(layer.w13_scale[e][:inter]), bits(ckpt[gate + "weight_scale"]))
        assert torch.equal(bits(layer.w13_scale[e][inter:]), bits(ckpt[up + "weight_scale"]))
        assert torch.equal(layer.w2[e], ckpt[down + "weight"])
        gs = torch.stack((ckpt[gate + "weight_scale_2"], ckpt[up + "weight_scale_2"]))
        assert torch.equal(layer.w13_global_scale[e], gs) and gs[0] != gs[1]
        assert torch.equal(layer.w2_global_scale[e], ckpt[down + "weight_scale_2"])
        assert torch.equal(
            layer.w13_input_scale[e], torch.stack((ckpt[gate + "input_scale"], ckpt[up + "input_scale"]))
        )
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=g) * 2
    out = layer(x, logits)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.bfloat16
    weights, ids = routing_of(layer, logits)
    want = hf_moe(x, dense_nvfp4(ckpt, num_experts), weights, ids, layer.routed_scaling_factor)
    assert rel_error(out, want) < 2e-2, f"seed {seed}"


def test_bf16_checkpoint_quantized_on_load(rng):
    _, g = rng
    experts = hf_experts(g, 4, 128, 64)
    layer = MoELayer(4, 2, 128, 64, quant="nvfp4")
    layer.load_expert_weights(experts)
    for e in range(4):
        for p, rows in (("gate_proj", slice(0, 64)), ("up_proj", slice(64, 128))):
            packed, block, gs = flashinfer_moe.quantize_nvfp4(experts[f"{e}.{p}.weight"])
            assert torch.equal(layer.w13[e, rows], packed) and torch.equal(bits(layer.w13_scale[e, rows]), bits(block))
            assert layer.w13_global_scale[e, 0 if p == "gate_proj" else 1] == gs
        packed, block, gs = flashinfer_moe.quantize_nvfp4(experts[f"{e}.down_proj.weight"])
        assert torch.equal(layer.w2[e], packed) and layer.w2_global_scale[e] == gs


def test_state_dict_round_trip(rng):
    seed, g = rng
    layer = make_layer("deepseek_v3", 8, 2, 128, 64, "nvfp4", g)
    layer.load_expert_weights(modelopt_checkpoint(hf_experts(g, 8, 128, 64), g))
    state = layer.state_dict()
    nvfp4 = {"w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "w13_input_scale", "w2_input_scale"}
    assert set(state) == {"router_weight", "correction_bias", "w13", "w2"} | nvfp4
    fresh = MoELayer(8, 2, 128, 64, quant="nvfp4", **ROUTING["deepseek_v3"])
    fresh.load_state_dict(state)
    x = torch.randn(3, 128, generator=g).bfloat16()
    assert torch.equal(fresh(x), layer(x)), f"seed {seed}"
    assert "quant='nvfp4'" in repr(fresh)


def test_bad_checkpoint_tensors_name_the_key(rng):
    _, g = rng
    layer = MoELayer(4, 2, 64, 32, quant="nvfp4", router=False)
    ckpt = modelopt_checkpoint(hf_experts(g, 4, 64, 32), g)
    before = layer.w13.clone()

    def load(**changes):
        return lambda: layer.load_expert_weights({k: v for k, v in (ckpt | changes).items() if v is not None})

    assert_error_names_argument(
        load(**{"1.up_proj.weight_scale": torch.ones(32, 4)}), TypeError, "1.up_proj.weight_scale"
    )
    short = ckpt["1.up_proj.weight_scale"][:, :2]
    assert_error_names_argument(load(**{"1.up_proj.weight_scale": short}), ValueError, "1.up_proj.weight_scale")
    packed = ckpt["2.down_proj.weight"][:, :8]
    assert_error_names_argument(load(**{"2.down_proj.weight": packed}), ValueError, "2.down_proj.weight")
    for bad in (torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(float("inf")), torch.ones(2)):
        changes = {"3.gate_proj.weight_scale_2": bad}
        assert_error_names_argument(load(**changes), ValueError, "3.gate_proj.weight_scale_2")
    assert_error_names_argument(
        load(**{"0.down_proj.input_scale": torch.tensor(-2.0)}), ValueError, "0.down_proj.input_scale"
    )
    assert_error_names_argument(load(**{"0.gate_proj.weight_scale_2": None}), ValueError, "0.gate_proj.weight_scale_2")
    assert torch.equal(layer.w13, before), "a failed load must leave the layer as it was"
    assert_error_names_argument(lambda: MoELayer(4, 2, 128, 48, quant="nvfp4"), ValueError, "hidden_size")


def _loaded_layer(g):
    """A small NVFP4 layer loaded from a ModelOpt checkpoint: ``(layer, checkpoint, input, its output)``."""
    layer = make_layer("softmax", 6, 2, 128, 64, "nvfp4", g)
    ckpt = modelopt_checkpoint(hf_experts(g, 6, 128, 64), g)
    layer.load_expert_weights(ckpt)
    x = torch.randn(5, 128, generator=g).bfloat16()
    return layer, ckpt, x, layer(x)


def test_pack_weights_k_permutes_in_place_and_loads_packed(rng):
    """pack_weights: same output, weights K-permuted (split_bits=False) over their own memory; loading into a packed layer packs
    what it loads; unpack_weights restores the checkpoint's bytes; sizes that are not whole spans refused."""
    seed, g = rng
    layer, ckpt, x, want = _loaded_layer(g)
    plain13, plain2, ptr = layer.w13.clone(), layer.w2.clone(), layer.w13.data_ptr()
    layer.pack_weights(split_bits=False)
    assert layer.weights_packed and layer.w13.data_ptr() == ptr and layer.w13.shape == (6, 128, 2, 32)
    assert torch.equal(layer.w13.flatten(2), flashinfer_moe.pack_nvfp4_weights(plain13, split_bits=False).data)
    assert torch.equal(layer.w2.flatten(2), flashinfer_moe.pack_nvfp4_weights(plain2, split_bits=False).data)
    assert torch.equal(layer(x), want), f"seed {seed}"
    fresh = make_layer("softmax", 6, 2, 128, 64, "nvfp4", g)
    fresh.pack_weights(split_bits=False)
    fresh.load_expert_weights(ckpt)
    assert torch.equal(fresh.w13, layer.w13) and torch.equal(fresh.w2, layer.w2)
    with pytest.raises(RuntimeError, match="size mismatch"):  # a packed state never loads as plain bytes
        make_layer("softmax", 6, 2, 128, 64, "nvfp4", g).load_state_dict(layer.state_dict())
    fresh.load_state_dict(layer.state_dict())
    layer.unpack_weights()
    assert not layer.weights_packed and torch.equal(layer.w13, plain13) and torch.equal(layer.w2, plain2)
    odd = MoELayer(4, 2, 128, 96, quant="nvfp4")
    assert_error_names_argument(odd.pack_weights, ValueError, "intermediate_size")


def test_pack_weights_split_bits(rng):
    """pack_weights() (split bits by default): same output, the bytes pack_nvfp4_weights() makes, over the
    same memory, shaped a word per row; loading into such a layer splits what it loads; a split state loads only
    into a layer packed the same way; repacking the other way and unpacking restore the checkpoint's bytes."""
    seed, g = rng
    layer, ckpt, x, want = _loaded_layer(g)
    plain13, plain2, ptr = layer.w13.clone(), layer.w2.clone(), layer.w13.data_ptr()
    layer.pack_weights()
    assert layer.nvfp4_split_bits and layer.w13.data_ptr() == ptr and layer.w13.shape == (6, 128, 16, 4)
    assert "split_bits=True" in repr(layer)
    assert torch.equal(layer.w13.flatten(2), flashinfer_moe.pack_nvfp4_weights(plain13, split_bits=True).data)
    assert torch.equal(layer.w2.flatten(2), flashinfer_moe.pack_nvfp4_weights(plain2, split_bits=True).data)
    assert all(w.split_bits for w in layer.expert_weights())
    assert torch.equal(layer(x), want), f"seed {seed}"
    fresh = make_layer("softmax", 6, 2, 128, 64, "nvfp4", g)
    fresh.pack_weights(split_bits=True)
    fresh.load_expert_weights(ckpt)
    assert torch.equal(fresh.w13, layer.w13) and torch.equal(fresh.w2, layer.w2)
    kperm = make_layer("softmax", 6, 2, 128, 64, "nvfp4", g)
    kperm.pack_weights(split_bits=False)
    with pytest.raises(RuntimeError, match="size mismatch"):  # never read as K-permuted bytes
        kperm.load_state_dict(layer.state_dict())
    layer.pack_weights(split_bits=False)  # to K-permuted bytes
    assert not layer.nvfp4_split_bits and torch.equal(
        layer.w13.flatten(2), flashinfer_moe.pack_nvfp4_weights(plain13, split_bits=False).data
    )
    layer.pack_weights(split_bits=True)
    layer.unpack_weights()
    assert not layer.weights_packed and not layer.nvfp4_split_bits
    assert torch.equal(layer.w13, plain13) and torch.equal(layer.w2, plain2)
    assert_error_names_argument(lambda: layer.pack_weights(split_bits="yes"), TypeError, "split_bits")
    fp8 = MoELayer(4, 2, 256, 128, quant="fp8_block")
    assert_error_names_argument(lambda: fp8.pack_weights(split_bits=True), ValueError, "split_bits")
    fp8.pack_weights()  # the default is each quant's own packing


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True, "split"])
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_gpu_forward_matches_dequantized_model(num_tokens, packed, rng):
    """The kernels (Triton W4A16, eager calls up to 256 tokens through CUDA graphs; plain and K-permuted
    weights) against the float64 model."""
    seed, g = rng
    num_experts, top_k, hidden, inter = 32, 4, 1024, 256
    layer = make_layer("deepseek_v3", num_experts, top_k, hidden, inter, "nvfp4", g, device="cuda")
    ckpt = modelopt_checkpoint(hf_experts(g, num_experts, hidden, inter), g)
    layer.load_expert_weights(ckpt)
    if packed:
        layer.pack_weights(split_bits=packed == "split")
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16().cuda()
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 2).cuda()
    out = layer(x, logits)
    weights, ids = reference.route(
        logits,
        top_k,
        scoring_func="sigmoid",
        renormalize=True,
        num_expert_group=4,
        topk_group=2,
        correction_bias=layer.correction_bias,
    )
    want = hf_moe(x, dense_nvfp4(ckpt, num_experts), weights.cpu(), ids.cpu(), layer.routed_scaling_factor)
    assert not out.isnan().any()
    assert rel_error(out, want) < 2e-2, f"seed {seed} (T={num_tokens})"
