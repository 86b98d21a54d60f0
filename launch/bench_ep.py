"""Benchmark of the expert-parallel MoE layer ``EPMoELayer`` against a torch + NCCL ``all_to_all_single``
layer (``TorchEPBaseline``) and, on one GPU, the single-GPU ``MoELayer``, all measured in the same run.

    torchrun --nproc-per-node W launch/bench_ep.py [--tokens 128,4096] [--mode fixed,auto] [--json F] [--markdown F]
    torchrun --nproc-per-node 2 launch/bench_ep.py --cpu-smoke      # gloo on CPUs, tiny shapes: the logic only

The layer (``--preset deepseek-v3``): FP8 block weights (128 x 128 ``weight_scale_inv``), E 256, top-8, 8 groups
/ top-4, sigmoid + correction bias, routed scaling 2.5, H 7168, I 2048, one shared expert of 2048;
``--experts/--hidden/--intermediate`` shrink it. Weights are ``ep_common.RandomMoEWeights`` of ``--seed``: every
rank sees the same global weights without communication and makes only those it reads. T tokens per rank;
T <= ``--ll-max`` (128) is decode. ``--mode fixed``: low_latency for decode, high_throughput for prefill;
``auto``, ``low_latency``, ``high_throughput``: one layer built with that mode (comma-separated: several rows).
``--share-gpu``: every rank on cuda:0 over a gloo group (the P2P backend over CUDA IPC); NCCL cannot run there,
so the baseline is skipped. Nothing is asserted: the goals are printed next to the numbers.

Rows per T: ``EPMoELayer`` (per mode); ``torch a2a``, the baseline (``BASELINE`` below); ``MoELayer`` (W = 1
only: the single-GPU layer + the shared MLP through ``fused_moe``, same weights); and once, on rank 0,
``fused_moe`` at T = 1 (all E experts, FP8 block, routed beforehand), the reference for host overhead. Columns:
  us, max us    time per layer: each rank's median of CUDA-event timed eager calls (a barrier before each),
                then the median and the max over ranks (perf_counter on CPUs)
  tok/s         T * W / max us
  base/x        the baseline's max us / this row's max us (the speed-up over the baseline)
  err base, err 1gpu  relative L2 error of the output against the baseline's / MoELayer's, over all tokens
                (FP8 rounding of both sides makes err base about 0.07 for a correct layer; a wrong one reads ~1)
  route .. shared  our layer's phases (us) from ``forward(x, phase_times=d)`` in a separate synchronized pass:
                each rank's median, the max over ranks
  wall, graph, host  decode: wall time per call of N back-to-back eager calls (synchronized at the end), GPU
                time per call of the same N calls replayed in one CUDA graph, host = wall - graph (empty where
                capture failed; the reason is printed)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

# NVLink multicast off (NCCL, torch symmetric memory, NVSHMEM), before any of them starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashinfer_moe import EPMoELayer, MoELayer, fused_moe, route  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_common import PRESETS, RandomMoEWeights, generator, hf_prefix, init_distributed, time_once  # noqa: E402
from timing import capture_graph  # noqa: E402

FP8, BLOCK = torch.float8_e4m3fn, 128
PHASES = ("route", "dispatch", "experts", "combine", "shared")
PROJ = ("gate_proj", "up_proj", "down_proj")
BASELINE = (
    "baseline: torch routing; bf16 rows, one per (token, expert) pair, over NCCL all_to_all_single after a count "
    "exchange (one host sync); per local expert rowwise FP8 torch._scaled_mm (weights requantized per output "
    "channel from the same 128x128 blocks, activations per token), SiLU; back, index_add; + shared MLP alike"
)


def _rowwise_fp8(weights: Mapping, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled projection requantized with one scale per output channel: ``(q [N, K], scale [1, N])``."""
    q, s = weights[name + ".weight"], weights[name + ".weight_scale_inv"]
    n, k = q.shape
    w = q.float() * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # [N, 1]
    return (w / scale).to(FP8), scale.t().contiguous()


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0  # [M, 1]
    return (x.float() / scale).to(FP8), scale


class TorchEPBaseline:
    """The same layer as a user writes it from torch ops and NCCL ``all_to_all_single`` (``BASELINE``)."""

    def __init__(self, cfg, weights: Mapping, prefix: str, rank: int, world: int):
        self.cfg, self.world, self.local = cfg, world, cfg.experts // world
        self.router = weights[prefix + "gate.weight"].float()
        self.bias = weights[prefix + "gate.e_score_correction_bias"].float() if cfg.correction_bias else None
        mine = range(rank * self.local, (rank + 1) * self.local)
        self.experts = [self._mlp_weights(weights, f"{prefix}experts.{e}.") for e in mine]
        self.shared = self._mlp_weights(weights, prefix + "shared_experts.") if cfg.shared_experts else None

    @staticmethod
    def _mlp_weights(weights: Mapping, prefix: str):
        (g, sg), (u, su), (d, sd) = (_rowwise_fp8(weights, prefix + p) for p in PROJ)
        w13 = torch.cat((g.view(torch.uint8), u.view(torch.uint8))).view(FP8)  # gate rows then up rows
        return w13, torch.cat((sg, su), dim=1), d, sd

    @staticmethod
    def _mlp(xq, sx, w13, s13, w2, s2) -> torch.Tensor:
        # cuBLAS's FP8 GEMM takes row counts in multiples of 16 and 16-byte aligned scales: padded copies.
        m = xq.shape[0]
        pad = -m % 16
        xq = torch.cat((xq.view(torch.uint8), xq.new_zeros(pad, xq.shape[1], dtype=torch.uint8))).view(FP8)
        sx = torch.cat((sx, sx.new_ones(pad, 1)))
        h = torch._scaled_mm(xq, w13.t(), scale_a=sx, scale_b=s13, out_dtype=torch.bfloat16)  # [M, 2I]
        gate, up = h.float().chunk(2, dim=1)
        aq, sa = _quant_rows(F.silu(gate) * up)
        return torch._scaled_mm(aq, w2.t(), scale_a=sa, scale_b=s2, out_dtype=torch.bfloat16)[:m]  # [M, H]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores; experts chosen on score (+ bias) among the best groups (each group's best, or with a bias the
        sum of its two best); weights: the unbiased scores, renormalized, times the routed scaling factor."""
        c, t = self.cfg, x.shape[0]
        logits = x.float() @ self.router.t()  # [T, E]
        scores = logits.softmax(-1) if c.scoring_func == "softmax" else logits.sigmoid()
        keys = scores if self.bias is None else scores + self.bias
        if c.num_expert_group and c.num_expert_group > 1:
            grouped = keys.view(t, c.num_expert_group, -1)  # [T, G, E/G]
            best = grouped.topk(2, dim=-1).values.sum(-1) if self.bias is not None else grouped.amax(-1)
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(c.topk_group, dim=-1).indices, True)
            keys = keys.masked_fill(~kept.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
        ids = keys.topk(c.top_k, dim=-1).indices  # [T, k]
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) if c.renormalize else w
        return w * (c.routed_scaling_factor or 1.0), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, world, local = self.cfg.top_k, self.world, self.local
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # pairs by expert, so by destination rank
        send = x[order // k]  # [T * k, H] bf16
        counts = torch.bincount(flat, minlength=self.cfg.experts)  # [E] pairs per global expert
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)  # [W * E/W]: from each source rank, per local expert
        per_source = got.view(world, local)
        host = torch.cat((counts.view(world, local).sum(1), per_source.sum(1), per_source.sum(0))).tolist()  # sync
        send_split, recv_split, per_expert = host[:world], host[world : 2 * world], host[2 * world :]
        rows = x.new_empty(sum(recv_split), x.shape[1])
        dist.all_to_all_single(rows, send, recv_split, send_split)
        expert_of_row = torch.arange(local, device=x.device).repeat(world).repeat_interleave(got, output_size=len(rows))
        by_expert = expert_of_row.argsort(stable=True)
        xq, sx = _quant_rows(rows[by_expert])
        ys, start = torch.empty_like(rows), 0
        for e, n in enumerate(per_expert):
            if n:
                ys[start : start + n] = self._mlp(xq[start : start + n], sx[start : start + n], *self.experts[e])
                start += n
        out_rows = torch.empty_like(rows)
        out_rows[by_expert] = ys
        back = torch.empty_like(send)
        dist.all_to_all_single(back, out_rows, send_split, recv_split)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, back.float() * weights.reshape(-1)[order, None])
        if self.shared is not None:
            out += self._mlp(*_quant_rows(x), *self.shared).float()
        return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------ timing


class Bench:
    """Timing and gathers of one run: ``dev`` the rank's device, ``cpu_group`` a gloo group for the gathers."""

    def __init__(self, dev: torch.device, cpu_group, reps: int, calls: int):
        self.dev, self.cpu_group, self.reps, self.calls = dev, cpu_group, reps, calls

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def ranks(self, value) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value, group=self.cpu_group)
        return out

    def time_us(self, fn, collective: bool = True) -> float:
        """This rank's median time of one call (us): CUDA events on a GPU, perf_counter on a CPU."""
        samples = []
        for _ in range(self.reps + 2):  # two warm-up calls first
            self.sync()
            if collective:
                dist.barrier()
            samples.append(time_once(fn, self.dev) * 1e6)
        return statistics.median(samples[2:])

    def phases(self, layer, x) -> dict:
        got = {}
        for _ in range(max(3, self.reps // 4)):
            times = {}
            self.sync()
            dist.barrier()
            layer(x, phase_times=times)
            for p, s in times.items():
                got.setdefault(p, []).append(s * 1e6)
        every = self.ranks({p: statistics.median(v) for p, v in got.items()})
        return {p: max(r.get(p, 0.0) for r in every) for p in every[0]}

    def host_overhead(self, fn, collective: bool = True) -> dict:
        """Wall time per call of ``calls`` back-to-back eager calls, GPU time per call of the same calls in one
        CUDA graph, their difference (us); ``graph_note`` says why capture failed."""
        walls = []
        for _ in range(self.reps):
            self.sync()
            if collective:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(self.calls):
                fn()
            self.sync()
            walls.append((time.perf_counter() - t0) / self.calls * 1e6)
        res = dict(wall_us=statistics.median(walls), graph_us=None, host_us=None, graph_note=None)
        if self.dev.type != "cuda":
            res["graph_note"] = "no CUDA graphs on a CPU"
            return res
        graph, why = None, None
        try:
            graph = capture_graph(lambda i: fn(), self.calls)
        except Exception as exc:  # report it and go on
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if collective:
            why = next((w for w in self.ranks(why) if w), None)  # every rank skips the replay if one failed
        if why is not None:
            res["graph_note"] = f"capture failed: {why}"
            return res
        res["graph_us"] = self.time_us(graph.replay, collective) / self.calls
        res["host_us"] = res["wall_us"] - res["graph_us"]
        return res

    def rel_err(self, out: torch.Tensor, ref: torch.Tensor | None) -> float | None:
        """Relative L2 error over every rank's tokens (collective; None where a rank has no reference)."""
        parts = None
        if ref is not None:
            parts = (float(((out.double() - ref.double()) ** 2).sum()), float((ref.double() ** 2).sum()))
        every = self.ranks(parts)
        if any(p is None for p in every):
            return None
        return (sum(p[0] for p in every) / max(sum(p[1] for p in every), 1e-300)) ** 0.5


# ------------------------------------------------------------------------------------------------- report

COLUMNS = ("T", "impl", "mode", "backend", "us", "max us", "tok/s", "base/x", "err base", "err 1gpu", *PHASES,
           "wall", "graph", "host")  # fmt: skip


def _cells(row: dict) -> list[str]:
    def f(v, spec=".1f"):
        return "" if v is None else format(v, spec)

    ph = row.get("phases") or {}
    return [str(row["tokens"]), row["impl"], row.get("mode", ""), row.get("backend", ""), f(row["us"]),
            f(row["us_max"]), f(row["tok_s"], ".3g"), f(row.get("vs_base"), ".2f"), f(row.get("err_base"), ".2e"),
            f(row.get("err_single"), ".2e"), *(f(ph.get(p)) for p in PHASES), f(row.get("wall_us")),
            f(row.get("graph_us")), f(row.get("host_us"))]  # fmt: skip


def _emit(rows: list, row: dict, rank: int) -> None:
    rows.append(row)
    if rank == 0:
        print(" | ".join(_cells(row)), flush=True)
        if row.get("graph_note"):
            print(f"#   {row['impl']} T={row['tokens']}: no graph time: {row['graph_note']}", flush=True)


def _goals(row: dict, world: int, decode: bool, single_us: float | None) -> str:
    out = []
    if world == 1 and single_us:
        out.append(f"EPMoELayer / MoELayer = {row['us_max'] / single_us:.3f} (goal <= 1.05)")
    if row.get("vs_base") is not None:
        out.append(f"{row['vs_base']:.2f}x the baseline (goal " + ("at EP4 >= 2x)" if decode else ">= 1.3x)"))
    if row.get("host_us") is not None:
        out.append(f"host overhead {row['host_us']:.1f} us/call (goal <= 50)")
    return f"#   goals T={row['tokens']} {row['mode']}: " + ("; ".join(out) or "n/a")


# --------------------------------------------------------------------------------------------------- main


def _layer_groups(modes: list[str], tokens: list[int], ll_max: int) -> list[tuple[str, list[int]]]:
    """(mode, the T it runs) per layer to build."""
    out = []
    for m in modes:
        if m == "fixed":
            out += [
                ("low_latency", [t for t in tokens if t <= ll_max]),
                ("high_throughput", [t for t in tokens if t > ll_max]),
            ]
        else:
            out.append((m, tokens))
    return [(m, ts) for m, ts in out if ts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 128,4096)")
    p.add_argument("--mode", default="fixed", help="fixed | auto | low_latency | high_throughput, comma-separated")
    p.add_argument("--backend", default="auto", choices=("auto", "p2p", "nccl"))
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None, help="I of the routed (and shared) experts")
    p.add_argument("--ll-max", type=int, default=128, help="the largest decode T, the low-latency block")
    p.add_argument("--reps", type=int, default=None, help="timed calls per row (default 20)")
    p.add_argument("--host-calls", type=int, default=20, help="N of the host-overhead measurement")
    p.add_argument("--pack", action="store_true", help="pack FP8 weights for decode rows (low_latency, MoELayer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share-gpu", action="store_true", help="every rank on cuda:0 over gloo (no baseline)")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPUs, the tiny preset, T 16,160")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA: CPUs and gloo even on a GPU machine
    cfg = PRESETS["tiny" if args.cpu_smoke else args.preset]
    shrink = dict(experts=args.experts, hidden=args.hidden, intermediate=args.intermediate)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in shrink.items() if v})
    if cfg.problems():
        sys.exit("bench_ep.py: " + "; ".join(cfg.problems()))
    tokens = [int(t) for t in (args.tokens or ("16,160" if args.cpu_smoke else "128,4096")).split(",")]
    env = init_distributed(share_gpu=args.share_gpu, timeout_s=900.0)  # first calls may wait on a JIT build
    rank, world, dev = env.rank, env.world, env.device
    b = Bench(dev, env.cpu_group, args.reps or (3 if args.cpu_smoke else 20), 3 if args.cpu_smoke else args.host_calls)
    torch.set_grad_enabled(False)
    prefix = hf_prefix(0)
    weights = RandomMoEWeights(cfg, 1, args.seed, dev, fp8_block=True)
    bias = weights[prefix + "gate.e_score_correction_bias"] if cfg.correction_bias else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    has_base = env.backend == "nccl" or dev.type == "cpu"  # all_to_all_single: NCCL on GPUs, gloo on CPUs
    if rank == 0:
        print(f"# {world} ranks ({env.launcher}), {name}, {env.backend}; {cfg}, FP8 block; T per rank {tokens}")
        print(f"# {BASELINE}" if has_base else "# baseline skipped: a shared GPU runs on a gloo group, and NCCL "
              "all_to_all_single cannot (NCCL refuses ranks that share a GPU)")  # fmt: skip
        print(" | ".join(COLUMNS), flush=True)
    xs = {t: torch.randn(t, cfg.hidden, generator=generator(dev, args.seed, "x", rank, t), device=dev).bfloat16()
          for t in tokens}  # fmt: skip

    rows, refs, base_us, single_us = [], {}, {}, {}
    base = TorchEPBaseline(cfg, weights, prefix, rank, world) if has_base else None
    single = shared = None
    if world == 1:
        single = MoELayer(cfg.experts, cfg.top_k, cfg.hidden, cfg.intermediate, quant="fp8_block", device=dev,
                          **cfg.routing_kwargs())  # fmt: skip
        single.load_expert_weights(weights, prefix + "experts.")
        single.load_router_weight(weights[prefix + "gate.weight"], bias)
        if cfg.shared_experts:
            shared = MoELayer(1, 1, cfg.hidden, cfg.shared_size, router=False, quant="fp8_block", device=dev)
            keys = [f"{p}.{s}" for p in PROJ for s in ("weight", "weight_scale_inv")]
            shared.load_expert_weights({f"0.{k}": weights[f"{prefix}shared_experts.{k}"] for k in keys})
    for t in tokens:
        x, decode = xs[t], t <= args.ll_max
        if base is not None:
            refs[("base", t)] = base(x)
            every = b.ranks(b.time_us(lambda: base(x)))
            base_us[t] = max(every)
            _emit(rows, dict(tokens=t, impl="torch a2a", backend=env.backend, us=statistics.median(every),
                             us_max=max(every), tok_s=t * world / max(every) * 1e6, vs_base=1.0), rank)  # fmt: skip
        if single is not None:
            if args.pack:  # as the low_latency layer's weights: packed for decode only
                single.pack_weights() if decode else single.unpack_weights()
            ones, zeros = torch.ones(t, 1, device=dev), torch.zeros(t, 1, dtype=torch.int32, device=dev)

            def one_gpu():
                if shared is None:
                    return single(x)
                return single(x) + fused_moe(x, shared.w13, shared.w2, ones, zeros, quant="fp8_block",
                                             w13_scale=shared.w13_scale, w2_scale=shared.w2_scale, validate=False)  # fmt: skip

            refs[("single", t)] = out = one_gpu()
            single_us[t] = us = b.time_us(one_gpu)
            row = dict(tokens=t, impl="MoELayer", mode="1 GPU", us=us, us_max=us, tok_s=t / us * 1e6,
                       vs_base=base_us[t] / us if t in base_us else None, err_base=b.rel_err(out, refs.get(("base", t))))  # fmt: skip
            _emit(rows, row | (b.host_overhead(one_gpu) if decode else {}), rank)

    for mode, group_tokens in _layer_groups(args.mode.split(","), tokens, args.ll_max):
        ll = max([args.ll_max] + (group_tokens if mode == "low_latency" else []))
        layer = EPMoELayer(cfg.experts, cfg.top_k, cfg.hidden, cfg.intermediate, quant="fp8_block", mode=mode,
                           backend=args.backend, max_tokens_per_rank=max(group_tokens + [ll]),
                           low_latency_max_tokens=ll, device=dev, **cfg.routing_kwargs(), **cfg.shared_kwargs())  # fmt: skip
        layer.load_expert_weights(weights, prefix)
        if args.pack and mode == "low_latency":
            layer.pack_weights()
        if rank == 0:
            why = f" ({layer.fallback_reason})" if layer.fallback_reason else ""
            print(f"# EPMoELayer mode={mode}{' packed' if args.pack and mode == 'low_latency' else ''}: backend "
                  f"{layer.backend}{why}", flush=True)  # fmt: skip
        for t in group_tokens:
            x, decode = xs[t], t <= args.ll_max
            out = layer(x)
            every = b.ranks(b.time_us(lambda: layer(x)))
            row = dict(tokens=t, impl="EPMoELayer", mode=mode, backend=layer.backend, us=statistics.median(every),
                       us_max=max(every), tok_s=t * world / max(every) * 1e6,
                       vs_base=base_us[t] / max(every) if t in base_us else None,
                       err_base=b.rel_err(out, refs.get(("base", t))), err_single=b.rel_err(out, refs.get(("single", t))),
                       phases=b.phases(layer, x))  # fmt: skip
            if decode and (mode == "low_latency" or (mode == "auto" and t <= layer.low_latency_max_tokens)):
                row.update(b.host_overhead(lambda: layer(x)))
            elif decode:
                row["graph_note"] = "high_throughput syncs the host: not capturable"
            _emit(rows, row, rank)
            if rank == 0:
                print(_goals(row, world, decode, single_us.get(t)), flush=True)
        layer.close()
        layer = None  # its memory is free before the next layer is built

    # Host-overhead reference: single-GPU fused_moe at T = 1 over all E experts, on rank 0 (the others wait).
    base = None
    if rank == 0:
        ref = single
        if ref is None:
            ref = MoELayer(cfg.experts, cfg.top_k, cfg.hidden, cfg.intermediate, router=False, quant="fp8_block",
                           device=dev)  # fmt: skip
            ref.load_expert_weights(weights, prefix + "experts.")
        ref.unpack_weights()  # fused_moe takes packed weights only wrapped; plain is the reference
        x1 = xs[tokens[0]][:1]
        logits = x1.float() @ weights[prefix + "gate.weight"].float().t()
        tw, ti = route(logits, cfg.top_k, **(cfg.routing_kwargs() | dict(correction_bias=bias)))
        kw = dict(quant="fp8_block", w13_scale=ref.w13_scale, w2_scale=ref.w2_scale, validate=False)
        us = b.time_us(lambda: fused_moe(x1, ref.w13, ref.w2, tw, ti, **kw), collective=False)
        row = dict(tokens=1, impl="fused_moe", mode="1 GPU", us=us, us_max=us, tok_s=1 / us * 1e6)
        _emit(rows, row | b.host_overhead(lambda: fused_moe(x1, ref.w13, ref.w2, tw, ti, **kw), collective=False), rank)
        ref = None
    dist.barrier(group=env.cpu_group)
    if rank == 0:
        meta = dict(command=" ".join(sys.argv), world=world, device=name, date=datetime.date.today().isoformat(),
                    config=dataclasses.asdict(cfg), baseline=BASELINE if has_base else "skipped (shared GPU)")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        if args.markdown:
            lines = [f"`{meta['command']}`: {world} x {name}, {meta['date']}. {meta['baseline']}.", "",
                     "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]  # fmt: skip
            Path(args.markdown).write_text(
                "\n".join(lines + ["| " + " | ".join(_cells(r)) + " |" for r in rows]) + "\n"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
