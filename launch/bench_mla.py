"""Benchmark of the paged MLA decode (``mla_decode_plan`` + ``mla_decode``) against FlashMLA, torch SDPA and the
HBM copy ceiling, all in the same run.

    python launch/bench_mla.py [--quick] [--pages 64,1] [--caches bf16,fp8] [--sk 4096,varlen] [--heads 16,128]
        [--s-q 1,2] [--no-flashmla] [--no-sdpa] [--markdown FILE] [--json FILE]
    python launch/bench_mla.py --sweep [--tma] [--classes 16x1,128x2] [--json FILE]

Grid (FlashMLA's): batch 128, s_k 4096 / 8192 / 16384 and a varlen batch (lengths uniform in [1, 16384], fixed
seed), h_q 16 / 32 / 64 / 128, s_q 1 / 2, causal; page 64 and page 1 (pages shuffled over the pool); bf16 cache
and FP8 cache (``[P, page, 576]`` float8_e4m3fn, per-tensor scale). Per row: time (us), GB/s (cache bytes the
sequences hold / time), TFLOP/s (``2 s_q h_q (576 + 512)`` per cached token).

Baselines, per row where they apply: ``flashmla`` (``flash_mla.get_mla_metadata`` + ``flash_mla_with_kvcache``,
bf16 page 64 only, metadata computed in every call as ours is), ``sdpa`` (``F.scaled_dot_product_attention``
over the cache gathered into contiguous `[B, L, 576]` beforehand, bf16 page 64 only: the query heads folded
into the query length, q `[B, 1, s_q h_q, 576]` against the one latent KV head `[B, 1, L, 576]` with v the
view of its first 512 channels, so nothing is expanded across heads; for s_q 2 an additive mask built once
gives query token i the keys up to L - s_q + i; every backend that takes these inputs is timed and the fastest
reported, with the one torch's own dispatch would pick; the math backend only where no fused one runs and
its score-sized tensors fit the 20 GB budget; each row's output checked against ours, and every backend
against the float64 reference on a small case at the start), ``copy`` (a device-to-device copy of the same
number of bytes: its time and the bytes read / that time).

Everything is timed as medians of CUDA-graph replays (plan + decode in one graph; FlashMLA's metadata and combine
kernels included), each after ``SETTLE_MS`` of its own replays, ours and FlashMLA in turn ``--rounds`` times per row
(the row's time: their median): an H200 running these kernels is power-limited, and one timed right after a lighter
row reads up to 16% faster than it sustains (see timing.time_graph). ``--sweep`` times kernel configurations (tokens
per tile, warps, stages, programs per SM) per (h_q, s_q) class at s_k 8192, page 64, for
``flashinfer_moe/mla/decode.py``'s ``CONFIGS`` (``--tma``: those of the TMA tile loads, ``TMA_CONFIGS``). ``--paths
triton,new`` times each row twice: ``new`` the default dispatch (on Hopper the CUDA kernel for bf16/fp16 pages),
``triton`` the Triton kernel (TMA tile loads where the cache's layout allows them), ``old`` Triton with the gathered
pointer loads forced; ``fp8_bf16`` the default with FP8 pages widened to bf16 (``FP8_F16_MATH`` off) instead of
fp16.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

if __name__ == "__main__":
    require_gpus(1)

from mla_sdpa import sdpa_self_check, time_sdpa  # noqa: E402

from flashinfer_moe.mla import decode as D  # noqa: E402
from flashinfer_moe.mla import decode_kernel as DK  # noqa: E402
from flashinfer_moe.mla import decode_sm90  # noqa: E402

FP8 = torch.float8_e4m3fn
DEV = "cuda"
BATCH = 128
SM_SCALE = 192**-0.5
SETTLE_MS = 200.0  # replays before each timing, so that every row is timed in its own sustained state
BACKEND_ENV = "FLASHINFER_MOE_MLA_BACKEND"
FP8_SCALE = 1.0 / 64


def flashmla():
    try:
        import flash_mla

        return flash_mla
    except ImportError:
        return None


class Cache:
    """A shuffled paged pool holding ``lens`` tokens, bf16 or FP8, with its block table."""

    def __init__(self, lens: list[int], page: int, dtype: torch.dtype, gen: torch.Generator):
        pages_of = [-(-n // page) for n in lens]
        num_pages = sum(pages_of)
        perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
        self.block_table = torch.zeros(len(lens), max(pages_of), dtype=torch.int32)
        start = 0
        for b, n in enumerate(pages_of):
            self.block_table[b, :n] = perm[start : start + n]
            start += n
        self.block_table = self.block_table.to(DEV)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        kv = torch.empty(num_pages, page, 576, dtype=torch.bfloat16, device=DEV).normal_()
        self.kv = _to_fp8(kv) if dtype == FP8 else kv
        self.bytes = sum(lens) * 576 * self.kv.element_size()
        self.lens = lens
        self.page = page

    def gathered(self) -> torch.Tensor | None:
        """`[B, L, 576]` bf16 (equal lengths only)."""
        if len(set(self.lens)) != 1:
            return None
        b, length = len(self.lens), self.lens[0]
        pos = torch.arange(length, device=DEV)
        rows = self.block_table[:, pos // self.page].long() * self.page + (pos % self.page)
        return self.kv.view(-1, 576)[rows.reshape(-1)].reshape(b, length, 576)


def _to_fp8(kv: torch.Tensor) -> torch.Tensor:
    out = torch.empty(kv.shape, dtype=FP8, device=DEV)
    for p0 in range(0, kv.shape[0], 1024):
        out[p0 : p0 + 1024] = (kv[p0 : p0 + 1024].float() / FP8_SCALE).to(FP8)
    return out


def queries(heads: int, s_q: int, gen_seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    q_nope = torch.randn(BATCH, s_q, heads, 512, generator=g, device=DEV, dtype=torch.bfloat16)
    q_pe = torch.randn(BATCH, s_q, heads, 64, generator=g, device=DEV, dtype=torch.bfloat16)
    return q_nope, q_pe


@contextlib.contextmanager
def forced_path(path: str):
    """``triton``: the Triton kernel where the default would take the CUDA one (``FLASHINFER_MOE_MLA_BACKEND``,
    read by the plan and at launch, so a graph captured inside keeps the choice); ``old``: Triton with the
    gathered pointer loads where it would take the TMA ones (``TMA_CONFIGS``, read at launch too); ``fp8_bf16``:
    FP8 pages widened to bf16 (``FP8_F16_MATH`` off); ``wide``: FP8 pages of up to 32 rows on the 64-row CUDA
    kernel instead of the narrow one (``decode_sm90.NARROW_MAX_ROWS`` 0); ``cpasync``: the 64-row CUDA kernel's
    tiles by cp.async token rows where it would take them by TMA (``decode_sm90.TMA_MIN_PAGE`` 0); ``tma_all``: by
    TMA at every page size (``TMA_MIN_PAGE`` 1); ``one_stage``: the narrow kernel with one fp16 stage
    (``decode_sm90.NARROW_STAGES`` 1, ``NARROW_RS`` off); ``f16_stages``: the narrow kernel with its fp16 stages
    instead of the one without images (``NARROW_RS`` off); ``pv16``: that kernel's values' product in fp16 at 17-32
    rows instead of FP8 (``decode_sm90.NARROW_PV8`` off); ``new``: the default."""
    saved, saved_f16, saved_env = D.TMA_CONFIGS, DK.FP8_F16_MATH, os.environ.get(BACKEND_ENV)
    saved_narrow, saved_tma = decode_sm90.NARROW_MAX_ROWS, decode_sm90.TMA_MIN_PAGE
    saved_stages, saved_rs, saved_pv8 = decode_sm90.NARROW_STAGES, decode_sm90.NARROW_RS, decode_sm90.NARROW_PV8
    if path in ("old", "triton"):
        os.environ[BACKEND_ENV] = "triton"
    if path == "old":
        D.TMA_CONFIGS = {}
    if path == "fp8_bf16":
        DK.FP8_F16_MATH = False
    if path == "wide":
        decode_sm90.NARROW_MAX_ROWS = 0
    if path == "one_stage":
        decode_sm90.NARROW_STAGES = 1
    if path in ("one_stage", "f16_stages"):
        decode_sm90.NARROW_RS = False
    if path == "pv16":
        decode_sm90.NARROW_PV8 = False
    if path in ("cpasync", "tma_all"):
        decode_sm90.TMA_MIN_PAGE = 0 if path == "cpasync" else 1
    try:
        yield
    finally:
        D.TMA_CONFIGS, DK.FP8_F16_MATH = saved, saved_f16
        decode_sm90.NARROW_MAX_ROWS, decode_sm90.TMA_MIN_PAGE = saved_narrow, saved_tma
        decode_sm90.NARROW_STAGES, decode_sm90.NARROW_RS, decode_sm90.NARROW_PV8 = saved_stages, saved_rs, saved_pv8
        if saved_env is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved_env


def time_ours(cache: Cache, q_nope, q_pe, config: dict | None = None, path: str = "new") -> float:
    """Median us of plan + decode; ``config``: a Triton kernel configuration (``--sweep``), else the default
    dispatch under ``path`` (``forced_path``)."""
    with forced_path("triton" if config is not None else path):
        return _time_ours(cache, q_nope, q_pe, config)


def _time_ours(cache: Cache, q_nope, q_pe, config: dict | None) -> float:
    s_q, heads = q_nope.shape[1], q_nope.shape[2]
    scale = torch.tensor([FP8_SCALE], device=DEV) if cache.kv.dtype == FP8 else None
    out = torch.empty_like(q_nope)
    if config is None:
        plan = D.mla_decode_plan(cache.seq_lens, s_q, heads, kv_dtype=cache.kv.dtype)

        def fn(i):
            D.mla_decode_plan(cache.seq_lens, s_q, heads, out=plan)
            D.mla_decode(
                q_nope, q_pe, cache.kv, cache.block_table, cache.seq_lens, SM_SCALE, kv_scale=scale, plan=plan, out=out
            )
    else:
        rows = s_q * heads
        block_m = D.block_m_for(rows)
        programs = max(1, D._sm_count(0) * config["ctas_per_sm"] // -(-rows // block_m))
        plan = D.make_plan(cache.seq_lens, s_q, heads, programs, block_m)
        kv = cache.kv

        def fn(i):
            torch.ops.flashinfer_moe.mla_decode_plan_(cache.seq_lens, plan.sched, programs)
            torch.ops.flashinfer_moe.mla_decode_(
                q_nope,
                q_pe,
                kv,
                kv[..., 512:],
                cache.block_table,
                cache.seq_lens,
                plan.sched,
                plan.part_out,
                plan.part_lse,
                out,
                None,
                SM_SCALE,
                scale,
                1.0,
                True,
                programs,
                block_m,
                config["BLOCK_N"],
                config["num_warps"],
                config["num_stages"],
                config.get("PREFETCH", 0),
                1 + config.get("SWAP", 0) if config.get("TMA", 0) else 0,
            )

    return time_graph(fn, calls=10, reps=10, settle_ms=SETTLE_MS)


def time_flashmla(fm, cache: Cache, q_nope, q_pe) -> float | None:
    if fm is None or cache.page != 64 or cache.kv.dtype != torch.bfloat16:
        return None
    q = torch.cat([q_nope, q_pe], dim=-1)
    k_cache = cache.kv.unsqueeze(2)  # [P, 64, 1, 576]

    def fn(i):
        meta, _ = fm.get_mla_metadata()
        fm.flash_mla_with_kvcache(
            q, k_cache, cache.block_table, cache.seq_lens, 512, meta, None, softmax_scale=SM_SCALE, causal=True
        )

    try:
        return time_graph(fn, calls=10, reps=10, settle_ms=SETTLE_MS)
    except Exception as e:  # a FlashMLA build that does not run here is a missing baseline, not a failure
        print(f"flashmla failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


_copy_us: dict[int, float] = {}


def time_copy(nbytes: int) -> float:
    if nbytes not in _copy_us:
        src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        _copy_us[nbytes] = time_graph(lambda i: dst.copy_(src), calls=10, reps=10, settle_ms=SETTLE_MS)
    return _copy_us[nbytes]


def varlen(gen: torch.Generator) -> list[int]:
    return torch.randint(1, 16385, (BATCH,), generator=gen).tolist()


def bench(args) -> list[dict]:
    fm = None if args.no_flashmla else flashmla()
    print(f"# {torch.cuda.get_device_name()}; FlashMLA {'found' if fm else 'not found'}", flush=True)
    heads_list = [int(h) for h in args.heads.split(",")]
    s_q_list = [int(s) for s in args.s_q.split(",")]
    lengths = args.sk.split(",") if not args.quick else ["4096", "varlen"]
    paths = args.paths.split(",")
    print(f"# paths {paths} (the last one's time is the row's)", flush=True)
    if args.sdpa:
        print(f"# torch {torch.__version__}; SDPA on a small case against the float64 reference:", flush=True)
        for case, verdict in sdpa_self_check().items():
            print(f"#   {case}: {verdict}", flush=True)
    header = (
        f"{'cache':>5} {'page':>4} {'s_k':>7} {'h_q':>4} {'s_q':>3} {'us':>8} {'GB/s':>6} {'TFLOP/s':>7} "
        f"{'flashmla':>8} {'x fmla':>6} {'sdpa':>8} {'x sdpa':>6} {'copy us':>7} {'of copy':>7}  sdpa backend"
    )
    print(header, flush=True)
    rows = []
    for s_k in lengths:
        lens = varlen(torch.Generator().manual_seed(1)) if s_k == "varlen" else [int(s_k)] * BATCH
        for cache_name in args.caches.split(","):
            dtype = FP8 if cache_name == "fp8" else torch.bfloat16
            for page in [int(p) for p in args.pages.split(",")]:
                cache = Cache(lens, page, dtype, torch.Generator().manual_seed(0))
                gathered = cache.gathered() if args.sdpa and dtype == torch.bfloat16 and page == 64 else None
                copy_us = time_copy(cache.bytes)
                for heads, s_q in itertools.product(heads_list, s_q_list):
                    q_nope, q_pe = queries(heads, s_q)
                    # Ours and FlashMLA in turn, ``--rounds`` times, medians: the board's sustained clocks drift.
                    samples: dict[str, list[float]] = {}
                    for _ in range(args.rounds):
                        for path in paths:
                            samples.setdefault(path, []).append(time_ours(cache, q_nope, q_pe, path=path))
                        f_round = time_flashmla(fm, cache, q_nope, q_pe)
                        if f_round is not None:
                            samples.setdefault("flashmla", []).append(f_round)
                    path_us = {path: statistics.median(samples[path]) for path in paths}
                    us = path_us[paths[-1]]
                    f_us = statistics.median(samples["flashmla"]) if "flashmla" in samples else None
                    sdpa = time_sdpa(cache, gathered, q_nope, q_pe)
                    s_us = sdpa.get("sdpa_us")
                    flops = 2 * s_q * heads * (576 + 512) * sum(lens)
                    row = dict(
                        cache=cache_name,
                        page=page,
                        s_k=s_k,
                        h_q=heads,
                        s_q=s_q,
                        us=us,
                        gbps=cache.bytes / us / 1e3,
                        tflops=flops / us / 1e6,
                        flashmla_us=f_us,
                        sdpa_us=s_us,
                        copy_us=copy_us,
                        bytes=cache.bytes,
                        us_rounds=samples[paths[-1]],
                        flashmla_us_rounds=samples.get("flashmla"),
                        **{f"{path}_us": t for path, t in path_us.items() if len(paths) > 1},
                        **{k: v for k, v in sdpa.items() if k != "sdpa_us"},
                    )
                    row["of_copy"] = copy_us / us
                    rows.append(row)
                    fmla = f"{f_us:8.1f} {f_us / us:6.2f}" if f_us else f"{'-':>8} {'-':>6}"
                    s_col = f"{s_us:8.1f} {s_us / us:6.2f}" if s_us else f"{'-':>8} {'-':>6}"
                    s_by = ""
                    if s_us:
                        s_by = f"{row['sdpa_backend']} (default {row['sdpa_default']}), check {row['sdpa_check']}"
                        s_by += f" (rel err {row['sdpa_rel_err']:.1e})"
                    elif sdpa:
                        s_by = sdpa.get("sdpa_note") or "; ".join(f"{k} {v}" for k, v in sdpa["sdpa_backends"].items())
                    print(
                        f"{cache_name:>5} {page:>4} {s_k:>7} {heads:>4} {s_q:>3} {us:8.1f} {row['gbps']:6.0f} "
                        f"{row['tflops']:7.1f} {fmla} {s_col} {copy_us:7.1f} {row['of_copy']:7.2f}  {s_by}",
                        flush=True,
                    )
                    if len(paths) > 1:
                        print(
                            "      paths: "
                            + ", ".join(f"{p} {t:.1f} us {cache.bytes / t / 1e3:.0f} GB/s" for p, t in path_us.items())
                            + f"; {paths[0]} / {paths[-1]} = {path_us[paths[0]] / us:.2f}x",
                            flush=True,
                        )
                del cache, gathered
                torch.cuda.empty_cache()
    return rows


SWEEP = [
    dict(BLOCK_N=32, num_warps=8, num_stages=2, ctas_per_sm=1),
    dict(BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1),
    dict(BLOCK_N=64, num_warps=8, num_stages=1, ctas_per_sm=1, PREFETCH=1),
    dict(BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2),
    dict(BLOCK_N=64, num_warps=4, num_stages=1, ctas_per_sm=2, PREFETCH=1),
    dict(BLOCK_N=64, num_warps=16, num_stages=1, ctas_per_sm=1, PREFETCH=1),
    dict(BLOCK_N=32, num_warps=4, num_stages=2, ctas_per_sm=2),
]


TMA_SWEEP = [
    dict(TMA=1, SWAP=1, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(TMA=1, SWAP=1, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(TMA=1, SWAP=1, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(TMA=1, SWAP=1, BLOCK_N=32, num_warps=4, num_stages=4),
    dict(TMA=1, SWAP=0, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(TMA=1, SWAP=0, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(TMA=1, SWAP=0, BLOCK_N=32, num_warps=8, num_stages=3),
]


def sweep(args) -> list[dict]:
    classes = [tuple(int(x) for x in c.split("x")) for c in args.classes.split(",")]
    configs = SWEEP
    if args.tma:
        configs = [json.loads(c) for c in args.configs] if args.configs else TMA_SWEEP
        # The public plan's program count (CONFIGS' programs per SM), which TMA_CONFIGS leaves as it is.
        configs = [dict(c, ctas_per_sm=c.get("ctas_per_sm", 0)) for c in configs]
    rows = []
    for cache_name in args.caches.split(","):
        dtype = FP8 if cache_name == "fp8" else torch.bfloat16
        cache = Cache([8192] * BATCH, 64, dtype, torch.Generator().manual_seed(0))
        for heads, s_q in classes:
            q_nope, q_pe = queries(heads, s_q)
            best = None
            block_m = D.block_m_for(heads * s_q)
            for config in configs:
                if not config.get("ctas_per_sm", 1):
                    config = dict(config, ctas_per_sm=D.CONFIGS[(block_m, False)]["ctas_per_sm"])
                try:
                    us = time_ours(cache, q_nope, q_pe, config)
                except Exception as e:  # out of shared memory, registers: the config does not fit
                    print(f"{cache_name} h{heads} s{s_q} {config}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                rows.append(dict(cache=cache_name, h_q=heads, s_q=s_q, us=us, gbps=cache.bytes / us / 1e3, **config))
                print(
                    f"{cache_name} h{heads} s{s_q} BLOCK_M {D.block_m_for(heads * s_q)} {config}: {us:.1f} us "
                    f"{cache.bytes / us / 1e3:.0f} GB/s",
                    flush=True,
                )
                if best is None or us < best[0]:
                    best = (us, config)
            if best:
                print(
                    f"BEST {cache_name} h{heads} s{s_q} (BLOCK_M {D.block_m_for(heads * s_q)}): {best[1]} "
                    f"{best[0]:.1f} us",
                    flush=True,
                )
        del cache
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| cache | page | s_k | h_q | s_q | us | GB/s | TFLOP/s | FlashMLA us | FlashMLA / ours | SDPA us "
        "| SDPA / ours | SDPA backend | copy us | copy / ours |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        f = f"{r['flashmla_us']:.1f} | {r['flashmla_us'] / r['us']:.2f}x" if r["flashmla_us"] else "- | -"
        s = f"{r['sdpa_us']:.1f} | {r['sdpa_us'] / r['us']:.2f}x | {r['sdpa_backend']}" if r["sdpa_us"] else "- | - | -"
        lines.append(
            f"| {r['cache']} | {r['page']} | {r['s_k']} | {r['h_q']} | {r['s_q']} | {r['us']:.1f} | "
            f"{r['gbps']:.0f} | {r['tflops']:.1f} | {f} | {s} | {r['copy_us']:.1f} | {r['of_copy']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="64,1")
    parser.add_argument("--caches", default="bf16,fp8")
    parser.add_argument("--heads", default="16,32,64,128")
    parser.add_argument("--s-q", default="1,2")
    parser.add_argument("--sk", default="4096,8192,16384,varlen", help="s_k values (and/or varlen)")
    parser.add_argument("--quick", action="store_true", help="s_k 4096 and varlen only")
    parser.add_argument("--rounds", type=int, default=3, help="timings per row of ours and FlashMLA, in turn (median)")
    parser.add_argument("--no-flashmla", action="store_true")
    parser.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--sweep", action="store_true", help="time kernel configurations instead of the grid")
    parser.add_argument("--classes", default="16x1,16x2,64x1,128x2", help="sweep: h_q x s_q classes")
    parser.add_argument("--tma", action="store_true", help="sweep: the TMA tile-load configurations")
    parser.add_argument("--configs", nargs="*", help="sweep --tma: configurations as JSON objects instead")
    parser.add_argument(
        "--paths",
        default="new",
        help="triton (Triton kernel), old (Triton, gathered loads), fp8_bf16 (FP8 widened to bf16), wide (FP8 up "
        "to 32 rows on the 64-row CUDA kernel), one_stage / f16_stages (FP8 up to 32 rows on the narrow kernel with "
        "one / two fp16 stages), pv16 (its values' product in fp16 at 17-32 rows), new (default); see forced_path",
    )
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    rows = sweep(args) if args.sweep else bench(args)
    if args.markdown and not args.sweep:
        args.markdown.write_text(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
