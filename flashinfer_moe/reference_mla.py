"""Plain-torch references of the MLA (Multi-head Latent Attention) ops, for tests and the CPU implementations.

Dimension legend: ``T`` new tokens of a ragged batch, ``B`` sequences, ``Hq`` query heads, ``P`` cache pages,
``page`` tokens per page. MLA's dimensions: latent ``512`` (kv_lora_rank), rope ``64``, non-absorbed q/k head
``192 = 128 (nope) + 64 (rope)``, value head ``128``. LSEs are natural logarithms.
"""

from __future__ import annotations

import torch

from . import reference_quant as ref_quant

FP8 = torch.float8_e4m3fn
LATENT, ROPE, NOPE, V_DIM = 512, 64, 128, 128


# ----------------------------------------------------------------------------------------------- KV append


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows as stored in a cache of ``dtype``: FP8 is ``e4m3(x * (1 / scale))`` round-to-nearest-even,
    saturating at +-448 (the per-tensor quantizer's definition); other types round to nearest even."""
    if dtype == FP8:
        return ref_quant.quantize_fp8_per_tensor(x.float(), scale)[0]
    return x.to(dtype)


def append_kv(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's latent and rope rows into its cache slot, in place.

    Args:
        ckv: `[N, 512]` latent rows.
        kpe: `[N, 64]` rope rows.
        slots: `[N]` int, ``page * page_size + offset``; slots outside ``[0, P * page)`` are skipped.
        kv_cache: `[P, page, 576]` (latent then rope), or `[P, page, 512]` with ``kpe_cache``.
        kpe_cache: `[P, page, 64]` or None.
        kv_scale: 0-d float32 dequantization scale of the FP8 parts.
    """
    page_size = kv_cache.shape[1]
    slots = slots.long()
    keep = (slots >= 0) & (slots < kv_cache.shape[0] * page_size)
    idx = slots[keep]
    page, offset = idx // page_size, idx % page_size
    latent = _to_cache(ckv[keep], kv_cache.dtype, kv_scale)
    if kpe_cache is None:
        kv_cache[page, offset, :LATENT] = latent
        kv_cache[page, offset, LATENT:] = _to_cache(kpe[keep], kv_cache.dtype, kv_scale)
    else:
        kv_cache[page, offset] = latent
        kpe_cache[page, offset] = _to_cache(kpe[keep], kpe_cache.dtype, kv_scale)


def rotate_rope(
    kpe: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rope rows rotated by their positions, in float64, then rounded to float32.

    Pair ``(a, b)`` at frequency ``i`` becomes ``(a cos - b sin, b cos + a sin)`` with ``cos, sin`` =
    ``cos_sin_cache[pos, i], cos_sin_cache[pos, 32 + i]``; products of float32 (or narrower) values are exact in
    float64, so each result is the float64 rounding of the exact rotation, then float32's.

    Args:
        kpe: `[N, 64]` unrotated rope rows.
        positions: `[N]` int, each in ``[0, max_pos)``.
        cos_sin_cache: `[max_pos, 64]`, 32 cosines then 32 sines per position.
        interleaved: pairs ``(x[2i], x[2i + 1])`` (GPT-J style, DeepSeek-V3's); else ``(x[i], x[i + 32])``.

    Returns:
        `[N, 64]` float32.
    """
    half = ROPE // 2
    table = cos_sin_cache[positions.long()].double()
    cos, sin = table[:, :half], table[:, half:]
    x = kpe.double()
    a, b = (x[:, 0::2], x[:, 1::2]) if interleaved else (x[:, :half], x[:, half:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = torch.stack((ra, rb), -1).flatten(1) if interleaved else torch.cat((ra, rb), 1)
    return out.float()


def append_kv_rope(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool = True,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """``append_kv`` of the rope rows rotated by ``rotate_rope`` (float32 rows, so one rounding to the cache's
    type); a token whose position is outside ``[0, cos_sin_cache.shape[0])`` is skipped like a bad slot.

    Args:
        ckv, kpe, slots, kv_cache, kpe_cache, kv_scale: as ``append_kv``, ``kpe`` unrotated.
        positions: `[N]` int.
        cos_sin_cache: `[max_pos, 64]`.
        interleaved: the pairing, as ``rotate_rope``.
    """
    positions = positions.long()
    valid = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    slots = torch.where(valid, slots.long(), -1)
    rotated = torch.zeros(kpe.shape, dtype=torch.float32, device=kpe.device)
    rotated[valid] = rotate_rope(kpe[valid], positions[valid], cos_sin_cache, interleaved)
    append_kv(ckv, rotated, slots, kv_cache, kpe_cache, kv_scale)


# ------------------------------------------------------------------------------------------------- prefill


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sm_scale: float,
    causal: bool = True,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every sequence of a ragged batch over itself (the new tokens of an MLA prefill).

    Args:
        q: `[T, Hq, 192]`.
        k: `[T, Hq, 192]`.
        v: `[T, Hq, 128]`.
        cu_seqlens: `[B + 1]` int, sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
        sm_scale: softmax scale.
        causal: token ``i`` of a sequence sees tokens ``0..i`` of it (else all of it).
        dtype: the computation's type.

    Returns:
        ``(out [T, Hq, 128], lse [T, Hq])`` in ``dtype``; rows outside every sequence are zero / -inf.
    """
    t, h = q.shape[:2]
    dev = q.device
    out = torch.zeros(t, h, v.shape[-1], dtype=dtype, device=dev)
    lse = torch.full((t, h), float("-inf"), dtype=dtype, device=dev)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end <= start:
            continue
        qs = q[start:end].to(dtype).transpose(0, 1)  # [Hq, L, 192]
        ks = k[start:end].to(dtype).transpose(0, 1)
        vs = v[start:end].to(dtype).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * sm_scale  # [Hq, L, L]
        if causal:
            n = end - start
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        out[start:end] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
        lse[start:end] = torch.logsumexp(s, -1).transpose(0, 1)
    return out, lse


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets combined into the attention over their union.

    ``out = (exp(lse_a - m) * out_a + exp(lse_b - m) * out_b) / (exp(lse_a - m) + exp(lse_b - m))`` with
    ``m = max(lse_a, lse_b)``, ``lse = m + log(...)``. A side with LSE -inf (no keys) has weight zero and its
    ``out`` is never read (it may hold anything, NaN included); both sides -inf give out 0, LSE -inf.

    Args:
        out_a: `[T, H, D]`.
        lse_a: `[T, H]` natural log.
        out_b: `[T, H, D]`.
        lse_b: `[T, H]`.
        dtype: the computation's type.

    Returns:
        ``(out [T, H, D], lse [T, H])`` in ``dtype``.
    """
    la, lb = lse_a.to(dtype), lse_b.to(dtype)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    ya = torch.where((wa > 0)[..., None], out_a.to(dtype) * wa[..., None], 0.0)
    yb = torch.where((wb > 0)[..., None], out_b.to(dtype) * wb[..., None], 0.0)
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return (ya + yb) * inv[..., None], m + torch.log(total)


def prefill_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sm_scale: float,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """A prefill over a cached prefix, in the non-absorbed form and float64: each new token attends (causally)
    to its sequence's ``prefix_lens[b]`` cached tokens, whose keys and values are rebuilt from the latent cache
    (``k_nope = latent @ w_uk[h].T``, ``v = latent @ w_uv[h]``, rope part shared by the heads), then to the
    new tokens up to itself.

    Args:
        q: `[T, Hq, 192]`, k: `[T, Hq, 192]`, v: `[T, Hq, 128]`: the new tokens.
        cu_seqlens: `[B + 1]` int.
        sm_scale: softmax scale.
        kv_cache: `[P, page, 576]`, or `[P, page, 512]` with ``kpe_cache`` `[P, page, 64]`.
        block_table: `[B, max_pages]` int, the pages of each sequence's prefix in order.
        prefix_lens: `[B]` int.
        w_uk: `[Hq, 128, 512]`, the key up-projection (``k_nope[h] = w_uk[h] @ latent``).
        w_uv: `[Hq, 512, 128]`, the value up-projection (``v[h] = latent @ w_uv[h]``).
        kv_scale: dequantization scale of FP8 pages (real = stored * scale).

    Returns:
        `[T, Hq, 128]` float64.
    """
    f64 = torch.float64
    page_size = kv_cache.shape[1]
    scale = 1.0 if kv_scale is None else float(kv_scale)

    def real(x: torch.Tensor) -> torch.Tensor:
        x64 = x.to(f64)
        return x64 * scale if x.dtype == FP8 else x64

    if kpe_cache is None:
        latent_all, rope_all = kv_cache[..., :LATENT], kv_cache[..., LATENT:]
    else:
        latent_all, rope_all = kv_cache, kpe_cache
    latent_all, rope_all = real(latent_all).reshape(-1, LATENT), real(rope_all).reshape(-1, ROPE)
    w_uk, w_uv = w_uk.to(f64), w_uv.to(f64)
    t, h = q.shape[:2]
    dev = q.device
    out = torch.zeros(t, h, V_DIM, dtype=f64, device=dev)
    bounds = cu_seqlens.tolist()
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n = end - start
        if n <= 0:
            continue
        plen = int(prefix_lens[b])
        pages = block_table[b].long()
        pos = torch.arange(plen, device=dev)
        rows = pages[pos // page_size] * page_size + pos % page_size
        lat, rope = latent_all[rows], rope_all[rows]  # [plen, 512], [plen, 64]
        k_nope = torch.einsum("hdc,pc->phd", w_uk, lat)  # [plen, Hq, 128]
        k_pre = torch.cat([k_nope, rope[:, None, :].expand(plen, h, ROPE)], -1)
        v_pre = torch.einsum("pc,hcd->phd", lat, w_uv)
        kk = torch.cat([k_pre, k[start:end].to(f64)], 0).transpose(0, 1)  # [Hq, plen + n, 192]
        vv = torch.cat([v_pre, v[start:end].to(f64)], 0).transpose(0, 1)
        qq = q[start:end].to(f64).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * sm_scale  # [Hq, n, plen + n]
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
        s[:, :, plen:] = s[:, :, plen:].masked_fill(mask, float("-inf"))
        out[start:end] = (torch.softmax(s, -1) @ vv).transpose(0, 1)
    return out


# -------------------------------------------------------------------------------------------------- decode


def gather_latent_cache(
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    length: int,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """One sequence's first ``length`` cached tokens, dequantized: `[L, 576]` in ``dtype`` (latent then rope).

    Args:
        kv_cache: `[P, page, 576]`, or `[P, page, 512]` with ``kpe_cache``.
        block_table_row: `[max_pages]` page ids of the sequence.
        length: tokens to gather.
        kpe_cache: `[P, page, 64]` rope pages, or None when ``kv_cache`` holds them.
        kv_scale: dequantization factor of FP8 pages (``real = stored * kv_scale``), applied to each FP8 part.
    """
    page = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    pages = block_table_row.to(device=kv_cache.device, dtype=torch.long)[pos // page]
    slots = pos % page

    def part(cache: torch.Tensor) -> torch.Tensor:
        x = cache[pages, slots].to(dtype)
        return x * kv_scale if cache.dtype == FP8 and kv_scale is not None else x

    if kpe_cache is None:
        return part(kv_cache)
    return torch.cat([part(kv_cache), part(kpe_cache)], dim=-1)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: float | None = None,
    causal: bool = True,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-form MLA decode over a paged latent cache: per head ``softmax(sm_scale * [q_nope, q_pe] . K^T)
    . V`` with ``K`` the 576-wide cached rows and ``V`` their first 512 columns.

    Query ``i`` of ``s_q`` sees cache positions ``< seq_len - s_q + i + 1`` when ``causal`` (the new tokens are
    the last ``s_q`` of the cache), all ``seq_len`` positions otherwise. A query that sees no position gets
    output 0 and LSE -inf.

    Args:
        q_nope: `[B, s_q, Hq, 512]`.
        q_pe: `[B, s_q, Hq, 64]`.
        kv_cache: `[P, page, 576]`, or `[P, page, 512]` with ``kpe_cache`` `[P, page, 64]`.
        block_table: `[B, max_pages]` page ids.
        seq_lens: `[B]` cached tokens per sequence (the new ones included).
        sm_scale: the scores' scale.
        kv_scale: dequantization factor of FP8 pages.
        causal: mask among the new tokens.
        compute_dtype: the arithmetic's dtype.

    Returns:
        ``(out [B, s_q, Hq, 512], lse [B, s_q, Hq])`` in ``compute_dtype``; LSE of the scaled scores.
    """
    batch, s_q, heads, _ = q_nope.shape
    dev = q_nope.device
    out = torch.zeros(batch, s_q, heads, LATENT, dtype=compute_dtype, device=dev)
    lse = torch.full((batch, s_q, heads), float("-inf"), dtype=compute_dtype, device=dev)
    for b, length in enumerate(seq_lens.tolist()):
        length = max(int(length), 0)
        if length == 0:
            continue
        kv = gather_latent_cache(kv_cache, block_table[b], length, kpe_cache, kv_scale, compute_dtype).to(dev)
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1).to(compute_dtype)  # [s_q, Hq, 576]
        scores = torch.einsum("shd,ld->shl", q, kv) * sm_scale  # [s_q, Hq, L]
        visible = torch.full((s_q,), length, dtype=torch.long, device=dev)
        if causal:
            visible = (length - s_q + 1 + torch.arange(s_q, device=dev)).clamp(min=0)
        hidden = torch.arange(length, device=dev)[None, :] >= visible[:, None]  # [s_q, L]
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [s_q, Hq]
        probs = torch.exp(scores - torch.where(torch.isneginf(row_lse), 0.0, row_lse)[..., None])
        out[b] = torch.einsum("shl,ld->shd", probs, kv[:, :LATENT])
        lse[b] = row_lse
    return out, lse


def mla_decode_split_plan(
    seq_lens: torch.Tensor, num_programs: int, tokens_per_unit: int, overhead_units: int, snap_units: int = 0
) -> dict[str, torch.Tensor]:
    """The split-KV schedule that ``mla_decode_plan`` computes on the device, in plain torch.

    Sequences' costs (``ceil(L / tokens_per_unit) + overhead_units`` units each) are laid end to end and cut
    into ``num_programs`` chunks of ``chunk`` units; a sequence is split where a chunk boundary falls inside
    it, and only split sequences take slots of the partial-result workspace. ``chunk`` is the balanced
    ``ceil(total / num_programs)``, or, where every sequence costs the same, ``ceil(B / num_programs)`` whole
    sequences if that is at most ``snap_units`` longer (no sequence split).

    Returns:
        int64 tensors: ``chunk`` and ``total`` (0-D), ``starts``/``ends`` `[B]` (cost units), ``splits`` `[B]`,
        ``slot`` `[B]` (first workspace slot of a split sequence), ``first_seq`` `[num_programs]` (the
        sequence where each chunk starts; ``B`` for a chunk past the end).
    """
    lens = seq_lens.to(torch.int64).clamp(min=0)
    cost = (lens + tokens_per_unit - 1) // tokens_per_unit + overhead_units
    ends = torch.cumsum(cost, 0)
    starts = ends - cost
    total = ends[-1] if ends.numel() else torch.zeros((), dtype=torch.int64, device=lens.device)
    chunk = torch.clamp((total + num_programs - 1) // num_programs, min=1)
    if cost.numel() and bool(cost.min() == cost.max()):
        whole = -(-cost.numel() // num_programs) * cost[0]
        chunk = torch.where(whole - chunk <= snap_units, whole, chunk)
    splits = (ends - 1) // chunk - starts // chunk + 1
    taken = torch.where(splits > 1, splits, 0)
    slot = torch.cumsum(taken, 0) - taken
    first_seq = torch.searchsorted(ends, torch.arange(num_programs, device=lens.device) * chunk, right=True)
    keys = ("chunk", "total", "starts", "ends", "splits", "slot", "first_seq")
    return dict(zip(keys, (chunk, total, starts, ends, splits, slot, first_seq), strict=True))
