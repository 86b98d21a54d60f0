"""CPU tier for the quantization references: hand-checked bits, error bounds against float64, and the argument
checks. The layout, permute and combine references are tested in test_reference_layout.py."""

import math

import pytest
import torch
from checks import assert_error_names_argument, bits, randn

from flashinfer_moe import reference_quant as rq

FP8 = torch.float8_e4m3fn
TINY = torch.finfo(torch.float32).tiny


# ------------------------------------------------------------------------------------------------ E2M1

E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e2m1_frombits(code: int) -> float:
    """Decode from the bit fields (sign, 2-bit exponent with bias 1, 1-bit mantissa), not from a table."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def test_e2m1_every_code_decodes_and_encodes_back():
    codes = torch.arange(16, dtype=torch.uint8)
    values = rq.e2m1_decode(codes)
    assert values.dtype == torch.float32
    assert values.tolist() == E2M1_BY_CODE == [e2m1_frombits(c) for c in range(16)]
    assert torch.signbit(values[8])  # code 8 is -0.0, not +0.0
    assert torch.equal(rq.e2m1_encode(values), codes)


@pytest.mark.parametrize(
    "value, expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
    + [(0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (4.9999995, 4.0), (5.0000005, 6.0)],
)
def test_e2m1_ties_to_even_and_neighbours(value, expected):
    for sign in (1.0, -1.0):
        code = rq.e2m1_encode(torch.tensor([sign * value]))
        assert rq.e2m1_decode(code).item() == sign * expected
        assert (code.item() >> 3) == (sign < 0)


def test_e2m1_saturates():
    v = torch.tensor([6.0, 6.5, 100.0, 1e30, math.inf, -6.5, -1e30, -math.inf])
    assert rq.e2m1_encode(v).tolist() == [7, 7, 7, 7, 7, 15, 15, 15]


def test_e2m1_encode_is_nearest(rng):
    seed, g = rng
    v = torch.rand(4096, generator=g) * 16 - 8
    grid = torch.tensor(E2M1_BY_CODE[:8])
    dist = (v.abs().clamp(max=6).unsqueeze(-1) - grid).abs().double()
    # Exact midpoints (torch.rand draws multiples of 2**-20 here, so |v| = 0.75 can come up) go to the even code;
    # distinct distances differ by at least 2**-20, more than the 2**-22 that breaks a tie.
    odd = (torch.arange(8) % 2).double()
    expected = grid[(dist + odd * 2.0**-22).argmin(-1)] * torch.where(v < 0, -1.0, 1.0)
    assert torch.equal(rq.e2m1_decode(rq.e2m1_encode(v)), expected), f"seed={seed}"


def test_nibble_order_hand_built_byte(rng):
    seed, g = rng
    codes = torch.tensor([[0x1, 0xA, 0xF, 0x0]], dtype=torch.uint8)
    packed = rq.pack_nibbles(codes)
    assert packed.tolist() == [[0xA1, 0x0F]]  # element 2i low nibble, 2i+1 high nibble
    assert rq.e2m1_decode(rq.unpack_nibbles(torch.tensor([0xA1], dtype=torch.uint8))).tolist() == [0.5, -1.0]
    rand = torch.randint(0, 16, (3, 5, 32), generator=g, dtype=torch.uint8)
    assert torch.equal(rq.unpack_nibbles(rq.pack_nibbles(rand)), rand), f"seed={seed}"


# ----------------------------------------------------------------------------------------------- NVFP4


def test_nvfp4_hand_checked_block():
    # global scale 1 and block amax 6: the block scale is exactly 1, so the codes are those of the values.
    x = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6]])
    packed, bs, gs = rq.quantize_nvfp4(x, 1.0)
    assert bs.dtype == FP8 and bs.float().tolist() == [[1.0]] and gs.item() == 1.0 and gs.dim() == 0
    assert rq.unpack_nibbles(packed).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 2, 2, 4, 4, 6, 6, 15]]
    assert packed[0, 0].item() == 0x10 and packed[0, 3].item() == 0x76
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, 1, 1, 2, 2, 4, 4, -6]
    assert rq.dequantize_nvfp4(packed, bs, gs).tolist() == [expected]


def test_nvfp4_saturates_block_scale():
    # amax / (6 * 1e-3) = 1000 > 448: the block scale saturates and the values then saturate at 6.
    x = torch.linspace(-6, 6, 16).reshape(1, 16)
    packed, bs, gs = rq.quantize_nvfp4(x, 1e-3)
    assert bs.float().item() == 448.0
    codes = rq.unpack_nibbles(packed)[0]
    assert codes[0].item() == 15 and codes[-1].item() == 7
    out = rq.dequantize_nvfp4(packed, bs, gs)
    assert out[0, -1].item() == pytest.approx(6 * 448 * 1e-3, rel=1e-6)


def test_nvfp4_zero_and_dead_blocks(rng):
    seed, g = rng
    x = randn(g, 2, 64) * 100
    x[0, 16:32] = 0  # all-zero block
    x[1, :16] = randn(g, 16) * 1e-30  # scale rounds to 0 against the global scale: zero codes
    packed, bs, gs = rq.quantize_nvfp4(x)
    out = rq.dequantize_nvfp4(packed, bs, gs)
    assert torch.isfinite(out).all(), f"seed={seed}"
    assert bs[0, 1].float().item() == 0 and bs[1, 0].float().item() == 0
    assert (rq.unpack_nibbles(packed)[0, 16:32] == 0).all() and (rq.unpack_nibbles(packed)[1, :16] == 0).all()
    assert (out[0, 16:32] == 0).all() and (out[1, :16] == 0).all()
    packed, bs, gs = rq.quantize_nvfp4(torch.zeros(3, 32))
    assert gs.item() == TINY and (packed == 0).all() and (rq.dequantize_nvfp4(packed, bs, gs) == 0).all()


def test_nvfp4_global_scale(rng):
    seed, g = rng
    x = randn(g, 4, 48, dtype=torch.bfloat16)
    _, _, gs = rq.quantize_nvfp4(x)
    assert gs.dtype == torch.float32 and gs.item() == (x.float().abs().max() / (6 * 448)).item(), f"seed={seed}"
    for given in (0.0125, torch.tensor(0.0125), torch.tensor([0.0125])):
        _, _, gs = rq.quantize_nvfp4(x, given)
        assert gs.dim() == 0 and gs.item() == torch.tensor(0.0125).item()


@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (2, 5, 160)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("given_scale", [False, True])
def test_nvfp4_round_trip_within_half_step(rng, shape, dtype, given_scale):
    seed, g = rng
    x = (randn(g, *shape) * torch.exp(randn(g, *shape[:-1], 1) * 3)).to(dtype)
    xf = x.double()
    packed, bs, gs = rq.quantize_nvfp4(x, 0.01 if given_scale else None)
    out = rq.dequantize_nvfp4(packed, bs, gs).double()
    s = (bs.double() * gs.double()).repeat_interleave(16, dim=-1)  # per-element scale
    dead = s == 0  # block scale rounded to 0 (block far below the tensor amax): exact zeros
    assert (out[dead] == 0).all(), f"seed={seed}"
    v = torch.where(dead, 0.0, xf / s).abs()
    # half of the grid step around |v|; values past 6 (E4M3 rounding of the block scale, or a saturated
    # scale) clamp to 6.
    half_step = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    bound = torch.where(v <= 6, half_step * s, (v - 6) * s) + 1e-6 * xf.abs()
    assert ((out - xf).abs() <= torch.where(dead, xf.abs(), bound)).all(), f"seed={seed}"
    if not given_scale:
        # With a normal (not subnormal) E4M3 block scale, its rounding moves |v| at most 2**-4 past 6.
        normal = bs.float().repeat_interleave(16, dim=-1) >= 2**-6
        assert (v[normal] <= 6 * (1 + 2**-4) + 1e-5).all(), f"seed={seed}"


def test_nvfp4_loads_modelopt_tensors_as_stored(rng):
    seed, g = rng
    n, k = 2, 32
    weight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    weight[0, 0] = 0x7F  # low nibble 0xF = -6, high nibble 0x7 = +6
    scales = [[2.0, 0.5], [448.0, 0.015625]]
    weight_scale = torch.tensor(scales).to(FP8)
    weight_scale_2 = torch.tensor(0.25)
    out = rq.dequantize_nvfp4(weight, weight_scale, weight_scale_2)
    assert out.shape == (n, k) and out.dtype == torch.float32
    assert out[0, :2].tolist() == [-3.0, 3.0]  # -6 * 2 * 0.25, 6 * 2 * 0.25
    expected = torch.empty(n, k)
    for r in range(n):
        for b in range(k // 2):
            byte = int(weight[r, b])
            for half, code in enumerate((byte & 0xF, byte >> 4)):
                col = 2 * b + half
                expected[r, col] = e2m1_frombits(code) * scales[r][col // 16] * 0.25
    assert torch.equal(out, expected), f"seed={seed}"


# ------------------------------------------------------------------------------------------------- FP8


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 rounding error: half an ulp (2**-4 relative) for normals, 2**-10 absolute in the subnormal range."""
    return x.abs() * 2**-4 + scale * 2**-10 + 1e-7 * x.abs()


def test_fp8_group_hand_checked():
    x = torch.zeros(1, 256)
    x[0, :128] = 1.0
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 896.0, 34.0, 38.0, 3.0  # group 0 amax 896 -> scale 2
    x[0, 128:] = -0.25
    x[0, 200] = -224.0  # group 1 amax 224 -> scale 0.5
    q, s = rq.quantize_fp8_per_token_group(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.tolist() == [[2.0, 0.5]]
    # 34 / 2 = 17 and 38 / 2 = 19 are ties in [16, 32) (step 2): nearest-even gives 16 and 20.
    assert q[0, :5].float().tolist() == [448.0, 16.0, 20.0, 1.5, 0.5]
    assert q[0, 200].float().item() == -448.0 and q[0, 201].float().item() == -0.5
    deq = rq.dequantize_fp8_per_token_group(q, s)
    assert deq[0, :5].tolist() == [896.0, 32.0, 40.0, 3.0, 1.0]


def test_fp8_saturates_instead_of_nan():
    q, s = rq.quantize_fp8_per_tensor(torch.tensor([500.0, -1000.0, 448.0, 464.0, 1.0]), scale=1.0)
    assert s.item() == 1.0 and q.float().tolist() == [448.0, -448.0, 448.0, 448.0, 1.0]


@pytest.mark.parametrize("shape, group", [((1, 128), 128), ((3, 256), 128), ((2, 7, 384), 128), ((5, 96), 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_group_round_trip(rng, shape, group, dtype):
    seed, g = rng
    x = (randn(g, *shape) * torch.exp(randn(g, *shape) * 2)).to(dtype)
    q, s = rq.quantize_fp8_per_token_group(x, group)
    assert s.shape == (*shape[:-1], shape[-1] // group)
    amax = x.double().unflatten(-1, (-1, group)).abs().amax(-1)
    assert torch.equal(s, (amax.float() / 448).clamp(min=TINY)), f"seed={seed}"
    out = rq.dequantize_fp8_per_token_group(q, s, group).double()
    err = (out - x.double()).abs()
    assert (err <= fp8_bound(x.double(), s.double().repeat_interleave(group, -1))).all(), f"seed={seed}"


def test_fp8_scale_pow2(rng):
    seed, g = rng
    x = randn(g, 64, 256) * torch.exp2(torch.randint(-40, 40, (64, 1), generator=g).float())
    x[0, :128] = 0
    x[1, :128] = 448.0  # amax / 448 is exactly 1: stays 1
    x[1, 128:] = 0.5
    x[1, 128] = 448.0 * (1 + 2**-20)  # just above: rounds up to 2
    q, s = rq.quantize_fp8_per_token_group(x, scale_pow2=True)
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all(), f"seed={seed}"
    amax = x.unflatten(-1, (2, 128)).abs().amax(-1)
    assert (s >= amax / 448).all() and ((s < 2 * amax / 448) | (amax == 0)).all(), f"seed={seed}"
    assert s[0, 0].item() == TINY and s[1, 0].item() == 1.0 and s[1, 1].item() == 2.0
    assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()
    out = rq.dequantize_fp8_per_token_group(q, s)
    assert (out[0, :128] == 0).all()
    assert ((out - x).abs() <= fp8_bound(x, s.repeat_interleave(128, -1))).all(), f"seed={seed}"


def test_fp8_per_tensor(rng):
    seed, g = rng
    x = randn(g, 3, 100, dtype=torch.bfloat16) * 7
    q, s = rq.quantize_fp8_per_tensor(x)
    assert s.dim() == 0 and s.item() == (x.float().abs().max() / 448).item(), f"seed={seed}"
    err = (q.double() * s.double() - x.double()).abs()
    assert (err <= fp8_bound(x.double(), s.double())).all(), f"seed={seed}"
    q, s = rq.quantize_fp8_per_tensor(x, torch.tensor(0.5))
    assert s.item() == 0.5 and torch.equal(q, (x.float() / 0.5).clamp(-448, 448).to(FP8))
    q, s = rq.quantize_fp8_per_tensor(torch.zeros(4))
    assert s.item() == TINY and (q.float() == 0).all()


@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((2, 130, 70), (64, 32))])
def test_fp8_block_weights(rng, shape, block):
    seed, g = rng
    w = randn(g, *shape) * torch.exp(randn(g, *shape) * 2)
    w[..., -1, -1] = 0  # the edge block is not all zero, the element is
    q, s = rq.quantize_fp8_block_weights(w, block)
    n, k = shape[-2:]
    bn, bk = block
    assert s.shape == (*shape[:-2], -(-n // bn), -(-k // bk)) and s.dtype == torch.float32
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            tile = w[..., i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            assert torch.equal(s[..., i, j], tile.abs().amax(dim=(-2, -1)) / 448), f"seed={seed} block {i},{j}"
    out = rq.dequantize_fp8_block(q, s, block).double()
    scale = s.double().repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    assert ((out - w.double()).abs() <= fp8_bound(w.double(), scale)).all(), f"seed={seed}"


# ------------------------------------------------------------------------------------------- bad input

_x16 = torch.ones(2, 32)
_meta = torch.device("meta")
BAD = {
    "nvfp4 K": (lambda: rq.quantize_nvfp4(torch.ones(2, 24)), ValueError, "x"),
    "nvfp4 x dtype": (lambda: rq.quantize_nvfp4(torch.ones(2, 32, dtype=torch.int32)), TypeError, "x"),
    "nvfp4 global dtype": (lambda: rq.quantize_nvfp4(_x16, torch.tensor(1.0).bfloat16()), TypeError, "global_scale"),
    "nvfp4 global device": (lambda: rq.quantize_nvfp4(_x16, torch.ones((), device=_meta)), ValueError, "global_scale"),
    "nvfp4 packed dtype": (
        lambda: rq.dequantize_nvfp4(torch.ones(2, 16, dtype=torch.int8), torch.ones(2, 2).to(FP8), 1.0),
        TypeError,
        "packed",
    ),
    "nvfp4 scales dtype": (
        lambda: rq.dequantize_nvfp4(torch.ones(2, 16, dtype=torch.uint8), torch.ones(2, 2), 1.0),
        TypeError,
        "block_scales",
    ),
    "nvfp4 scales shape": (
        lambda: rq.dequantize_nvfp4(torch.ones(2, 16, dtype=torch.uint8), torch.ones(2, 3).to(FP8), 1.0),
        ValueError,
        "block_scales",
    ),
    "e2m1 values dtype": (lambda: rq.e2m1_encode(torch.ones(4, dtype=torch.int64)), TypeError, "values"),
    "fp8 group size": (lambda: rq.quantize_fp8_per_token_group(torch.ones(2, 100)), ValueError, "group_size"),
    "fp8 x not tensor": (lambda: rq.quantize_fp8_per_token_group([1.0] * 128), TypeError, "x"),
    "fp8 scales dtype": (
        lambda: rq.dequantize_fp8_per_token_group(torch.ones(2, 128).to(FP8), torch.ones(2, 1).bfloat16()),
        TypeError,
        "scales",
    ),
    "fp8 scales shape": (
        lambda: rq.dequantize_fp8_per_token_group(torch.ones(2, 128).to(FP8), torch.ones(2, 2)),
        ValueError,
        "scales",
    ),
    "fp8 scales device": (
        lambda: rq.dequantize_fp8_per_token_group(torch.ones(2, 128).to(FP8), torch.ones(2, 1, device=_meta)),
        ValueError,
        "scales",
    ),
    "fp8 tensor scale dtype": (lambda: rq.quantize_fp8_per_tensor(_x16, torch.tensor(1.0).half()), TypeError, "scale"),
    "fp8 block scale shape": (
        lambda: rq.dequantize_fp8_block(torch.ones(200, 300).to(FP8), torch.ones(2, 2)),
        ValueError,
        "weight_scale_inv",
    ),
    "fp8 block w 1-D": (lambda: rq.quantize_fp8_block_weights(torch.ones(128)), ValueError, "w"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    assert_error_names_argument(*BAD[case])


# ------------------------------------------------------------------------------------------ CPU vs CUDA


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit(rng):
    seed, g = rng
    x = randn(g, 37, 512) * torch.exp(randn(g, 37, 1) * 3)
    calls = {
        "group": lambda d: rq.quantize_fp8_per_token_group(x.to(d)),
        "group pow2": lambda d: rq.quantize_fp8_per_token_group(x.to(d), scale_pow2=True),
        "tensor": lambda d: rq.quantize_fp8_per_tensor(x.to(d)),
        "block": lambda d: rq.quantize_fp8_block_weights(x.view(1, 37, 512).to(d)),
        "nvfp4": lambda d: rq.quantize_nvfp4(x.to(d)),
        "nvfp4 round trip": lambda d: rq.dequantize_nvfp4(*rq.quantize_nvfp4(x.to(d))),
    }
    for name, call in calls.items():
        cpu, cuda = call("cpu"), call("cuda")
        cpu, cuda = (cpu, cuda) if isinstance(cpu, tuple) else ((cpu,), (cuda,))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(cpu, cuda, strict=True)), f"{name} seed={seed}"
