"""Compiles the NVFP4 Triton GEMM for sm_90a on a machine with no GPU and reports what ptxas says of it.

Run as a script (``python tests/triton_sm90.py``) in its own process: it installs a stand-in for Triton's CUDA
driver that answers only what compilation asks (the target, device 0, stream 0), so that
``JITFunction.run(..., warmup=True)`` compiles the kernel exactly as a launch would, specializations
included, without launching it. Prints one JSON line per case: the config class, the weight packing
(plain bytes, K-permuted, split bits), the expert count, the layout, registers and whether ptxas serialized
the wgmma pipeline (its notice C7515).
"""

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


def _ptxas(ptx: str) -> tuple[int, bool]:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    if res.returncode:
        raise RuntimeError(res.stderr)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    return int(regs.group(1)) if regs else -1, "C7515" in res.stderr or "are serialized" in res.stderr


def compile_nvfp4(kernel, config: dict, experts: int, gated: bool, masked: bool, packing: str) -> tuple[int, bool]:
    """(registers, serialized) of the NVFP4 GEMM as ``kernel.launch`` would compile it for this call."""
    rows, n, k = 4096, 2048 if gated else 4096, 7168
    nw = 2 * n if gated else n
    counts = torch.zeros(experts, dtype=torch.int32)
    offsets = None if masked else torch.zeros(experts, dtype=torch.int32)
    args = (
        torch.empty(rows, k, dtype=torch.bfloat16),
        torch.empty(experts, nw, k // 2, dtype=torch.uint8),
        torch.empty(experts, nw, k // 16, dtype=torch.float8_e4m3fn),
        torch.empty((experts, 2) if gated else (experts,), dtype=torch.float32),
        torch.empty(rows, n, dtype=torch.bfloat16),
        counts,
        offsets,
    )
    jit_fn = kernel.grouped_gemm_nvfp4_kernel
    launch_run = jit_fn.run
    compiled = {}

    def compile_only(*a, grid, warmup, **kw):
        compiled["kernel"] = launch_run(*a, grid=grid, warmup=True, **kw)
        return compiled["kernel"]

    jit_fn.run = compile_only
    try:
        kernel.launch(
            *args,
            act=int(gated),
            alpha=1.702,
            limit=7.0,
            capacity=rows // experts if masked else 2**31 - 1,
            config=config,
            kperm=packing != "plain",
            split_bits=packing == "split",
        )
    finally:
        jit_fn.run = launch_run
    return _ptxas(compiled["kernel"].asm["ptx"])


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
                    regs, serialized = compile_nvfp4(kernel, config, experts, gated, masked, packing)
                    case = dict(cls=cls, packing=packing, experts=experts, masked=masked)
                    print(json.dumps(dict(case, regs=regs, serialized=serialized)), flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    main()
