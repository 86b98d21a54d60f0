"""Benchmark of the NVFP4-weight (W4A16) grouped GEMMs and fused_moe(quant="nvfp4") against our FP8 block-scaled
ones on the same shapes, in one run.

    python launch/bench_nvfp4.py [--tables masked,contiguous,fused] [--sweep] [--json FILE] [--markdown FILE]
                                 [--sass DIR]

Tables:
- masked (decode): 32 experts x {8, 16, 64, 128} rows, (N, K) = (4096, 7168) and (7168, 2048), every slot in use:
  microseconds, and effective weight bandwidth (NVFP4: the 4-bit bytes; FP8: its bytes) for NVFP4, FP8 block
  (default backend) and FP8 block with packed weights (``pack_fp8_block_weights``).
- contiguous (prefill): 8 x 4096 and 32 x 512 rows at both (N, K): TFLOP/s.
- fused: ``fused_moe`` for a DeepSeek-V3 layer (H 7168, I 2048, top-8; E = 256, and E = 64 as one EP4 rank sees
  it), T in {1, 16, 128, 4096}: microseconds, NVFP4 against FP8 block (plain and packed weights).

--sweep first times a few tile configs per shape class of ``gemm_nvfp4_kernel.CONFIGS`` (the table's own first),
checks each one's output against the first's, prints the fastest per class as a line to paste into the table,
and makes the fastest the ones the tables below use (the JSON records both); --sweep-kperm does the same on
K-permuted weights (``pack_nvfp4_weights``) for ``CONFIGS_KPERM``. Every table also times NVFP4 on K-permuted
weights (``nvfp4_kperm``: on Hopper the CUDA kernel, moe/gemm_nvfp4_sm90.py) and the same on the Triton kernel
alone (``nvfp4_kperm_triton``), and weights packed with split bits the same ways (``nvfp4_split*``). --sass DIR
writes the SASS (and TTGIR/PTX) of every compiled NVFP4 kernel and prints its count of wgmma (HGMMA)
instructions.

Times are medians of CUDA-graph replays, NVFP4 and FP8 timed in turn, each after a short settle of its own
replays (an H200 running these kernels is power-limited; see timing.time_graph).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_graph  # noqa: E402

if __name__ == "__main__":
    require_gpus(1)

from bench_gemm import _fp8_rows, _fp8_weights, _layout, tflops  # noqa: E402
from nvfp4_sweep_space import SWEEP  # noqa: E402

import flashinfer_moe as fm  # noqa: E402
from flashinfer_moe.moe import gemm_nvfp4_kernel as kernel  # noqa: E402

DEV = "cuda"
FP8 = torch.float8_e4m3fn
SETTLE_MS = 100.0
ROUNDS = 2


def nvfp4_weights(e: int, n: int, k: int, gated: bool = False):
    """Random codes, block scales around 1 and global scales that keep unit-size outputs (no quantizer pass)."""
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEV)
    s = (torch.rand(e, n, k // 16, device=DEV) + 0.5).to(FP8)
    gs = torch.full((e, 2) if gated else (e,), 1.0 / (3 * k**0.5), device=DEV)
    return w, s, gs


@contextlib.contextmanager
def _triton_only():
    """Keeps a call on the Triton kernel (it would take the Hopper CUDA kernel of moe/gemm_nvfp4_sm90.py)."""
    old = os.environ.get("FLASHINFER_MOE_GEMM_BACKEND")
    os.environ["FLASHINFER_MOE_GEMM_BACKEND"] = "triton"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLASHINFER_MOE_GEMM_BACKEND"]
        else:
            os.environ["FLASHINFER_MOE_GEMM_BACKEND"] = old


def _on_triton(fn):
    def call(i):
        with _triton_only():
            return fn(i)

    return call


def timed(fns: dict, calls: int = 6, reps: int = 7) -> dict[str, float]:
    """Median over ROUNDS of ``time_graph`` for each ``name -> fn(i)``, timed in turn."""
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(time_graph(fn, calls=calls, reps=reps, settle_ms=SETTLE_MS))
    return {name: statistics.median(v) for name, v in samples.items()}


# ------------------------------------------------------------------------------------------------- sweep


def sweep(rows: list[dict], kperm: bool = False) -> dict[str, dict]:
    """Times the candidates of every class (on K-permuted weights with ``kperm``); returns the fastest config
    per class."""
    best = {}
    table = kernel.CONFIGS_KPERM if kperm else {}
    for cls, ((kind, e, per_expert, n, k, gated), candidates) in SWEEP.items():
        w, s, gs = nvfp4_weights(e, n, k, gated)
        if kperm:
            w = fm.pack_nvfp4_weights(w, split_bits=False).data
        counts = torch.full((e,), per_expert, dtype=torch.int32, device=DEV)
        a = torch.randn(e * per_expert, k, device=DEV, dtype=torch.bfloat16)
        offsets = None if kind == "masked" else torch.arange(e, dtype=torch.int32, device=DEV) * per_expert
        out_n = n // 2 if gated else n
        capacity = per_expert if kind == "masked" else 2**31 - 1
        first = table.get(cls, kernel.CONFIGS[cls])
        configs = [dict(first, SWAP_AB=first.get("SWAP_AB", True))] + candidates
        want = None
        results = []
        for cfg in configs:
            out = torch.empty(e * per_expert, out_n, device=DEV, dtype=torch.bfloat16)

            def call(i, cfg=cfg, out=out):
                kernel.launch(
                    a,
                    w,
                    s,
                    gs,
                    out,
                    counts,
                    offsets,
                    act=int(gated),
                    alpha=1.702,
                    limit=7.0,
                    capacity=capacity,
                    config=cfg,
                    kperm=kperm,
                )

            try:
                call(0)
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not compile (shared memory, registers) is skipped
                print(f"sweep {cls} {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            if want is None:
                want = out.float().clone()
            err = ((out.float() - want).norm() / want.norm()).item()
            us = time_graph(call, calls=6, reps=5, settle_ms=SETTLE_MS)
            flops = 2.0 * e * per_expert * (2 * out_n if gated else n) * k
            results.append((us, cfg))
            ok = err < 1e-2
            rows.append(
                dict(
                    table="sweep",
                    cls=cls,
                    kperm=kperm,
                    config=json.dumps(cfg),
                    us=us,
                    tflops=tflops(flops, us),
                    rel_err_vs_first=err,
                    ok=ok,
                )
            )
            print(
                f"sweep {cls}{' kperm' if kperm else ''} {cfg}: {us:.1f} us, {tflops(flops, us):.0f} TFLOP/s, err {err:.1e}",
                flush=True,
            )
            if not ok:
                results.pop()
        if results:
            us, cfg = min(results, key=lambda r: r[0])
            best[cls] = cfg
            print(
                f"BEST {cls}{' kperm' if kperm else ''}: {us:.1f} us (table's: {results[0][0]:.1f} us): {json.dumps(cfg)}",
                flush=True,
            )
    return best


# ------------------------------------------------------------------------------------------------ tables


def masked_rows(rows: list[dict]) -> None:
    e = 32
    for n, k in ((4096, 7168), (7168, 2048)):
        sets = 2
        nv = [nvfp4_weights(e, n, k) for _ in range(sets)]
        f8 = [_fp8_weights(e, n, k) for _ in range(sets)]
        packed = [fm.pack_fp8_block_weights(w) for w, _ in f8]
        nvp = {
            name: [(fm.pack_nvfp4_weights(w, split_bits=split), s, gs) for w, s, gs in nv]
            for name, split in (("kperm", False), ("split", True))
        }
        for per_expert in (8, 16, 64, 128):
            a = torch.randn(e, per_expert, k, device=DEV, dtype=torch.bfloat16)
            aq, a_s = _fp8_rows(e * per_expert, k)
            aq, a_s = aq.view(e, per_expert, k), a_s.view(e, per_expert, -1)
            counts = torch.full((e,), per_expert, dtype=torch.int32, device=DEV)
            out = torch.empty(e, per_expert, n, dtype=torch.bfloat16, device=DEV)
            fns = {"nvfp4": lambda i: fm.grouped_gemm_nvfp4_masked(a, *nv[i % sets], counts, validate=False, out=out)}
            for name, ws in nvp.items():  # K-permuted and split bits: default routing, Triton alone, CUDA lifted
                call = lambda i, ws=ws: fm.grouped_gemm_nvfp4_masked(a, *ws[i % sets], counts, validate=False, out=out)  # noqa: E731
                fns |= {f"nvfp4_{name}": call, f"nvfp4_{name}_triton": _on_triton(call)}
            fns["fp8"] = lambda i: fm.grouped_gemm_fp8_block_masked(aq, a_s, *f8[i % sets], counts, out=out)
            fns["fp8_packed"] = lambda i: fm.grouped_gemm_fp8_block_masked(
                aq, a_s, packed[i % sets], f8[i % sets][1], counts, out=out
            )
            t = timed(fns)
            fp8_best = min(t["fp8"], t["fp8_packed"])
            rows.append(
                dict(
                    table="masked",
                    experts=e,
                    rows=per_expert,
                    n=n,
                    k=k,
                    nvfp4_us=t["nvfp4"],
                    nvfp4_kperm_us=t["nvfp4_kperm"],
                    nvfp4_kperm_triton_us=t["nvfp4_kperm_triton"],
                    nvfp4_split_us=t["nvfp4_split"],
                    nvfp4_split_triton_us=t["nvfp4_split_triton"],
                    fp8_us=t["fp8"],
                    fp8_packed_us=t["fp8_packed"],
                    speedup_vs_fp8_best=fp8_best / t["nvfp4"],
                    kperm_speedup_vs_fp8_best=fp8_best / t["nvfp4_kperm"],
                    split_speedup_vs_fp8_best=fp8_best / t["nvfp4_split"],
                    nvfp4_weight_tb_s=e * n * k / 2 / (t["nvfp4"] * 1e-6) / 1e12,
                    nvfp4_kperm_weight_tb_s=e * n * k / 2 / (t["nvfp4_kperm"] * 1e-6) / 1e12,
                    nvfp4_with_scales_tb_s=e * n * (k / 2 + k / 16) / (t["nvfp4"] * 1e-6) / 1e12,
                    fp8_weight_tb_s=e * n * k / (fp8_best * 1e-6) / 1e12,
                    nvfp4_tflops=tflops(2.0 * e * per_expert * n * k, t["nvfp4"]),
                )
            )
            print(rows[-1], flush=True)


def contiguous_rows(rows: list[dict]) -> None:
    for e, per_expert, n, k in (
        (8, 4096, 4096, 7168),
        (8, 4096, 7168, 2048),
        (32, 512, 4096, 7168),
        (32, 512, 7168, 2048),
    ):
        m = e * per_expert
        layout = _layout([per_expert] * e)
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        aq, a_s = _fp8_rows(m, k)
        w, s, gs = nvfp4_weights(e, n, k)
        wp, wb = fm.pack_nvfp4_weights(w, split_bits=False), fm.pack_nvfp4_weights(w, split_bits=True)
        w8, s8 = _fp8_weights(e, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        kperm = lambda i: fm.grouped_gemm_nvfp4_contiguous(a, wp, s, gs, layout, validate=False, out=out)  # noqa: E731
        split = lambda i: fm.grouped_gemm_nvfp4_contiguous(a, wb, s, gs, layout, validate=False, out=out)  # noqa: E731
        t = timed(
            {
                "nvfp4": lambda i: fm.grouped_gemm_nvfp4_contiguous(a, w, s, gs, layout, validate=False, out=out),
                "nvfp4_kperm": kperm,
                "nvfp4_split": split,
                "nvfp4_kperm_triton": _on_triton(kperm),
                "nvfp4_split_triton": _on_triton(split),
                "fp8": lambda i: fm.grouped_gemm_fp8_block_contiguous(aq, a_s, w8, s8, layout, out=out),
            },
            calls=3,
            reps=5,
        )
        flops = 2.0 * m * n * k
        rows.append(
            dict(
                table="contiguous",
                experts=e,
                rows=per_expert,
                n=n,
                k=k,
                nvfp4_us=t["nvfp4"],
                nvfp4_kperm_us=t["nvfp4_kperm"],
                fp8_us=t["fp8"],
                nvfp4_tflops=tflops(flops, t["nvfp4"]),
                nvfp4_kperm_tflops=tflops(flops, t["nvfp4_kperm"]),
                nvfp4_split_tflops=tflops(flops, t["nvfp4_split"]),
                nvfp4_kperm_triton_tflops=tflops(flops, t["nvfp4_kperm_triton"]),
                nvfp4_split_triton_tflops=tflops(flops, t["nvfp4_split_triton"]),
                fp8_tflops=tflops(flops, t["fp8"]),
                nvfp4_vs_fp8=t["fp8"] / t["nvfp4"],
                kperm_vs_fp8=t["fp8"] / t["nvfp4_kperm"],
                split_vs_fp8=t["fp8"] / t["nvfp4_split"],
            )
        )
        print(rows[-1], flush=True)


H, INTER, TOP_K = 7168, 2048, 8  # DeepSeek-V3's MoE layer


def deepseek_layer(
    e: int, names: tuple[str, ...] = ("nvfp4", "nvfp4_kperm", "nvfp4_split", "fp8", "fp8_packed")
) -> dict[str, dict]:
    """``fused_moe`` arguments (``w13``, ``w2`` and the keywords) of a DeepSeek-V3 layer with ``e`` experts, for
    each of ``names``: NVFP4 plain, K-permuted (``nvfp4_kperm``) and split bits (``nvfp4_split``); FP8 block with
    plain and packed weights (``fp8``, ``fp8_packed``)."""
    args = {}
    if any(n.startswith("nvfp4") for n in names):
        w13, s13, g13 = nvfp4_weights(e, 2 * INTER, H, gated=True)
        w2, s2, g2 = nvfp4_weights(e, H, INTER)
        kw = dict(quant="nvfp4", w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)
        packings = {"nvfp4": None, "nvfp4_kperm": False, "nvfp4_split": True}
        for name in names:
            if name in packings:
                split = packings[name]
                pack = (
                    (lambda w: w)
                    if split is None
                    else (lambda w, split=split: fm.pack_nvfp4_weights(w, split_bits=split))
                )
                args[name] = dict(kw, w13=pack(w13), w2=pack(w2))
    if any(n.startswith("fp8") for n in names):
        f13, fs13 = _fp8_weights(e, 2 * INTER, H)
        f2, fs2 = _fp8_weights(e, H, INTER)
        kw = dict(quant="fp8_block", w13_scale=fs13, w2_scale=fs2)
        if "fp8" in names:
            args["fp8"] = dict(kw, w13=f13, w2=f2)
        if "fp8_packed" in names:
            args["fp8_packed"] = dict(
                kw, w13=fm.pack_fp8_block_weights(f13, gated=True), w2=fm.pack_fp8_block_weights(f2)
            )
    return {name: args[name] for name in names}


def moe_call(x, weights, ids, out, kw: dict):
    """``fn(i)`` running ``fused_moe`` on ``x`` with the arguments ``kw`` (``deepseek_layer``'s)."""
    rest = {k: v for k, v in kw.items() if k not in ("w13", "w2")}
    return lambda i: fm.fused_moe(x, kw["w13"], kw["w2"], weights, ids, out=out, validate=False, **rest)


def fused_rows(rows: list[dict]) -> None:
    for e in (256, 64):
        args = deepseek_layer(e)
        for t in (1, 16, 128, 4096):
            x = torch.randn(t, H, device=DEV, dtype=torch.bfloat16)
            weights, ids = fm.route(torch.randn(t, e, device=DEV), TOP_K)
            out = torch.empty(t, H, dtype=torch.bfloat16, device=DEV)
            call = {name: moe_call(x, weights, ids, out, kw) for name, kw in args.items()}
            times = timed(
                {
                    "nvfp4": call["nvfp4"],
                    "nvfp4_kperm": call["nvfp4_kperm"],
                    "nvfp4_kperm_triton": _on_triton(call["nvfp4_kperm"]),
                    "nvfp4_split": call["nvfp4_split"],
                    "nvfp4_split_triton": _on_triton(call["nvfp4_split"]),
                    "fp8": call["fp8"],
                    "fp8_packed": call["fp8_packed"],
                },
                calls=4,
                reps=5,
            )
            active = int((torch.bincount(ids.reshape(-1), minlength=e) > 0).sum())
            fp8_best = min(times["fp8"], times["fp8_packed"])
            rows.append(
                dict(
                    table="fused",
                    experts=e,
                    tokens=t,
                    nvfp4_us=times["nvfp4"],
                    nvfp4_kperm_us=times["nvfp4_kperm"],
                    nvfp4_kperm_triton_us=times["nvfp4_kperm_triton"],
                    nvfp4_split_us=times["nvfp4_split"],
                    nvfp4_split_triton_us=times["nvfp4_split_triton"],
                    fp8_us=times["fp8"],
                    fp8_packed_us=times["fp8_packed"],
                    speedup_vs_fp8_best=fp8_best / times["nvfp4"],
                    kperm_speedup_vs_fp8_best=fp8_best / times["nvfp4_kperm"],
                    split_speedup_vs_fp8_best=fp8_best / times["nvfp4_split"],
                    active_experts=active,
                    nvfp4_weight_tb_s=active * 3 * H * INTER / 2 / (times["nvfp4"] * 1e-6) / 1e12,
                )
            )
            print(rows[-1], flush=True)


def check_sass(directory: Path) -> None:
    """SASS, TTGIR and PTX of every compiled NVFP4 kernel, and its wgmma count."""
    directory.mkdir(parents=True, exist_ok=True)
    compiled = [c for cache in kernel.grouped_gemm_nvfp4_kernel.device_caches.values() for c in cache[0].values()]
    summary = []
    for i, c in enumerate(compiled):
        cubin = directory / f"nvfp4_{i}.cubin"
        cubin.write_bytes(c.asm["cubin"])
        for ir in ("ttgir", "ptx"):
            if ir in c.asm:
                (directory / f"nvfp4_{i}.{ir}").write_text(c.asm[ir])
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
        (directory / f"nvfp4_{i}.sass").write_text(sass)
        counts = {op: sass.count(op) for op in ("HGMMA", "HMMA", "LDS", "STS", "LDSM")}
        sample = next((line.strip() for line in sass.splitlines() if "HGMMA" in line), "")
        line = (
            f"kernel {i}: {c.metadata.num_warps} warps, {c.metadata.num_stages} stages, {c.metadata.shared} B smem,"
            f" {counts}; first HGMMA: {sample}"
        )
        summary.append(line)
        print(line, flush=True)
    (directory / "summary.txt").write_text("\n".join(summary) + "\n")


def markdown(rows: list[dict], tables: list[str]) -> str:
    lines = []
    for table in tables:
        sel = [r for r in rows if r["table"] == table]
        if not sel:
            continue
        keys = [k for k in sel[0] if k != "table"]
        lines += [f"### {table}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in sel:
            lines.append(
                "| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="masked,contiguous,fused")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-kperm", action="store_true", help="sweep the configs for K-permuted weights")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sass", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    tables = [t for t in args.tables.split(",") if t]
    default_configs = {cls: dict(cfg) for cls, cfg in kernel.CONFIGS.items()}
    default_kperm = {cls: dict(cfg) for cls, cfg in kernel.CONFIGS_KPERM.items()}
    if args.sweep:
        best = sweep(rows)
        kernel.CONFIGS.update(best)  # the tables below use the winners
        print("CONFIGS = " + json.dumps(kernel.CONFIGS, indent=1), flush=True)
    if args.sweep_kperm:
        best = sweep(rows, kperm=True)
        kernel.CONFIGS_KPERM.update(best)
        print("CONFIGS_KPERM = " + json.dumps(kernel.CONFIGS_KPERM, indent=1), flush=True)
    runners = {"masked": masked_rows, "contiguous": contiguous_rows, "fused": fused_rows}
    for table in tables:
        try:
            runners[table](rows)
        except Exception as exc:  # keep the other tables and the JSON
            print(f"table {table} failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    if args.sass:
        check_sass(args.sass)
    text = markdown(rows, ["sweep", *tables])
    print(text, flush=True)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        meta = dict(
            table="meta",
            device=torch.cuda.get_device_name(),
            default_configs=default_configs,
            used_configs=kernel.CONFIGS,
            default_kperm_configs=default_kperm,
            used_kperm_configs=kernel.CONFIGS_KPERM,
        )
        args.json.write_text(json.dumps([meta, *rows], indent=1))


if __name__ == "__main__":
    main()
