"""Which token tile the Hopper NVFP4 CUDA kernel should take for contiguous groups, and fused_moe(quant="nvfp4")
against FP8 block on the current choice, in one run.

    python launch/bench_nvfp4_tiles.py [--tables routed,tails,masked_fill,equal,fused] [--json FILE]

Tables:
- routed: ``fused_moe`` for a DeepSeek-V3 layer (H 7168, I 2048, top-8, split bits) on routed tokens (uneven
  groups), the kernel's tile forced to each of the three tiles from the mean group's up (``moe/gemm_nvfp4_sm90.py``
  ``tile_for``): E = 256 at T = 256 .. 4096 (means of 8 .. 128 rows) and E = 64 at T = 128 .. 4096; also whether
  the outputs of every tile are bit-identical (they should be: a tile changes no sum's order).
- tails: the same ``fused_moe`` at E = 256 (T = 2048 .. 8192) and E = 64 (T = 1024 .. 4096) on the default tile,
  with the tail launches (``tail_tiles_for``: a group's few rows past its last whole tile on smaller tiles) forced
  off, to each smaller tile, and to 32 and 64; outputs compared bit for bit as above.
- masked_fill: ``grouped_gemm_nvfp4_masked`` on 32 experts whose groups fill little of the capacity (as an
  expert-parallel decode's dispatch does) or all of it: the capacity's tile without tail launches, with one of
  32, with 32 and 64 (and 128 beside 256), and the tile of the groups' actual size (which the host does not
  know), against FP8 block.
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


def patched(fn, name: str, chooser):
    """``fn`` with ``sm90.<name>`` replaced by ``chooser`` around each call (and so in a captured graph)."""
    original = getattr(sm90, name)

    def call(i):
        setattr(sm90, name, chooser)
        try:
            return fn(i)
        finally:
            setattr(sm90, name, original)

    return call


def forced_tile(fn, tile: int):
    """``fn`` with the CUDA kernel's token tile fixed to ``tile``."""
    return patched(fn, "tile_for_layout", lambda rows, experts, capacity: tile)


def forced_tails(fn, tails: tuple[int, ...], masked: bool = False):
    """``fn`` with the tail launches' tiles fixed to ``tails`` (() for none) beside the default tile, on the
    contiguous layout (``masked``: on the masked one)."""
    return patched(fn, "tail_tiles_for", lambda tile, capacity: tails if (capacity is not None) == masked else ())


def routed_table(rows: list[dict], table: str, cases, variants, fields) -> None:
    """``fused_moe`` of a DeepSeek-V3 layer on routed tokens, for each ``(E, tokens)`` of ``cases``: the wrappers of
    ``variants(tile)`` (name -> wrapper of the call; ``tile`` the default one) timed in turn and their outputs
    compared bit for bit; ``fields(tile)`` adds the row's own."""
    for e, tokens in cases:
        nv = deepseek_layer(e, ("nvfp4_split",))["nvfp4_split"]
        for t in tokens:
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            weights, ids = fm.route(torch.randn(t, e, device=DEV), TOP_K)
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            out = torch.empty(t, H, dtype=torch.bfloat16, device=DEV)
            call = moe_call(x, weights, ids, out, nv)
            tile = sm90.tile_for_layout(t * TOP_K, e, None)
            fns = {name: wrap(call) for name, wrap in variants(tile, -(-t * TOP_K // e)).items()}
            outs = []
            for fn in fns.values():
                fn(0)
                outs.append(out.clone())
            us = timed(fns, calls=4, reps=5)
            rows.append(
                dict(
                    table=table,
                    experts=e,
                    tokens=t,
                    rows_mean=t * TOP_K / e,
                    rows_min=int(counts.min()),
                    rows_max=int(counts.max()),
                    **fields(tile),
                    **{f"{name}_us": v for name, v in us.items()},
                    outputs_bit_equal=all(torch.equal(o, outs[0]) for o in outs),
                )
            )
            print(rows[-1], flush=True)


def routed_rows(rows: list[dict]) -> None:
    def variants(tile, mean):
        tiles = [c for c in sm90.TILES if c >= sm90.tile_for(mean)][:3]
        return {f"tile_{c}": lambda call, c=c: forced_tile(call, c) for c in tiles}

    cases = ((256, (256, 512, 768, 1024, 1536, 2048, 4096)), (64, (128, 256, 512, 1024, 4096)))
    routed_table(rows, "routed", cases, variants, lambda tile: dict(default_tile=tile))


def tail_rows(rows: list[dict]) -> None:
    def variants(tile, mean):
        tails = [(), *[(c,) for c in (32, 64, 128) if c < tile]] + ([(32, 64)] if tile > 64 else [])
        return {"tail_" + ("_".join(map(str, c)) or "0"): lambda call, c=c: forced_tails(call, c) for c in tails}

    cases = ((256, (2048, 4096, 8192)), (64, (1024, 2048, 4096)))
    fields = lambda tile: dict(tile=tile, default_tails=list(sm90.tail_tiles_for(tile, None)))  # noqa: E731
    routed_table(rows, "tails", cases, variants, fields)


def masked_fill_rows(rows: list[dict]) -> None:
    """The masked layout below its capacity (an expert-parallel decode's dispatch: capacity W x max tokens a rank):
    the capacity's tile without tail launches, with one of 32, with 32 and 64 (and 128 beside 256), and the tile of
    the actual groups (which the host does not know), against FP8 block on the same layout."""
    from bench_gemm import _fp8_rows, _fp8_weights

    e = 32
    for n, k, gated in ((4096, 7168, True), (7168, 2048, False)):
        w, s, gs = nvfp4_weights(e, n, k, gated)
        wb = fm.pack_nvfp4_weights(w, split_bits=True)
        f8w, f8s = _fp8_weights(e, n, k)
        act = "silu" if gated else None
        # (capacity, mean): groups of mean / 2 .. 3 mean / 2 rows; None: every slot filled (the masked table's case)
        cases = ((128, 8), (128, 32), (128, 96), (512, 8), (512, 32), (512, 96), (512, 160), (64, None), (128, None))
        for capacity, mean in cases + ((512, None),):
            if mean is None:
                counts = torch.full((e,), capacity, device=DEV, dtype=torch.int32)
            else:
                counts = torch.randint(mean // 2, mean * 3 // 2 + 1, (e,), device=DEV, dtype=torch.int32)
            a = torch.randn(e, capacity, k, device=DEV, dtype=torch.bfloat16)
            aq, a_s = _fp8_rows(e * capacity, k)
            aq, a_s = aq.view(e, capacity, k), a_s.view(e, capacity, -1)
            out = torch.empty(e, capacity, n // 2 if gated else n, dtype=torch.bfloat16, device=DEV)

            def call(i, a=a, counts=counts, out=out):
                return fm.grouped_gemm_nvfp4_masked(a, wb, s, gs, counts, activation=act, validate=False, out=out)

            cap_tile = sm90.tile_for_layout(e * capacity, e, capacity)
            fit_tile = sm90.tile_for(capacity if mean is None else 2 * mean)
            fns = {
                "capacity_tile": forced_tails(call, (), masked=True),
                "tail_32": forced_tails(call, (32,) if cap_tile >= 64 else (), masked=True),
                "tails_32_64": forced_tails(call, (32, 64) if cap_tile >= 128 else (), masked=True),
                "tails_32_64_128": forced_tails(call, (32, 64, 128) if cap_tile >= 256 else (), masked=True),
                "fit_tile": forced_tails(forced_tile(call, fit_tile), (), masked=True),
                "fp8": lambda i, aq=aq, a_s=a_s, counts=counts, out=out: fm.grouped_gemm_fp8_block_masked(
                    aq, a_s, f8w, f8s, counts, activation=act, out=out
                ),
            }
            us = timed(fns)
            rows.append(
                dict(
                    table="masked_fill",
                    experts=e,
                    n=n,
                    k=k,
                    gated=gated,
                    capacity=capacity,
                    rows_mean=float(counts.float().mean()),
                    capacity_tile=cap_tile,
                    default_tails=list(sm90.tail_tiles_for(cap_tile, capacity)),
                    fit_tile=fit_tile,
                    **{f"{name}_us": v for name, v in us.items()},
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
    parser.add_argument("--tables", default="routed,tails,masked_fill,equal,fused")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    runners = {
        "routed": routed_rows,
        "tails": tail_rows,
        "masked_fill": masked_fill_rows,
        "equal": equal_rows,
        "fused": fused_rows,
    }
    meta = dict(table="meta", device=torch.cuda.get_device_name())
    rows: list[dict] = []
    for table in [t for t in args.tables.split(",") if t]:
        runners[table](rows)
        torch.cuda.empty_cache()
        if args.json:  # after every table: a run cut short keeps what it measured
            args.json.write_text(json.dumps([meta, *rows], indent=1))


if __name__ == "__main__":
    main()
