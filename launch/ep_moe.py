"""The main job: MoE layers split over the ranks of an expert-parallel group (``flashinfer_moe.EPMoELayer``),
run on a prefill step and decode steps, checked against a single-process reference, and timed.

    torchrun --nproc-per-node N launch/ep_moe.py [--model tiny|deepseek-v3|kimi-k2|qwen3-235b|qwen3-30b|mixtral]
    mpirun -np N python launch/ep_moe.py [options]

Every rank builds the same random global weights from ``--seed`` (each tensor from a generator seeded by its
layer and name, so nothing is communicated and a rank makes only its own experts), or loads them from
``--checkpoint`` (Hugging Face layout). Each step draws random hidden states per rank; the layers' router
picks the experts; each layer's output feeds the next through a residual add. Rank 0 gathers every layer's
inputs and outputs, computes them again with one ``flashinfer_moe.MoELayer`` holding all experts plus the
shared MLP in plain torch, and prints the relative errors and PASS or FAIL (exit status 1 on every rank on
FAIL). Then it prints the time per step (median of ``--repeats``, slowest rank) and per phase.

On a GPU machine each rank takes ``cuda:{LOCAL_RANK}`` and NCCL (``--share-gpu``: all on cuda:0, gloo, the
P2P all-to-all over CUDA IPC); without a GPU, CPU and gloo, where the kernels run their plain-torch reference.
"""

from __future__ import annotations

import os

# Before torch.distributed starts (ep_common.COMM_ENV says why).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_common import (  # noqa: E402
    PRESETS,
    Log,
    RandomMoEWeights,
    RankParser,
    UsageError,
    available_memory_bytes,
    gather_rows,
    generator,
    hf_prefix,
    memory_estimate,
    non_negative,
    positive,
    run_job,
    save_checkpoint,
    sync,
    time_per_call,
)

PHASES = ("route", "dispatch", "experts", "combine", "shared")
# Bounds on max|out - ref| / max|ref| and on the normwise error, by quant. Routing, dispatch and the routed
# experts run the same ops as the reference (the same FP8 rounding of the same rows), and the reference's shared
# MLP rounds its activations as the layer's does, so what differs is the order of the sums (over experts and
# ranks, in bf16/fp32), the bf16 output, and with FP8 on a GPU the requantization of GEMM1's output, which lands
# on the neighbouring FP8 value (2**-4 relative) where the two kernels summed in another order; with a small I
# one such element moves an output by ~1%. Observed, max / normwise: without FP8 8e-3 / 3.2e-3 (CPU, tiny, 2-3
# ranks, 4 seeds) and 5.7e-3 / 3.2e-3 (H100); fp8_block 6.5e-3 / 3e-3 on CPU, on an H100 up to 2.2e-2 / 3.8e-3
# (tiny, 1-2 ranks, 3 seeds) and 8.5e-3 / 3.3e-3 (deepseek-v3): bounds 2.5-4x that. fp8_tensor differs by
# design: its reference (MoELayer) scales the experts' activations per tensor where the layer sends them per
# 128 channels, two FP8 roundings of 3-4% each: observed 8e-2 / 6.4e-2 (CPU and H100), so its bounds only catch
# gross errors (one wrong expert gives 30% and more).
TOLERANCE = {None: (2e-2, 1e-2), "fp8_block": (6e-2, 1.5e-2), "fp8_tensor": (1.5e-1, 9e-2)}
CPU_MAX_RANDOM_VALUES = 2e9  # past this a CPU run spends minutes making weights: refuse, suggest shrinking


def parse_args(argv=None) -> argparse.Namespace:
    p = RankParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="shapes and routing (default tiny)")
    for flag, what in (("--experts", "E"), ("--hidden", "H"), ("--intermediate", "I"), ("--top-k", "k")):
        p.add_argument(flag, type=positive, help=f"override the preset's {what}")
    p.add_argument("--layers", type=positive, default=1, help="MoE layers run in sequence, each its own weights")
    p.add_argument("--first-layer", type=non_negative, default=0, help="index of the first layer's weights")
    p.add_argument("--quant", choices=("none", "fp8_block", "fp8_tensor"), help="default fp8_block on GPU, none on CPU")
    p.add_argument("--mode", choices=("auto", "high_throughput", "low_latency"), default="auto")
    p.add_argument("--backend", choices=("auto", "p2p", "nccl"), default="auto", help="the all-to-all's")
    p.add_argument("--tokens-per-rank", type=positive, help="decode tokens per rank (default 128 GPU, 4 CPU)")
    p.add_argument("--prefill-tokens-per-rank", type=positive, help="default 4096 GPU, 32 CPU")
    p.add_argument("--decode-steps", type=non_negative, default=2)
    p.add_argument("--repeats", type=positive, help="timed repeats per step (default 10 GPU, 3 CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", metavar="DIR", help="load the weights from safetensors files (HF layout)")
    p.add_argument("--save-checkpoint", metavar="DIR", help="write the random weights there first (rank 0)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (rank 0)")
    p.add_argument("--no-check", action="store_true", help="skip the single-process reference")
    p.add_argument("--share-gpu", action="store_true", help="every rank on cuda:0, gloo group, P2P all-to-all")
    p.add_argument("--timeout", type=float, default=120.0, help="process group start/operation bound (s)")
    args = p.parse_args(argv)
    if args.share_gpu and args.backend == "nccl":
        p.error("--share-gpu puts every rank on one GPU, where NCCL cannot run two ranks: use --backend p2p (or auto)")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    return args


def _forward(layers, x, phase_times: dict | None = None, keep: list | None = None) -> torch.Tensor:
    """One step through every layer (residual add between them); ``keep`` receives (input, output) per layer."""
    for layer in layers:
        times = {} if phase_times is not None else None
        out = layer(x, phase_times=times)
        if keep is not None:
            keep.append((x, out))
        for name, seconds in (times or {}).items():
            phase_times[name] = phase_times.get(name, 0.0) + seconds
        x = x + out
    return x


def _dense(src, name: str, device) -> torch.Tensor:
    """One projection in fp32, FP8 dequantized with its scale."""
    w = src[name + "weight"].to(device)
    if w.dtype != torch.float8_e4m3fn:
        return w.float()
    if name + "weight_scale_inv" in src:
        from flashinfer_moe.reference_quant import dequantize_fp8_block

        return dequantize_fp8_block(w, src[name + "weight_scale_inv"].to(device).float())
    return w.float() * src[name + "weight_scale"].to(device).float()


def _fp8_rounded(t: torch.Tensor, quant: str | None) -> torch.Tensor:
    """``t`` as the layer's FP8 activations hold it (per 128 channels, or per tensor), dequantized."""
    from flashinfer_moe import quantize_fp8_per_tensor, quantize_fp8_per_token_group

    if quant == "fp8_block":
        q, scale = quantize_fp8_per_token_group(t, 128)
        return q.float() * scale.repeat_interleave(128, dim=-1)
    if quant == "fp8_tensor":
        q, scale = quantize_fp8_per_tensor(t.bfloat16())  # the layer rounds GEMM1's output to bf16 first
        return q.float() * scale
    return t.float()


def _shared_mlp(x, gate, up, down, quant) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` in fp32 from the fp32 weights, with the FP8 rounding of the layer's
    activations (its input and GEMM2's input) where it has FP8, so that the bounds can stay tight."""
    x = _fp8_rounded(x, quant)
    return _fp8_rounded(F.silu(x @ gate.t()) * (x @ up.t()), quant) @ down.t()


def _check(args, env, cfg, quant, steps, gathered, src, log) -> list[dict]:
    """Rank 0: every layer again with one MoELayer of all experts plus the shared MLP in plain torch; the
    relative errors per (layer, kind of step)."""
    from flashinfer_moe import MoELayer

    dev, h = env.device, cfg.hidden
    tol_max, tol_norm = TOLERANCE[quant]
    rows = []
    for i in range(args.layers):
        t0, p = time.perf_counter(), hf_prefix(args.first_layer + i)
        log(f"rank 0: reference layer {i + 1}/{args.layers}: loading all {cfg.experts} experts on {dev}...")
        ref = MoELayer(cfg.experts, cfg.top_k, h, cfg.intermediate, quant=quant, **cfg.routing_kwargs(), device=dev)
        ref.load_expert_weights(src, p + "experts.")
        bias = src[p + "gate.e_score_correction_bias"].to(dev) if cfg.correction_bias else None
        ref.load_router_weight(src[p + "gate.weight"].to(dev), bias)
        shared = None
        if cfg.shared_experts:
            shared = [_dense(src, f"{p}shared_experts.{j}_proj.", dev) for j in ("gate", "up", "down")]
        stats = {}
        for (kind, _), per_layer in zip(steps, gathered, strict=True):
            s = stats.setdefault(kind, [0.0, 0.0, 0.0, 0.0])  # max|err|, max|ref|, sum err^2, sum ref^2
            # Rank by rank: the router's matmul then has the layer's shape, so near-ties between experts are
            # decided by the same fp32 sums (a batch of another size may sum in another order).
            for chunk in per_layer[i]:
                if chunk.shape[0] == 0:
                    continue
                chunk = chunk.to(dev)
                x, out = chunk[:, :h], chunk[:, h:].float()
                expect = ref(x).float()
                if shared is not None:
                    expect += _shared_mlp(x, *shared, quant)
                err = out - expect
                s[0], s[1] = max(s[0], err.abs().max().item()), max(s[1], expect.abs().max().item())
                s[2] += err.double().square().sum().item()
                s[3] += expect.double().square().sum().item()
        for kind, (e_max, r_max, e_sq, r_sq) in stats.items():
            rel, norm = e_max / max(r_max, 1e-30), (e_sq / max(r_sq, 1e-30)) ** 0.5
            ok = rel <= tol_max and norm <= tol_norm
            rows.append(dict(layer=args.first_layer + i, step=kind, max_rel=rel, norm_rel=norm, passed=ok))
        log(f"rank 0: reference layer {i + 1}/{args.layers} done ({time.perf_counter() - t0:.1f} s)")
        del ref, shared
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(args, env, log: Log) -> int:
    from flashinfer_moe import EPMoELayer

    dev, gpu, rank, world = env.device, env.device.type == "cuda", env.rank, env.world
    overrides = dict(experts=args.experts, hidden=args.hidden, intermediate=args.intermediate, top_k=args.top_k)
    cfg = dataclasses.replace(PRESETS[args.model], **{k: v for k, v in overrides.items() if v is not None})
    quant_name = args.quant or ("fp8_block" if gpu else "none")
    quant = None if quant_name == "none" else quant_name
    decode_t = args.tokens_per_rank or (128 if gpu else 4)
    prefill_t = args.prefill_tokens_per_rank or (4096 if gpu else 32)
    reps = args.repeats or (10 if gpu else 3)
    problems = cfg.problems()
    if cfg.experts % world:
        problems.append(f"--experts {cfg.experts} must be divisible by the {world} ranks")
    if quant and any(n % 128 for n in (cfg.hidden, cfg.intermediate, cfg.shared_size)):
        problems.append(f"--quant {quant} needs --hidden and --intermediate in multiples of 128")
    if not gpu and args.backend == "p2p":
        problems.append("--backend p2p needs GPUs (CPU ranks exchange over gloo: --backend auto or nccl)")
    if problems:
        raise UsageError("; ".join(problems))
    est = memory_estimate(cfg, args.layers, quant)
    if not gpu:
        need, avail = est["layers_bytes"] + est["reference_bytes"], available_memory_bytes()
        if est["random_values"] > CPU_MAX_RANDOM_VALUES or (avail and need > 0.8 * avail):
            raise UsageError(
                f"--model {args.model} is too big for a CPU run: about {need / 2**30:.0f} GiB of weights (the "
                f"layers and the single-process reference) and {est['random_values'] / 1e9:.1f} G random values "
                "to make. Shrink it (e.g. --experts 16 --hidden 512 --intermediate 256) or run it on GPUs."
            )
    if env.shared_gpu and args.backend == "nccl":
        raise UsageError("the ranks share one GPU, where NCCL cannot run two ranks: use --backend p2p (or auto)")
    backend = "p2p" if env.shared_gpu and args.backend == "auto" else args.backend
    max_t = max(prefill_t, decode_t)
    # In auto mode the decode batch takes the low-latency exchange and a larger prefill batch high throughput.
    ll_t = max_t if args.mode == "low_latency" else decode_t
    modes = {
        t: args.mode if args.mode != "auto" else ("low_latency" if t <= ll_t else "high_throughput")
        for t in (prefill_t, decode_t)
    }
    steps = [("prefill", prefill_t)] + [("decode", decode_t)] * args.decode_steps
    dev_name = f"{dev} ({torch.cuda.get_device_name(dev)})" if gpu else "cpu"
    routing = f"{cfg.scoring_func}" + (" + bias" if cfg.correction_bias else "")
    if cfg.num_expert_group:
        routing += f", {cfg.num_expert_group} groups / top-{cfg.topk_group}"
    if cfg.routed_scaling_factor:
        routing += f", scale {cfg.routed_scaling_factor}"
    log(
        f"ep_moe: --model {args.model}: E {cfg.experts}, top-{cfg.top_k}, H {cfg.hidden}, I {cfg.intermediate}, "
        f"{cfg.shared_experts} shared (I {cfg.shared_size}); {routing}; {args.layers} layer(s)"
    )
    log(
        f"world {world} ({env.launcher}), device {dev_name}, group {env.backend}, quant {quant_name}"
        f"{'' if args.quant else ' (default on ' + ('GPU' if gpu else 'CPU') + ')'}, mode {args.mode}, "
        f"tokens/rank prefill {prefill_t} + {args.decode_steps} decode step(s) of {decode_t}"
    )
    if args.share_gpu and not gpu:
        log("no GPU: --share-gpu has no effect")
    log(
        f"weights: {est['layers_bytes'] / world / 2**30:.2f} GiB per rank; reference on rank 0 up to "
        f"{est['reference_bytes'] / 2**30:.2f} GiB"
    )

    source = RandomMoEWeights(
        cfg, args.layers, args.seed, dev, fp8_block=quant == "fp8_block", first_layer=args.first_layer
    )
    if args.save_checkpoint:
        if rank == 0:
            log(f"rank 0: writing the random weights to {args.save_checkpoint}...")
            save_checkpoint(source, args.save_checkpoint, log=lambda m: log(f"rank 0: {m}"))
        dist.barrier(group=env.cpu_group)

    kw = dict(
        group=env.group,
        quant=quant,
        mode=args.mode,
        backend=backend,
        max_tokens_per_rank=max_t,
        low_latency_max_tokens=ll_t,
        router=True,
        device=dev,
        **cfg.routing_kwargs(),
        **cfg.shared_kwargs(),
    )
    layers = []
    try:
        for i in range(args.layers):
            t0, p = time.perf_counter(), hf_prefix(args.first_layer + i)
            what = (
                f"loading layer {i + 1}/{args.layers} from {args.checkpoint}"
                if args.checkpoint
                else (f"generating layer {i + 1}/{args.layers} weights")
            )
            log(f"rank 0: {what} ({cfg.experts // world} of {cfg.experts} experts per rank)...")
            layer = EPMoELayer(cfg.experts, cfg.top_k, cfg.hidden, cfg.intermediate, **kw)
            layers.append(layer)
            if args.checkpoint:
                layer.load_safetensors(args.checkpoint, prefix=p)
            else:
                layer.load_expert_weights(source, prefix=p)
            sync(dev)
            log(f"rank 0: layer {i + 1}/{args.layers} ready ({time.perf_counter() - t0:.1f} s)")
        backend_used, reason = layers[0].backend, layers[0].fallback_reason
        if backend_used == "nccl" and env.backend == "gloo":
            backend_used = "collective over gloo"  # the collective path runs on the group's own backend
        why = reason or (
            "ranks sharing one GPU: P2P over CUDA IPC"
            if backend != args.backend
            else ("auto: every P2P check passed" if args.backend == "auto" else f"--backend {args.backend}")
        )
        log(f"all-to-all backend: {backend_used} ({why})")
        return _steps_and_report(
            args, env, log, cfg, quant, quant_name, layers, steps, modes, reps, source, backend_used, reason
        )
    finally:
        for layer in layers:
            layer.close()


def _steps_and_report(args, env, log, cfg, quant, quant_name, layers, steps, modes, reps, source, backend, reason):
    dev, rank, world = env.device, env.rank, env.world

    def hidden(step: int, t: int) -> torch.Tensor:
        return torch.randn(
            t, cfg.hidden, generator=generator(dev, args.seed, "hidden", rank, step), device=dev
        ).bfloat16()

    # The checked pass: inputs and outputs of every layer gathered on rank 0 (CPU).
    gathered = []
    for s, (kind, t) in enumerate(steps):
        first = s <= 1  # the first call of each kind (and so of each mode in auto mode)
        if first:
            compiles = " (compiles kernels on first use)" if dev.type == "cuda" else ""
            log(f"{kind} step, {t} tokens/rank, {modes[t]}: first call{compiles}...")
        t0, pairs = time.perf_counter(), []
        with torch.no_grad():
            _forward(layers, hidden(s, t), keep=pairs)
        sync(dev)
        if first:
            log(f"{kind} step: first call done ({time.perf_counter() - t0:.1f} s)")
        if not args.no_check:
            gathered.append([gather_rows(torch.cat(pair, dim=1), env.cpu_group) for pair in pairs])
        del pairs

    # The timed pass: per step (median over repeats of the slowest rank), then per phase (synchronized).
    results = []
    with torch.no_grad():
        for kind, t in dict(steps).items():
            x = hidden(0 if kind == "prefill" else 1, t)
            samples = time_per_call(lambda x=x: _forward(layers, x), env, reps)
            phases = []
            for _ in range(min(reps, 3)):
                times = {}
                _forward(layers, x, phase_times=times)
                phases.append(torch.tensor([times.get(name, 0.0) for name in PHASES], dtype=torch.float64))
            phases = torch.stack(phases)
            dist.all_reduce(phases, dist.ReduceOp.MAX, group=env.cpu_group)
            step_s = statistics.median(samples)
            results.append(
                dict(
                    step=kind,
                    tokens_per_rank=t,
                    global_tokens=t * world,
                    mode=modes[t],
                    step_ms=step_s * 1e3,
                    step_ms_samples=[v * 1e3 for v in samples],
                    tokens_per_s=t * world / step_s,
                    phases_ms={n: v * 1e3 for n, v in zip(PHASES, phases.median(0).values.tolist(), strict=True)},
                )
            )

    check = None
    if not args.no_check:
        if rank == 0:
            # A checkpoint just written from these same random weights is checked against them (round trip).
            roundtrip = (
                args.checkpoint
                and args.save_checkpoint
                and (Path(args.checkpoint).resolve() == Path(args.save_checkpoint).resolve())
            )
            if args.checkpoint and not roundtrip:
                from flashinfer_moe.checkpoint import SafetensorsMapping

                with SafetensorsMapping(args.checkpoint) as src:
                    check = _check(args, env, cfg, quant, steps, gathered, src, log)
            else:
                check = _check(args, env, cfg, quant, steps, gathered, source, log)
        box = [check]
        dist.broadcast_object_list(box, src=0, group=env.cpu_group)
        check = box[0]
    verdict = "SKIPPED" if check is None else ("PASS" if all(r["passed"] for r in check) else "FAIL")

    if rank == 0:
        print(
            f"\n{'step':8} {'T/rank':>6} {'tokens':>7} {'mode':15} {'step ms':>9} {'tokens/s':>10} "
            + " ".join(f"{n:>8}" for n in PHASES)
            + "   (phases in ms, slowest rank)"
        )
        for r in results:
            print(
                f"{r['step']:8} {r['tokens_per_rank']:>6} {r['global_tokens']:>7} {r['mode']:15} "
                f"{r['step_ms']:>9.3f} {r['tokens_per_s']:>10.0f} "
                + " ".join(f"{r['phases_ms'][n]:>8.3f}" for n in PHASES)
            )
        print(
            f"backend {backend} ({reason or 'no fallback'}), world {world}, device {dev}, quant {quant_name}, "
            f"mode {args.mode}, {args.layers} layer(s)"
        )
        if check is not None:
            tol = TOLERANCE[quant]
            print(f"\ncheck against the single-process reference (bounds: max rel {tol[0]:g}, normwise {tol[1]:g}):")
            for r in check:
                print(
                    f"  layer {r['layer']:>3} {r['step']:8} max rel err {r['max_rel']:.3e}  normwise "
                    f"{r['norm_rel']:.3e}  {'ok' if r['passed'] else 'FAIL'}"
                )
        print(f"\n{verdict}", flush=True)
        if args.json:
            report = dict(
                model=args.model,
                config=dataclasses.asdict(cfg),
                layers=args.layers,
                world=world,
                launcher=env.launcher,
                device=str(dev),
                group_backend=env.backend,
                quant=quant_name,
                mode=args.mode,
                backend=backend,
                fallback_reason=reason,
                seed=args.seed,
                steps=results,
                check=check,
                tolerance=dict(zip(("max_rel", "norm_rel"), TOLERANCE[quant], strict=True)),
                verdict=verdict,
            )
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            log(f"wrote {args.json}")
    return 1 if verdict == "FAIL" else 0


def main(argv=None) -> None:
    args = parse_args(argv)  # usage errors exit 2 here, on every rank alike
    run_job(
        lambda env: run(args, env, Log(env.rank)), prog="ep_moe.py", share_gpu=args.share_gpu, timeout_s=args.timeout
    )


if __name__ == "__main__":
    main()
