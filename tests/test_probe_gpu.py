"""GPU tiers for the probe and its live flag check (pytest -m gpu / -m multigpu)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from flashinfer_moe.comm.p2p_check import live_flag_check


def _probe(*args, env=None, timeout=600):
    full = dict(os.environ)
    full.pop("FLASHINFER_MOE_PROBE_FORCE", None)
    full.update(env or {})
    # The subprocess timeout is a hang guard: a probe that does not return fails the test.
    return subprocess.run(
        [sys.executable, "-m", "flashinfer_moe", "probe", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )


@pytest.mark.gpu
def test_live_check_on_one_gpu_then_forced_failures_leave_the_context_usable():
    assert live_flag_check(0, 0).status == "OK"
    timed_out = live_flag_check(0, 0, timeout_s=0.2, force="timeout")
    assert timed_out.status == "TIMEOUT" and "0.2 s" in timed_out.detail
    failed = live_flag_check(0, 0, force="fail")
    assert failed.status == "FAIL" and "payload" in failed.detail
    assert live_flag_check(0, 0).status == "OK"
    x = torch.arange(10, device="cuda")
    assert int(x.sum()) == 45


@pytest.mark.gpu
def test_probe_single_gpu_exit_0():
    res = _probe("--devices", "0", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["matrices"]["ipc"] == [["OK"]] and doc["recommendation"]["backend"] == "p2p"


needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.multigpu
@needs_two
def test_live_check_every_pair():
    n = torch.cuda.device_count()
    for a in range(n):
        for b in range(n):
            check = live_flag_check(a, b)
            assert check.status == "OK", check


@pytest.mark.multigpu
@needs_two
def test_probe_all_pairs_ok_text_and_json():
    res = _probe("--bandwidth")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1].startswith("Recommended all-to-all backend: p2p")
    doc = json.loads(_probe("--json").stdout)
    n = torch.cuda.device_count()
    assert len(doc["devices"]) == n and doc["exit_code"] == 0
    for i in range(n):
        for j in range(n):
            if i != j:
                assert doc["matrices"]["live_flag"][i][j] == "OK"
                assert doc["matrices"]["peer_access"][i][j] == "Y"
            assert doc["matrices"]["ipc"][i][j] == "OK"


@pytest.mark.multigpu
@needs_two
@pytest.mark.parametrize("mode, cell", [("timeout", "TIMEOUT"), ("fail", "FAIL")])
def test_forced_failure_exit_1(mode, cell):
    n = torch.cuda.device_count()
    pairs = n * (n - 1)
    # each TIMEOUT cell costs the 0.5 s timeout; the rest is start-up and the IPC child
    res = _probe("--json", "--timeout", "0.5", "--force-failure", mode, timeout=120 + pairs)
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["recommendation"]["backend"] == "nccl" and cell in doc["recommendation"]["reason"]
    assert all(doc["matrices"]["live_flag"][i][j] == cell for i in range(n) for j in range(n) if i != j)
