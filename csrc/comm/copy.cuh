// Warp copies of the all-to-all kernels (a2a.cu: the P2P path, collective.cu: the NCCL path's rows).
#pragma once

#include <cstdint>

namespace fim {
namespace comm {

// Range [begin, end) of `part` when `n` units are split into `parts` near-equal pieces.
__device__ __forceinline__ void split(int64_t n, int part, int parts, int64_t* begin, int64_t* end) {
  const int64_t per = (n + parts - 1) / parts;
  *begin = min(n, per * part);
  *end = min(n, *begin + per);
}

// One warp copies piece `part` of `n` bytes from `src` to `dst + offset` for every dst in `dsts`. 16-byte
// vectors when addresses and size allow (workspace rows always are); loads are batched before the stores.
__device__ __forceinline__ void copy_to_all(char* const* dsts, int nd, int64_t offset, const char* src, int64_t n,
                                            int part, int parts, int lane) {
  bool vec =
      ((reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(n) | static_cast<uintptr_t>(offset)) & 15) == 0;
  for (int q = 0; q < nd && vec; ++q) vec = (reinterpret_cast<uintptr_t>(dsts[q]) & 15) == 0;
  if (vec) {
    constexpr int kUnroll = 4;
    int64_t begin, end;
    split(n / 16, part, parts, &begin, &end);
    const int4* s = reinterpret_cast<const int4*>(src);
    for (int64_t base = begin + lane; base < end; base += 32 * kUnroll) {
      int4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + 32 * u;
        r[u] = i < end ? s[i] : make_int4(0, 0, 0, 0);
      }
      for (int q = 0; q < nd; ++q) {
        int4* d = reinterpret_cast<int4*>(dsts[q] + offset);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + 32 * u;
          if (i < end) d[i] = r[u];
        }
      }
    }
  } else {
    int64_t begin, end;
    split(n, part, parts, &begin, &end);
    for (int64_t i = begin + lane; i < end; i += 32) {
      const char c = src[i];
      for (int q = 0; q < nd; ++q) dsts[q][offset + i] = c;
    }
  }
}

__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t n, int part, int parts, int lane) {
  copy_to_all(&dst, 1, 0, src, n, part, parts, lane);
}

// All n bytes by one warp.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t n, int lane) {
  copy_to_all(&dst, 1, 0, src, n, 0, 1, lane);
}

}  // namespace comm
}  // namespace fim
