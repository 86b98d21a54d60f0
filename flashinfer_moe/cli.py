"""The ``flashinfer-moe`` command (also ``python -m flashinfer_moe``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from . import __version__

# Modules that register kernel families with the JIT; `build` and `env` import them all.
KERNEL_MODULES = (
    "flashinfer_moe.moe.routing",
    "flashinfer_moe.moe._kernels",
    "flashinfer_moe.moe.gemm_sm90",
    "flashinfer_moe.moe.gemm_nvfp4_sm90",
    "flashinfer_moe.comm.p2p_check",
    "flashinfer_moe.comm._kernels",
    "flashinfer_moe.mla.append",
    "flashinfer_moe.mla.decode_sm90",
)


def _load_kernel_registry():
    import importlib

    from . import jit

    for name in KERNEL_MODULES:
        importlib.import_module(name)
    return jit


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _one_line(text: str) -> str:
    """``text`` on one line: its lines joined with "; " (a field of ``env`` is one line, whatever reported it)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from . import sysinfo

    jit = _load_kernel_registry()
    rows: list[tuple[str, str]] = [
        ("flashinfer-moe", f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (built for CUDA {torch.version.cuda or 'none'})"),
        ("driver", sysinfo.driver_versions()),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            rows.append(
                (
                    f"GPU {i}",
                    f"{prop.name}, compute capability {prop.major}.{prop.minor}, "
                    f"{prop.multi_processor_count} SMs, {prop.total_memory / 2**30:.0f} GiB",
                )
            )
    else:
        rows.append(("GPUs", "none visible to torch"))
    try:
        nvcc = jit.find_nvcc()
        rows.append(("nvcc", f"{nvcc} ({jit.nvcc_version(nvcc)})"))
    except Exception as exc:
        rows.append(("nvcc", f"not found ({exc})"))
    try:
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        rows.append(("NCCL (torch)", sysinfo.nccl_library() if nccl else "not available"))
    except Exception as exc:
        rows.append(("NCCL (torch)", f"not available ({exc})"))
    builds, size = jit.cache_size()
    rows.append(("cache dir", f"{jit.cache_root()} ({builds} builds, {_format_bytes(size)})"))
    rows.append(("kernels", ", ".join(sorted(jit.REGISTRY))))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}} : {_one_line(value)}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    jit = _load_kernel_registry()

    names = args.kernel or sorted(jit.REGISTRY)
    unknown = [n for n in names if n not in jit.REGISTRY]
    if unknown:
        print(f"flashinfer-moe build: unknown kernel(s) {unknown}; known: {sorted(jit.REGISTRY)}", file=sys.stderr)
        return 2
    if args.arch:
        arch, where = [a.strip() for a in args.arch.split(",")], ""
    else:
        arch, where = jit.current_arch(), jit.arch.arch_origin()
    # Every family is checked against the targets before anything is compiled, so an unsupported GPU gets
    # one clear message per family instead of a compiler error partway through.
    plan, refused = [], []
    for name in names:
        spec = jit.REGISTRY[name]
        if spec.archs and not set(spec.archs) & set(arch) and not args.kernel:
            print(f"{name}: skipped (written for sm_{', sm_'.join(spec.archs)} only)")
            continue
        try:
            targets = jit.supported_archs(spec, arch, where)
        except jit.UnsupportedArchError as exc:
            refused.append(str(exc))
            continue
        # An optional dependency that is missing skips its family when everything is built (the library then
        # takes other kernels for those shapes); a family named with --kernel must build or fail.
        problem = jit.core.header_problem(spec)
        if problem is not None:
            if args.kernel:
                refused.append(f"{name}: {problem}")
            else:
                print(f"{name}: skipped ({problem})")
            continue
        for a in arch:
            if a not in targets and not spec.archs:
                print(f"{name}: not built for sm_{a} ({jit.arch_problem(spec, a)})")
        plan.append((spec, targets))
    if refused:
        for message in refused:
            print(f"flashinfer-moe build: {message}", file=sys.stderr)
        others = " ".join(f"--kernel {spec.name}" for spec, _ in plan)
        hint = f" (`{others}` builds the families that do support {', '.join(f'sm_{a}' for a in arch)})" if plan else ""
        print(f"flashinfer-moe build: nothing was compiled{hint}", file=sys.stderr)
        return 1
    for spec, targets in plan:
        start = time.perf_counter()
        path = jit.build(spec, targets, why=jit.core.BUILD_COMMAND)
        print(f"{spec.name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _device_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices takes comma-separated GPU indices, got {text!r}") from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--timeout takes seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--timeout must be > 0, got {text!r}")
    return value


def cmd_probe(args: argparse.Namespace) -> int:
    from .comm import probe

    try:
        code, text = probe.run(args.devices, args.timeout, args.json, args.bandwidth, args.force_failure)
    except ValueError as exc:
        print(f"flashinfer-moe probe: {exc}", file=sys.stderr)
        return probe.EXIT_USAGE
    print(text, file=sys.stdout if code != probe.EXIT_NO_GPU or args.json else sys.stderr)
    return code


PROBE_EPILOG = """exit codes:
  0  every pair of the probed GPUs is fit for one-shot P2P all-to-all
  1  the probe ran and some pair is not (the NCCL fallback is advised)
  2  usage error
  3  no GPU or no driver
"""


def cmd_clear_cache(args: argparse.Namespace) -> int:
    from . import jit

    root = jit.cache_root()
    if not root.exists():
        print(f"nothing to clear: the cache folder {root} does not exist (FLASHINFER_MOE_CACHE_DIR)")
        return 0
    if not root.is_dir():
        print(f"flashinfer-moe clear-cache: {root} is not a folder (FLASHINFER_MOE_CACHE_DIR)", file=sys.stderr)
        return 1
    if not any(root.iterdir()):
        print(f"nothing to clear: the cache folder {root} is empty")
        return 0
    builds, _ = jit.cache_size()
    freed = jit.clear_cache()
    print(f"cleared {root}: {builds} build(s), {_format_bytes(freed)} freed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashinfer-moe", description="flashinfer-moe: MoE kernels and expert-parallel communication"
    )
    parser.add_argument("--version", action="version", version=f"flashinfer-moe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="report the package, torch, CUDA, driver, GPUs, nvcc, NCCL and kernel cache")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("build", help="precompile every kernel (or those named) into the cache")
    p.add_argument("--arch", help="target(s), comma-separated, e.g. 90a; default: the visible GPUs'")
    p.add_argument("--kernel", action="append", help="only this kernel family (repeatable)")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser(
        "probe",
        help="check peer access, links, P2P atomics (live), CUDA IPC between every GPU pair",
        epilog=PROBE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--devices", type=_device_list, help="GPU indices to probe, e.g. 0,1 (default: all)")
    p.add_argument("--timeout", type=_positive_seconds, default=2.0, help="seconds a live check waits (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--bandwidth", action="store_true", help="also measure copy bandwidth and flag latency per pair")
    p.add_argument(
        "--force-failure",
        choices=["timeout", "fail"],
        help="make every live check fail this way (shows the failure path; same as FLASHINFER_MOE_PROBE_FORCE)",
    )
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("clear-cache", help="delete every cached kernel build")
    p.set_defaults(func=cmd_clear_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import FlashInferMoEError

    try:
        return args.func(args)
    except (FlashInferMoEError, ValueError) as exc:
        print(f"flashinfer-moe {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
