// Warp-level helpers shared by the kernels.
#pragma once

#include <cstdint>

namespace fim {

constexpr unsigned kFullMask = 0xffffffffu;

// Maps a float to an unsigned integer with the same order, so that warp-wide max/min of floats can use
// the single-instruction integer reductions (redux.sync) instead of five shuffle rounds.
// -0.0 and +0.0 must be canonicalised by the caller (x + 0.0f) if they are to compare equal.
__device__ __forceinline__ uint32_t float_to_ordered(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float ordered_to_float(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

__device__ __forceinline__ float warp_max(float x) {
  return ordered_to_float(__reduce_max_sync(kFullMask, float_to_ordered(x)));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ __forceinline__ int warp_sum_int(int x) { return __reduce_add_sync(kFullMask, x); }

// Sum of x over lanes 0 .. this lane.
__device__ __forceinline__ int warp_inclusive_sum(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += up;
  }
  return x;
}

}  // namespace fim
