"""The plots of docs/perf.md, drawn from the benchmarks' JSON output. Needs matplotlib (``pip install -e '.[bench]'``).

    python launch/plot_perf.py [--data docs/data] [--out docs/img]

Reads (each written by the benchmark named, with ``--json FILE``):
  bench_routing.json   launch/bench_routing.py   ->  routing.png
  bench_permute.json   launch/bench_permute.py   ->  permute.png
  bench_gemm.json      launch/bench_gemm.py      ->  gemm.png, fused_moe.png
  bench_ep.json        launch/bench_ep.py        ->  ep_layer.png

Each title names the GPU and the date of the run: from the JSON where it records them (``bench_ep.json``'s
``meta``), else ``RUN_GPU`` and ``RUN_DATE`` below, which describe the files in docs/data. Update those two
constants when docs/data is replaced by a run on another GPU or day.

The output is deterministic: the Agg backend, fixed fonts, sizes and colours, and no timestamp or software
version in the PNG metadata, so the same JSON gives the same bytes. A missing JSON file skips its plot and
makes the exit status 1; the other plots are still written.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from plot_style import (  # noqa: E402
    BASELINE,
    BASELINE_ALT,
    BASELINE_OTHER,
    GOAL,
    OURS,
    OURS_ALT,
    OURS_EAGER,
    STYLE,
    bar_labels,
    finite,
    load_json,
    log_axis,
    save,
    ticks_at,
    title,
)

ROOT = Path(__file__).resolve().parent.parent

# The GPU and date of the runs in docs/data, for the JSON files that do not record them (all but bench_ep.json).
RUN_GPU = "NVIDIA H200"
RUN_DATE = "2026-11-25"

# --------------------------------------------------------------------------------------------------------------
# Routing


MODEL_NAMES = {
    "deepseek_v3": "DeepSeek-V3",
    "kimi_k2": "Kimi K2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "llama4": "Llama 4",
}


def plot_routing(rows: list[dict], out: Path, written: list[Path]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    ds = sorted((r for r in rows if r["model"] == "deepseek_v3"), key=lambda r: r["tokens"])
    if ds:
        t = [r["tokens"] for r in ds]
        series = (
            ("kernel_graph_us", "ours, GPU time (CUDA graph)", OURS, "o", "-"),
            ("kernel_eager_us", "ours, eager call from Python", OURS_EAGER, "o", "--"),
            ("torch_graph_us", "torch reference, GPU time (CUDA graph)", BASELINE, "s", "-"),
            ("torch_eager_us", "torch reference, eager", BASELINE_ALT, "s", "--"),
            ("torch_compile_us", "torch.compile'd reference", BASELINE_OTHER, "^", ":"),
        )
        for key, label, colour, marker, ls in series:
            pts = [(x, r[key]) for x, r in zip(t, ds, strict=True) if finite(r.get(key))]
            if pts:
                left.plot(*zip(*pts, strict=True), marker=marker, ls=ls, color=colour, label=label)
        e, k = ds[0]["experts"], ds[0]["top_k"]
        left.set_title(f"DeepSeek-V3 routing (E = {e}, top-{k}, fp32 logits)")
        log_axis(left, "x")
        log_axis(left, "y")
        ticks_at(left, t)
        left.set_xlabel("tokens T")
        left.set_ylabel("time per call (us, log scale)")
        left.legend(loc="upper left")
    models = [m for m in MODEL_NAMES if any(r["model"] == m for r in rows)]
    models += sorted({r["model"] for r in rows} - set(models))
    palette = ("#1f5fa8", "#d9541e", "#2a9d4b", "#8c6bb1", "#7a7a7a", "#f2a541")
    for i, model in enumerate(models):
        sel = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tokens"])
        e, k = sel[0]["experts"], sel[0]["top_k"]
        right.plot(
            [r["tokens"] for r in sel],
            [r["graph_over_graph"] for r in sel],
            marker="o",
            color=palette[i % len(palette)],
            label=f"{MODEL_NAMES.get(model, model)} (E = {e}, top-{k})",
        )
    right.set_title("Speed-up over the torch reference, GPU time against GPU time")
    log_axis(right, "x")
    ticks_at(right, sorted({r["tokens"] for r in rows}))
    right.set_ylim(bottom=0)
    right.set_xlabel("tokens T")
    right.set_ylabel("torch graph time / our graph time (x)")
    right.legend(loc="upper left")
    title(fig, "Routing: flashinfer_moe.route", RUN_GPU, RUN_DATE, "python launch/bench_routing.py --json FILE")
    save(fig, out, "routing.png", written)


# --------------------------------------------------------------------------------------------------------------
# Layout, permute with quantization, combine


def plot_permute(data: dict, out: Path, written: list[Path]) -> None:
    rows = data["rows"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    by = {(r["op"], r["tokens"]): r for r in rows}
    shades = (OURS_ALT, OURS, OURS_EAGER)
    colours = {t: shades[i % len(shades)] for i, t in enumerate(tokens)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.0), constrained_layout=True)

    moving = [op for op in ops if any(finite(by.get((op, t), {}).get("gbps")) for t in tokens)]
    height = 0.8 / len(tokens)
    for j, t in enumerate(tokens):
        ys, vs = [], []
        for i, op in enumerate(moving):
            r = by.get((op, t))
            if r is not None and finite(r["gbps"]):
                ys.append(i + (j - (len(tokens) - 1) / 2) * height)
                vs.append(r["gbps"])
        bars = left.barh(ys, vs, height=height, color=colours[t], label=f"ours, T = {t}")
        bar_labels(left, bars, ".0f")
    for value, label, ls in (
        (data.get("copy_gbps"), "device copy, read + write", "--"),
        (data.get("write_gbps"), "write-only fill", ":"),
    ):
        if finite(value):
            left.axvline(value, color=BASELINE, ls=ls, lw=1.5, label=f"{label}: {value:.0f} GB/s")
    left.set_yticks(range(len(moving)), moving)
    left.invert_yaxis()
    left.set_xlim(0, 1.18 * max(r["gbps"] for r in rows if finite(r["gbps"])))
    left.set_xlabel("bandwidth of the bytes that must move (GB/s)")
    left.set_title("Bandwidth against the same run's copy and fill ceilings")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    left.grid(axis="y", visible=False)

    for j, t in enumerate(tokens):
        ys, vs = [], []
        for i, op in enumerate(ops):
            r = by.get((op, t))
            if r is not None:
                ys.append(i + (j - (len(tokens) - 1) / 2) * height)
                vs.append(r["kernel_us"])
        bars = right.barh(ys, vs, height=height, color=colours[t], label=f"ours, T = {t}")
        bar_labels(right, bars, ".1f")
    for j, t in enumerate(tokens):
        pts = [
            (by[(op, t)]["torch_us"], i + (j - (len(tokens) - 1) / 2) * height)
            for i, op in enumerate(ops)
            if (op, t) in by
        ]
        right.plot(
            *zip(*pts, strict=True),
            ls="none",
            marker="D" if j else "s",
            color=BASELINE if j else BASELINE_ALT,
            label=f"torch reference (eager), T = {t}",
        )
    log_axis(right, "x", subs=(1.0,))
    right.set_xlim(1, 10 * max(max(r["torch_us"], r["kernel_us"]) for r in rows))
    right.set_yticks(range(len(ops)), ops)
    right.invert_yaxis()
    right.set_xlabel("time per call (us, log scale); ours from CUDA-graph replays")
    right.set_title("Time per call, ours against the torch reference")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    right.grid(axis="y", visible=False)
    title(
        fig,
        "Layout, permute + quantization, combine (DeepSeek-V3 shapes: E = 256, top-8, H = 7168, bf16)",
        RUN_GPU,
        RUN_DATE,
        "python launch/bench_permute.py --json FILE",
    )
    save(fig, out, "permute.png", written)


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMMs


def plot_gemm(rows: list[dict], out: Path, written: list[Path]) -> None:
    n, k = 4096, 7168
    masked = sorted((r for r in rows if r["table"] == "masked" and (r["n"], r["k"]) == (n, k)), key=lambda r: r["rows"])
    contiguous = sorted(
        (r for r in rows if r["table"] == "contiguous" and (r["n"], r["k"]) == (n, k)), key=lambda r: r["rows"]
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6.2), constrained_layout=True)

    def flops(r):
        return 2.0 * r["experts"] * r["rows"] * n * k

    # Left: TFLOP/s against rows per expert, masked (decode) then contiguous (prefill): one colour per series,
    # drawn as two pieces (the two layouts are different benchmarks).
    xm = [r["rows"] for r in masked]
    xc = [r["rows"] for r in contiguous]
    series = (
        ("ours (default choice)", OURS, "o-", lambda r: r["tflops"], lambda r: r["fp8_block_tflops"]),
        ("ours, packed weights (masked only)", OURS_ALT, "o--", lambda r: r["packed_tflops"], None),
        (
            "ours, Triton kernel (the fallback)",
            OURS_EAGER,
            "^:",
            lambda r: r["triton_tflops"],
            lambda r: r["dense_scaled_mm_tflops"] * r["block_triton_vs_dense"],
        ),
        (
            "per-expert torch._scaled_mm loop",
            BASELINE_ALT,
            "s-",
            lambda r: flops(r) / (r["loop_scaled_mm_us"] * 1e-6) / 1e12,
            lambda r: r["loop_scaled_mm_tflops"],
        ),
        ("one dense torch._scaled_mm, same FLOPs", BASELINE, "D-", None, lambda r: r["dense_scaled_mm_tflops"]),
    )
    for label, colour, fmt, of_masked, of_contiguous in series:
        labelled = False
        for sel, xs, of in ((masked, xm, of_masked), (contiguous, xc, of_contiguous)):
            if sel and of is not None:
                left.plot(xs, [of(r) for r in sel], fmt, color=colour, label=None if labelled else label)
                labelled = True
    for r in contiguous:
        left.annotate(
            f"ours / dense\n{r['block_vs_dense']:.2f}x",
            (r["rows"], r["dense_scaled_mm_tflops"]),
            xytext=(0, 8),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color=OURS,
        )
    if masked and contiguous:
        split = math.sqrt(xm[-1] * xc[0])
        left.axvline(split, color="#999", lw=1)
        left.text(split, 20, "  contiguous\n  (prefill)", fontsize=8, color="#555", va="bottom")
        left.text(split, 20, "masked  \n(decode)  ", fontsize=8, color="#555", va="bottom", ha="right")
    log_axis(left, "x")
    ticks_at(left, xm + xc)
    left.set_ylim(0, 1.25 * max(y for line in left.get_lines() for y in line.get_ydata()))
    left.set_xlabel("rows per expert (log scale); masked: 32 experts; contiguous: 32 x 512, 8 x 4096")
    left.set_ylabel("TFLOP/s")
    left.set_title(f"FP8 block-scaled grouped GEMM, (N, K) = ({n}, {k})")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)

    # Right: weight bytes per second in decode (masked), the weight stream being the bound there.
    if masked:
        weight_bytes = masked[0]["experts"] * n * k
        right.plot(xm, [r["weight_tb_s"] for r in masked], "o-", color=OURS, label="ours (default choice)")
        right.plot(xm, [r["packed_tb_s"] for r in masked], "o--", color=OURS_ALT, label="ours, packed weights")
        if all(finite(r.get("triton_tb_s")) for r in masked):
            right.plot(
                xm, [r["triton_tb_s"] for r in masked], "^:", color=OURS_EAGER, label="ours, Triton kernel (fallback)"
            )
        right.plot(
            xm,
            [r["loop_weight_tb_s"] for r in masked],
            "s-",
            color=BASELINE_ALT,
            label="per-expert torch._scaled_mm loop (graph)",
        )
        right.axhline(4.0, color=GOAL, ls="--", lw=1.2, label="goal: 4.0 TB/s at 16 and 64 rows")
        for r in masked:
            right.annotate(
                f"{r['packed_tb_s']:.2f}",
                (r["rows"], r["packed_tb_s"]),
                xytext=(0, 5),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=OURS_ALT,
            )
        log_axis(right, "x")
        ticks_at(right, xm)
        right.set_ylim(0, 1.15 * max(4.0, *(r["packed_tb_s"] for r in masked), *(r["weight_tb_s"] for r in masked)))
        right.set_xlabel("rows per expert (masked layout, 32 experts, every slot used)")
        right.set_ylabel("weight bytes / time (TB/s)")
        right.set_title(f"Decode: weight stream, {weight_bytes / 1e9:.2f} GB of FP8 weights per call")
        right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    title(
        fig,
        "Grouped GEMM (FP8, 128 x 128 weight blocks, 1 x 128 activation groups): ours against cuBLAS",
        RUN_GPU,
        RUN_DATE,
        "python launch/bench_gemm.py --json FILE",
    )
    save(fig, out, "gemm.png", written)


def plot_fused(rows: list[dict], out: Path, written: list[Path]) -> None:
    fused = [r for r in rows if r["table"] == "fused"]
    experts = sorted({r["experts"] for r in fused}, reverse=True)
    fig, axes = plt.subplots(1, len(experts), figsize=(6.2 * len(experts), 4.8), constrained_layout=True, sharey=True)
    axes = [axes] if len(experts) == 1 else list(axes)
    for ax, e in zip(axes, experts, strict=True):
        sel = sorted((r for r in fused if r["experts"] == e), key=lambda r: r["tokens"])
        t = [r["tokens"] for r in sel]
        ax.plot(t, [r["graph_us"] for r in sel], "o-", color=OURS, label="fused_moe, CUDA graph")
        ax.plot(t, [r["packed_graph_us"] for r in sel], "o--", color=OURS_ALT, label="fused_moe, packed weights, graph")
        ax.plot(t, [r["eager_us"] for r in sel], "o:", color=OURS_EAGER, label="fused_moe, eager")
        ax.plot(t, [r["torch_us"] for r in sel], "s-", color=BASELINE, label="torch per-expert _scaled_mm layer")
        for r in sel:
            ax.annotate(
                f"{r['speedup']:.0f}x",
                (r["tokens"], r["torch_us"]),
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=BASELINE,
            )
        log_axis(ax, "x")
        log_axis(ax, "y")
        ticks_at(ax, t)
        ax.set_xlabel("tokens T")
        ax.set_title(f"E = {e} experts" + (" (one EP4 rank's share)" if e == 64 else ""))
        ax.legend(loc="lower right")
    axes[0].set_ylabel("time per layer (us, log scale)")
    title(
        fig,
        "fused_moe, DeepSeek-V3 layer (H 7168, I 2048, top-8, FP8 block); labels: torch time / ours (graph)",
        RUN_GPU,
        RUN_DATE,
        "python launch/bench_gemm.py --tables fused --json FILE",
    )
    save(fig, out, "fused_moe.png", written)


# --------------------------------------------------------------------------------------------------------------
# Expert-parallel layer


def plot_ep(data: dict, out: Path, written: list[Path]) -> None:
    meta = data.get("meta", {})
    rows = data["rows"]
    world = meta.get("world", 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.0), constrained_layout=True)

    impls = (
        ("torch a2a", "torch + NCCL all_to_all_single (baseline)", BASELINE),
        ("MoELayer", "MoELayer (single GPU)", OURS_ALT),
        ("EPMoELayer", "EPMoELayer", OURS),
    )
    tokens = sorted({r["tokens"] for r in rows if r["impl"] in ("EPMoELayer", "torch a2a")})
    width = 0.8 / len(impls)
    for j, (impl, label, colour) in enumerate(impls):
        xs, vs, rs = [], [], []
        for i, t in enumerate(tokens):
            r = next((r for r in rows if r["impl"] == impl and r["tokens"] == t), None)
            if r is not None:
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                vs.append(r["us_max"] / 1000)
                rs.append(r)
        bars = left.bar(xs, vs, width=width, color=colour, label=label)
        for bar, r in zip(bars, rs, strict=True):
            text = f"{bar.get_height():.2f} ms"
            if r["impl"] != "torch a2a" and finite(r.get("vs_base")):
                text += f"\n{r['vs_base']:.1f}x"
            left.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                fontsize=8,
            )
    modes = {r["tokens"]: r.get("mode", "") for r in rows if r["impl"] == "EPMoELayer"}

    def _us(impl: str, t: int):
        return next((r["us_max"] for r in rows if r["impl"] == impl and r["tokens"] == t), None)

    labels = []
    for t in tokens:
        label = f"T = {t} per rank ({modes.get(t, '').replace('_', '-')})"
        ep, single = _us("EPMoELayer", t), _us("MoELayer", t)
        if ep is not None and single is not None:
            label += f"\nEPMoELayer / MoELayer time: {ep / single:.3f}x"
        labels.append(label)
    left.set_xticks(range(len(tokens)), labels)
    log_axis(left, "y")
    # Headroom above the tallest bar for the legend (log scale).
    left.set_ylim(min(1.0, min(r["us_max"] for r in rows) / 2000), 25 * max(r["us_max"] for r in rows) / 1000)
    left.set_ylabel("time per layer (ms, log scale)")
    left.set_title(f"Time per layer, W = {world}; labels: speed-up over the baseline")
    left.legend(loc="upper right")
    left.grid(axis="x", visible=False)

    # Right: host overhead of eager calls = wall time of back-to-back eager calls - the same calls in a graph.
    cases = [r for r in rows if finite(r.get("host_us")) and finite(r.get("graph_us"))]
    names = [
        f"{r['impl']}\nT = {r['tokens']}" + ("\n(functional op)" if r["impl"] == "fused_moe" else "") for r in cases
    ]
    host = [r["host_us"] for r in cases]
    bars = right.bar(
        range(len(cases)), host, width=0.55, color=[OURS if r["impl"] != "fused_moe" else OURS_EAGER for r in cases]
    )
    for bar, r in zip(bars, cases, strict=True):
        v = r["host_us"]
        right.annotate(
            f"host {v:+.0f} us\n(GPU time {r['graph_us']:.0f} us)",
            (bar.get_x() + bar.get_width() / 2, max(v, 0)),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    right.axhline(0, color="#333", lw=0.8)
    right.axhline(50, color=GOAL, ls="--", lw=1.2, label="goal: at most 50 us")
    right.set_xticks(range(len(cases)), names)
    right.set_ylim(min(-30, min(host, default=0) - 10), max(200, max(host, default=0) * 1.25))
    right.set_ylabel("eager wall time - CUDA-graph time per call (us)")
    right.set_title("Host overhead of an eager call (values below 0 are noise)")
    right.legend(loc="upper left")
    right.grid(axis="x", visible=False)
    cfg = meta.get("config", {})
    what = (
        f"Expert-parallel layer, DeepSeek-V3 shape (E {cfg.get('experts', '?')}, top-{cfg.get('top_k', '?')}, "
        f"H {cfg.get('hidden', '?')}, FP8 block, {cfg.get('shared_experts', '?')} shared expert), "
        f"W = {world} GPU{'s' if world != 1 else ''}"
    )
    title(
        fig,
        what,
        meta.get("device", RUN_GPU),
        meta.get("date", RUN_DATE),
        f"torchrun --nproc-per-node {world} launch/bench_ep.py --json FILE",
    )
    save(fig, out, "ep_layer.png", written)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "docs" / "data", help="folder of the JSON files")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the PNG files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update(STYLE)
    written: list[Path] = []
    missing = 0
    for name, plots in (
        ("bench_routing.json", (plot_routing,)),
        ("bench_permute.json", (plot_permute,)),
        ("bench_gemm.json", (plot_gemm, plot_fused)),
        ("bench_ep.json", (plot_ep,)),
    ):
        data = load_json(args.data, name)
        if data is None:
            missing += 1
            continue
        for plot in plots:
            plot(data, args.out, written)
    for path in written:
        print(f"wrote {path}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
