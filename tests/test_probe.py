"""CPU tier for the probe: no-GPU behaviour, exit codes, report formatting from a capability table."""

import json
import os
import subprocess
import sys

import pytest
import torch

from flashinfer_moe import envs
from flashinfer_moe.comm import probe


def _probe(*args, env=None):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "flashinfer_moe", "probe", *args], capture_output=True, text=True, env=full, timeout=300
    )


def _report(n, overrides=None):
    """A synthetic report of n GPUs where everything passed, with cells replaced by overrides[(matrix, i, j)]."""
    mats = {}
    for key, ok in (
        ("peer_access", "Y"),
        ("link", "NV18"),
        ("native_atomics", "Y"),
        ("live_flag", "OK"),
        ("ipc", "OK"),
    ):
        mats[key] = [["-" if i == j and key != "ipc" else ok for j in range(n)] for i in range(n)]
    for (key, i, j), value in (overrides or {}).items():
        mats[key][i][j] = value
    report = {
        "schema_version": probe.SCHEMA_VERSION,
        "header": {"driver": "580.00", "GPUs": f"{n} probed of {n} visible"},
        "devices": [
            {"index": i, "name": "GPU", "pci_bus_id": f"0000:{i:02x}:00.0", "compute_capability": "9.0"}
            for i in range(n)
        ],
        "matrices": mats,
        "details": {},
    }
    report["recommendation"] = probe.recommend(report)
    return report


def test_all_ok_recommends_p2p():
    rec = probe.recommend(_report(4))
    assert rec["backend"] == "p2p"


@pytest.mark.parametrize(
    "override, phrase",
    [
        (("peer_access", 0, 3), "GPU 0 -> 3: no peer access"),
        (("native_atomics", 2, 1), "GPU 2 -> 1: no native P2P atomics"),
        (("live_flag", 1, 2), "GPU 1 -> 2: live flag check TIMEOUT"),
        (("ipc", 3, 0), "GPU 3 -> 0: CUDA IPC TIMEOUT"),
    ],
)
def test_any_failing_pair_recommends_nccl_and_names_it(override, phrase):
    report = _report(4, {override: "TIMEOUT" if override[0] in ("live_flag", "ipc") else "N"})
    assert report["recommendation"]["backend"] == "nccl"
    assert phrase in report["recommendation"]["reason"]


def test_single_gpu_has_no_pairs():
    assert probe.recommend(_report(1))["backend"] == "p2p"


def test_format_report_layout():
    text = probe.format_report(_report(3, {("live_flag", 0, 2): "FAIL"}))
    lines = text.splitlines()
    assert lines[0] == "driver: 580.00"
    header_rows = [line for line in lines if line.startswith("D\\D")]
    assert len(header_rows) == 5 and header_rows[0].split() == ["D\\D", "0", "1", "2"]
    i = lines.index(next(line for line in lines if line.startswith("Live flag check")))
    assert lines[i + 2].split() == ["0", "-", "OK", "FAIL"]
    assert "Legend:" in lines and any(line.strip().startswith("TIMEOUT") for line in lines)
    assert lines[-1].startswith("Recommended all-to-all backend: nccl (GPU 0 -> 2: live flag check FAIL")


def test_format_matrix_pads_to_widest_cell():
    text = probe.format_matrix("T", ["0", "1"], [["-", "TIMEOUT"], ["OK", "-"]])
    assert text.splitlines()[1:] == ["D\\D      0        1", "0        -        TIMEOUT", "1        OK       -"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_no_gpu_exit_3_text_and_json():
    res = _probe()
    assert res.returncode == 3 and "no CUDA GPU" in res.stderr and "Traceback" not in res.stderr
    res = _probe("--json")
    assert res.returncode == 3
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == probe.SCHEMA_VERSION and doc["exit_code"] == 3 and doc["error"]


@pytest.mark.parametrize("args", [["--devices", "a,b"], ["--timeout", "0"], ["--force-failure", "maybe"], ["--nope"]])
def test_usage_errors_exit_2(args):
    res = _probe(*args)
    assert res.returncode == 2 and "usage" in res.stderr


def test_probe_force_variable_is_validated(monkeypatch):
    monkeypatch.setenv("FLASHINFER_MOE_PROBE_FORCE", "sometimes")
    with pytest.raises(ValueError, match="FLASHINFER_MOE_PROBE_FORCE must be 'timeout' or 'fail', got 'sometimes'"):
        envs.probe_force()
    monkeypatch.setenv("FLASHINFER_MOE_PROBE_FORCE", "timeout")
    assert envs.probe_force() == "timeout"
