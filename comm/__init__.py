"""Expert-parallel communication (installed as ``flashinfer_moe.comm``)."""
