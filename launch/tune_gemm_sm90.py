"""Sweep of the CUTLASS FP8 block-scaled grouped GEMM's configurations and tile orders on the benchmark shapes.

    python launch/tune_gemm_sm90.py [--json FILE] [--configs wg128,coop,...] [--orders 1m,2m,4n] [--repeat R]
        [--shapes contiguous|masked|routed|all]

For every shape of ``bench_gemm.py``'s contiguous and masked tables, times each configuration of
``flashinfer_moe.moe.gemm_sm90.CONFIGS`` with each swizzle (1, 2, 4, 8) and raster order (m, n), plus the dense
``torch._scaled_mm`` baseline of the same FLOPs, all in this run; prints the best few per shape. ``--shapes
routed`` times contiguous groups as random top-8 routing makes them instead (uneven; about 128 rows per expert
unless ``--routed E:tokens,...`` says otherwise). The table in ``gemm_sm90.pick`` is written from its output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

if __name__ == "__main__":  # profile_gemm_sm90.py imports this module after its own check
    require_gpus(1, capability=(9, 0))

from bench_gemm import _fp8_rows, _fp8_weights, _layout, _scaled_mm, tflops  # noqa: E402

from flashinfer_moe.moe import gemm_sm90  # noqa: E402

DEV = "cuda"
CONTIGUOUS = ((8, 4096, 4096, 7168), (8, 4096, 7168, 2048), (32, 512, 4096, 7168), (32, 512, 7168, 2048))
MASKED = ((32, 16, 4096, 7168), (32, 64, 4096, 7168), (32, 128, 4096, 7168))
# Contiguous groups as random top-8 routing makes them (uneven): (E, tokens), each at the two (N, K) of
# DeepSeek-V3's layer; about 128 rows per expert.
ROUTED = ((256, 4096), (64, 1024))
ROUTED_NK = ((4096, 7168), (7168, 2048))


def routed_counts(num_experts: int, tokens: int, top_k: int, seed: int = 0) -> list[int]:
    """Rows per expert when each token picks ``top_k`` distinct experts uniformly at random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=num_experts).tolist()


def contiguous_case(num_experts: int, per_expert: int, n: int, k: int):
    """``grouped_case`` with ``per_expert`` rows for each of the experts."""
    return grouped_case([per_expert] * num_experts, n, k)


def grouped_case(counts: list[int], n: int, k: int):
    """``(fn(i, config, swizzle, raster), dense_fn(i), flops)`` of contiguous groups of ``counts[e]`` rows;
    ``dense_fn`` is the rowwise ``_scaled_mm`` of the same FLOPs."""
    num_experts, m = len(counts), sum(counts)
    layout = _layout(counts)
    a, a_s = _fp8_rows(m, k)
    w, w_s = _fp8_weights(num_experts, n, k)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    rows, offsets = layout.tokens_per_expert, layout.expert_offsets

    def fn(i, config, swizzle, raster):
        gemm_sm90.launch(a, a_s, w, w_s, out, rows, offsets, None, config, swizzle, raster)

    b_dense = w.reshape(-1, k)[:n].t()
    sa, sb = torch.rand(m, 1, device=DEV) + 0.5, torch.rand(1, n, device=DEV) + 0.5
    return fn, (lambda i: _scaled_mm(a, b_dense, sa, sb)), 2.0 * m * n * k


def masked_case(num_experts: int, per_expert: int, n: int, k: int, sets: int = 3):
    """``(fn(i, config, swizzle, raster), flops, weight bytes)`` of one masked shape, every slot used; call i
    reads weight set i % sets, so that no weight stays in L2 between calls."""
    ws = [_fp8_weights(num_experts, n, k) for _ in range(sets)]
    a, a_s = _fp8_rows(num_experts * per_expert, k)
    counts = torch.full((num_experts,), per_expert, dtype=torch.int32, device=DEV)
    out = torch.empty(num_experts * per_expert, n, dtype=torch.bfloat16, device=DEV)

    def fn(i, config, swizzle, raster):
        w, w_s = ws[i % sets]
        gemm_sm90.launch(a, a_s, w, w_s, out, counts, None, per_expert, config, swizzle, raster)

    return fn, 2.0 * num_experts * per_expert * n * k, num_experts * n * k


ALL_ORDERS = tuple((swizzle, raster) for swizzle in (1, 2, 4, 8) for raster in ("m", "n"))


def sweep(fn, flops: float, weight_bytes: int, configs: list[str], orders=ALL_ORDERS, repeat: int = 1) -> list[dict]:
    """Times every (config, order) ``repeat`` times, the passes alternating the configs' order so that drift
    during the run does not favour one of them; each row keeps the median and every time."""
    times = {}
    for rep in range(repeat):
        for config in configs if rep % 2 == 0 else configs[::-1]:
            for swizzle, raster in orders:
                us = time_graph(lambda i: fn(i, config, swizzle, raster), calls=5)
                times.setdefault((config, swizzle, raster), []).append(us)
    rows = []
    for (config, swizzle, raster), all_us in times.items():
        us = statistics.median(all_us)
        tb_s = weight_bytes / (us * 1e-6) / 1e12
        rows.append(
            dict(
                config=config,
                swizzle=swizzle,
                raster=raster,
                us=us,
                us_all=all_us,
                tflops=tflops(flops, us),
                weight_tb_s=tb_s,
            )
        )
    return sorted(rows, key=lambda r: r["us"])


def parse_orders(text: str) -> tuple[tuple[int, str], ...]:
    """``"1m,2n"`` -> ``((1, "m"), (2, "n"))``."""
    orders = []
    for item in text.split(","):
        swizzle, raster = item[:-1], item[-1:]
        if not swizzle.isdigit() or (int(swizzle), raster) not in ALL_ORDERS:
            raise SystemExit(f"--orders: expected items like 1m or 4n (swizzle 1/2/4/8, raster m/n), got {item!r}")
        orders.append((int(swizzle), raster))
    return tuple(orders)


def _best_per_config(rows: list[dict]) -> list[dict]:
    """The fastest tile order of each configuration, fastest first (``rows`` is sorted)."""
    seen, best = set(), []
    for r in rows:
        if r["config"] not in seen:
            seen.add(r["config"])
            best.append(r)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--configs", default=",".join(gemm_sm90.CONFIGS))
    parser.add_argument("--orders", default=None, help="tile orders to try, e.g. 1m,2m,4n (default: all eight)")
    parser.add_argument("--repeat", type=int, default=1, help="passes over the configs (median kept), default 1")
    parser.add_argument("--routed", default=None, help="E:tokens pairs for --shapes routed, e.g. 256:8192,64:2048")
    parser.add_argument(
        "--shapes", default="all", help="contiguous, masked, routed, or all (the default: contiguous and masked)"
    )
    args = parser.parse_args()
    configs = args.configs.split(",")
    orders = parse_orders(args.orders) if args.orders else ALL_ORDERS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    if args.repeat < 1 or args.shapes not in ("contiguous", "masked", "routed", "all"):
        raise SystemExit(
            f"--repeat must be >= 1 and --shapes one of contiguous, masked, routed, all: {args.repeat}, {args.shapes}"
        )

    def contiguous(label: str, num_experts: int, n: int, k: int, group_rows: list[int], **record) -> None:
        fn, dense_fn, flops = grouped_case(group_rows, n, k)
        dense = time_graph(dense_fn, calls=5)
        rows = sweep(fn, flops, num_experts * n * k, configs, orders, args.repeat)
        for r in rows:
            r["vs_dense"] = dense / r["us"]
        results.append(dict(**record, experts=num_experts, n=n, k=k, dense_us=dense, sweep=rows))
        print(f"{label} ({n}, {k}): dense {tflops(flops, dense):.0f} TFLOP/s", flush=True)
        for r in _best_per_config(rows):
            print(
                f"   {r['config']:9s} swizzle {r['swizzle']} raster {r['raster']}: {r['tflops']:.0f} TFLOP/s, "
                f"{r['vs_dense']:.3f}x dense",
                flush=True,
            )

    routed = [tuple(map(int, item.split(":"))) for item in args.routed.split(",")] if args.routed else ROUTED
    for (num_experts, tokens), (n, k) in itertools.product(routed, ROUTED_NK) if args.shapes == "routed" else ():
        counts = routed_counts(num_experts, tokens, 8)
        label = f"routed E={num_experts} T={tokens} top-8, rows per expert {min(counts)}-{max(counts)}"
        contiguous(label, num_experts, n, k, counts, layout="routed", tokens=tokens, top_k=8, counts=counts)
    for num_experts, per_expert, n, k in CONTIGUOUS if args.shapes in ("contiguous", "all") else ():
        label = f"contiguous {num_experts}x{per_expert}"
        contiguous(label, num_experts, n, k, [per_expert] * num_experts, layout="contiguous", rows=per_expert)
    for num_experts, per_expert, n, k in MASKED if args.shapes in ("masked", "all") else ():
        fn, flops, weight_bytes = masked_case(num_experts, per_expert, n, k)
        rows = sweep(fn, flops, weight_bytes, configs, orders, args.repeat)
        results.append(dict(layout="masked", experts=num_experts, rows=per_expert, n=n, k=k, sweep=rows))
        print(f"masked {num_experts}x{per_expert} ({n}, {k})", flush=True)
        for r in _best_per_config(rows):
            print(
                f"   {r['config']:9s} swizzle {r['swizzle']} raster {r['raster']}: {r['weight_tb_s']:.2f} TB/s, "
                f"{r['tflops']:.0f} TFLOP/s",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
