"""The FP8-page decode's softmax weights in E4M3 (17-32 rows, bf16 queries: the values' product on the FP8 tensor
cores, ``FLASHINFER_MOE_MLA_FP8_PV``, the default) against float64 and against the same call with the product in
fp16 (``FLASHINFER_MOE_MLA_FP8_PV=0``, which test_mla_decode_gpu.py holds to the bf16 output tolerance)."""

from __future__ import annotations

import pytest
import torch
from test_mla_decode import FP8, assert_close, lse_tol, make_case, reference, run_decode
from test_mla_decode_gpu import _fp8_pages, _rising_case

from flashinfer_moe.mla import decode_sm90

pytestmark = pytest.mark.gpu
DEV = "cuda"
MIX = [1, 63, 64, 65, 4097, 16384]
SM_SCALE = 192**-0.5
ENV = "FLASHINFER_MOE_MLA_FP8_PV"
# Bounds of the E4M3 weights (relative rounding up to 2^-4 each, as the FP8 cache's own values): the largest error
# relative to max(1, |out|), which a short or peaked sequence's few weights set (an H200 measured up to 0.035), and
# the relative L2 error over the full mix (0.7-1.2% on N(0, 1) caches, where nearly equal scores round alike;
# fp16 weights 0.08-0.13%). The other setting keeps the bf16 output tolerance.
OUT_TOL_E4M3 = 6e-2
REL_L2 = {"1": 0.025, "0": 0.004}


def _rel_l2(out, want):
    return ((out.double() - want).norm() / want.norm()).item()


def _applies(rows: int, q_dtype: torch.dtype) -> bool:
    hopper = torch.cuda.get_device_capability() == (9, 0)
    return 16 < rows <= 32 and q_dtype == torch.bfloat16 and decode_sm90.NARROW_PV8 and hopper


@pytest.mark.parametrize("page, split", [(1, False), (16, True), (64, False), (64, True), (128, False)])
@pytest.mark.parametrize(
    "heads, s_q, q_dtype",
    [
        (32, 1, torch.bfloat16),
        (16, 2, torch.bfloat16),
        (10, 3, torch.bfloat16),
        (7, 3, torch.bfloat16),
        (17, 1, torch.bfloat16),
        (16, 1, torch.bfloat16),
        (32, 1, torch.float16),
    ],
)
@pytest.mark.parametrize("num_sms", [None, 3])
def test_weights_in_e4m3(rng, monkeypatch, page, split, heads, s_q, q_dtype, num_sms):
    """The full length mix with NaN-poisoned pools under both settings, against float64 (the LSE within the
    FP8 cache's tolerance either way: it takes the exact sums); the outputs differ exactly where the setting
    applies (17-32 rows and bf16 queries on Hopper), else they are equal."""
    seed, g = rng
    case = make_case(g, MIX, s_q, heads, page, q_dtype, FP8, split=split, device=DEV)
    want_out, want_lse = reference(case, SM_SCALE, device=DEV)
    applies = _applies(s_q * heads, q_dtype)
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV, flag)
        got[flag] = run_decode(case, SM_SCALE, num_sms=num_sms)
        what = f"seed {seed}, {ENV}={flag}"
        out_tol = OUT_TOL_E4M3 if flag == "1" and applies else None
        assert_close(*got[flag], want_out, want_lse, q_dtype, what, lse_tol=lse_tol(case), out_tol=out_tol)
        assert _rel_l2(got[flag][0], want_out) < REL_L2[flag], what
    assert torch.equal(got["1"][0], got["0"][0]) != applies, f"seed {seed}: the setting applies: {applies}"


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("heads, s_q", [(32, 1), (16, 2), (7, 3)])
@pytest.mark.parametrize("num_sms", [None, 3])
def test_rising_maxima(rng, page, heads, s_q, num_sms):
    """Scores that jump late by 7-14 (log2) over a long run of nearly equal ones, past the E4M3 weights' slack of
    2^3: the running maxima move while the earlier tokens, their weights now 2^-2 .. 2^-9 in E4M3, carry most of
    the sum."""
    seed, g = rng
    case = _rising_case(g, heads, s_q, page)
    assert _applies(s_q * heads, torch.bfloat16)
    got = run_decode(case, SM_SCALE, num_sms=num_sms)
    want = reference(case, SM_SCALE, device=DEV)
    assert_close(*got, *want, torch.bfloat16, f"seed {seed}", lse_tol=lse_tol(case), out_tol=OUT_TOL_E4M3)


@pytest.mark.parametrize("heads, s_q", [(32, 1), (16, 2)])
def test_fp8_cache_accuracy_against_bf16(rng, heads, s_q):
    """As test_mla_decode_gpu.py's test of the same name, with the E4M3 weights: an H200 measured a relative L2
    error of 4.4-4.6% against the bf16 cache's float64 attention, where the same FP8 values in float64 give 4.2-4.3%.
    Bound: 8%, and within 1.1x of that float64 result plus 0.005."""
    seed, g = rng
    case = make_case(g, [4097, 16384, 700, 65], s_q, heads, 64, torch.bfloat16, torch.bfloat16, device=DEV)
    exact, _ = reference(case, SM_SCALE, device=DEV)
    kv8, scale = _fp8_pages(case["kv_cache"].nan_to_num())
    case8 = dict(case, kv_cache=kv8, kv_scale=scale)
    fp8_out, _ = run_decode(case8, SM_SCALE, num_sms=None)
    fp8_exact, _ = reference(case8, SM_SCALE, device=DEV)
    err, floor = _rel_l2(fp8_out, exact), _rel_l2(fp8_exact, exact)
    print(f"\nh_q {heads} x s_q {s_q}: rel L2 error, E4M3 weights {err:.4f}, the FP8 values in float64 {floor:.4f}")
    assert err < 0.08 and err < 1.1 * floor + 0.005, seed
