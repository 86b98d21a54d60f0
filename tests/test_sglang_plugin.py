"""The SGLang plugin against SGLang 0.5.23 itself (installed from PyPI, run on CPU): its plugin loader finds
the entry point, its parser takes the flag, its ``FusedMoE`` layers built with the flag equal the same layers on
SGLang's native path, with SGLang's loader, routing and dispatcher; what the plugin does not support falls
back with a warning. SGLang's state is per process, so the cases run in a worker process
(``tests/sglang_cases.py``)."""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("sglang", reason="the SGLang tests need sglang (the README's test command installs it)")

import sglang_cases as cases  # noqa: E402
from launcher import run_ranks  # noqa: E402

from flashinfer_moe.integrations import sglang as sglang_plugin  # noqa: E402

# Relative L2 error bounds: bf16 outputs; FP8 against SGLang's native bf16 path (which has no FP8 MoE on a
# CPU) adds the FP8 rounding of the activations, which the float64 reference of our FP8 pipeline does not.
BF16 = 0.01
FP8_VS_NATIVE = 0.08
FP8_VS_REFERENCE = 0.01


@pytest.fixture(scope="module")
def sglang():
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=cases.setup)

    def call(fn, *args):
        return pool.submit(fn, *args).result(timeout=300)

    yield call
    pool.shutdown(cancel_futures=True)


def test_entry_point_discovered_and_flag_parsed(sglang):
    seen = sglang(cases.case_discovery)
    assert "flashinfer_moe.integrations.sglang:register" in seen["entry_points"]
    assert seen["choice"] and seen["parsed"] == "flashinfer_moe"
    assert "flashinfer_moe" in seen["resolved"]
    assert len(seen["hooked"]) == 6, seen["hooked"]


@pytest.mark.parametrize("quant", [None, "fp8_block", "fp8_tensor", "nvfp4"])
@pytest.mark.parametrize(
    "routing, rsf, drop_ids",
    [("deepseek", 2.5, False), ("deepseek", None, True), ("qwen", None, False), ("qwen", 1.7, True)],
)
def test_layer_matches_sglang_native(sglang, quant, routing, rsf, drop_ids):
    r = sglang(cases.case_matches_native, quant, routing, rsf, drop_ids, 17)
    assert r["same_bytes"], "SGLang's loader must leave the checkpoint's bytes as they are"
    assert not r["nan"]
    # NVFP4 is W4A16: against SGLang's native bf16 path on the dequantized weights, only bf16 rounding differs.
    bound = BF16 if quant in (None, "nvfp4") else FP8_VS_NATIVE
    assert r["vs_native"] < bound, r
    # On CUDA the runner applies routed_scaling_factor (SGLang's model leaves it to the runner there).
    assert r["scaled_vs_native"] < bound, r
    if quant == "fp8_block":
        assert r["vs_reference"] < FP8_VS_REFERENCE, r
    elif quant is None:
        assert r["vs_reference"] < BF16, r


@pytest.mark.parametrize("split_bits", [False, True])
def test_nvfp4_weights_k_permuted_after_loading_and_reloads_stay_right(sglang, split_bits):
    r = sglang(cases.case_nvfp4_reload, 7, 13, split_bits)
    assert r["split"] == split_bits, r
    assert r["permuted_after_load"] and not r["permuted_after_partial"] and r["permuted_after_full"], r
    assert r["partial_vs_native"] < BF16 and r["full_vs_native"] < BF16, r
    assert not r["nan"]


@pytest.mark.parametrize("kind", ["clamped_interleaved", "clamped_split", "no_combine", "on_input"])
def test_runner_options_as_sglang_applies_them(sglang, kind):
    r = sglang(cases.case_runner_config, kind)
    assert r["vs_reference"] < BF16, r
    assert r["shape"] == ((19, 8, cases.H) if kind == "no_combine" else (19, cases.H))
    if "vs_native" in r:
        assert r["vs_native"] < BF16, r


@pytest.mark.parametrize("kind, why", [("gelu", "'gelu'"), ("bias", "expert biases"), ("swiglu_limit", "swiglu_limit")])
def test_unsupported_falls_back_with_one_warning(sglang, kind, why):
    r = sglang(cases.case_fallback, kind)
    assert len(r["warnings"]) == 1 and why in r["warnings"][0], r
    assert not r["taken_over"] and "TRITON" in r["backend"]
    assert r["equal"], "a fallback layer must give SGLang's own result"


@pytest.mark.parametrize("what", ["weight", "scale"])
def test_checkpoint_shape_disagreeing_with_layer_is_refused(sglang, what):
    message = sglang(cases.case_bad_checkpoint, what)
    assert "experts.1." in message and "must have the shape" in message and "got (" in message, message


def test_expert_parallel_ranks_with_minus_one_ids():
    for errors in run_ranks(cases.case_expert_parallel, 2, timeout_s=300):
        assert errors["None"] < BF16 and errors["fp8_block"] < FP8_VS_REFERENCE, errors


@pytest.mark.parametrize(
    "version, ok",
    [("0.5.23", True), ("0.5.23.post1", True), ("0.5.22", False), ("0.5.24", False), ("0.6.0", False), ("dev", False)],
)
def test_version_range(version, ok):
    assert (sglang_plugin.sglang_version_problem(version) is None) == ok


def test_out_of_range_sglang_is_refused_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(sglang_plugin, "_registered", False)
    monkeypatch.setattr(sglang_plugin.metadata, "version", lambda name: "0.5.22")
    with caplog.at_level(logging.WARNING, logger="flashinfer_moe"):
        sglang_plugin.register()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "0.5.22" in lines[0] and ">=0.5.23,<0.5.24" in lines[0], lines
    assert not sglang_plugin._registered


def test_extra_pins_the_supported_range():
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["sglang"] == [f"sglang{sglang_plugin.SUPPORTED_SGLANG_SPEC}"]
    entry = project["entry-points"]["sglang.srt.plugins"]
    assert entry == {"flashinfer_moe": "flashinfer_moe.integrations.sglang:register"}
