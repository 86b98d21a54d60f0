// wgmma wrappers of the Hopper MLA decode (sm90_mla_decode.cu, sm90_mla_decode_narrow.cu): both operands in shared
// memory, bf16 or fp16 inputs, fp32 accumulators. Scores: m64 x n64 x k16, both operands K-major. Values: m64 x n256 x
// k16 with the B operand (the cache tile's latent columns) MN-major, the latent dimension contiguous (transpose bit
// set).
#pragma once

#include <cstdint>

#include "gemm/sm90_wgmma_common.cuh"

namespace fim {
namespace sm90_mla {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The asm for input type TYPE ("f16" or "bf16").
#define FIM_MLA_WGMMA_SCORES(TYPE)                                                                                  \
  asm volatile(                                                                                                     \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                  \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE                                                   \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                 \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                   \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <bool F16>
__device__ __forceinline__ void mma_scores(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (F16) {
    FIM_MLA_WGMMA_SCORES("f16");
  } else {
    FIM_MLA_WGMMA_SCORES("bf16");
  }
}
#undef FIM_MLA_WGMMA_SCORES

// The asm for input type TYPE ("f16" or "bf16").
#define FIM_MLA_WGMMA_VALUES(TYPE)                                                                                     \
  asm volatile(                                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                    \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "    \
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, " \
      "%67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, " \
      "%89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "  \
      "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "   \
      "%127}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                                         \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),    \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),         \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),        \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),        \
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),        \
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),        \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),        \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),        \
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),        \
        "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),        \
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),        \
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),        \
        "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),   \
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),              \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),              \
        "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),              \
        "+f"(d[126]), "+f"(d[127])                                                                                     \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <bool F16>
__device__ __forceinline__ void mma_values(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (F16) {
    FIM_MLA_WGMMA_VALUES("f16");
  } else {
    FIM_MLA_WGMMA_VALUES("bf16");
  }
}
#undef FIM_MLA_WGMMA_VALUES

// The narrow kernel's products (sm90_mla_decode_narrow.cu), fp16 inputs, n = the query rows (16 or 32), B K-major:
// scores transposed (A: the tile, K-major) and values transposed (A: the tile's latent columns, MN-major: TRANS_A).

#define FIM_MLA_WGMMA_N16(TRANS_A)                                                                                     \
  asm volatile(                                                                                                        \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                                                     \
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, " TRANS_A \
      ", 0;\n}\n"                                                                                                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])                 \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

#define FIM_MLA_WGMMA_N32(TRANS_A)                                                                                  \
  asm volatile(                                                                                                     \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                                  \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, " \
      "%13, %14, %15}, %16, %17, p, 1, 1, " TRANS_A ", 0;\n}\n"                                                     \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                    \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <int N, bool TRANS_A>
__device__ __forceinline__ void mma_narrow(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (N == 16) {
    if constexpr (TRANS_A) {
      FIM_MLA_WGMMA_N16("1");
    } else {
      FIM_MLA_WGMMA_N16("0");
    }
  } else {
    static_assert(N == 32, "16 or 32 query rows");
    if constexpr (TRANS_A) {
      FIM_MLA_WGMMA_N32("1");
    } else {
      FIM_MLA_WGMMA_N32("0");
    }
  }
}
#undef FIM_MLA_WGMMA_N16
#undef FIM_MLA_WGMMA_N32

// The register-operand narrow kernel's products (sm90_mla_decode_narrow_rs.cu). Scores: the FP8 tile (A) times the
// queries' two FP8 parts (B, NB = 2 x the query rows), both K-major in shared memory. Values: fp16 fragments of the
// tile's latent columns (A, in registers) times P^T (B, K-major), accumulating.

#define FIM_MLA_WGMMA_FP8_N32                                                                                       \
  asm volatile(                                                                                                     \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                                  \
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "    \
      "%12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"                                                                \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                    \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <int NB>
__device__ __forceinline__ void mma_scores_fp8(float (&d)[NB / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (NB == 32) {
    FIM_MLA_WGMMA_FP8_N32;
  } else {
    static_assert(NB == 64, "two parts of 16 or 32 query rows");
    sm90_wgmma::wgmma_m64n64k32(d, desc_a, desc_b, accumulate);
  }
}
#undef FIM_MLA_WGMMA_FP8_N32

// The 32-row scores of the same kernel: the queries' two FP8 parts (A, this thread's fragments in registers) times
// the tile (B, K-major in shared memory), m64 x n64 x k32.
__device__ __forceinline__ void mma_scores_fp8_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                  int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void mma_values_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
        "%12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    static_assert(N == 32, "16 or 32 query rows");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

// The values' product with P^T in E4M3 (NARROW_PV8): FP8 fragments of the tile's latent columns (A, in registers,
// their k order P^T's) times P^T (B, K-major), m64 x n32 x k32, accumulating.
__device__ __forceinline__ void mma_values_fp8_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

#endif

}  // namespace sm90_mla
}  // namespace fim
