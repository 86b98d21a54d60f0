"""Benchmark of the grouped GEMMs and fused_moe against cuBLAS, all baselines timed in the same run.

    python launch/bench_gemm.py [--tables contiguous,masked,fused] [--markdown FILE] [--json FILE] [--sass DIR]

Tables:
- contiguous: FP8 block-scaled grouped GEMM (8 x 4096 rows at (N, K) = (4096, 7168) and (7168, 2048); 32 x 512
  rows at both) against ``torch._scaled_mm`` rowwise on ONE dense GEMM of the same FLOPs, and a per-expert loop
  of ``_scaled_mm``; also the per-tensor FP8 and bf16 kernels on the same shapes (bf16 against ``torch.mm``).
- masked: decode, 32 experts x {16, 64, 128} rows, (N, K) = (4096, 7168), every slot in use: weight bytes / time
  and TFLOP/s, against a per-expert loop of ``_scaled_mm``.
- fused: ``fused_moe`` (FP8 block) for a DeepSeek-V3 layer (H 7168, I 2048, top-8; E = 256, and E = 64 as one
  EP4 rank sees it), T in {1, 16, 128, 4096}, against a torch layer of per-expert ``_scaled_mm`` calls.

The FP8 block-scaled rows also time each backend of that GEMM in the same run: on Hopper the CUTLASS kernels
(``coop``: 128x128 tiles; ``pingpong``: 64x128) and our wgmma kernel (``wg64``: 64x256 tiles; ``wg128w``:
128x256 in two halves; ``wg128q``: 128x256 in quarters), each in its default tile order, and the Triton kernel
(``triton``); the plain column is the default choice. The masked and fused rows also time the same weights
packed by ``pack_fp8_block_weights`` (``packed``), in the same rotation.

Kernel times are medians of CUDA-graph replays (inputs cycling through several sets where they are small
enough, so that L2 does not hold them); the torch per-expert loops are timed eagerly, as they must sync. The
FP8 block-scaled backends and the dense baseline are timed in turn over three rounds (medians), each after
300 ms of its own replays, so that every one is timed in its own sustained power state.
--sass DIR writes each compiled GEMM kernel's SASS there and prints its count of wgmma instructions.
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
from timing import require_gpus, time_eager, time_graph  # noqa: E402

if __name__ == "__main__":  # the scripts that import this module make their own check first
    require_gpus(1)

import flashinfer_moe as fm  # noqa: E402

FP8 = torch.float8_e4m3fn
DEV = "cuda"


def tflops(flops: float, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def _layout(counts: list[int]):
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    return fm.moe_align_contiguous(ids.reshape(-1, 1).to(DEV), len(counts), 1)  # R = sum(counts)


def _fp8_rows(m: int, k: int):
    x = torch.randn(m, k, device=DEV)
    return fm.quantize_fp8_per_token_group(x)


def _fp8_weights(e: int, n: int, k: int):
    """``(w [E, N, K] FP8, w_scale)``, made 16 experts at a time (an fp32 [256, 4096, 7168] would take 30 GB)."""
    w = torch.empty(e, n, k, dtype=FP8, device=DEV)
    s = torch.empty(e, -(-n // 128), -(-k // 128), device=DEV)
    for e0 in range(0, e, 16):
        chunk = torch.randn(min(16, e - e0), n, k, device=DEV) / k**0.5
        w[e0 : e0 + 16], s[e0 : e0 + 16] = fm.quantize_fp8_block_weights(chunk)
    return w, s


@contextlib.contextmanager
def block_backend(name: str):
    """Routes the FP8 block-scaled GEMM to one backend: ``auto``, ``triton``, or a Hopper config by name."""
    from flashinfer_moe.moe import gemm_sm90

    saved_env, saved_pick = os.environ.get("FLASHINFER_MOE_GEMM_BACKEND"), gemm_sm90.pick
    os.environ["FLASHINFER_MOE_GEMM_BACKEND"] = "triton" if name == "triton" else "auto"
    if name in gemm_sm90.CONFIGS:
        gemm_sm90.pick = lambda *args: (name, *gemm_sm90.DEFAULT_ORDERS[name])
    try:
        yield
    finally:
        gemm_sm90.pick = saved_pick
        if saved_env is None:
            os.environ.pop("FLASHINFER_MOE_GEMM_BACKEND", None)
        else:
            os.environ["FLASHINFER_MOE_GEMM_BACKEND"] = saved_env


BLOCK_BACKENDS = ("coop", "pingpong", "wg64", "wg128w", "wg128q", "triton")


# Replays before each timing of the rotation below (see timing.time_graph).
SETTLE_MS = 300.0


def time_block_backends(fn, baseline=None, rounds: int = 3, extra=None, **kw) -> dict[str, float]:
    """Median over ``rounds`` of ``time_graph`` for ``fn`` under the default choice (``auto``) and each of
    ``BLOCK_BACKENDS`` (Hopper ones only on sm_90), for ``baseline`` if given (``baseline``), and for each of
    ``extra`` (name -> a function like ``fn``, timed under the default choice).

    Each round times them all in turn, each after ``SETTLE_MS`` of its own replays: sustained FP8 GEMMs are
    power-limited on an H200, and a kernel timed right after a lighter phase reads faster.
    """
    kw.setdefault("settle_ms", SETTLE_MS)
    names = ["auto"]
    names += [n for n in BLOCK_BACKENDS if n == "triton" or torch.cuda.get_device_capability() == (9, 0)]
    samples: dict[str, list[float]] = {n: [] for n in names}
    others = dict(extra or {})
    if baseline is not None:
        others["baseline"] = baseline
    samples.update({n: [] for n in others})
    for _ in range(rounds):
        for name in names:
            with block_backend(name):
                samples[name].append(time_graph(fn, **kw))
        for name, other in others.items():
            samples[name].append(time_graph(other, **kw))
    return {n: statistics.median(v) for n, v in samples.items()}


def _scaled_mm(a, b_t, sa, sb):
    return torch._scaled_mm(a, b_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def contiguous_rows(rows: list[dict]) -> None:
    for num_experts, per_expert, n, k in (
        (8, 4096, 4096, 7168),
        (8, 4096, 7168, 2048),
        (32, 512, 4096, 7168),
        (32, 512, 7168, 2048),
    ):
        m = num_experts * per_expert
        flops = 2.0 * m * n * k
        layout = _layout([per_expert] * num_experts)
        a, a_s = _fp8_rows(m, k)
        w, w_s = _fp8_weights(num_experts, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        # Baselines: one dense GEMM of the same FLOPs, rowwise scales; and one _scaled_mm per expert.
        b_dense = w.reshape(-1, k)[:n].t()  # [K, N] column-major, as _scaled_mm wants
        sa, sb = torch.rand(m, 1, device=DEV) + 0.5, torch.rand(1, n, device=DEV) + 0.5
        variants = time_block_backends(
            lambda i: fm.grouped_gemm_fp8_block_contiguous(a, a_s, w, w_s, layout, out=out),
            baseline=lambda i: _scaled_mm(a, b_dense, sa, sb),
            calls=5,
        )
        block, dense = variants.pop("auto"), variants.pop("baseline")
        row_s = torch.rand(m, device=DEV) + 0.5
        exp_s = torch.rand(num_experts, device=DEV) + 0.5
        tensor = time_graph(lambda i: fm.grouped_gemm_fp8_tensor_contiguous(a, row_s, w, exp_s, layout, out=out), 5)
        fast = time_graph(
            lambda i: fm.grouped_gemm_fp8_tensor_contiguous(a, row_s, w, exp_s, layout, fast_accum=True, out=out), 5
        )
        dense_fast = time_graph(
            lambda i: torch._scaled_mm(
                a, b_dense, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            calls=5,
        )
        sa_e = sa[:per_expert]

        def loop():
            for e in range(num_experts):
                _scaled_mm(a[e * per_expert : (e + 1) * per_expert], w[e].t(), sa_e, sb)

        looped = time_eager(loop, calls=5, reps=5)
        ab = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        wb = torch.randn(num_experts, n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        outb = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        bf16 = time_graph(lambda i: fm.grouped_gemm_bf16_contiguous(ab, wb, layout, out=outb), calls=5)
        wbt = wb.reshape(-1, k)[:n].t()
        dense_bf16 = time_graph(lambda i: torch.mm(ab, wbt, out=outb), calls=5)
        rows.append(
            dict(
                table="contiguous",
                experts=num_experts,
                rows=per_expert,
                n=n,
                k=k,
                fp8_block_us=block,
                fp8_block_tflops=tflops(flops, block),
                fp8_tensor_us=tensor,
                fp8_tensor_fast_tflops=tflops(flops, fast),
                dense_fast_tflops=tflops(flops, dense_fast),
                tensor_fast_vs_dense_fast=dense_fast / fast,
                fp8_tensor_tflops=tflops(flops, tensor),
                dense_scaled_mm_tflops=tflops(flops, dense),
                loop_scaled_mm_tflops=tflops(flops, looped),
                block_vs_dense=dense / block,
                **{f"block_{name}_vs_dense": dense / us for name, us in variants.items()},
                tensor_vs_dense=dense / tensor,
                block_vs_loop=looped / block,
                bf16_tflops=tflops(flops, bf16),
                dense_bf16_tflops=tflops(flops, dense_bf16),
                bf16_vs_dense=dense_bf16 / bf16,
            )
        )
        print(rows[-1], flush=True)


def masked_rows(rows: list[dict]) -> None:
    num_experts, n, k = 32, 4096, 7168
    sets = 3  # 3 weight sets of 0.94 GB each: no weight stays in L2 between calls
    ws = [_fp8_weights(num_experts, n, k) for _ in range(sets)]
    packed = [fm.pack_fp8_block_weights(w) for w, _ in ws]  # the same weights packed (pack_fp8_block_weights)
    for per_expert in (16, 64, 128):
        a, a_s = _fp8_rows(num_experts * per_expert, k)
        a, a_s = a.view(num_experts, per_expert, k), a_s.view(num_experts, per_expert, -1)
        counts = torch.full((num_experts,), per_expert, dtype=torch.int32, device=DEV)
        out = torch.empty(num_experts, per_expert, n, dtype=torch.bfloat16, device=DEV)
        gemm = fm.grouped_gemm_fp8_block_masked
        variants = time_block_backends(
            lambda i: gemm(a, a_s, ws[i % sets][0], ws[i % sets][1], counts, out=out),
            calls=6,
            extra={"packed": lambda i: gemm(a, a_s, packed[i % sets], ws[i % sets][1], counts, out=out)},
        )
        us = variants.pop("auto")
        sa, sb = torch.rand(per_expert, 1, device=DEV) + 0.5, torch.rand(1, n, device=DEV) + 0.5

        def loop(i):
            w = ws[i % sets][0]
            for e in range(num_experts):
                _scaled_mm(a[e], w[e].t(), sa, sb)

        looped = time_graph(loop, calls=6, reps=5)
        weight_bytes = num_experts * n * k
        flops = 2.0 * num_experts * per_expert * n * k
        rows.append(
            dict(
                table="masked",
                experts=num_experts,
                rows=per_expert,
                n=n,
                k=k,
                us=us,
                weight_tb_s=weight_bytes / (us * 1e-6) / 1e12,
                tflops=tflops(flops, us),
                loop_scaled_mm_us=looped,
                loop_weight_tb_s=weight_bytes / (looped * 1e-6) / 1e12,
                speedup_vs_loop=looped / us,
                **{f"{name}_tb_s": weight_bytes / (v * 1e-6) / 1e12 for name, v in variants.items()},
                **{f"{name}_tflops": tflops(flops, v) for name, v in variants.items()},
            )
        )
        print(rows[-1], flush=True)


class TorchLayer:
    """The baseline MoE: sort pairs by expert, then per expert with rows: rowwise FP8 ``_scaled_mm`` for
    GEMM1, SwiGLU, requantize, ``_scaled_mm`` for GEMM2, and an index_add_ back (one host sync for counts)."""

    def __init__(self, w13, w2):
        self.w13, self.w2 = w13, w2
        e, two_i, h = w13.shape
        self.s13 = torch.ones(1, two_i, device=DEV)
        self.s2 = torch.ones(1, h, device=DEV)

    def __call__(self, x, weights, ids):
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // k
        xs = x[tokens]
        amax = xs.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-6)
        xq = (xs.float() * (448 / amax)).to(FP8)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=DEV)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows = slice(start, start + c)
            h1 = _scaled_mm(xq[rows], self.w13[e].t(), amax[rows] / 448, self.s13)
            gate, up = h1.float().chunk(2, dim=1)
            act = torch.nn.functional.silu(gate) * up
            s = act.abs().amax(dim=1, keepdim=True).clamp(min=1e-6) / 448
            y = _scaled_mm((act / s).to(FP8), self.w2[e].t(), s, self.s2)
            out.index_add_(0, tokens[rows], y.float() * weights.reshape(-1)[order[rows], None])
            start += c
        return out.to(x.dtype)


def fused_rows(rows: list[dict]) -> None:
    h, inter, k = 7168, 2048, 8
    for num_experts in (256, 64):
        w13, s13 = _fp8_weights(num_experts, 2 * inter, h)
        w2, s2 = _fp8_weights(num_experts, h, inter)
        p13, p2 = fm.pack_fp8_block_weights(w13, gated=True), fm.pack_fp8_block_weights(w2)
        baseline = TorchLayer(w13, w2)
        for t in (1, 16, 128, 4096):
            x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
            logits = torch.randn(t, num_experts, device=DEV)
            weights, ids = fm.route(logits, k)
            out = torch.empty(t, h, dtype=torch.bfloat16, device=DEV)
            kw = dict(quant="fp8_block", w13_scale=s13, w2_scale=s2, out=out, validate=False)
            # Plain and packed weights alternately, two rounds each, medians.
            plain, packed = [], []
            for _ in range(2):
                plain.append(time_graph(lambda i: fm.fused_moe(x, w13, w2, weights, ids, **kw), calls=5, reps=7))
                packed.append(time_graph(lambda i: fm.fused_moe(x, p13, p2, weights, ids, **kw), calls=5, reps=7))
            us, packed_us = statistics.median(plain), statistics.median(packed)
            eager = time_eager(lambda: fm.fused_moe(x, w13, w2, weights, ids, **kw), calls=10, reps=5)
            base = time_eager(lambda: baseline(x, weights, ids), calls=3, reps=3)
            active = int((torch.bincount(ids.reshape(-1), minlength=num_experts) > 0).sum())
            weight_bytes = active * 3 * h * inter
            rows.append(
                dict(
                    table="fused",
                    experts=num_experts,
                    tokens=t,
                    graph_us=us,
                    packed_graph_us=packed_us,
                    eager_us=eager,
                    torch_us=base,
                    speedup=base / us,
                    active_experts=active,
                    weight_tb_s=weight_bytes / (us * 1e-6) / 1e12,
                    tflops=tflops(2.0 * t * k * 3 * h * inter, us),
                )
            )
            print(rows[-1], flush=True)


def check_sass(directory: Path) -> None:
    """SASS of every compiled GEMM specialisation in Triton's in-process cache, and its wgmma count."""
    from flashinfer_moe.moe import gemm_kernel

    directory.mkdir(parents=True, exist_ok=True)
    compiled_kernels = [
        c for cache in gemm_kernel.grouped_gemm_kernel.device_caches.values() for c in cache[0].values()
    ]
    for i, compiled in enumerate(compiled_kernels):
        if True:
            cubin = directory / f"grouped_gemm_{i}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
            (directory / f"grouped_gemm_{i}.sass").write_text(sass)
            counts = {op: sass.count(op) for op in ("HGMMA", "QGMMA", "HMMA", "IMMA")}
            name = getattr(compiled.metadata, "name", "?")
            print(
                f"kernel {i} ({name}, {compiled.metadata.num_warps} warps, {compiled.metadata.shared} B smem): {counts}"
            )


def check_cutlass_sass(directory: Path) -> None:
    """SASS of the Hopper grouped GEMM libraries (CUTLASS and ours), and their wgmma counts per kernel."""
    from flashinfer_moe import jit
    from flashinfer_moe.moe import gemm_sm90

    if torch.cuda.get_device_capability() != (9, 0):
        return
    for spec in (gemm_sm90.SPEC, gemm_sm90.WGMMA_SPEC):
        lib = jit.build(spec)
        sass = subprocess.run(["cuobjdump", "-sass", str(lib)], capture_output=True, text=True).stdout
        (directory / f"{spec.name}.sass").write_text(sass)
        for chunk in sass.split("Function : ")[1:]:
            name = chunk.split("\n", 1)[0].strip()
            counts = {op: chunk.count(op) for op in ("HGMMA", "QGMMA", "HMMA", "IMMA")}
            print(f"{spec.name} kernel ({name[:70]}...): {counts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="contiguous,masked,fused")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sass", type=Path)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    tables = args.tables.split(",")
    if "contiguous" in tables:
        contiguous_rows(rows)
    if "masked" in tables:
        masked_rows(rows)
    if "fused" in tables:
        fused_rows(rows)
    if args.sass:
        check_sass(args.sass)
        check_cutlass_sass(args.sass)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
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
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
