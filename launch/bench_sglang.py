"""SGLang's ``FusedMoE`` layer run by ``--moe-runner-backend flashinfer_moe`` against SGLang's own Triton
fused-MoE kernels on the same FP8 block weights, one GPU, same run.

    python launch/bench_sglang.py [--tokens 1,16,128,4096] [--routing deepseek|softmax] [--json F] [--markdown F]

The layer: DeepSeek-V3's routed experts (E 256, H 7168, I 2048, top-8), FP8 E4M3 weights with 128 x 128
``weight_scale_inv`` blocks (random), bf16 activations. Routing (not timed): random logits through
``flashinfer_moe.route`` (``deepseek``: grouped sigmoid, 8 groups / top-4, a correction bias; ``softmax``:
plain softmax top-8), handed to both sides as SGLang's ``StandardTopKOutput``.

Columns (us: median of CUDA-event timed repetitions after warm-up; err: relative L2 error):
  ours          ``layer(x, topk_output)`` of an SGLang ``FusedMoE`` (``Fp8Config`` block [128, 128]) whose
                runner is this library's, eager (Python dispatch included)
  ours graph    the same calls replayed from one CUDA graph ("n/a" where capture fails; the reason is printed)
  sgl gemms     SGLang's ``invoke_fused_moe_kernel`` for GEMM1 and GEMM2 alone (inputs already quantized and
                aligned), with the configs SGLang's ``try_get_optimal_moe_config`` picks
  sgl seq       SGLang's whole sequence as ``fused_experts_impl`` runs it: align, quantize, GEMM1, SiLU-and-mul,
                quantize, GEMM2 (router weight applied), sum over top-k; steps whose SGLang kernel cannot run
                here (no ``sgl_kernel``, or a JIT build fails) are replaced, and the notes say by what
  gemms/ours    sgl gemms / ours
  err ours~sgl  ours against SGLang's sequence, over all tokens
  err ours~ref, err sgl~ref  against a float64 reference (``flashinfer_moe.reference_gemm.fused_moe``: the
                same per-token-group FP8 activation quantization) on the first ``--ref-tokens`` tokens, T <= 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_eager, time_graph  # noqa: E402

require_gpus(1)

import torch  # noqa: E402

from flashinfer_moe._import_standin import install_import_standin  # noqa: E402

E, H, I, TOP_K, BLOCK = 256, 7168, 2048, 8, 128
FP8 = torch.float8_e4m3fn
NOTES: list[str] = []


def note(line: str) -> None:
    if line not in NOTES:
        NOTES.append(line)
        print(f"# note: {line}", flush=True)


def ensure_sgl_kernel() -> None:
    """SGLang's CUDA MoE modules import names from ``sgl_kernel`` at module level; the benchmark never calls
    them, so where it does not import, an import-only stand-in answers."""
    try:
        import sgl_kernel  # noqa: F401
    except Exception as exc:  # absent, or its CUDA library does not load here
        install_import_standin("sgl_kernel")
        note(f"sgl_kernel not importable ({type(exc).__name__}: {exc}); an import-only stand-in is installed")


# -------------------------------------------------------------------------------------------- SGLang set-up


def setup_sglang() -> None:
    """SGLang's process state for one ``FusedMoE`` on cuda:0 (TP = EP = 1), plugins loaded."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    try:
        args = ServerArgs(model_path="dummy", device="cuda", tp_size=1, ep_size=1)
    except Exception as exc:
        note(f"ServerArgs(device='cuda') failed ({type(exc).__name__}: {exc}); published with device='cpu'")
        args = ServerArgs(model_path="dummy", device="cpu", tp_size=1, ep_size=1)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    initialize_moe_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    parallel_state.initialize_model_parallel()


def make_layer(gen: torch.Generator):
    """SGLang's ``FusedMoE`` with our runner and random FP8 block weights written into its parameters."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, resolve_moe_runner_backend
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.runtime_context import get_flags

    flags = get_flags().moe
    flags.runner_backend = resolve_moe_runner_backend("flashinfer_moe")
    try:
        with torch.device("cuda"):
            layer = FusedMoE(
                num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, layer_id=0,
                params_dtype=torch.bfloat16,
                quant_config=Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[BLOCK, BLOCK]),
            )  # fmt: skip
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name).data
            for e in range(w.shape[0]):  # one expert at a time: no [E, N, K] bf16 temporary
                w[e].copy_(torch.randn(w.shape[1:], generator=gen, device="cuda").clamp_(-8, 8).to(FP8))
            s = getattr(layer, name + "_scale_inv").data
            # FP8 values ~N(0, 1) times 1/sqrt(K): the dequantized weights have unit-variance outputs.
            s.copy_(torch.rand(s.shape, generator=gen, device="cuda").add_(0.5).div_(w.shape[2] ** 0.5))
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        flags.runner_backend = MoeRunnerBackend.AUTO
    takeover = getattr(layer.quant_method, "_flashinfer_moe_takeover", None)
    if takeover is None:
        raise RuntimeError("the flashinfer_moe runner did not take the layer over (see the log above)")
    return layer


def routing(t: int, kind: str, gen: torch.Generator):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from flashinfer_moe import route

    x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(t, E, generator=gen, device="cuda")
    if kind == "deepseek":
        bias = torch.randn(E, generator=gen, device="cuda") / 10
        w, ids = route(logits, TOP_K, scoring_func="sigmoid", num_expert_group=8, topk_group=4, correction_bias=bias)
    else:
        w, ids = route(logits, TOP_K, scoring_func="softmax")
    return x, StandardTopKOutput(
        topk_weights=w.float().contiguous(), topk_ids=ids.int().contiguous(), router_logits=logits
    )


# ------------------------------------------------------------------------------- SGLang's Triton sequence


def torch_align(topk_ids: torch.Tensor, block: int, num_experts: int):
    """SGLang's ``moe_align_block_size`` output format, from torch ops without a host sync: buckets are
    ``id + 1`` (0 holds the -1 ids), each padded to a multiple of ``block``, in bucket order; pad slots hold
    ``numel``; ``expert_ids`` per block is ``bucket - 1``; ``[total]`` padded rows."""
    numel, dev = topk_ids.numel(), topk_ids.device
    if numel < num_experts + 1:
        cap = numel * block
    else:
        cap = numel + (num_experts + 1) * (block - 1)
    cap = (cap + 3) // 4 * 4
    bucket = topk_ids.reshape(-1).long() + 1
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)
    sb = bucket[order]
    pos = (ends - padded)[sb] + torch.arange(numel, device=dev) - (counts.cumsum(0) - counts)[sb]
    sorted_ids = torch.full((cap,), numel, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    starts = torch.arange(-(-cap // block), device=dev) * block
    total = ends[-1]
    expert_ids = torch.where(starts < total, torch.searchsorted(ends, starts, right=True) - 1, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.reshape(1).to(torch.int32)


class SglangTriton:
    """SGLang's ``fused_experts_impl`` for FP8 block weights, step by step, on the layer's own tensors."""

    def __init__(self, layer):
        from sglang.kernels.ops.moe import fused_moe_triton_kernels as k
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as cfgmod

        self.k, self.cfgmod = k, cfgmod
        self.w1, self.w2 = layer.w13_weight.data, layer.w2_weight.data
        self.s1, self.s2 = layer.w13_weight_scale_inv.data, layer.w2_weight_scale_inv.data
        self.quant, self.act, self.sum = self._pick_quant(), self._pick_act(), self._pick_sum()

    # Each pick tries SGLang's CUDA-path kernel on a small input, then a substitute.
    def _pick_quant(self):
        from sglang.kernels.ops.quantization import fp8_kernel

        probe = torch.randn(3, 2 * BLOCK, device="cuda", dtype=torch.bfloat16)
        for name in ("sglang_per_token_group_quant_fp8", "per_token_group_quant_fp8"):
            fn = getattr(fp8_kernel, name, None)
            try:
                q, s = fn(probe, BLOCK)
                torch.cuda.synchronize()
                if q.dtype == FP8 and tuple(s.shape) == (3, 2):
                    if name != "sglang_per_token_group_quant_fp8":
                        note(f"activation quant: SGLang's Triton {name} (sglang_per_token_group_quant_fp8 failed)")
                    return lambda x, fn=fn: fn(x, BLOCK)
            except Exception as exc:
                note(f"activation quant: SGLang's {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
        from flashinfer_moe import quantize_fp8_per_token_group

        note("activation quant: substitute flashinfer_moe.quantize_fp8_per_token_group")
        return lambda x: quantize_fp8_per_token_group(x, BLOCK)

    def _pick_act(self):
        try:
            from sglang.kernels.ops.activation.activation import silu_and_mul

            a = torch.randn(4, 2 * BLOCK, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(4, BLOCK, device="cuda", dtype=torch.bfloat16)
            silu_and_mul(a, out)
            torch.cuda.synchronize()
            want = torch.nn.functional.silu(a[:, :BLOCK].float()) * a[:, BLOCK:].float()
            if (out.float() - want).abs().max() <= 0.05:
                return lambda c1, c2, ids: silu_and_mul(c1, c2, expert_ids=ids.view(-1), expert_step=1)
            note("silu_and_mul: SGLang's JIT kernel gave wrong values on a probe")
        except Exception as exc:
            note(f"silu_and_mul: SGLang's JIT kernel failed: {type(exc).__name__}: {str(exc)[:200]}")
        note("silu_and_mul: substitute torch F.silu(gate) * up (every row)")

        def act(c1, c2, ids):
            g, u = c1.chunk(2, dim=-1)
            torch.mul(torch.nn.functional.silu(g), u, out=c2)

        return act

    def _pick_sum(self):
        try:
            x = torch.randn(2, TOP_K, H, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(2, H, device="cuda", dtype=torch.bfloat16)
            self.k.moe_sum_reduce_triton(x, out, 1.0)
            torch.cuda.synchronize()
            if (out.float() - x.float().sum(1)).abs().max() <= 0.1:
                note("top-k sum: SGLang's moe_sum_reduce_triton at every T (SGLang's CUDA path uses it for "
                     "T <= 32 with PDL, sgl_kernel.moe_sum_reduce above)")  # fmt: skip
                return lambda c3, out: self.k.moe_sum_reduce_triton(c3, out, 1.0)
        except Exception as exc:
            note(f"top-k sum: moe_sum_reduce_triton failed: {type(exc).__name__}: {str(exc)[:200]}")
        note("top-k sum: substitute torch .sum(dim=1)")
        return lambda c3, out: torch.sum(c3, dim=1, out=out)

    def config(self, t: int, quiet: bool = False):
        """SGLang's (GEMM1 config, GEMM2 config) for T tokens, as ``_prepare_fused_moe_run`` gets them."""
        dtype = self.cfgmod.get_config_dtype_str(use_fp8_w8a8=True, dtype=torch.bfloat16)
        config, (down, _) = self.cfgmod.try_get_optimal_moe_config(
            self.w1.shape, self.w2.shape, TOP_K, dtype, t, block_shape=[BLOCK, BLOCK], return_down_config=True
        )
        config, down = dict(config), dict(down) if down else None
        tma = config.pop("USE_TMA", False) | (down is not None and down.pop("USE_TMA", False))
        if not quiet:
            if tma:
                note("a tuned config asked for TMA; run without it (SGLang's TMA path needs its JIT quant)")
            tuned = self.cfgmod.get_moe_configs(E, I, dtype, BLOCK, BLOCK)
            note(f"SGLang config for E={E} N={I} fp8_w8a8 [128,128]: " + ("tuned file" if tuned else "default"))
        return config, down or config

    def align(self, topk_ids: torch.Tensor, block_m: int):
        """``(fn, what)``: SGLang's ``moe_align_block_size`` if it runs for these ids, else its JIT kernel,
        else :func:`torch_align`; checked against :func:`torch_align`."""
        from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size

        want = torch_align(topk_ids, block_m, E)
        total = int(want[2])
        for what, fn in (("SGLang moe_align_block_size", lambda: moe_align_block_size(topk_ids, block_m, E)),
                         ("SGLang JIT moe_align", lambda: self._jit_align(topk_ids, block_m))):  # fmt: skip
            try:
                got = fn()
                torch.cuda.synchronize()
                ok = int(got[2][0]) == total and torch.equal(got[1][: total // block_m], want[1][: total // block_m])
                if ok:
                    return fn, what
                note(f"{what}: output differs from the torch align; not used")
            except Exception as exc:
                note(f"{what} failed (T*k={topk_ids.numel()}): {type(exc).__name__}: {str(exc)[:200]}")
        return (lambda: torch_align(topk_ids, block_m, E)), "torch align (substitute)"

    @staticmethod
    def _jit_align(topk_ids, block_m):
        from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit_align

        sorted_ids, expert_ids, ntp = torch_align(topk_ids, block_m, E)  # buffers of SGLang's sizes
        cumsum = torch.empty(E + 2, dtype=torch.int32, device=topk_ids.device)
        jit_align(topk_ids, E + 1, block_m, sorted_ids, expert_ids, ntp, cumsum, True)
        return sorted_ids, expert_ids, ntp

    def gemm(self, a, a_scale, w, w_scale, c, topk, aligned, mul_weight, top_k, config):
        import triton.language as tl

        self.k.invoke_fused_moe_kernel(
            a, w, None, c, a_scale, w_scale, None, topk.topk_weights, topk.topk_ids, *aligned, mul_weight, top_k,
            config, compute_type=tl.bfloat16, use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False,
            use_int4_w4a16=False, per_channel_quant=False, block_shape=[BLOCK, BLOCK], filter_expert=True,
            router_topk=TOP_K,
        )  # fmt: skip

    def prepare(self, x, topk):
        """``(sequence, gemms_only)`` callables for these inputs."""
        t = x.shape[0]
        c1cfg, c2cfg = self.config(t)
        align, what = self.align(topk.topk_ids, c1cfg["BLOCK_SIZE_M"])
        self.align_used = what

        def sequence():
            self.config(t, quiet=True)  # SGLang looks its configs up on every call
            aligned = align()
            c1 = torch.empty(t * TOP_K, 2 * I, device=x.device, dtype=x.dtype)
            xq, xs = self.quant(x)
            self.gemm(xq, xs, self.w1, self.s1, c1, topk, aligned, False, TOP_K, c1cfg)
            c2 = torch.empty(t * TOP_K, I, device=x.device, dtype=x.dtype)
            self.act(c1, c2, topk.topk_ids)
            aq, as_ = self.quant(c2)
            c3 = torch.empty(t, TOP_K, H, device=x.device, dtype=x.dtype)
            self.gemm(aq, as_, self.w2, self.s2, c3, topk, aligned, True, 1, c2cfg)
            out = torch.empty_like(x)
            self.sum(c3, out)
            return out

        aligned = align()
        xq, xs = self.quant(x)
        c1 = torch.empty(t * TOP_K, 2 * I, device=x.device, dtype=x.dtype)
        self.gemm(xq, xs, self.w1, self.s1, c1, topk, aligned, False, TOP_K, c1cfg)
        c2 = torch.empty(t * TOP_K, I, device=x.device, dtype=x.dtype)
        self.act(c1, c2, topk.topk_ids)
        aq, as_ = self.quant(c2)
        c3 = torch.empty(t, TOP_K, H, device=x.device, dtype=x.dtype)

        def gemms_only():
            self.gemm(xq, xs, self.w1, self.s1, c1, topk, aligned, False, TOP_K, c1cfg)
            self.gemm(aq, as_, self.w2, self.s2, c3, topk, aligned, True, 1, c2cfg)

        return sequence, gemms_only


# ------------------------------------------------------------------------------------------------ measure


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def reference(layer, x, topk, n: int) -> torch.Tensor:
    """float64 of the first ``n`` tokens over the experts they use only (the whole layer in float64 would
    not fit)."""
    from flashinfer_moe.reference_gemm import fused_moe as ref_moe

    ids = topk.topk_ids[:n].long()
    used, local = torch.unique(ids, return_inverse=True)
    w13, w2 = layer.w13_weight.data[used], layer.w2_weight.data[used]
    s13, s2 = layer.w13_weight_scale_inv.data[used], layer.w2_weight_scale_inv.data[used]
    return ref_moe(x[:n], w13, w2, topk.topk_weights[:n], local.to(torch.int32), quant="fp8_block",
                   w13_scale=s13, w2_scale=s2, out_dtype=torch.float64)  # fmt: skip


def graph_us(fn, calls: int, reps: int):
    try:
        return time_graph(lambda i: fn(), calls=calls, reps=reps), None
    except Exception as exc:  # report it and go on
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


COLUMNS = ("T", "ours FusedMoE (us)", "ours graph (us)", "SGLang Triton GEMMs only (us)",
           "SGLang Triton sequence w/ substitutes (us)", "GEMMs-only / ours", "err ours~sgl", "err ours~ref",
           "err sgl~ref", "align")  # fmt: skip


def cells(r: dict) -> list[str]:
    def f(v, spec=".1f"):
        return "n/a" if v is None else format(v, spec)

    return [str(r["tokens"]), f(r["ours_us"]), f(r["ours_graph_us"]), f(r["sgl_gemms_us"]), f(r["sgl_seq_us"]),
            f(r["gemms_over_ours"], ".2f"), f(r["err_ours_sgl"], ".2e"), f(r["err_ours_ref"], ".2e"),
            f(r["err_sgl_ref"], ".2e"), r.get("align") or ""]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,128,4096")
    p.add_argument("--routing", default="deepseek", choices=("deepseek", "softmax"))
    p.add_argument("--calls", type=int, default=20, help="calls per timed repetition")
    p.add_argument("--reps", type=int, default=9, help="timed repetitions (the median is reported)")
    p.add_argument("--ref-tokens", type=int, default=4, help="tokens checked against float64 (T <= 128 only)")
    p.add_argument(
        "--intermediate",
        type=int,
        default=2048,
        help="expert intermediate size: 2048 (the whole expert, as with expert parallelism) or 256 (a TP8 shard, "
        "the shape SGLang ships tuned Triton configs for)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    global I
    I = args.intermediate

    torch.cuda.set_device(0)
    torch.set_grad_enabled(False)
    ensure_sgl_kernel()
    import sglang

    from flashinfer_moe import __version__ as fim_version

    setup_sglang()
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    layer = make_layer(gen)
    sgl = SglangTriton(layer)
    name = torch.cuda.get_device_name()
    print(f"# {name}; SGLang {sglang.__version__}, flashinfer-moe {fim_version}, torch {torch.__version__}; "
          f"E={E} H={H} I={I} top-{TOP_K}, FP8 block 128x128, routing {args.routing}")  # fmt: skip
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
    rows = []
    for t in tokens:
        x, topk = routing(t, args.routing, gen)
        r = dict(tokens=t, ours_us=None, ours_graph_us=None, sgl_gemms_us=None, sgl_seq_us=None,
                 gemms_over_ours=None, err_ours_sgl=None, err_ours_ref=None, err_sgl_ref=None, graph_note=None)  # fmt: skip
        ours = layer(x, topk)
        r["ours_us"] = time_eager(lambda: layer(x, topk), calls=args.calls, reps=args.reps)
        r["ours_graph_us"], r["graph_note"] = graph_us(lambda: layer(x, topk), args.calls, args.reps)
        try:
            sequence, gemms = sgl.prepare(x, topk)
            r["align"] = sgl.align_used
            theirs = sequence()
            r["sgl_seq_us"] = time_eager(sequence, calls=args.calls, reps=args.reps)
            r["sgl_gemms_us"] = time_eager(gemms, calls=args.calls, reps=args.reps)
            r["gemms_over_ours"] = r["sgl_gemms_us"] / r["ours_us"]
            r["err_ours_sgl"] = rel_err(ours, theirs)
        except Exception as exc:
            theirs = None
            r["sgl_note"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if t <= 128 and args.ref_tokens > 0:
            n = min(t, args.ref_tokens)
            try:
                ref = reference(layer, x, topk, n)
                r["err_ours_ref"] = rel_err(ours[:n], ref)
                r["err_sgl_ref"] = None if theirs is None else rel_err(theirs[:n], ref)
            except Exception as exc:
                r["ref_note"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ref = None
        rows.append(r)
        print("| " + " | ".join(cells(r)) + " |", flush=True)
        for key in ("graph_note", "sgl_note", "ref_note"):
            if r.get(key):
                print(f"#   T={t}: {key}: {r[key]}", flush=True)
    print("# notes:\n" + "\n".join(f"#   - {n}" for n in NOTES), flush=True)
    meta = dict(command=" ".join(sys.argv), device=name, date=datetime.date.today().isoformat(),
                sglang=sglang.__version__, flashinfer_moe=fim_version, torch=torch.__version__,
                shape=dict(E=E, H=H, I=I, top_k=TOP_K, quant="fp8_block 128x128"), routing=args.routing,
                calls=args.calls, reps=args.reps, ref_tokens=args.ref_tokens)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, notes=NOTES, rows=rows), indent=1))
    if args.markdown:
        lines = [f"`{meta['command']}`: {name}, {meta['date']}, SGLang {meta['sglang']}.", "",
                 "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]  # fmt: skip
        lines += ["| " + " | ".join(cells(r)) + " |" for r in rows] + ["", *(f"- {n}" for n in NOTES)]
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
