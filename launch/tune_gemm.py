"""Tile-config sweep for the grouped GEMM on the benchmark shapes: prints each config's time, best first.

    python launch/tune_gemm.py [--json FILE]

The winners go into moe/gemm_config.py by hand; nothing here runs at serving time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

require_gpus(1)

from flashinfer_moe.moe import gemm_config, gemm_kernel  # noqa: E402

FP8 = torch.float8_e4m3fn
DEV = "cuda"

# (name, masked, E, rows per expert, N (weight rows), K, a_mode, w_mode, act, quant_out)
SHAPES = [
    ("block 8x4096 4096x7168", False, 8, 4096, 4096, 7168, 3, 2, 0, False),
    ("block 8x4096 7168x2048", False, 8, 4096, 7168, 2048, 3, 2, 0, False),
    ("block 32x512 4096x7168", False, 32, 512, 4096, 7168, 3, 2, 0, False),
    ("block gemm1+silu+q 8x4096", False, 8, 4096, 4096, 7168, 3, 2, 1, True),
    ("tensor 8x4096 4096x7168", False, 8, 4096, 4096, 7168, 2, 1, 0, False),
    ("masked 32x16", True, 32, 16, 4096, 7168, 3, 2, 0, False),
    ("masked 32x64", True, 32, 64, 4096, 7168, 3, 2, 0, False),
    ("masked 32x128", True, 32, 128, 4096, 7168, 3, 2, 0, False),
]


def configs(rows_per_expert: int, act: int, quant_out: bool):
    bms = (64,) if rows_per_expert <= 16 else (64, 128)
    for bm, bn, warps, stages, group_m in itertools.product(bms, (128, 256), (4, 8), (3, 4, 5), (1, 8)):
        if (act and bn == 256) or (bm == 128 and warps == 4 and bn == 256) or (quant_out and bn % 128):
            continue
        if bn == 256 and stages > 4:
            continue
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=warps, num_stages=stages, GROUP_M=group_m)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    results = []
    for name, masked, e, m, nw, k, a_mode, w_mode, act, quant_out in SHAPES:
        if args.only and args.only not in name:
            continue
        rows = e * m
        a = torch.randn(rows, k, device=DEV).to(FP8)
        w = (torch.randn(e, nw, k, device=DEV) / 8).to(FP8)
        a_scale = torch.rand(rows, k // 128, device=DEV) if a_mode == 3 else torch.rand(rows, device=DEV)
        w_scale = torch.rand(e, nw // 128, k // 128, device=DEV) if w_mode == 2 else torch.rand(e, device=DEV)
        n = nw // 2 if act else nw
        out = torch.empty(rows, n, dtype=FP8 if quant_out else torch.bfloat16, device=DEV)
        out_scale = torch.empty(rows, n // 128, device=DEV) if quant_out else None
        counts = torch.full((e,), m, dtype=torch.int32, device=DEV)
        offsets = None if masked else torch.arange(0, rows + 1, m, dtype=torch.int32, device=DEV)
        capacity = m if masked else 2**31 - 1
        default = gemm_config.pick(FP8, a_mode, w_mode, act, quant_out, rows, e, capacity, n, k)
        timed = []
        for cfg in [default, *configs(m, act, quant_out)]:

            def run(i, cfg=cfg):
                gemm_kernel.launch(
                    a,
                    w,
                    out,
                    out_scale,
                    counts,
                    offsets,
                    a_scale,
                    w_scale,
                    a_mode=a_mode,
                    w_mode=w_mode,
                    act=act,
                    alpha=1.702,
                    limit=7.0,
                    capacity=capacity,
                    config=cfg,
                )

            try:
                us = time_graph(run, calls=5, reps=5)
            except Exception as exc:  # a config that does not fit (shared memory) is skipped
                print(f"  {cfg}: failed ({type(exc).__name__})", flush=True)
                continue
            timed.append((us, cfg))
        timed.sort(key=lambda x: x[0])
        flops = 2.0 * rows * nw * k
        default_us = [us for us, cfg in timed if cfg is default]
        print(f"{name}: default {default_us[0] if default_us else float('nan'):.1f} us", flush=True)
        for us, cfg in timed[:5]:
            print(f"  {us:8.1f} us {flops / us / 1e6:7.0f} TFLOP/s {cfg}", flush=True)
        results.append(dict(shape=name, best=[dict(us=us, **cfg) for us, cfg in timed[:5]]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
