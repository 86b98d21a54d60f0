"""Benchmark of the MLA prefill path: the new tokens' attention (``mla_prefill``, q/k 192, v 128, causal)
against torch SDPA timed in the same run, the LSE merge and the KV append.

    python launch/bench_mla_prefill.py [--heads 128] [--sweep] [--markdown FILE] [--json FILE]
    python launch/bench_mla_prefill.py --append-only [--markdown FILE] [--json FILE]

Attention cases: one sequence of 4096 tokens and a ragged batch (4 x 1024 + 1 x 4096), 128 heads (DeepSeek-V3
without tensor parallelism), bf16. TFLOP/s count the causal FLOPs only (2 x visible pairs x (192 + 128) per
head). Times are medians of CUDA-graph replays. SDPA gets each sequence as `[1, H, L, D]` contiguous tensors
(its preferred layout, made outside the timing) and one call per sequence; each backend (flash, efficient,
cudnn) is tried alone. Flash needs equal q/k and v head dims: where it refuses v of 128, v is zero-padded to 192
(the padded columns are computed and discarded) and the row says so. ``--sweep`` times every kernel config on
the first case.

Merge: `[T, H, 128]` bf16 partial outputs (and a 512-wide latent variant), GB/s of bytes read + written.
Append: N tokens' 576 channels into a paged cache (bf16 and FP8 pages, page 64 and page 1), GB/s. Append with
rope (N = 1, 16, 128, 4096; bf16 and FP8 pages, page 64; both pairings; positions random in DeepSeek-V3's 163840,
fp32 cos/sin table): ``fused`` (``mla_append_kv`` given ``positions`` and ``cos_sin_cache``) against
``separate`` (a plain-torch rope into a preallocated bf16 buffer, then ``mla_append_kv``), both in the same run;
the torch rope alone and the append alone (kpe already rotated) are timed too. The torch rope is four
kernels, the fewest plain torch needs for bf16 rows: the rows widened into fp32 pairs, the table's rows
gathered as complex64 ``cos + i sin`` (built once outside the timing), one complex multiply, the narrowing
back. Each fused row is checked against its separate row (the caches agree within one bf16 / e4m3 step).
``--append-only`` runs only the append sections.
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

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashinfer_moe as fm  # noqa: E402
from flashinfer_moe.mla import prefill_kernel  # noqa: E402

SCALE = 192**-0.5
CASES = {"1 x 4096": [4096], "4 x 1024 + 1 x 4096": [1024] * 4 + [4096]}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def timed(fn) -> tuple[float, str]:
    """Median us per call from graph replays; eager timing where the call cannot be captured."""
    try:
        return time_graph(lambda i: fn(), calls=5, reps=9), "graph"
    except Exception:  # noqa: BLE001 - some SDPA backends refuse capture; time them eagerly
        torch.cuda.synchronize()
        return time_eager(fn, calls=5, reps=9), "eager"


def sdpa_rows(name, lens, heads, q, k, v, flops, ours_us):
    rows = []
    per_seq = []
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        per_seq.append(tuple(x[start:end].transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)))
    for backend, which in BACKENDS.items():
        for pad in (False, True):
            seqs = per_seq
            if pad:
                seqs = [(a, b, F.pad(c, (0, 64))) for a, b, c in per_seq]
            try:
                with sdpa_kernel(which):
                    for a, b, c in seqs[:1]:
                        F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=SCALE)
                    torch.cuda.synchronize()

                    def run(seqs=seqs):
                        for a, b, c in seqs:
                            F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=SCALE)

                    us, how = timed(run)
            except Exception as exc:  # noqa: BLE001 - a backend that does not take these shapes
                if pad:
                    rows.append(dict(case=name, impl=f"sdpa {backend}", error=str(exc).splitlines()[0][:160]))
                continue
            note = "v zero-padded to 192" if pad else ""
            rows.append(
                dict(
                    case=name, impl=f"sdpa {backend}", us=us, tflops=flops / us / 1e6, timing=how, note=note,
                    ours_speedup=us / ours_us if ours_us else float("nan"),
                )
            )  # fmt: skip
            break
    return rows


def attention(heads: int, gen: torch.Generator, with_sdpa: bool, sweep: bool) -> list[dict]:
    rows = []
    for index, (name, lens) in enumerate(CASES.items()):
        t = sum(lens)
        q, k, v = (torch.randn(t, heads, d, generator=gen).bfloat16().cuda() for d in (192, 192, 128))
        cu = cu_of(lens)
        out = torch.empty(t, heads, 128, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(t, heads, device="cuda")
        flops = prefill_kernel.causal_flops(lens, heads)
        configs = prefill_kernel.CONFIGS if sweep and index == 0 else (prefill_kernel.DEFAULT,)
        ours_us = None
        for config in configs:

            def run(config=config):
                prefill_kernel.launch(q, k, v, cu, out, lse, SCALE, max(lens), True, config)

            try:
                us, _ = timed(run)
            except Exception as exc:  # noqa: BLE001 - a sweep candidate that does not fit this GPU
                rows.append(dict(case=name, impl="ours", config=str(config), error=str(exc).splitlines()[0][:160]))
                print(f"{name:<22} ours {config}: failed ({rows[-1]['error']})", flush=True)
                continue
            row = dict(case=name, impl="ours", config=str(config), us=us, tflops=flops / us / 1e6)
            rows.append(row)
            print(f"{name:<22} ours {config}: {us:9.1f} us {row['tflops']:7.1f} TFLOP/s", flush=True)
            if config == prefill_kernel.DEFAULT:
                ours_us = us
        public_us, _ = timed(lambda: fm.mla_prefill(q, k, v, cu, max(lens), SCALE, out=out, lse=lse))
        rows.append(dict(case=name, impl="ours (mla_prefill)", us=public_us, tflops=flops / public_us / 1e6))
        if with_sdpa:
            for row in sdpa_rows(name, lens, heads, q, k, v, flops, ours_us):
                rows.append(row)
                if "error" in row:
                    print(f"{name:<22} {row['impl']}: not run ({row['error']})", flush=True)
                else:
                    print(
                        f"{name:<22} {row['impl']}: {row['us']:9.1f} us {row['tflops']:7.1f} TFLOP/s "
                        f"({row['timing']}{', ' + row['note'] if row['note'] else ''}); ours {row['ours_speedup']:.2f}x",
                        flush=True,
                    )
    return rows


def merge(heads: int, gen: torch.Generator) -> list[dict]:
    rows = []
    t = 4096
    for d in (128, 512):
        a, b = (torch.randn(t, heads, d, generator=gen).bfloat16().cuda() for _ in range(2))
        la, lb = (torch.randn(t, heads, generator=gen).cuda() for _ in range(2))
        out, out_lse = torch.empty_like(a), torch.empty_like(la)
        us, _ = timed(lambda: fm.merge_attn_states(a, la, b, lb, out=out, out_lse=out_lse))
        moved = 3 * a.numel() * 2 + 3 * la.numel() * 4
        rows.append(dict(op=f"merge [T={t}, H={heads}, D={d}] bf16", us=us, gbps=moved / us / 1e3))
    return rows


def append(gen: torch.Generator) -> list[dict]:
    rows = []
    for n in (128, 4096):
        ckv = torch.randn(n, 512, generator=gen).bfloat16().cuda()
        kpe = torch.randn(n, 64, generator=gen).bfloat16().cuda()
        for page in (64, 1):
            pages = 4 * n // page
            slots = torch.randperm(pages * page, generator=gen)[:n].cuda()
            for dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, torch.tensor([0.02], device="cuda"))):
                cache = torch.zeros(pages, page, 576, dtype=dtype, device="cuda")
                us, _ = timed(lambda: fm.mla_append_kv(ckv, kpe, slots, cache, kv_scale=scale))
                moved = n * 576 * (2 + cache.element_size()) + n * 8
                kind = "bf16" if scale is None else "fp8"
                rows.append(dict(op=f"append N={n} page {page} -> {kind}", us=us, gbps=moved / us / 1e3))
    return rows


ROPE_MAX_POS = 163840


class TorchRope:
    """kpe rotated by plain torch ops into a preallocated ``out`` (the separate path's rope): pairs as complex64
    numbers times the gathered ``cos + i sin`` rows."""

    def __init__(self, n: int, cos_sin: torch.Tensor, interleaved: bool, dtype: torch.dtype):
        max_pos = cos_sin.shape[0]
        self.cis = torch.view_as_complex(cos_sin.float().view(max_pos, 2, 32).transpose(1, 2).contiguous())
        self.pairs = torch.empty(n, 32, 2, device="cuda")
        self.rows = torch.empty(n, 32, dtype=torch.complex64, device="cuda")
        self.prod = torch.empty(n, 32, dtype=torch.complex64, device="cuda")
        self.out = torch.empty(n, 64, dtype=dtype, device="cuda")
        self.interleaved = interleaved

    def _pairs_view(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.view(n, 32, 2) if self.interleaved else x.view(n, 2, 32).transpose(1, 2)

    def __call__(self, kpe: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.pairs.copy_(self._pairs_view(kpe))
        torch.index_select(self.cis, 0, positions, out=self.rows)
        torch.mul(torch.view_as_complex(self.pairs), self.rows, out=self.prod)
        self._pairs_view(self.out).copy_(torch.view_as_real(self.prod))
        return self.out


def append_rope(gen: torch.Generator) -> list[dict]:
    rows = []
    theta = torch.rand(ROPE_MAX_POS, 32, generator=gen, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([theta.cos(), theta.sin()], 1).float().cuda()
    page = 64
    for n in (1, 16, 128, 4096):
        ckv = torch.randn(n, 512, generator=gen).bfloat16().cuda()
        kpe = torch.randn(n, 64, generator=gen).bfloat16().cuda()
        positions = torch.randint(0, ROPE_MAX_POS, (n,), generator=gen).cuda()
        pages = max(4, 4 * n // page)
        slots = torch.randperm(pages * page, generator=gen)[:n].cuda()
        for dtype, scale in ((torch.bfloat16, None), (torch.float8_e4m3fn, torch.tensor([0.02], device="cuda"))):
            kind = "bf16" if scale is None else "fp8"
            for interleaved in (True, False):
                fused_cache = torch.zeros(pages, page, 576, dtype=dtype, device="cuda")
                sep_cache = torch.zeros_like(fused_cache)
                rope = TorchRope(n, cos_sin, interleaved, kpe.dtype)

                def fused():
                    fm.mla_append_kv(
                        ckv, kpe, slots, fused_cache, kv_scale=scale, positions=positions, cos_sin_cache=cos_sin,
                        rope_interleaved=interleaved,
                    )  # fmt: skip

                def separate():
                    fm.mla_append_kv(ckv, rope(kpe, positions), slots, sep_cache, kv_scale=scale)

                fused_us, _ = timed(fused)
                sep_us, _ = timed(separate)
                rope_us, _ = timed(lambda: rope(kpe, positions))
                append_us, _ = timed(lambda: fm.mla_append_kv(ckv, rope.out, slots, sep_cache, kv_scale=scale))
                # The two paths round differently (complex64 products, bf16 rows before FP8): at most one step of
                # the cache's type apart (relative 2**-7 for bf16, 2**-3 for e4m3; e4m3's subnormal step 2**-9;
                # 1e-5 for the fp32 products' error where a rotation cancels).
                got, want = fused_cache.float()[..., 512:], sep_cache.float()[..., 512:]
                step, tiny = (2.0**-7, 1e-5) if scale is None else (2.0**-3, 2.0**-9)
                worst = ((got - want).abs() / (step * torch.maximum(got.abs(), want.abs()) + tiny)).max().item()
                same_latent = torch.equal(fused_cache[..., :512].float(), sep_cache[..., :512].float())
                rows.append(
                    dict(
                        n=n, cache=kind, page=page, pairing="interleaved" if interleaved else "neox",
                        fused_us=fused_us, separate_us=sep_us, torch_rope_us=rope_us, append_us=append_us,
                        separate_over_fused=sep_us / fused_us, rope_diff_in_steps=worst,
                        check="ok" if same_latent and worst <= 1.0 else "MISMATCH",
                    )
                )  # fmt: skip
                r = rows[-1]
                print(
                    f"append+rope N={n:<5} {kind:<4} {r['pairing']:<11} fused {fused_us:7.2f} us  separate "
                    f"{sep_us:7.2f} us ({rope_us:6.2f} rope + {append_us:6.2f} append)  separate/fused "
                    f"{r['separate_over_fused']:.2f}  check {r['check']} (rope diff {worst:.2f} steps)",
                    flush=True,
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="time every kernel config on the first case")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the torch SDPA baselines")
    parser.add_argument("--append-only", action="store_true", help="only the append sections (with and without rope)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    attn = [] if args.append_only else attention(args.heads, gen, not args.no_sdpa, args.sweep)
    moves = ([] if args.append_only else merge(args.heads, gen)) + append(gen)
    for r in moves:
        print(f"{r['op']:<40} {r['us']:9.2f} us {r['gbps']:8.0f} GB/s", flush=True)
    roped = append_rope(gen)
    if args.markdown:
        lines = [
            f"{torch.cuda.get_device_name()}, bf16, {args.heads} heads, causal; TFLOP/s of the causal FLOPs.",
            "",
            "| case | implementation | us | TFLOP/s | ours vs this | note |",
            "|---|---|---:|---:|---:|---|",
        ]
        for r in attn:
            if "error" in r:
                what = f"{r['config']}: " if "config" in r else ""
                lines.append(f"| {r['case']} | {r['impl']} | - | - | - | {what}not run: {r['error']} |")
                continue
            note = r.get("config") or r.get("note", "")
            vs = f"{r['ours_speedup']:.2f}x" if "ours_speedup" in r else ""
            lines.append(f"| {r['case']} | {r['impl']} | {r['us']:.1f} | {r['tflops']:.0f} | {vs} | {note} |")
        if not attn:
            lines = [f"{torch.cuda.get_device_name()}; the append sections only."]
        lines += ["", "| op | us | GB/s |", "|---|---:|---:|"]
        lines += [f"| {r['op']} | {r['us']:.2f} | {r['gbps']:.0f} |" for r in moves]
        lines += [
            "",
            "| N | cache | pairing | fused us | separate us | torch rope us | append us | separate / fused | check |",
            "|---:|---|---|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['n']} | {r['cache']} | {r['pairing']} | {r['fused_us']:.2f} | {r['separate_us']:.2f} | "
            f"{r['torch_rope_us']:.2f} | {r['append_us']:.2f} | {r['separate_over_fused']:.2f} | {r['check']} |"
            for r in roped
        ]
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(device=torch.cuda.get_device_name(), attention=attn, moves=moves, append_rope=roped), indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
