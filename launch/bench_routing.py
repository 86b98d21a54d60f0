"""Routing benchmark: the fused kernel against the torch reference, eager and torch.compile'd, same run.

    python launch/bench_routing.py [--tokens 1,128,4096,65536] [--markdown FILE] [--no-compile]

Times, in microseconds (median of repeated measurements, CUDA events):
  kernel (graph): GPU time per call, from replays of a CUDA graph holding 20 calls (no launch gaps);
  kernel (eager): wall time per call issued from Python in a loop (host overhead included);
  torch eager:    the reference (flashinfer_moe.reference.route) called eagerly;
  torch graph:    the same reference replayed from a CUDA graph (its GPU time alone);
  torch.compile:  the reference compiled with torch.compile (default mode), called eagerly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus, time_eager, time_graph  # noqa: E402

require_gpus(1)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_configs import MODEL_ROUTING, model_inputs  # noqa: E402

import flashinfer_moe  # noqa: E402
from flashinfer_moe import reference  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,128,4096,65536")
    parser.add_argument("--models", default=",".join(MODEL_ROUTING))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    # One compiled graph per (model, T): raise dynamo's recompile limit so none falls back to eager.
    torch._dynamo.config.recompile_limit = 256
    compiled_ref = None if args.no_compile else torch.compile(reference.route, dynamic=False)

    rows = []
    header = (
        f"{'model':<12} {'T':>6} {'E':>4} {'k':>2} | {'kernel graph':>12} {'kernel eager':>12} | "
        f"{'torch eager':>11} {'torch graph':>11} {'compile':>9} | {'eager/kern':>10} {'graph/graph':>11}"
    )
    print(f"# {torch.cuda.get_device_name()}, logits {args.dtype}, times in us")
    print(header)
    for name in args.models.split(","):
        for num_tokens in [int(t) for t in args.tokens.split(",")]:
            logits, top_k, kwargs = model_inputs(name, num_tokens, dtype, "cuda", gen)
            out = (
                torch.empty(num_tokens, top_k, device="cuda"),
                torch.empty(num_tokens, top_k, dtype=torch.int32, device="cuda"),
            )
            w, ids = flashinfer_moe.route(logits, top_k, out=out, **kwargs)
            w_ref, ids_ref = reference.route(logits, top_k, **kwargs)
            assert torch.equal(ids, ids_ref), f"{name} T={num_tokens}: kernel ids differ from the reference"

            def kernel(logits=logits, top_k=top_k, out=out, kwargs=kwargs):
                flashinfer_moe.route(logits, top_k, out=out, **kwargs)

            def ref(logits=logits, top_k=top_k, kwargs=kwargs):
                reference.route(logits, top_k, **kwargs)

            k_graph = time_graph(lambda i: kernel())  # noqa: B023
            k_graph_again = time_graph(lambda i: kernel())  # noqa: B023  # the same measurement twice: its spread is the noise floor
            k_eager = time_eager(kernel)
            r_eager = time_eager(ref, calls=20)
            try:
                r_graph = time_graph(lambda i: ref(), calls=5)  # noqa: B023
            except Exception as exc:  # report, do not hide, a reference that cannot be captured
                print(f"  (reference not capturable: {type(exc).__name__}: {exc})")
                r_graph = float("nan")
            r_comp = float("nan")
            if compiled_ref is not None:
                t0 = time.perf_counter()
                compiled_ref(logits, top_k, **kwargs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                r_comp = time_eager(lambda: compiled_ref(logits, top_k, **kwargs), calls=20)  # noqa: B023
            else:
                compile_s = float("nan")
            num_experts = logits.shape[1]
            row = dict(
                model=name,
                tokens=num_tokens,
                experts=num_experts,
                top_k=top_k,
                dtype=args.dtype,
                kernel_graph_us=k_graph,
                kernel_graph_again_us=k_graph_again,
                kernel_eager_us=k_eager,
                torch_eager_us=r_eager,
                torch_graph_us=r_graph,
                torch_compile_us=r_comp,
                torch_compile_first_call_s=compile_s,
                eager_over_kernel_eager=r_eager / k_eager,
                graph_over_graph=r_graph / k_graph,
            )
            rows.append(row)
            print(
                f"{name:<12} {num_tokens:>6} {num_experts:>4} {top_k:>2} | {k_graph:>12.2f} {k_eager:>12.2f} | "
                f"{r_eager:>11.1f} {r_graph:>11.1f} {r_comp:>9.1f} | {r_eager / k_eager:>9.1f}x "
                f"{r_graph / k_graph:>10.1f}x",
                flush=True,
            )

    if args.markdown:
        lines = [
            "| model | T | E | k | kernel, graph (us, timed twice) | kernel, eager (us) | torch eager (us) | torch graph (us) "
            "| torch.compile (us) | torch eager / kernel eager | torch graph / kernel graph |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['model']} | {r['tokens']} | {r['experts']} | {r['top_k']} | {r['kernel_graph_us']:.2f} / {r['kernel_graph_again_us']:.2f} | "
                f"{r['kernel_eager_us']:.2f} | {r['torch_eager_us']:.1f} | {r['torch_graph_us']:.1f} | "
                f"{r['torch_compile_us']:.1f} | {r['eager_over_kernel_eager']:.1f}x | {r['graph_over_graph']:.1f}x |"
            )
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
