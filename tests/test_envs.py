"""Environment variables as envs.py parses them."""

import pytest

from flashinfer_moe import envs


@pytest.mark.parametrize(
    "name, read", [("FLASHINFER_MOE_MLA_FP8_PV", "mla_fp8_pv"), ("FLASHINFER_MOE_NVFP4_SPLIT_BITS", "nvfp4_split_bits")]
)
def test_boolean_variables_refuse_other_values(monkeypatch, name, read):
    """A value that is no boolean is refused when read, naming the variable; 0, 1 and off read as such, unset as
    the default."""
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, read)() is True
    for raw, want in (("0", False), ("1", True), ("off", False)):
        monkeypatch.setenv(name, raw)
        assert getattr(envs, read)() is want
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=name):
        getattr(envs, read)()
