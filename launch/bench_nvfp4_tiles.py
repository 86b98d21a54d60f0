"""Which token tile the Hopper NVFP4 CUDA kernel should take for contiguous groups, and fused_moe(quant="nvfp4")
against FP8 block on the current choice, in one run.

    python launch/bench_nvfp4_tiles.py [--tables routed,tails,equal,fused] [--json FILE]

Tables:
- routed: ``fused_moe`` for a DeepSeek-V3 layer (H 7168, I 2048, top-8, split bits) on routed tokens (uneven
  groups), the kernel's tile forced to each of the three tiles from the mean group's up (``moe/gemm_nvfp4_sm90.py``
  ``tile_for``): E = 256 at T = 256 .. 4096 (means of 8 .. 128 rows) and E = 64 at T = 128 .. 4096; also whether
  the outputs of every tile are bit-identical (they should be: a tile changes no sum's order).
- tails: the same ``fused_moe`` at E = 256 (T = 2048 .. 8192) and E = 64 (T = 1024 .. 4096) on the default tile,
  with the tail launch (``tail_tile_for``: a group's few rows past its last whole tile on a smaller tile) forced
  off and to each smaller tile; outputs compared bit for bit as above.
- equal: ``grouped_gemm_nvfp4_contiguous`` on 32 equal groups of 12 .. 64 rows at (7168, 2048) and, gated,
  (4096, 7168): the mean's tile and the next.
- fused: the ``fused_moe`` cases of ``bench_nvfp4.py`` (E = 256 and 64, T in {1, 16, 128, 4096}) with the default
  tile choice, NVFP4 split bits against FP8 block with plain and packed weights.

The variants of a case are timed in turn (``bench_nvfp4.timed``: medians of CUDA-graph replays after a settle).
A forced tile is set around each call (and so in the captured graph) and restored after it.
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
    require_gpus(1, capability=(9, 0))

from bench_gemm import _layout  # noqa: E402
from bench_nvfp4 import TOP_K, H, deepseek_layer, moe_call, nvfp4_weights, timed  # noqa: E402

import flashinfer_moe as fm  # noqa: E402
from flashinfer_moe.moe import gemm_nvfp4_sm90 as sm90  # noqa: E402

DEV = "cuda"


def forced_tile(fn, tile: int):
    """``fn`` with the CUDA kernel's token tile fixed to ``tile``."""
    chooser = sm90.tile_for_layout

    def call(i):
        sm90.tile_for_layout = lambda rows, experts, capacity: tile
        try:
            return fn(i)
        finally:
            sm90.tile_for_layout = chooser

    return call


def routed_rows(rows: list[dict]) -> None:
    for e, tokens in ((256, (256, 512, 768, 1024, 1536, 2048, 4096)), (64, (128, 256, 512, 1024, 4096))):
        nv = deepseek_layer(e, ("nvfp4_split",))["nvfp4_split"]
        for t in tokens:
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            weights, ids = fm.route(torch.randn(t, e, device=DEV), TOP_K)
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            out = torch.empty(t, H, dtype=torch.bfloat16, device=DEV)
            call = moe_call(x, weights, ids, out, nv)
            mean_tile = sm90.tile_for(-(-t * TOP_K // e))
            tiles = [tile for tile in sm90.TILES if tile >= mean_tile][:3]
            outs = []
            for tile in tiles:
                forced_tile(call, tile)(0)
                outs.append(out.clone())
            us = timed({f"tile_{tile}": forced_tile(call, tile) for tile in tiles}, calls=4, reps=5)
            rows.append(
                dict(
                    table="routed",
                    experts=e,
                    tokens=t,
                    rows_mean=t * TOP_K / e,
                    rows_min=int(counts.min()),
                    rows_max=int(counts.max()),
                    default_tile=sm90.tile_for_layout(t * TOP_K, e, None),
                    **{f"{name}_us": v for name, v in us.items()},
                    outputs_bit_equal=all(torch.equal(o, outs[0]) for o in outs),
                )
            )
            print(rows[-1], flush=True)


def forced_tail(fn, tail: int):
    """``fn`` with the tail launch's tile fixed to ``tail`` (0: none) beside the default tile."""
    chooser = sm90.tail_tile_for

    def call(i):
        sm90.tail_tile_for = lambda tile, capacity: tail if capacity is None else 0
        try:
            return fn(i)
        finally:
            sm90.tail_tile_for = chooser

    return call


def tail_rows(rows: list[dict]) -> None:
    for e, tokens in ((256, (2048, 4096, 8192)), (64, (1024, 2048, 4096))):
        nv = deepseek_layer(e, ("nvfp4_split",))["nvfp4_split"]
        for t in tokens:
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            weights, ids = fm.route(torch.randn(t, e, device=DEV), TOP_K)
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            out = torch.empty(t, H, dtype=torch.bfloat16, device=DEV)
            call = moe_call(x, weights, ids, out, nv)
            tile = sm90.tile_for_layout(t * TOP_K, e, None)
            tails = [0] + [tail for tail in (32, 64, 128) if tail < tile]  # tiles below 32 cannot split
            outs = []
            for tail in tails:
                forced_tail(call, tail)(0)
                outs.append(out.clone())
            us = timed({f"tail_{tail}": forced_tail(call, tail) for tail in tails}, calls=4, reps=5)
            rows.append(
                dict(
                    table="tails",
                    experts=e,
                    tokens=t,
                    rows_mean=t * TOP_K / e,
                    rows_min=int(counts.min()),
                    rows_max=int(counts.max()),
                    tile=tile,
                    default_tail=sm90.tail_tile_for(tile, None),
                    **{f"{name}_us": v for name, v in us.items()},
                    outputs_bit_equal=all(torch.equal(o, outs[0]) for o in outs),
                )
            )
            print(rows[-1], flush=True)


def equal_rows(rows: list[dict]) -> None:
    e = 32
    for n, k, gated in ((7168, 2048, False), (4096, 7168, True)):
        w, s, gs = nvfp4_weights(e, n, k, gated)
        wb = fm.pack_nvfp4_weights(w, split_bits=True)
        act = "silu" if gated else None
        for per in (12, 24, 48, 64):
            layout = _layout([per] * e)
            a = torch.randn(e * per, k, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(e * per, n // 2 if gated else n, dtype=torch.bfloat16, device=DEV)

            def call(i, a=a, layout=layout, out=out):
                return fm.grouped_gemm_nvfp4_contiguous(a, wb, s, gs, layout, activation=act, validate=False, out=out)

            mean_tile = sm90.tile_for(per)
            tiles = [tile for tile in sm90.TILES if tile >= mean_tile][:2]
            us = timed({f"tile_{tile}": forced_tile(call, tile) for tile in tiles})
            rows.append(
                dict(
                    table="equal",
                    experts=e,
                    rows=per,
                    n=n,
                    k=k,
                    gated=gated,
                    default_tile=sm90.tile_for_layout(e * per, e, None),
                    **{f"{name}_us": v for name, v in us.items()},
                )
            )
            print(rows[-1], flush=True)


def fused_rows(rows: list[dict]) -> None:
    for e in (256, 64):
        args = deepseek_layer(e, ("nvfp4_split", "fp8", "fp8_packed"))
        for t in (1, 16, 128, 4096):
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            weights, ids = fm.route(torch.randn(t, e, device=DEV), TOP_K)
            out = torch.empty(t, H, dtype=torch.bfloat16, device=DEV)
            us = timed({name: moe_call(x, weights, ids, out, kw) for name, kw in args.items()}, calls=4, reps=5)
            best = min(us["fp8"], us["fp8_packed"])
            rows.append(
                dict(
                    table="fused",
                    experts=e,
                    tokens=t,
                    **{f"{name}_us": v for name, v in us.items()},
                    split_speedup_vs_fp8_best=best / us["nvfp4_split"],
                )
            )
            print(rows[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="routed,tails,equal,fused")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    runners = {"routed": routed_rows, "tails": tail_rows, "equal": equal_rows, "fused": fused_rows}
    meta = dict(table="meta", device=torch.cuda.get_device_name())
    rows: list[dict] = []
    for table in [t for t in args.tables.split(",") if t]:
        runners[table](rows)
        torch.cuda.empty_cache()
        if args.json:  # after every table: a run cut short keeps what it measured
            args.json.write_text(json.dumps([meta, *rows], indent=1))


if __name__ == "__main__":
    main()
