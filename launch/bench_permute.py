"""Benchmark of the data-movement kernels: layout, permute (plain, FP8, NVFP4) and combine, against the torch
reference timed in the same run, and the device's copy bandwidth measured first as the ceiling.

    python launch/bench_permute.py [--tokens 128,4096] [--markdown FILE] [--json FILE]

Shapes are DeepSeek-V3's: E = 256 experts, top-8, H = 7168, bf16 activations, uniform random routing.
Per row: the kernel's GPU time (median of CUDA-graph replays, the graph cycling through 8 input sets so that
no input stays in L2; timed twice, both shown), the bytes that must move (every input read once, every
output written once, owned rows only), the bandwidth those bytes give, its share of the measured copy
bandwidth, and the torch reference (flashinfer_moe.reference, plain torch ops) timed eagerly on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_eager, time_graph  # noqa: E402

require_gpus(1)

import flashinfer_moe as fm  # noqa: E402
from flashinfer_moe import reference as ref  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, BLOCK_ROWS, SETS = 256, 8, 7168, 128, 8


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB issued eagerly (a copy kernel; inside a graph the copy may go to the
    copy engines instead), in GB/s counting bytes read plus bytes written."""
    src = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = time_eager(lambda: dst.copy_(src), calls=10, reps=5)
    return 2 * src.numel() * 2 / (us * 1e-6) / 1e9


def write_bandwidth() -> float:
    """Writing 4 GiB (a fill kernel, nothing read), in GB/s: the ceiling of write-dominated kernels such as
    permute, which writes each token k times and reads it once."""
    dst = torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    us = time_eager(lambda: dst.fill_(1.0), calls=10, reps=5)
    return dst.numel() * 2 / (us * 1e-6) / 1e9


def routing_ids(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(-1)[:, :TOP_K].int().cuda()


def bench(
    num_tokens: int, gen: torch.Generator, ceiling: float, write_ceiling: float, ops: str | None, with_reference: bool
) -> list[dict]:
    pairs = num_tokens * TOP_K
    ids = [routing_ids(num_tokens, gen) for _ in range(SETS)]
    xs = [torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16().cuda() for _ in range(SETS)]
    weights = [torch.rand(num_tokens, TOP_K, generator=gen).cuda() for _ in range(SETS)]
    # The masked layout is the decode one: room for every token in every expert, so nothing overflows.
    decode = num_tokens <= 512
    capacity = num_tokens if decode else 0
    layouts = [fm.moe_align_contiguous(i, NUM_EXPERTS, BLOCK_ROWS) for i in ids]
    masked = [fm.moe_align_masked(i, NUM_EXPERTS, capacity) for i in ids]
    global_scale = torch.tensor(0.002, device="cuda")
    rows = layouts[0].num_rows

    def outs(shape, dtype):
        return [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(SETS)]

    q, s = outs((rows, HIDDEN), torch.float8_e4m3fn), outs((rows, HIDDEN // 128), torch.float32)
    qm = outs((NUM_EXPERTS, capacity, HIDDEN), torch.float8_e4m3fn)
    sm = outs((NUM_EXPERTS, capacity, HIDDEN // 128), torch.float32)
    pk, bs = outs((rows, HIDDEN // 2), torch.uint8), outs((rows, HIDDEN // 16), torch.float8_e4m3fn)
    copy_out = outs((rows, HIDDEN), torch.bfloat16)
    ys = [torch.randn(rows, HIDDEN, generator=gen).bfloat16().cuda() for _ in range(SETS)]
    out = outs((num_tokens, HIDDEN), torch.bfloat16)
    residual = [torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16().cuda() for _ in range(SETS)]

    index = pairs * 4  # row_of read (int32)
    act = num_tokens * HIDDEN * 2
    fp8_rows = pairs * (HIDDEN + HIDDEN // 128 * 4)
    cases = [
        ("align contiguous", 0, lambda i: fm.moe_align_contiguous(ids[i], NUM_EXPERTS, BLOCK_ROWS, validate=False),
         lambda: ref.moe_align_contiguous(ids[0], NUM_EXPERTS, BLOCK_ROWS)),
        ("align masked", 0, lambda i: fm.moe_align_masked(ids[i], NUM_EXPERTS, capacity, validate=False),
         lambda: ref.moe_align_masked(ids[0], NUM_EXPERTS, capacity)),
        ("permute bf16", act + index + pairs * HIDDEN * 2, lambda i: fm.permute(xs[i], layouts[i], out=copy_out[i]),
         lambda: ref.permute(xs[0], layouts[0])),
        ("permute + FP8 1x128", act + index + fp8_rows,
         lambda i: fm.permute_fp8_per_token_group(xs[i], layouts[i], out=(q[i], s[i])),
         lambda: ref.permute_fp8_per_token_group(xs[0], layouts[0])),
        ("permute + FP8 1x128, masked", act + index + fp8_rows,
         lambda i: fm.permute_fp8_per_token_group(xs[i], masked[i], out=(qm[i], sm[i])),
         lambda: ref.permute_fp8_per_token_group(xs[0], masked[0])),
        ("permute + NVFP4", act + index + pairs * (HIDDEN // 2 + HIDDEN // 16),
         lambda i: fm.permute_nvfp4(xs[i], layouts[i], global_scale, out=(pk[i], bs[i])),
         lambda: ref.permute_nvfp4(xs[0], layouts[0], global_scale)),
        ("combine", pairs * (HIDDEN * 2 + 8) + act,
         lambda i: fm.combine(ys[i], weights[i], layouts[i], out=out[i]),
         lambda: ref.combine(ys[0], weights[0], layouts[0])),
        ("combine + scale + residual", pairs * (HIDDEN * 2 + 8) + 2 * act,
         lambda i: fm.combine(ys[i], weights[i], layouts[i], routed_scaling_factor=2.5, residual=residual[i], out=out[i]),
         lambda: ref.combine(ys[0], weights[0], layouts[0], routed_scaling_factor=2.5, residual=residual[0])),
    ]  # fmt: skip
    if not decode:
        cases = [c for c in cases if "masked" not in c[0]]
    if ops:
        cases = [c for c in cases if any(o in c[0] for o in ops.split(","))]
    results = []
    for name, nbytes, kernel, torch_ref in cases:
        calls = SETS * (4 if num_tokens <= 512 else 1)
        first = time_graph(lambda i, kernel=kernel: kernel(i % SETS), calls, reps=20)
        again = time_graph(lambda i, kernel=kernel: kernel(i % SETS), calls, reps=20)
        reference_us = time_eager(torch_ref, calls=5, reps=5) if with_reference else float("nan")
        us = min(first, again)
        gbps = nbytes / (us * 1e-6) / 1e9 if nbytes else float("nan")
        results.append(
            dict(op=name, tokens=num_tokens, bytes=nbytes, kernel_us=first, kernel_again_us=again, gbps=gbps,
                 of_copy=gbps / ceiling, of_write=gbps / write_ceiling, torch_us=reference_us,
                 speedup=reference_us / us)
        )  # fmt: skip
        r = results[-1]
        print(
            f"{name:<30} {num_tokens:>6} {nbytes / 1e6:>9.1f} {first:>9.2f} {again:>9.2f} {gbps:>8.0f} "
            f"{100 * r['of_copy']:>6.1f}% {100 * r['of_write']:>6.1f}% {reference_us:>10.1f} {r['speedup']:>8.1f}x",
            flush=True,
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ops", help="only the ops whose name contains one of these comma-separated words")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    ceiling, write_ceiling = copy_bandwidth(), write_bandwidth()
    print(
        f"# {torch.cuda.get_device_name()}: device-to-device copy {ceiling:.0f} GB/s (read + write), "
        f"write-only fill {write_ceiling:.0f} GB/s"
    )
    print(
        f"{'op':<30} {'T':>6} {'MB moved':>9} {'us':>9} {'us again':>9} {'GB/s':>8} {'of copy':>7} {'of fill':>7} "
        f"{'torch us':>10} {'speedup':>9}"
    )
    rows = []
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        rows += bench(num_tokens, gen, ceiling, write_ceiling, args.ops, not args.no_reference)
    if args.markdown:
        lines = [
            f"Ceilings measured in the same run: device-to-device copy {ceiling:.0f} GB/s (read + write), "
            f"write-only fill {write_ceiling:.0f} GB/s.",
            "",
            "| op | T | MB that must move | kernel (us, timed twice) | GB/s | of copy | of fill | torch reference (us) "
            "| reference / kernel |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else "-"
            gbps = f"{r['gbps']:.0f}" if r["bytes"] else "-"
            share = f"{100 * r['of_copy']:.0f}% | {100 * r['of_write']:.0f}%" if r["bytes"] else "- | -"
            lines.append(
                f"| {r['op']} | {r['tokens']} | {mb} | {r['kernel_us']:.2f} / {r['kernel_again_us']:.2f} | {gbps} | "
                f"{share} | {r['torch_us']:.1f} | {r['speedup']:.1f}x |"
            )
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(dict(copy_gbps=ceiling, write_gbps=write_ceiling, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
