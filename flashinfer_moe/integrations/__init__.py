"""Integrations with serving engines: :mod:`flashinfer_moe.integrations.sglang`, SGLang's MoE runner plugin
(``--moe-runner-backend flashinfer_moe``), loaded by SGLang's plugin entry point, never by ``import flashinfer_moe``."""
