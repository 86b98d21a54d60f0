"""The Triton kernels that run on Hopper compile for sm_90a with their wgmma pipelined and race-free (compile only:
CI has no GPU): every tile config of the NVFP4 GEMM, the bf16 and FP8 grouped GEMM's configs, the MLA prefill and
four tiles of the MLA Triton decode. ptxas serializes the wgmma of a loop when other instructions write their
registers inside the pipeline (its notice C7515); the kernel then runs, only far slower (1.25x at prefill,
measured), and nothing else shows it. Whether it happens turns on register allocation, so it changed with the
expert count (``BLOCK_E``) and with the order of the gated kernel's expansions and products. Where ptxas does not
serialize, no instruction may write the register operand, or touch the accumulators, of a wgmma still in flight
(``sass_wgmma.hazards``): the NVFP4 kernel did, and computed wrong outputs on an H200."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("triton_sm90.py")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    res = subprocess.run(
        [sys.executable, str(HELPER)], capture_output=True, text=True, timeout=1200, env=env, cwd=HELPER.parent.parent
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_every_config_compiled(compiled):
    from flashinfer_moe.moe.gemm_nvfp4_kernel import CONFIGS  # no kernel is launched, nothing is compiled here

    nvfp4 = [c for c in compiled if c["kernel"] == "nvfp4"]
    assert {c["cls"] for c in nvfp4} == set(CONFIGS)
    assert {c["packing"] for c in nvfp4} == {"plain", "kperm", "split"}
    assert {c["dtype"] for c in compiled if c["kernel"] == "grouped_gemm"} == {"bf16", "fp8_block", "fp8_tensor"}
    assert sum(c["kernel"] == "mla_prefill" for c in compiled) == 2
    assert sum(c["kernel"] == "mla_decode" for c in compiled) == 4
    assert all(c["regs"] > 0 for c in compiled), compiled


def test_no_config_serializes_its_wgmma(compiled):
    serialized = [c for c in compiled if c["serialized"]]
    assert not serialized, f"ptxas serialized the wgmma of {serialized}"


def test_no_instruction_touches_an_unfinished_wgmmas_registers(compiled):
    racy = [c for c in compiled if c["hazards"]]
    assert not racy, f"SASS writes the operand or touches the accumulators of a wgmma in flight in {racy}"
