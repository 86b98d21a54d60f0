"""The paged MLA decode's kernel configurations (measured on an H200) and the test of whether a pool's pages can be
loaded with TMA."""

from __future__ import annotations

import functools

import torch

# Kernel configuration per row block (``BLOCK_M`` (new token, head) rows per program): tokens per tile, warps,
# pipeline stages, programs per SM that the schedule plans for (read from the bf16 entry for both caches), and
# PREFETCH (the next tile's loads issued before this tile's math). From launch/bench_mla.py --sweep on an H200
# (s_k 8192, page 64): 64-token tiles are 1.3-1.5x faster than 32 everywhere (stages 2-4 time the same: the
# gathered loads are not overlapped by Triton's pipelining, so bytes in flight come from tile size and CTAs);
# 16 rows: two 4-warp programs per SM; 32 rows: the register double buffer (1.15x); 64 rows: neither (both
# spill the `[64, 512]` accumulator).
CONFIGS: dict[tuple[int, bool], dict[str, int]] = {
    (16, False): dict(BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2, PREFETCH=0),
    (32, False): dict(BLOCK_N=64, num_warps=8, num_stages=1, ctas_per_sm=1, PREFETCH=1),
    (64, False): dict(BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, PREFETCH=0),
    (16, True): dict(BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2, PREFETCH=0),
    (32, True): dict(BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, PREFETCH=0),
    (64, True): dict(BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1, PREFETCH=0),
}

# The configuration where the tiles are loaded with TMA (``tma_layout``; the op's ``tma`` argument: 0 off, 1 on,
# 2 on with SWAP): these loads are pipelined ``num_stages`` deep through shared memory, and the products read the
# tiles there. SWAP: scores and accumulators transposed, the tile on the tensor cores' 64-wide M side, for row
# blocks narrower than that. The program count stays the one CONFIGS plans for. From launch/bench_mla.py on an
# H200 (page 64, s_k 4096-16384): 16 rows 1.27x the gathered loads (3.3 TB/s), 32 rows 1.13-1.15x (4 warps:
# 1.2x 8), 64 rows 1.08-1.11x. FP8 pages stay on the gathered loads: through TMA they measured 0.25-0.7x, the
# widening taking the tile from shared memory to registers and back (and spilling) where the gathered path
# overlaps it with a second program per SM.
TMA_CONFIGS: dict[tuple[int, bool], dict[str, int]] = {
    (16, False): dict(BLOCK_N=64, num_warps=4, num_stages=2, SWAP=1),
    (32, False): dict(BLOCK_N=64, num_warps=4, num_stages=2, SWAP=1),
    (64, False): dict(BLOCK_N=64, num_warps=8, num_stages=2, SWAP=0),
}


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def tma_layout(ckv: torch.Tensor, kpe: torch.Tensor, block_n: int) -> bool:
    """Whether the kernel can load ``block_n``-token tiles of these pages with TMA: a page holds whole tiles,
    pages are contiguous in a token-major pool (page stride = page * token stride, so the pool is a `[P * page,
    W]` matrix), bases and token strides are 16-byte aligned, and the GPU has TMA (sm_90+; the interpreter
    emulates it)."""
    page = ckv.shape[1]
    if page % block_n or ckv.shape[0] * page >= 2**31:
        return False
    for t in (ckv, kpe):
        if t.stride(0) != page * t.stride(1) or t.data_ptr() % 16 or t.stride(1) * t.element_size() % 16:
            return False
    return not ckv.is_cuda or _capability(ckv.device.index or 0) >= 9
