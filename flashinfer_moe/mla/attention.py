"""``MLAAttention``: one Multi-head Latent Attention layer's kernels (DeepSeek-V2/V3/R1, Kimi-K2) behind the
calls a serving engine makes per layer, with the engine's own paged cache and page table.

The engine owns the weights, the projections, the rope and the cache; this class holds the layer's fixed
parameters (heads, softmax scale, page size, cache type and FP8 scale) and runs:

* ``append_kv``: the new tokens' latent + rope rows into their cache slots (FP8 quantization on the way);
* ``plan`` then ``decode``: paged absorbed-form decode (``s_q`` new tokens per sequence); ``plan`` once per
  step, its result passed to every layer's ``decode``;
* ``prefill``: the new tokens' causal attention in the non-absorbed form, plus, where sequences have a cached
  prefix, the prefix's part in absorbed form over the paged cache, merged by LSE.

Shapes (legend: ``B`` sequences, ``T`` new tokens of a ragged prefill batch, ``Hq`` heads, ``P`` pages):

=====================  =========================  ==================================================
``q`` (prefill)        `[T, Hq, 192]`             ``cat(q_nope [128], q_pe [64])`` per head
``k`` (prefill)        `[T, Hq, 192]`             ``cat(latent @ w_uk[h].T, k_pe)`` per head
``v`` (prefill)        `[T, Hq, 128]`             ``latent @ w_uv[h]``
``q_nope_absorbed``    `[T, Hq, 512]`             ``q_nope[t, h] @ w_uk[h]``
``q_pe``               `[T, Hq, 64]`              the query's rotated rope part
``w_uk``               `[Hq, 128, 512]`           ``kv_b_proj.weight.view(Hq, 256, 512)[:, :128]``
``w_uv``               `[Hq, 512, 128]`           ``kv_b_proj.weight.view(Hq, 256, 512)[:, 128:].transpose(1, 2)``
``kv_cache``           `[P, page, 576]`           or `[P, page, 512]` + ``kpe_cache`` `[P, page, 64]`
``block_table``        `[B, max_pages]` int32     the pages of each sequence, in order
=====================  =========================  ==================================================
"""

from __future__ import annotations

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref

from .append import CACHE_DTYPES, PAGE_SIZES, check_cache, mla_append_kv
from .merge import merge_attn_states
from .prefill import check_cu_seqlens, mla_prefill

__all__ = ["MLAAttention"]

FP8 = torch.float8_e4m3fn


class MLAAttention:
    """The attention kernels of one MLA layer, for an engine's own paged cache.

    Args:
        num_heads: query heads ``Hq`` on this rank (e.g. 128 for DeepSeek-V3 without tensor parallelism).
        sm_scale: softmax scale, the same in both forms (DeepSeek: ``192 ** -0.5 * mscale ** 2``).
        page_size: tokens per cache page: 1, 16, 32, 64 or 128.
        kv_dtype: the cache's latent type: bfloat16, float16 or float8_e4m3fn.
        kv_scale: dequantization scale of FP8 pages (real = stored * kv_scale; SGLang's ``k_scale``), a positive
            float or a one-element float32 tensor on the cache's device (the tensor form is capturable);
            required for FP8 pages, refused otherwise.
    """

    def __init__(
        self,
        num_heads: int,
        sm_scale: float,
        page_size: int,
        *,
        kv_dtype: torch.dtype = torch.bfloat16,
        kv_scale: torch.Tensor | float | None = None,
    ):
        self.num_heads = _checks.integer("num_heads", num_heads, 1)
        self.sm_scale = _checks.positive_float("sm_scale", sm_scale)
        if page_size not in PAGE_SIZES or isinstance(page_size, bool):
            raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {page_size!r}")
        self.page_size = page_size
        if kv_dtype not in CACHE_DTYPES:
            raise TypeError(f"kv_dtype must be one of {CACHE_DTYPES}, got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        if kv_dtype == FP8 and kv_scale is None:
            raise ValueError("kv_scale must be given with kv_dtype float8_e4m3fn (real = stored * kv_scale), got None")
        if kv_dtype != FP8 and kv_scale is not None:
            raise ValueError(f"kv_scale is only for float8_e4m3fn caches, got one with kv_dtype {kv_dtype}")
        if kv_scale is not None and not isinstance(kv_scale, torch.Tensor):
            kv_scale = _checks.positive_float("kv_scale", kv_scale, "a float or a float32 tensor")
        self.kv_scale = kv_scale

    def __repr__(self) -> str:
        dtype = str(self.kv_dtype).replace("torch.", "")
        return (
            f"MLAAttention(num_heads={self.num_heads}, sm_scale={self.sm_scale:.6g}, page_size={self.page_size}, "
            f"kv_dtype={dtype})"
        )

    def _cache(self, kv_cache, kpe_cache):
        kv_cache, kpe_cache = check_cache(kv_cache, kpe_cache)
        if kv_cache.dtype != self.kv_dtype:
            raise TypeError(f"kv_cache must have this layer's kv_dtype {self.kv_dtype}, got {kv_cache.dtype}")
        if kv_cache.shape[1] != self.page_size:
            raise ValueError(f"kv_cache must have this layer's page size {self.page_size}, got {kv_cache.shape[1]}")
        return kv_cache, kpe_cache

    def append_kv(
        self,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        slots: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        kpe_cache: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cos_sin_cache: torch.Tensor | None = None,
        rope_interleaved: bool = True,
    ) -> None:
        """Writes new tokens' latent `[N, 512]` and rope `[N, 64]` rows into slots `[N]`
        (``page * page_size + offset``, negative to skip) of ``kv_cache``; the rope rows arrive rotated, or
        unrotated with ``positions`` `[N]` and ``cos_sin_cache`` `[max_pos, 64]`, rotated in the same kernel;
        see ``mla_append_kv``."""
        kv_cache, kpe_cache = self._cache(kv_cache, kpe_cache)
        mla_append_kv(
            ckv,
            kpe,
            slots,
            kv_cache,
            kpe_cache=kpe_cache,
            kv_scale=self.kv_scale,
            positions=positions,
            cos_sin_cache=cos_sin_cache,
            rope_interleaved=rope_interleaved,
        )

    def plan(self, seq_lens: torch.Tensor, s_q: int = 1, **kwargs):
        """The decode schedule for one step, computed on the GPU (capturable): pass it to every layer's
        ``decode`` of that step. ``seq_lens`` `[B]` int32 include the new tokens; ``kwargs`` as
        ``mla_decode_plan``'s."""
        from .decode import mla_decode_plan

        kwargs.setdefault("kv_dtype", self.kv_dtype)
        return mla_decode_plan(seq_lens, s_q, self.num_heads, **kwargs)

    def decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        kpe_cache: torch.Tensor | None = None,
        plan=None,
        causal: bool = True,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Absorbed-form decode over the paged cache: ``q_nope`` `[B, s_q, Hq, 512]` (already multiplied by
        ``w_uk``), ``q_pe`` `[B, s_q, Hq, 64]`, ``block_table`` `[B, max_pages]` int32, ``seq_lens`` `[B]` int32
        (new tokens included) -> latent-space output `[B, s_q, Hq, 512]` (the caller applies ``w_uv``), with the
        LSE `[B, s_q, Hq]` float32 if ``return_lse``; see ``mla_decode``."""
        from .decode import mla_decode

        kv_cache, kpe_cache = self._cache(kv_cache, kpe_cache)
        return mla_decode(
            q_nope,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            self.sm_scale,
            kpe_cache=kpe_cache,
            kv_scale=self.kv_scale,
            causal=causal,
            plan=plan,
            out=out,
            lse=lse,
            return_lse=return_lse,
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        q_nope_absorbed: torch.Tensor | None = None,
        q_pe: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        kpe_cache: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        prefix_lens: torch.Tensor | None = None,
        w_uv: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Prefill attention of a ragged batch of new tokens, over their cached prefix too where given.

        Without ``kv_cache``: each sequence's new tokens attend causally to themselves (``mla_prefill``). With it,
        token ``i`` of sequence ``b`` also attends to the ``prefix_lens[b]`` tokens cached before it (the pages
        ``block_table[b]``; the new tokens need not be in the cache): that part runs in absorbed form, one
        ``mla_decode`` query per new token (``causal=False``, the token's sequence's block-table row and prefix
        length), its latent output is brought to the value space by ``w_uv`` (a batched GEMM), and the two
        parts are merged by LSE (``merge_attn_states``). A sequence with an empty prefix gets the new-token part
        alone. Allocates its temporaries, including a `[T, max_pages]` int32 copy of the block-table rows.

        Args:
            q: `[T, Hq, 192]` bfloat16/float16 (nope then rope channels per head).
            k: `[T, Hq, 192]`, ``q``'s dtype.
            v: `[T, Hq, 128]`, ``q``'s dtype.
            cu_seqlens: `[B + 1]` int32 offsets of the sequences' new tokens in ``T``.
            max_seqlen: an int >= the most new tokens of a sequence.
            q_nope_absorbed: `[T, Hq, 512]`, ``q_nope[t, h] @ w_uk[h]``; with ``kv_cache``.
            q_pe: `[T, Hq, 64]`, the query's rope part (``q[..., 128:]``); with ``kv_cache``.
            kv_cache: `[P, page, 576]` or `[P, page, 512]` (+ ``kpe_cache`` `[P, page, 64]`) of this layer.
            block_table: `[B, max_pages]` int32, each sequence's pages in order.
            prefix_lens: `[B]` int32 cached tokens of each sequence before its new ones (0 allowed).
            w_uv: `[Hq, 512, 128]`, ``q``'s dtype: ``v[h] = latent @ w_uv[h]``.
            out: optional `[T, Hq, 128]` buffer of ``q``'s dtype.
            return_lse: also return the LSE `[T, Hq]` float32 over all keys seen.

        Returns:
            `[T, Hq, 128]` in ``q``'s dtype (and the LSE if ``return_lse``).
        """
        if q.dim() == 3 and q.shape[1] != self.num_heads:
            raise ValueError(f"q must have this layer's {self.num_heads} heads, got shape {tuple(q.shape)}")
        prefix = kv_cache is not None
        given = {"q_nope_absorbed": q_nope_absorbed, "q_pe": q_pe, "block_table": block_table}
        given.update(prefix_lens=prefix_lens, w_uv=w_uv)
        if not prefix:
            extra = [name for name, value in {**given, "kpe_cache": kpe_cache}.items() if value is not None]
            if extra:
                raise ValueError(f"{extra[0]} is only for a prefill over a cached prefix, got it without kv_cache")
            new_out, new_lse = mla_prefill(q, k, v, cu_seqlens, max_seqlen, self.sm_scale, out=out)
            return (new_out, new_lse) if return_lse else new_out
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"{missing[0]} must be given with kv_cache (a prefill over a cached prefix), got None")
        new_out, new_lse = mla_prefill(q, k, v, cu_seqlens, max_seqlen, self.sm_scale)
        t, h = q.shape[:2]
        cu_seqlens = check_cu_seqlens(cu_seqlens, max_seqlen, t, q)
        batch = cu_seqlens.shape[0] - 1
        q_nope_absorbed = self._heads("q_nope_absorbed", q_nope_absorbed, ref.LATENT, q)
        q_pe = self._heads("q_pe", q_pe, ref.ROPE, q)
        w_uv = _checks.tensor("w_uv", w_uv)
        if tuple(w_uv.shape) != (h, ref.LATENT, ref.V_DIM):
            raise ValueError(
                f"w_uv must have shape [Hq, 512, 128] = {(h, ref.LATENT, ref.V_DIM)}, got {tuple(w_uv.shape)}"
            )
        if w_uv.dtype != q.dtype:
            raise TypeError(f"w_uv must have q's dtype ({q.dtype}), got {w_uv.dtype}")
        _checks.same_device("w_uv", w_uv, "q", q)
        prefix_lens = _checks.tensor("prefix_lens", prefix_lens)
        _checks.dtype_in("prefix_lens", prefix_lens, (torch.int32,))
        if tuple(prefix_lens.shape) != (batch,):
            raise ValueError(f"prefix_lens must have shape [B] = ({batch},), got {tuple(prefix_lens.shape)}")
        _checks.same_device("prefix_lens", prefix_lens, "q", q)
        block_table = _checks.tensor("block_table", block_table)
        _checks.dtype_in("block_table", block_table, (torch.int32,))
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [B = {batch}, max_pages], got {tuple(block_table.shape)}")
        _checks.same_device("block_table", block_table, "q", q)
        if t == 0:
            empty = new_out if out is None else _checks.tensor("out", out)
            return (empty, new_lse) if return_lse else empty

        # The sequence of every new token, found on the device (no sync): the number of sequence ends <= t.
        token_seq = torch.searchsorted(
            cu_seqlens[1:], torch.arange(t, dtype=torch.int32, device=q.device), right=True
        ).clamp_(max=batch - 1)
        token_pages = block_table.index_select(0, token_seq)  # [T, max_pages]
        token_prefix = prefix_lens.index_select(0, token_seq)  # [T]
        latent_out, prefix_lse = self.decode(
            q_nope_absorbed[:, None],
            q_pe[:, None],
            kv_cache,
            token_pages,
            token_prefix,
            kpe_cache=kpe_cache,
            causal=False,
            return_lse=True,
        )  # [T, 1, Hq, 512], [T, 1, Hq]
        prefix_out = torch.bmm(latent_out[:, 0].transpose(0, 1), w_uv).transpose(0, 1)  # [T, Hq, 128]
        if out is not None:
            out = _checks.tensor("out", out)
        merged, lse = merge_attn_states(new_out, new_lse, prefix_out, prefix_lse[:, 0], out=out)
        return (merged, lse) if return_lse else merged

    @staticmethod
    def _heads(name: str, x: object, dim: int, q: torch.Tensor) -> torch.Tensor:
        x = _checks.tensor(name, x)
        if tuple(x.shape) != (*q.shape[:2], dim):
            raise ValueError(f"{name} must have shape [T, Hq, {dim}] = {(*q.shape[:2], dim)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype ({q.dtype}), got {x.dtype}")
        _checks.same_device(name, x, "q", q)
        return x
