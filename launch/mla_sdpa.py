"""The torch SDPA baseline of ``launch/bench_mla.py``: the absorbed MLA decode posed to
``scaled_dot_product_attention`` over the cache gathered into `[B, s_k, 576]`, the query heads folded into its
query length against the one latent KV head (nothing expanded across heads), every backend that takes it timed,
and each checked against the float64 reference (``sdpa_self_check``) and against our decode."""

from __future__ import annotations

import warnings

import torch
from timing import time_graph
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashinfer_moe import reference_mla as ref_mla
from flashinfer_moe.mla import decode as D

DEV = "cuda"
SM_SCALE = 192**-0.5


SDPA_BUDGET = 20e9  # bytes the SDPA baseline may hold: the gathered cache, a v copy, the math backend's work
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_inputs(k: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor):
    """SDPA's view of the decode with one KV head: the query heads folded into the query length, so nothing
    is expanded across heads. Returns ``(q [B, 1, s_q h_q, 576], k [B, 1, s_k, 576], v [B, 1, s_k, 512] (a
    view of k), mask)``; ``mask`` is None for s_q 1, else an additive `[1, 1, s_q h_q, s_k]` mask in q's dtype
    where query row ``r`` (new token ``r // h_q``) sees keys up to ``s_k - s_q + r // h_q`` (built once:
    SDPA would turn a boolean mask into this on every call)."""
    b, s_q, heads = q_nope.shape[:3]
    s_k = k.shape[1]
    q = torch.cat([q_nope, q_pe], dim=-1).reshape(b, 1, s_q * heads, 576)
    kk = k[:, None]
    mask = None
    if s_q > 1:
        token = torch.arange(s_q * heads, device=k.device) // heads
        visible = torch.arange(s_k, device=k.device)[None, :] <= (s_k - s_q + token)[:, None]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=k.device).masked_fill(~visible, float("-inf"))
        mask = mask[None, None]
    return q, kk, kk[..., :512], mask


def sdpa_footprint(batch: int, s_k: int, rows: int, backend: str) -> int:
    """Bytes held beside the queries: the gathered bf16 keys and a v copy (where the view is refused); the
    math backend adds fp32 copies of k and v and three `[B, rows, s_k]` fp32 score-sized tensors."""
    held = batch * s_k * (576 + 512) * 2
    if backend == "math":
        held += batch * s_k * (576 + 512) * 4 + 3 * batch * rows * s_k * 4
    return held


def sdpa_backend_choice(q, k, v, mask) -> str:
    """The backend torch's own dispatch picks for these inputs (a private query; "?" where it is missing)."""
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=SM_SCALE)).name.lower()
    except Exception:  # noqa: BLE001 - torch versions without the query
        return "?"


def run_sdpa(backend: str, q, k, v, mask) -> torch.Tensor:
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SM_SCALE)


def sdpa_usable(backend: str, q, k, v, mask) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """``(output, v used, note)`` of one call of ``backend``: v as the view of k, else a contiguous copy made
    here (outside any timing); ``(None, None, reason)`` where the backend takes neither."""
    why = ""
    for v_try, note in ((v, "v view"), (None, "v copy")):
        with warnings.catch_warnings(record=True) as caught:  # where SDPA says why it refuses
            warnings.simplefilter("always")
            try:
                v_try = v.contiguous() if v_try is None else v_try
                return run_sdpa(backend, q, k, v_try, mask), v_try, note
            except Exception as e:  # noqa: BLE001 - a backend that refuses these shapes
                reasons = [str(w.message).splitlines()[0][:160] for w in caught] or [str(e).splitlines()[0][:160]]
                why = reasons[-1]
    return None, None, why


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def sdpa_self_check(device: str = DEV, tol: float = 1e-2) -> dict[str, str]:
    """Each SDPA backend on a small case (B 2, s_k 6, h_q 3, s_q 1 and 2; bf16) against the float64 reference
    decode, where the causal mask among the new tokens changes the result: proof that ``sdpa_inputs`` poses the
    same problem. Returns backend -> "ok (rel err ...)" / "WRONG ..." / "refused: ...", per s_q."""
    g = torch.Generator().manual_seed(7)
    batch, s_k, heads = 2, 6, 3
    k = torch.randn(batch, s_k, 576, generator=g).bfloat16().to(device)
    cache = k.reshape(batch * s_k, 1, 576)
    table = torch.arange(batch * s_k, device=device, dtype=torch.int32).view(batch, s_k)
    lens = torch.full((batch,), s_k, dtype=torch.int32, device=device)
    report = {}
    for s_q in (1, 2):
        q_nope = torch.randn(batch, s_q, heads, 512, generator=g).bfloat16().to(device)
        q_pe = torch.randn(batch, s_q, heads, 64, generator=g).bfloat16().to(device)
        want, _ = ref_mla.mla_decode(q_nope, q_pe, cache, table, lens, SM_SCALE, causal=True)
        q, kk, v, mask = sdpa_inputs(k, q_nope, q_pe)
        for name in SDPA_BACKENDS:
            out, _, note = sdpa_usable(name, q, kk, v, mask)
            if out is None:
                report[f"{name} s_q={s_q}"] = f"refused: {note}"
                continue
            err = rel_err(out.view(batch, s_q, heads, 512), want)
            report[f"{name} s_q={s_q}"] = f"{'ok' if err < tol else 'WRONG'} (rel err {err:.1e}, {note})"
    return report


def time_sdpa(cache, k: torch.Tensor | None, q_nope, q_pe) -> dict:
    """The SDPA baseline of one row: every backend that takes the inputs (math only where no fused one does
    and it fits ``SDPA_BUDGET``), timed; the fastest is the row's, its output checked against our decode
    (``cache``: bench_mla's ``Cache``)."""
    if k is None:
        return {}
    batch, s_q, heads = q_nope.shape[:3]
    s_k = k.shape[1]
    if sdpa_footprint(batch, s_k, s_q * heads, "efficient") > SDPA_BUDGET:
        return dict(sdpa_note="skipped: the gathered cache alone is over the budget")
    q, kk, v, mask = sdpa_inputs(k, q_nope, q_pe)
    result = dict(sdpa_default=sdpa_backend_choice(q, kk, v, mask), sdpa_backends={})
    best = None
    for name in SDPA_BACKENDS:
        if name == "math" and best is not None:
            continue  # only a stand-in when no fused backend runs: it materializes the scores
        if sdpa_footprint(batch, s_k, s_q * heads, name) > SDPA_BUDGET:
            result["sdpa_backends"][name] = "skipped: over the memory budget"
            continue
        out, v_used, note = sdpa_usable(name, q, kk, v, mask)
        if out is None:
            result["sdpa_backends"][name] = f"refused: {note}"
            continue
        try:
            us = time_graph(lambda i, v_used=v_used, name=name: run_sdpa(name, q, kk, v_used, mask), calls=5, reps=5)
        except Exception as e:  # noqa: BLE001 - a backend that runs eagerly but not under capture
            result["sdpa_backends"][name] = f"failed under capture: {type(e).__name__}"
            continue
        result["sdpa_backends"][name] = f"{us:.1f} us ({note})"
        if best is None or us < best[0]:
            best = (us, name, note, out)
        del v_used
    if best is None:
        return result
    ours = D.mla_decode(q_nope, q_pe, cache.kv, cache.block_table, cache.seq_lens, SM_SCALE)
    err = rel_err(best[3].view(ours.shape), ours)
    result.update(
        sdpa_us=best[0], sdpa_backend=f"{best[1]}, {best[2]}", sdpa_rel_err=err,
        sdpa_check="ok" if err < 2e-2 else "MISMATCH",
    )  # fmt: skip
    return result
