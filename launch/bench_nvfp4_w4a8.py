"""Benchmark of the NVFP4 GEMM's W4A8 mode (FP8 activations, weights in W4A8 words) against W4A16 (split bits, the
default) and our FP8 block-scaled GEMM, in one run, and the error of each NVFP4 mode against the exact product.

    python launch/bench_nvfp4_w4a8.py [--tables masked,contiguous,error] [--json FILE] [--markdown FILE]

Tables:
- masked (decode): 32 experts x {8, 16, 64, 128} rows, (N, K) = (4096, 7168) and (7168, 2048), every slot in use:
  microseconds and effective weight bandwidth (4-bit bytes) of W4A16, W4A8, FP8 block (best of plain and packed
  weights). Every GEMM takes its activations as given: bf16 for W4A16, FP8 with per-row scales for W4A8 (per row
  and 128 channels for FP8 block), quantized outside the timed region.
- contiguous (prefill): 8 x 4096 and 32 x 512 rows at both (N, K): TFLOP/s.
- error: relative Frobenius error against the float64 product of bf16 activations and the dequantized NVFP4
  weights (weights quantized from Gaussian ones by ``quantize_nvfp4``): W4A16, W4A8, and FP8 activations alone.

Times are medians of CUDA-graph replays, the variants timed in turn (``bench_nvfp4.timed``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus  # noqa: E402

if __name__ == "__main__":
    require_gpus(1)

from bench_gemm import _fp8_rows, _fp8_weights, _layout, tflops  # noqa: E402
from bench_nvfp4 import markdown, nvfp4_weights, timed  # noqa: E402

import flashinfer_moe as fm  # noqa: E402

DEV = "cuda"
FP8 = torch.float8_e4m3fn
SHAPES = ((4096, 7168), (7168, 2048))


def fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's activations: e4m3 rows and one fp32 scale each (amax / 448)."""
    scale = (x.float().abs().amax(dim=-1) / 448).clamp(min=2.0**-126)
    return (x.float() / scale[..., None]).to(FP8), scale


def _variants(e, n, k):
    """Two weight sets a variant (alternated between calls, so that L2 holds neither)."""
    nv = [nvfp4_weights(e, n, k) for _ in range(2)]
    w4a16 = [(fm.pack_nvfp4_weights(w), s, gs) for w, s, gs in nv]
    w4a8 = [(fm.pack_nvfp4_weights(w, w4a8=True), s, gs) for w, s, gs in nv]
    f8 = [_fp8_weights(e, n, k) for _ in range(2)]
    f8_packed = [(fm.pack_fp8_block_weights(w), s) for w, s in f8]
    return w4a16, w4a8, f8, f8_packed


def masked_rows(rows: list[dict]) -> None:
    e = 32
    for n, k in SHAPES:
        w4a16, w4a8, f8, f8_packed = _variants(e, n, k)
        for per_expert in (8, 16, 64, 128):
            x = torch.randn(e, per_expert, k, device=DEV)
            a = x.bfloat16()
            a8, a8_scale = fp8_per_row(x)
            aq, a_s = _fp8_rows(e * per_expert, k)
            aq, a_s = aq.view(e, per_expert, k), a_s.view(e, per_expert, -1)
            counts = torch.full((e,), per_expert, dtype=torch.int32, device=DEV)
            out = torch.empty(e, per_expert, n, dtype=torch.bfloat16, device=DEV)
            t = timed(
                {
                    "w4a16": lambda i: fm.grouped_gemm_nvfp4_masked(a, *w4a16[i % 2], counts, validate=False, out=out),
                    "w4a8": lambda i: fm.grouped_gemm_nvfp4_masked(
                        a8, *w4a8[i % 2], counts, a_scale=a8_scale, validate=False, out=out
                    ),
                    "fp8": lambda i: fm.grouped_gemm_fp8_block_masked(aq, a_s, *f8[i % 2], counts, out=out),
                    "fp8_packed": lambda i: fm.grouped_gemm_fp8_block_masked(
                        aq, a_s, *f8_packed[i % 2], counts, out=out
                    ),
                }
            )
            fp8_best = min(t["fp8"], t["fp8_packed"])
            rows.append(
                dict(
                    table="masked",
                    rows=per_expert,
                    n=n,
                    k=k,
                    w4a16_us=t["w4a16"],
                    w4a8_us=t["w4a8"],
                    fp8_us=t["fp8"],
                    fp8_packed_us=t["fp8_packed"],
                    w4a8_vs_w4a16=t["w4a16"] / t["w4a8"],
                    w4a16_vs_fp8=fp8_best / t["w4a16"],
                    w4a8_vs_fp8=fp8_best / t["w4a8"],
                    w4a8_weight_tb_s=e * n * k / 2 / (t["w4a8"] * 1e-6) / 1e12,
                )
            )
            print(rows[-1], flush=True)


def contiguous_rows(rows: list[dict]) -> None:
    for n, k in SHAPES:
        for e, per_expert in ((8, 4096), (32, 512)):
            w4a16, w4a8, f8, f8_packed = _variants(e, n, k)
            layout = _layout([per_expert] * e)
            x = torch.randn(e * per_expert, k, device=DEV)
            a = x.bfloat16()
            a8, a8_scale = fp8_per_row(x)
            aq, a_s = _fp8_rows(e * per_expert, k)
            out = torch.empty(e * per_expert, n, dtype=torch.bfloat16, device=DEV)
            t = timed(
                {
                    "w4a16": lambda i: fm.grouped_gemm_nvfp4_contiguous(
                        a, *w4a16[i % 2], layout, validate=False, out=out
                    ),
                    "w4a8": lambda i: fm.grouped_gemm_nvfp4_contiguous(
                        a8, *w4a8[i % 2], layout, a_scale=a8_scale, validate=False, out=out
                    ),
                    "fp8": lambda i: fm.grouped_gemm_fp8_block_contiguous(aq, a_s, *f8[i % 2], layout, out=out),
                    "fp8_packed": lambda i: fm.grouped_gemm_fp8_block_contiguous(
                        aq, a_s, *f8_packed[i % 2], layout, out=out
                    ),
                },
                calls=2,
                reps=5,
            )
            flops = 2.0 * e * per_expert * n * k
            fp8_best = min(t["fp8"], t["fp8_packed"])
            rows.append(
                dict(
                    table="contiguous",
                    experts=e,
                    rows=per_expert,
                    n=n,
                    k=k,
                    w4a16_tflops=tflops(flops, t["w4a16"]),
                    w4a8_tflops=tflops(flops, t["w4a8"]),
                    fp8_tflops=tflops(flops, fp8_best),
                    w4a8_vs_w4a16=t["w4a16"] / t["w4a8"],
                    w4a8_vs_fp8=fp8_best / t["w4a8"],
                )
            )
            print(rows[-1], flush=True)


def error_rows(rows: list[dict]) -> None:
    from flashinfer_moe.moe.gemm_nvfp4 import dequantize_weights

    torch.manual_seed(0)
    e, per_expert = 4, 64
    for n, k in SHAPES:
        wf = torch.randn(e, n, k, device=DEV) / k**0.5
        q = [fm.quantize_nvfp4(wf[i]) for i in range(e)]
        w = torch.stack([p for p, _, _ in q])
        s = torch.stack([sc for _, sc, _ in q])
        gs = torch.stack([g.reshape(()) for _, _, g in q]).float()
        x = torch.randn(e, per_expert, k, device=DEV).bfloat16()
        exact = torch.einsum("eck,enk->ecn", x.double(), dequantize_weights(w, s, gs, torch.float64))
        counts = torch.full((e,), per_expert, dtype=torch.int32, device=DEV)
        a8, a8_scale = fp8_per_row(x)
        got16 = fm.grouped_gemm_nvfp4_masked(x, fm.pack_nvfp4_weights(w), s, gs, counts, out_dtype=torch.float32)
        got8 = fm.grouped_gemm_nvfp4_masked(
            a8, fm.pack_nvfp4_weights(w, w4a8=True), s, gs, counts, a_scale=a8_scale, out_dtype=torch.float32
        )
        a8_only = torch.einsum(
            "eck,enk->ecn", a8.double() * a8_scale.double()[..., None], dequantize_weights(w, s, gs, torch.float64)
        )

        def err(y):
            return ((y.double() - exact).norm() / exact.norm()).item()

        rows.append(dict(table="error", n=n, k=k, w4a16=err(got16), w4a8=err(got8), fp8_activations_only=err(a8_only)))
        print(rows[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="masked,contiguous,error")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    tables = [t for t in args.tables.split(",") if t]
    runners = {"masked": masked_rows, "contiguous": contiguous_rows, "error": error_rows}
    for table in tables:
        try:
            runners[table](rows)
        except Exception as exc:  # keep the other tables and the JSON
            print(f"table {table} failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    text = markdown(rows, tables)
    print(text, flush=True)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps([dict(table="meta", device=torch.cuda.get_device_name()), *rows], indent=1))


if __name__ == "__main__":
    main()
