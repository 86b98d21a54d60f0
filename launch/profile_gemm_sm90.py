"""Where the CUTLASS grouped GEMM loses time: the same work cut into more or fewer groups, timed in one run.

    python launch/profile_gemm_sm90.py [--json FILE] [--configs coop,pingpong,...]
    python launch/profile_gemm_sm90.py --once CASE --config NAME   # three launches, for ncu
    python launch/profile_gemm_sm90.py --gemm1 [--repeat R] [--json FILE]

--gemm1: GEMM1 of a DeepSeek-V3 layer (FP8 block, SwiGLU, FP8 output; N = 2 x 2048, K = 7168) at several rows
per expert, three ways timed in this run: the Triton kernel with the activation fused, the grouped GEMM of
``gemm_sm90.pick`` to bf16 plus the activation pass (``moe/act_kernel.py``), and our wgmma kernel with the
activation in its epilogue (``gemm_sm90.pick_gated``, the default).

Contiguous: 16384 rows at (N, K) = (4096, 7168) as E groups of 16384 / E rows (E = 1 is one plain GEMM); the
tiles and FLOPs stay the same, only the number of group changes per CTA grows with E. Masked: the 0.94 GB of
decode weights as 32 experts of N = 4096 or 8 experts of N = 16384 (same tiles, a quarter of the group
changes). The dense ``torch._scaled_mm`` of the same FLOPs is timed in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

require_gpus(1, capability=(9, 0))

from bench_gemm import SETTLE_MS, _fp8_rows, _fp8_weights, _layout, tflops  # noqa: E402
from tune_gemm_sm90 import contiguous_case, masked_case  # noqa: E402

from flashinfer_moe.moe import gemm_sm90  # noqa: E402

CONTIGUOUS = tuple((e, 16384 // e, 4096, 7168) for e in (1, 4, 8, 32, 64))
MASKED = ((32, 16, 4096, 7168), (8, 16, 16384, 7168), (32, 64, 4096, 7168), (8, 64, 16384, 7168))
ORDERS = ((1, "m"), (2, "m"), (1, "n"))


def _call(fn, config, swizzle, raster, i):
    fn(i, config, swizzle, raster)


def _orders(fn, configs: list[str], calls: int):
    """``(config, swizzle, raster, us)`` for each configuration and tile order of ``ORDERS``."""
    for config in configs:
        for swizzle, raster in ORDERS:
            us = time_graph(functools.partial(_call, fn, config, swizzle, raster), calls=calls)
            yield config, swizzle, raster, us


def gemm1(json_path: Path | None, repeat: int) -> None:
    import flashinfer_moe as fm

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    n, k, sets = 2 * 2048, 7168, 3
    for num_experts, per_expert in ((256, 1), (256, 4), (256, 16), (256, 64), (256, 128), (64, 16), (64, 512)):
        layout = _layout([per_expert] * num_experts)
        a, a_s = _fp8_rows(num_experts * per_expert, k)
        ws = [_fp8_weights(num_experts, n, k) for _ in range(sets if per_expert <= 64 else 1)]

        def fn(i, ws=ws, a=a, a_s=a_s, layout=layout):
            w, w_s = ws[i % len(ws)]
            fm.grouped_gemm_fp8_block_contiguous(a, a_s, w, w_s, layout, activation="silu", quantize_output=True)

        samples = {}
        saved = gemm_sm90.SPLIT_MIN_ROWS_PER_EXPERT, gemm_sm90.FUSED_ACTIVATION
        paths = (("fused_triton", 1 << 30, False), ("split", 1, False), ("fused_wgmma", 1, True))
        try:
            # Passes in alternating order, each timing after settling at its own power state (the board is
            # power-limited: a path timed right after a lighter one reads fast); the median per path.
            for rep in range(repeat):
                for name, threshold, fused in paths if rep % 2 == 0 else paths[::-1]:
                    gemm_sm90.SPLIT_MIN_ROWS_PER_EXPERT, gemm_sm90.FUSED_ACTIVATION = threshold, fused
                    samples.setdefault(name, []).append(time_graph(fn, calls=6, settle_ms=SETTLE_MS))
        finally:
            gemm_sm90.SPLIT_MIN_ROWS_PER_EXPERT, gemm_sm90.FUSED_ACTIVATION = saved
        times = {name: statistics.median(v) for name, v in samples.items()}
        flops = 2.0 * num_experts * per_expert * n * k
        row = dict(experts=num_experts, rows=per_expert, **{f"{k_}_us": v for k_, v in times.items()})
        row["fused_over_split"] = times["split"] / times["fused_wgmma"]
        results.append(row)
        config = gemm_sm90.pick_gated(num_experts * per_expert, num_experts, None, n, k)
        print(
            f"GEMM1 E {num_experts:3d} x {per_expert:3d} rows: "
            + ", ".join(f"{k_} {v:8.1f} us ({tflops(flops, v):4.0f} TFLOP/s)" for k_, v in times.items())
            + f"; split / fused wgmma {row['fused_over_split']:.2f}x ({config and config[0]})",
            flush=True,
        )
    if json_path:
        json_path.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--configs", default=",".join(gemm_sm90.CONFIGS))
    parser.add_argument("--gemm1", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="--gemm1: timing passes per path (median)")
    parser.add_argument("--once", choices=["contiguous32", "contiguous32n", "masked16", "masked64", "masked128"])
    parser.add_argument("--config", default="coop")
    parser.add_argument("--swizzle", type=int, default=2)
    parser.add_argument("--raster", default="m")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if args.gemm1:
        gemm1(args.json, args.repeat)
        return
    if args.once:
        if args.once.startswith("contiguous32"):  # 32 x 512 rows at (4096, 7168), or (7168, 2048) with the n
            fn, _, _ = contiguous_case(32, 512, *((7168, 2048) if args.once.endswith("n") else (4096, 7168)))
        else:
            fn, _, _ = masked_case(32, int(args.once[len("masked") :]), 4096, 7168)
        for i in range(3):
            fn(i, args.config, args.swizzle, args.raster)
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    for shape in CONTIGUOUS:
        fn, dense_fn, flops = contiguous_case(*shape)
        dense = time_graph(dense_fn, calls=5)
        line = [f"contiguous {shape[0]:2d} x {shape[1]:5d}: dense {tflops(flops, dense):5.0f}"]
        for config, swizzle, raster, us in _orders(fn, configs, calls=5):
            results.append(
                dict(
                    case="contiguous",
                    shape=shape,
                    config=config,
                    swizzle=swizzle,
                    raster=raster,
                    us=us,
                    tflops=tflops(flops, us),
                    vs_dense=dense / us,
                )
            )
            line.append(f"{config}/{swizzle}{raster} {dense / us:.3f}")
        print("  ".join(line), flush=True)
        torch.cuda.empty_cache()
    for shape in MASKED:
        fn, flops, weight_bytes = masked_case(*shape)
        line = [f"masked {shape[0]:2d} x {shape[1]:3d} N {shape[2]:5d}:"]
        for config, swizzle, raster, us in _orders(fn, configs, calls=6):
            tb_s = weight_bytes / (us * 1e-6) / 1e12
            results.append(
                dict(
                    case="masked",
                    shape=shape,
                    config=config,
                    swizzle=swizzle,
                    raster=raster,
                    us=us,
                    tflops=tflops(flops, us),
                    weight_tb_s=tb_s,
                )
            )
            line.append(f"{config}/{swizzle}{raster} {tb_s:.2f} TB/s")
        print("  ".join(line), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
