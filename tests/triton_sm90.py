"""Compiles the Triton kernels that run on Hopper for sm_90a on a machine with no GPU and reports what ptxas says.

Run as a script (``python tests/triton_sm90.py``) in its own process: it installs a stand-in for Triton's CUDA
driver that answers only what compilation asks (the target, device 0, stream 0), so that
``JITFunction.run(..., warmup=True)`` compiles a kernel exactly as a launch would, specializations included,
without launching it. Prints one JSON line per compiled kernel: which kernel and case, its registers, the bytes
it spills, whether ptxas serialized its wgmma pipeline (notice C7515) and how many instructions of its SASS touch
the registers of a wgmma still in flight (``sass_wgmma.hazards``). The kernels: the NVFP4 grouped GEMM (every
tile class, plain, K-permuted and split-bits weights, 8 and 256 experts, both layouts for split bits), the bf16
and FP8 grouped GEMM (its picked configs, with and without the fused activation), the MLA prefill and the MLA
Triton decode (four of its tiles)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_wgmma  # noqa: E402


class _CompileOnlyDriver:
    """The parts of Triton's active driver that compiling (not launching) a kernel reads."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _ptxas(ptx: str) -> tuple[int, int, bool, int]:
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", src, "-o", cubin],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode:
            raise RuntimeError(res.stderr)
        hazards = len(sass_wgmma.hazards(sass_wgmma.sass_of(cubin)))
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    serialized = "C7515" in res.stderr or "are serialized" in res.stderr
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0, serialized, hazards


def _compiled(jit_fn, launch) -> tuple[int, int, bool, int]:
    """(registers, spilled bytes, serialized, SASS hazards) of the kernel that ``launch()`` would run through ``jit_fn``."""
    launch_run = jit_fn.run
    compiled = {}

    def compile_only(*a, grid, warmup, **kw):
        compiled["kernel"] = launch_run(*a, grid=grid, warmup=True, **kw)
        return compiled["kernel"]

    jit_fn.run = compile_only
    try:
        launch()
    finally:
        jit_fn.run = launch_run
    return _ptxas(compiled["kernel"].asm["ptx"])


def compile_nvfp4(
    kernel, config: dict, experts: int, gated: bool, masked: bool, packing: str
) -> tuple[int, int, bool, int]:
    """The NVFP4 GEMM as ``kernel.launch`` compiles it for one call."""
    rows, n, k = 4096, 2048 if gated else 4096, 7168
    nw = 2 * n if gated else n
    counts = torch.zeros(experts, dtype=torch.int32)
    args = (
        torch.empty(rows, k, dtype=torch.bfloat16),
        torch.empty(experts, nw, k // 2, dtype=torch.uint8),
        torch.empty(experts, nw, k // 16, dtype=torch.float8_e4m3fn),
        torch.empty((experts, 2) if gated else (experts,), dtype=torch.float32),
        torch.empty(rows, n, dtype=torch.bfloat16),
        counts,
        None if masked else torch.zeros(experts, dtype=torch.int32),
    )
    kw = dict(act=int(gated), alpha=1.702, limit=7.0, capacity=rows // experts if masked else 2**31 - 1)
    kw.update(config=config, kperm=packing != "plain", split_bits=packing == "split")
    return _compiled(kernel.grouped_gemm_nvfp4_kernel, lambda: kernel.launch(*args, **kw))


def compile_grouped_gemm(
    dtype, a_mode: int, w_mode: int, act: int, experts: int, per_expert: int
) -> tuple[int, int, bool, int]:
    """The bf16 / FP8 grouped GEMM (contiguous layout) with the config ``gemm_config.pick`` gives the shape."""
    from flashinfer_moe.moe import gemm_config, gemm_kernel

    rows, n, k = experts * per_expert, 2048 if act else 4096, 7168
    nw = 2 * n if act else n
    a_scale = {0: None, 1: torch.empty(1), 3: torch.empty(rows, k // 128)}[a_mode]
    w_scale = {0: None, 1: torch.empty(experts), 2: torch.empty(experts, nw // 128, k // 128)}[w_mode]
    config = gemm_config.pick(dtype, a_mode, w_mode, act, False, rows, experts, 2**31 - 1, n, k)
    args = (
        torch.empty(rows, k, dtype=dtype),
        torch.empty(experts, nw, k, dtype=dtype),
        torch.empty(rows, n, dtype=torch.bfloat16),
        None,
        torch.zeros(experts, dtype=torch.int32),
        torch.zeros(experts, dtype=torch.int32),
        a_scale,
        w_scale,
    )
    kw = dict(a_mode=a_mode, w_mode=w_mode, act=act, alpha=1.702, limit=7.0, capacity=2**31 - 1, config=config)
    return _compiled(gemm_kernel.grouped_gemm_kernel, lambda: gemm_kernel.launch(*args, **kw))


def compile_mla_prefill(causal: bool) -> tuple[int, int, bool, int]:
    """The MLA prefill kernel with its default config (128 heads, head dims 192 / 128)."""
    from flashinfer_moe.mla import prefill_kernel

    t, heads = 4096, 128
    q, k = (torch.empty(t, heads, 192, dtype=torch.bfloat16) for _ in range(2))
    v, out = (torch.empty(t, heads, 128, dtype=torch.bfloat16) for _ in range(2))
    lse, cu = torch.empty(t, heads), torch.tensor([0, t], dtype=torch.int32)
    return _compiled(
        prefill_kernel.prefill_kernel,
        lambda: prefill_kernel.launch(q, k, v, cu, out, lse, 0.1, t, causal=causal, config=prefill_kernel.DEFAULT),
    )


def compile_mla_decode(heads: int, cache: str, tma: bool) -> tuple[int, int, bool, int]:
    """The Triton MLA decode kernel (the Hopper path of FP8 latent pages beside bf16 rope pages, and of
    ``FLASHINFER_MOE_MLA_BACKEND=triton``) with its configured tile for ``heads`` query rows, page 64."""
    from flashinfer_moe.mla import decode_configs, decode_kernel

    batch, pages, page, programs = 4, 64, 64, 132
    fp8 = cache != "bf16"
    block_m = 16 if heads <= 16 else 32 if heads <= 32 else 64
    table = decode_configs.TMA_CONFIGS if tma else decode_configs.CONFIGS
    config = dict(table[(block_m, False) if tma else (block_m, fp8)], BLOCK_M=block_m, TMA=int(tma))
    q_nope = torch.empty(batch, 1, heads, 512, dtype=torch.bfloat16)
    q_pe = torch.empty(batch, 1, heads, 64, dtype=torch.bfloat16)
    if cache == "fp8_bf16_rope":
        ckv = torch.empty(pages, page, 512, dtype=torch.float8_e4m3fn)
        kpe = torch.empty(pages, page, 64, dtype=torch.bfloat16)
    else:
        pool = torch.empty(pages, page, 576, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        ckv, kpe = pool, pool[..., 512:]
    sched = torch.zeros(2 + 4 * batch + programs, dtype=torch.int32)
    tables, lens = torch.zeros(batch, 8, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
    part_out, part_lse = torch.empty(8, heads, 512), torch.empty(8, heads)
    out, lse = torch.empty(batch, 1, heads, 512, dtype=torch.bfloat16), torch.empty(batch, 1, heads)
    args = (q_nope, q_pe, ckv, kpe, tables, lens, sched, part_out, part_lse, out, lse, 0.1, 1.0 if fp8 else None)
    combine = decode_kernel.launch_combine
    decode_kernel.launch_combine = lambda *a, **k: None  # a second kernel, not the one compiled here
    try:
        return _compiled(
            decode_kernel._decode_kernel, lambda: decode_kernel.launch_decode(*args, False, programs, config)
        )
    finally:
        decode_kernel.launch_combine = combine


def _report(case: dict, result: tuple[int, int, bool, int]) -> None:
    regs, spilled, serialized, hazards = result
    print(json.dumps(dict(case, regs=regs, spilled_bytes=spilled, serialized=serialized, hazards=hazards)), flush=True)


def main() -> None:
    driver.set_active(_CompileOnlyDriver())
    from flashinfer_moe.moe import gemm_nvfp4_kernel as kernel

    for cls in kernel.CONFIGS:
        gated = cls.endswith("_gated")
        for packing in ("plain", "kperm", "split"):
            config = kernel.CONFIGS[cls] if packing == "plain" else kernel.CONFIGS_KPERM.get(cls, kernel.CONFIGS[cls])
            layouts = (False, True) if packing == "split" else (False,)  # split bits: the default packing
            for experts in (8, 256):
                for masked in layouts:
                    if masked and experts != 8:
                        continue
                    case = dict(kernel="nvfp4", cls=cls, packing=packing, experts=experts, masked=masked)
                    _report(case, compile_nvfp4(kernel, config, experts, gated, masked, packing))
    fp8 = torch.float8_e4m3fn
    for name, dtype, a_mode, w_mode in (
        ("bf16", torch.bfloat16, 0, 0),
        ("fp8_block", fp8, 3, 2),
        ("fp8_tensor", fp8, 1, 1),
    ):
        for act in (0, 1):
            for experts, per_expert in ((8, 512), (256, 16)):
                case = dict(kernel="grouped_gemm", dtype=name, act=act, experts=experts, per_expert=per_expert)
                _report(case, compile_grouped_gemm(dtype, a_mode, w_mode, act, experts, per_expert))
    for causal in (True, False):
        _report(dict(kernel="mla_prefill", causal=causal), compile_mla_prefill(causal))
    for heads, cache, tma in (
        (16, "bf16", False),
        (64, "bf16", True),
        (16, "fp8_bf16_rope", False),
        (32, "fp8", False),
    ):
        _report(dict(kernel="mla_decode", heads=heads, cache=cache, tma=tma), compile_mla_decode(heads, cache, tma))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    main()
