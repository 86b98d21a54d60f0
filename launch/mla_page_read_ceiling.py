"""How fast HBM reads a paged latent cache's rows in the orders a decode reads them, with nothing else running.

    python launch/mla_page_read_ceiling.py [--sk 4096,16384] [--json FILE]

Batch 128, rows of 576 elements (bf16: 1152 bytes; FP8: 576), read once each by one Triton kernel that sums them
(so the loads are kept), in four orders: contiguous, random 64-row pages, random 16-row pages, random rows (page
1). Each order takes the fastest of a few launch shapes; CUDA-graph medians (``timing.time_graph``). The page-1 /
page-64 time ratio is what the decode kernels' page-1 goal (within 10% of page 64) can reach at best. The FP8 rows
are read 64 bytes a row per load, which holds this kernel below what the decode kernels reach on them; compare
their orders with each other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

if __name__ == "__main__":
    require_gpus(1)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BATCH, ROW = 128, 576
# (rows per block, columns per load, warps, programs per SM)
SHAPES = ((16, 64, 4, 8), (32, 64, 4, 8), (16, 64, 4, 16), (32, 64, 8, 4), (64, 64, 8, 4))


@triton.jit
def _read_rows(src, idx, out, n_rows, ROW: tl.constexpr, BLOCK_R: tl.constexpr, CH: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_R, CH), dtype=tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, CH)
    for r0 in range(pid * BLOCK_R, n_rows, tl.num_programs(0) * BLOCK_R):
        ok = r0 + offs_r < n_rows
        rows = tl.load(idx + r0 + offs_r, mask=ok, other=0).to(tl.int64)
        base = src + rows[:, None] * ROW + offs_c[None, :]
        for c in tl.static_range(0, ROW, CH):
            acc += tl.load(base + c, mask=ok[:, None], other=0).to(tl.float32)
    tl.store(out + pid * BLOCK_R * CH + offs_r[:, None] * CH + offs_c[None, :], acc)


def best_time(src: torch.Tensor, idx: torch.Tensor, sms: int) -> float:
    """The fastest of SHAPES reading the rows of ``src`` `[n, ROW]` in the order ``idx`` `[n]`, us."""
    n = src.shape[0]
    best = float("inf")
    for block_r, ch, warps, per_sm in SHAPES:
        progs = sms * per_sm
        out = torch.empty(progs * block_r * ch, device=src.device, dtype=torch.float32)
        grid = (progs,)
        best = min(
            best,
            time_graph(
                lambda i, grid=grid, out=out, block_r=block_r, ch=ch, warps=warps: _read_rows[grid](
                    src, idx, out, n, ROW=ROW, BLOCK_R=block_r, CH=ch, num_warps=warps
                ),
                calls=5,
                reps=20,
            ),
        )
    return best


def orders(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Row orders `[n]` int32: contiguous, pages of 64 and 16 rows in random order, rows in random order."""

    def pages(size: int) -> torch.Tensor:
        return (torch.randperm(n // size, generator=gen)[:, None] * size + torch.arange(size)).reshape(-1)

    return {
        "contiguous": torch.arange(n),
        "page64": pages(64),
        "page16": pages(16),
        "page1": torch.randperm(n, generator=gen),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sk", default="4096,16384", help="tokens per sequence")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    results = []
    for s_k in (int(x) for x in args.sk.split(",")):
        n = BATCH * s_k
        for cache in ("bf16", "fp8"):
            if cache == "bf16":
                src = torch.randn(n, ROW, device="cuda", dtype=torch.bfloat16)
            else:  # the bytes only matter as bytes
                src = torch.randint(0, 64, (n, ROW), device="cuda", dtype=torch.uint8)
            nbytes = src.numel() * src.element_size()
            times = {}
            for name, order in orders(n, torch.Generator().manual_seed(0)).items():
                times[name] = best_time(src, order.to(torch.int32).cuda(), sms)
                print(f"s_k {s_k:>6} {cache} {name:>10}: {times[name]:8.1f} us  {nbytes / times[name] / 1e6:5.2f} TB/s")
            ratio = times["page1"] / times["page64"]
            print(f"  page 1 / page 64 time: {ratio:.3f}", flush=True)
            results.append(dict(s_k=s_k, cache=cache, bytes=nbytes, us=times, page1_over_page64=ratio))
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=results), indent=1))


if __name__ == "__main__":
    main()
