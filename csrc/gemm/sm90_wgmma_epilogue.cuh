// The Hopper wgmma kernel's epilogues (csrc/gemm/sm90_fp8_block_wgmma.cu): promoted fp32 accumulators to
// global memory, in place through a per-warp staging buffer or asynchronously through the TMA, plain or with
// GEMM1's gated activation (and FP8 per 128 columns).
#pragma once

#include "sm90_wgmma_common.cuh"

namespace fim {
namespace sm90_wgmma {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Writes a lane's two adjacent columns of one row into the staging buffer as KIND.
template <int KIND>
__device__ __forceinline__ void put_pair(uint32_t addr, float a, float b) {
  if constexpr (KIND == kOutBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    sts(addr, *reinterpret_cast<uint32_t*>(&v));
  } else if constexpr (KIND == kOutF32) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
  } else {
    const uint16_t v = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
  }
}

// Stores a warp's 16 rows x (8 * CHUNKS) columns as KIND through a 1 KiB staging buffer of its own (shared
// address `stage`), 64 bytes of each row per pass, so that each global store writes whole 64-byte row segments
// (16 bytes per lane). `vals` holds the lane's accumulator layout: per 8-column chunk c, vals[4 c .. 4 c + 1] are
// its two columns of row lane / 4 and vals[4 c + 2 .. 4 c + 3] the same columns of row lane / 4 + 8. A row's
// four 16-byte segments sit in the buffer rotated by (row / 2) % 4, which for bf16 and e4m3 puts the words one
// store instruction writes, and the 8 segments a quarter-warp reads back, in distinct banks. `out` points at the
// warp's first row and column, `ld` is in elements; rows from `valid_rows` on (the expert's end) and columns
// from `cols` on (N) are skipped.
template <int KIND, int CHUNKS>
__device__ __forceinline__ void store_tile(const float* vals, void* out, int64_t ld, int valid_rows, int cols,
                                           uint32_t stage, int lane) {
  constexpr int kSize = KIND == kOutF32 ? 4 : KIND == kOutBf16 ? 2 : 1;
  constexpr int kPerPass = 64 / (8 * kSize);  // chunks per pass
  static_assert(CHUNKS % kPerPass == 0, "whole passes");
  const int row = lane / 4, pair = lane % 4, rot = (row >> 1) & 3;  // rows r and r + 8 share the rotation
  const uint32_t top = stage + row * 64, low = top + 8 * 64;
  uint8_t* base = static_cast<uint8_t*>(out);
#pragma unroll
  for (int pass = 0; pass < CHUNKS / kPerPass; ++pass) {
    if (pass * (64 / kSize) >= cols) break;
#pragma unroll
    for (int j = 0; j < kPerPass; ++j) {
      const float* f = vals + 4 * (kPerPass * pass + j);
      const int b = 8 * kSize * j + 2 * kSize * pair;  // byte in the row's 64
      const uint32_t at = 16 * ((b / 16) ^ rot) + b % 16;
      put_pair<KIND>(top + at, f[0], f[1]);
      put_pair<KIND>(low + at, f[2], f[3]);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 2; ++it) {
      const int q = lane + 32 * it, r = q / 4, seg = q % 4;  // 4 segments of 16 bytes per row
      if (r < valid_rows) {
        const uint4 v = lds128(stage + r * 64 + 16 * (seg ^ ((r >> 1) & 3)));
        *reinterpret_cast<uint4*>(base + (r * ld + pass * (64 / kSize)) * kSize + 16 * seg) = v;
      }
    }
    __syncwarp();
  }
}

__device__ __forceinline__ float gated_act(float gate, float up, const Params& p) {
  // __fdividef: x / inf is 0 there, which is silu's limit for very negative inputs.
  if (p.act == kActSilu) return __fdividef(gate, 1.f + __expf(-gate)) * up;
  const float g = fminf(gate, p.limit), u = fminf(fmaxf(up, -p.limit), p.limit);
  return __fdividef(g, 1.f + __expf(-p.alpha * g)) * (u + 1.f);
}

// FP8 scale of a group from its amax as the group quantizer computes it: max(amax / 448, 2^-126).
__device__ __forceinline__ float fp8_scale(float amax) { return fmaxf(__fdiv_rn(amax, 448.f), 1.17549435e-38f); }

// GEMM1's epilogue for a warp's 16 rows: y = act(gate, up), optionally FP8 with one scale per row, stored like
// store_tile. Each 128-row half of the tile's W rows is 64 gate rows and then the matching 64 up rows (the
// producer loads them so), so element i < 32 of a promoted 64-register group and element i + 32 are the gate and
// up values of one output column: `fin` holds F / 64 such groups, which make F output columns of the warp's rows.
// A 64-row tile's two warpgroups hold 64 of its 128 output columns each: for FP8, the warps with the same rows
// swap their row maxima through `mine` / `other` (16 floats each, switched between two sets every tile so one
// barrier per tile suffices) at named barrier `pair_bar`; only `owner` writes the scales.
template <int F>
__device__ __forceinline__ void gated_rows(const float* fin, const Params& p, float (&y)[F / 2], int64_t row, int group,
                                           int valid_rows, int lane, float* mine, const float* other, int pair_bar,
                                           bool owner) {
#pragma unroll
  for (int h = 0; h < F / 64; ++h) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[32 * h + i] = gated_act(fin[64 * h + i], fin[64 * h + 32 + i], p);
  }
  if (p.out_kind != kOutE4m3) return;
  const int64_t groups = p.n / 2 / kBlockK;
  float top = 0.f, low = 0.f;  // rows lane / 4 and lane / 4 + 8
#pragma unroll
  for (int j = 0; j < F / 2; ++j) {
    if (j & 2) {
      low = fmaxf(low, fabsf(y[j]));
    } else {
      top = fmaxf(top, fabsf(y[j]));
    }
  }
#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, x));
    low = fmaxf(low, __shfl_xor_sync(0xffffffffu, low, x));
  }
  if (mine) {
    if (lane % 4 == 0) {
      mine[lane / 4] = top;
      mine[lane / 4 + 8] = low;
    }
    asm volatile("bar.sync %0, 64;" ::"r"(pair_bar) : "memory");
    top = fmaxf(top, other[lane / 4]);
    low = fmaxf(low, other[lane / 4 + 8]);
  }
  const float s_top = fp8_scale(top), s_low = fp8_scale(low);
  const float i_top = fminf(__frcp_rn(s_top), 3.40282347e38f), i_low = fminf(__frcp_rn(s_low), 3.40282347e38f);
#pragma unroll
  for (int j = 0; j < F / 2; ++j) y[j] = fminf(fmaxf(y[j] * ((j & 2) ? i_low : i_top), -448.f), 448.f);
  if (owner && lane % 4 == 0) {
    const int r = lane / 4;
    float* s = p.out_scale + row * groups + group;
    if (r < valid_rows) s[r * groups] = s_top;
    if (r + 8 < valid_rows) s[(r + 8) * groups] = s_low;
  }
}

template <int F>
__device__ __forceinline__ void store_gated(const float* fin, const Params& p, int64_t row, int col, int group,
                                            int valid_rows, uint32_t stage, int lane, float* mine, const float* other,
                                            int pair_bar, bool owner) {
  float y[F / 2];
  gated_rows<F>(fin, p, y, row, group, valid_rows, lane, mine, other, pair_bar, owner);
  const int64_t ld = p.n / 2;
  if (p.out_kind == kOutE4m3) {
    store_tile<kOutE4m3, F / 8>(y, static_cast<uint8_t*>(p.out) + row * ld + col, ld, valid_rows, F, stage, lane);
  } else if (p.out_kind == kOutF32) {
    store_tile<kOutF32, F / 8>(y, static_cast<float*>(p.out) + row * ld + col, ld, valid_rows, F, stage, lane);
  } else {
    store_tile<kOutBf16, F / 8>(y, static_cast<__nv_bfloat16*>(p.out) + row * ld + col, ld, valid_rows, F, stage, lane);
  }
}

// Byte offset of 16-byte chunk `c` (8 columns) of row `r` in a warp's four [16][64] bf16 boxes, as the TMA's
// 128-byte swizzle lays them out: chunk c % 8 of a 128-byte row sits at position (c % 8) ^ (r % 8).
__device__ __forceinline__ uint32_t box_offset(int r, int c) {
  return (c / 8) * 2048 + r * 128 + 16 * ((c % 8) ^ (r % 8));
}

// The asynchronous form of store_tile for a warp's 16 rows x 256 columns: the rows go to shared memory as four
// [16][64] bf16 boxes at `region` (8 KiB, 1024-byte aligned) in the TMA's 128-byte swizzle (16-byte chunk c of
// row r at chunk c ^ (r % 8): a store instruction's 32 words fall in distinct banks), then lane 0 hands each box
// to the TMA, which the warp does not wait for; the caller waits with bulk_wait_read before the region is
// written again. A warp whose rows pass the expert's end (rows from `valid_rows` on must stay untouched)
// copies its valid rows out itself instead, synchronously. `row` is the warp's first row of `out`, `col` its
// first column; columns from `cols` on (N) are skipped.
__device__ __forceinline__ void store_tile_async(const float* fin, uint32_t region, const CUtensorMap* map,
                                                 __nv_bfloat16* out, int64_t ld, int row, int col, int valid_rows,
                                                 int cols, int lane) {
  const int r = lane / 4;
  const uint32_t word = region + (lane % 4) * 4;
#pragma unroll
  for (int c = 0; c < 32; ++c) {  // 8 columns each
    const float* f = fin + 4 * c;
    __nv_bfloat162 t = __floats2bfloat162_rn(f[0], f[1]), l = __floats2bfloat162_rn(f[2], f[3]);
    sts(word + box_offset(r, c), *reinterpret_cast<uint32_t*>(&t));
    sts(word + box_offset(r + 8, c), *reinterpret_cast<uint32_t*>(&l));
  }
  if (valid_rows >= 16) {
    // The TMA reads through the async proxy: make the generic stores above visible to it.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (64 * b < cols) tma_store(map, region + b * 2048, col + 64 * b, row);
      }
      bulk_commit();
    }
    return;
  }
  __syncwarp();
  for (int q = lane; q < valid_rows * 32; q += 32) {
    const int rr = q / 32, c = q % 32;  // row, 16-byte chunk
    if (8 * c < cols) {
      const uint4 v = lds128(region + box_offset(rr, c));
      *reinterpret_cast<uint4*>(out + rr * ld + 8 * c) = v;
    }
  }
}

// Byte offset of the 2-byte pair (8-column chunk `c`, lane pair `pair`) of row `r` in a warp's [16][128] e4m3 box
// in the TMA's 128-byte swizzle: 16-byte chunk c / 2 of the row sits at position (c / 2) ^ (r % 8).
__device__ __forceinline__ uint32_t fp8_box_offset(int r, int c, int pair) {
  return r * 128 + 16 * ((c / 2) ^ (r % 8)) + 8 * (c % 2) + 2 * pair;
}

// The asynchronous form of store_gated for a warp's 16 rows x 128 output columns (the 128 x 256 tiles), bf16 or
// e4m3, like store_tile_async: staged at `region` as the TMA's swizzled boxes ([16][64] bf16 x 2, or one
// [16][128] e4m3), handed to the TMA by lane 0 unless the rows pass the expert's end, then copied out here.
__device__ __forceinline__ void store_gated_async(const float* fin, const Params& p, uint32_t region,
                                                  const CUtensorMap* map, int64_t row, int col, int group,
                                                  int valid_rows, int lane) {
  float y[64];
  gated_rows<128>(fin, p, y, row, group, valid_rows, lane, nullptr, nullptr, 0, true);
  const int r = lane / 4, pair = lane % 4;
  const bool fp8 = p.out_kind == kOutE4m3;
#pragma unroll
  for (int c = 0; c < 16; ++c) {  // 8 columns each
    if (fp8) {
      put_pair<kOutE4m3>(region + fp8_box_offset(r, c, pair), y[4 * c], y[4 * c + 1]);
      put_pair<kOutE4m3>(region + fp8_box_offset(r + 8, c, pair), y[4 * c + 2], y[4 * c + 3]);
    } else {
      put_pair<kOutBf16>(region + box_offset(r, c) + 4 * pair, y[4 * c], y[4 * c + 1]);
      put_pair<kOutBf16>(region + box_offset(r + 8, c) + 4 * pair, y[4 * c + 2], y[4 * c + 3]);
    }
  }
  if (valid_rows >= 16) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
      if (fp8) {
        tma_store(map, region, col, static_cast<int>(row));
      } else {
        tma_store(map, region, col, static_cast<int>(row));
        tma_store(map, region + 2048, col + 64, static_cast<int>(row));
      }
      bulk_commit();
    }
    return;
  }
  __syncwarp();
  const int size = fp8 ? 1 : 2, pieces = 8 * size;  // 16-byte pieces per row
  const int64_t ld = p.n / 2;
  uint8_t* out = static_cast<uint8_t*>(p.out) + (row * ld + col) * size;
  for (int q = lane; q < valid_rows * pieces; q += 32) {
    const int rr = q / pieces, c = q % pieces;
    const uint32_t at = fp8 ? rr * 128 + 16 * (c ^ (rr % 8)) : box_offset(rr, c);
    *reinterpret_cast<uint4*>(out + rr * ld * size + 16 * c) = lds128(region + at);
  }
}

#endif

}  // namespace sm90_wgmma
}  // namespace fim
