// PTX wrappers of the Hopper NVFP4 grouped GEMM (sm90_nvfp4_w4a16_grouped.cu): cp.async copies, shared-memory
// loads and stores, warpgroup barriers, and wgmma with its A operand in registers (m64 x n{8, 16, 32, 64, 128, 256} x
// k16, bf16 inputs, or k32, e4m3 inputs; fp32 accumulators); the helpers it shares with the FP8 wgmma kernels come from
// sm90_wgmma_common.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "sm90_wgmma_common.cuh"

namespace fim {
namespace sm90_nvfp4 {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared with the FP8 wgmma kernels.
using sm90_wgmma::fence_regs;
using sm90_wgmma::last_at_or_before;
using sm90_wgmma::lds;
using sm90_wgmma::lds128;
using sm90_wgmma::smem_u32;
using sm90_wgmma::sts;
using sm90_wgmma::wgmma_wait;

// 16 bytes into shared memory; src_bytes 0 fills zeros (rows past the group).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// With an L2 policy (sm90_wgmma::l2_evict_first).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src), "r"(src_bytes),
               "l"(policy)
               : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// The 128 threads of warpgroup wg of W (barrier 1 + wg; 0 is __syncthreads'): with two, ids as immediates so that
// ptxas counts two barriers, not all sixteen.
template <int W>
__device__ __forceinline__ void warpgroup_sync(int wg) {
  if constexpr (W == 2) {
    if (wg == 0) {
      asm volatile("bar.sync 1, 128;" ::: "memory");
    } else {
      asm volatile("bar.sync 2, 128;" ::: "memory");
    }
  } else {
    asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory");
  }
}

// wgmma with A (the expanded weights) in registers and B (the activations) in shared memory, accumulating: one
// overload per N (the accumulators d, N / 2 a thread, listed as operands four or sixteen at a time), for bf16 (k16;
// its last immediate leaves B untransposed) and for e4m3 (k32, the W4A8 mode: the A fragment's registers hold four
// e4m3 each, rows lane / 4 and + 8, k 4 (lane % 4) .. + 3 and 16 more; no transpose immediates).
#define FIM_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define FIM_ACC16(i) FIM_ACC4(i), FIM_ACC4(i + 4), FIM_ACC4(i + 8), FIM_ACC4(i + 12)
// The operands of m64nN: d's N / 2 registers, a's four, the descriptor.
#define FIM_OPS_8 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8"
#define FIM_OPS_16 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12"
#define FIM_OPS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20"
#define FIM_OPS_64                                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36"
#define FIM_OPS_128                                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "   \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, " \
  "%68"
#define FIM_OPS_256                                                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, "  \
  "%68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, "  \
  "%90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "  \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "   \
  "{%128, %129, %130, %131}, %132"
#define FIM_WGMMA_RS(FN, N, TYPES, K, TAIL, ...)                                                              \
  __device__ __forceinline__ void FN(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {            \
    asm volatile(                                                                                             \
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                            \
        "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TYPES " " FIM_OPS_##N ", p, 1, 1" TAIL ";\n}\n" \
        : __VA_ARGS__                                                                                         \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                                           \
  }
// Every tile width of one operand type: FN(d, a, desc_b) overloaded on N.
#define FIM_WGMMA_RS_ALL(FN, TYPES, K, TAIL)                                                                      \
  FIM_WGMMA_RS(FN, 8, TYPES, K, TAIL, FIM_ACC4(0))                                                                \
  FIM_WGMMA_RS(FN, 16, TYPES, K, TAIL, FIM_ACC4(0), FIM_ACC4(4))                                                  \
  FIM_WGMMA_RS(FN, 32, TYPES, K, TAIL, FIM_ACC16(0))                                                              \
  FIM_WGMMA_RS(FN, 64, TYPES, K, TAIL, FIM_ACC16(0), FIM_ACC16(16))                                               \
  FIM_WGMMA_RS(FN, 128, TYPES, K, TAIL, FIM_ACC16(0), FIM_ACC16(16), FIM_ACC16(32), FIM_ACC16(48))                \
  FIM_WGMMA_RS(FN, 256, TYPES, K, TAIL, FIM_ACC16(0), FIM_ACC16(16), FIM_ACC16(32), FIM_ACC16(48), FIM_ACC16(64), \
               FIM_ACC16(80), FIM_ACC16(96), FIM_ACC16(112))
FIM_WGMMA_RS_ALL(wgmma_rs, "bf16.bf16", 16, ", 0")
FIM_WGMMA_RS_ALL(wgmma_rs_e4m3, "e4m3.e4m3", 32, "")
#undef FIM_WGMMA_RS_ALL
#undef FIM_WGMMA_RS
#undef FIM_OPS_8
#undef FIM_OPS_16
#undef FIM_OPS_32
#undef FIM_OPS_64
#undef FIM_OPS_128
#undef FIM_OPS_256
#undef FIM_ACC16
#undef FIM_ACC4

// Four 8 x 8 bf16 matrices of mma fragments (register i: matrix i, this thread's row lane / 4, columns
// 2 (lane % 4) and + 1), stored transposed: this thread's address is row lane % 8 of matrix lane / 8, the
// fragment's column lane % 8 (16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void stg128(void* ptr, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Two floats as a bf16x2 (lo in the low half), rounded to nearest.
__device__ __forceinline__ uint32_t bf16x2_of(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// The register operand's fragments, likewise (accumulators: sm90_wgmma::fence_regs): four k16 steps (bf16) or two
// k32 steps (e4m3) of a 64-deep span.
template <int C>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[C][4]) {
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[c][i])::"memory");
}

#endif

}  // namespace sm90_nvfp4
}  // namespace fim
