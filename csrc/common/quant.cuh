// FP8 (E4M3) and NVFP4 (E2M1 + E4M3 block scale) encoding, bit-exact with flashinfer_moe/reference_quant.py.
//
// Every rounding step is spelled with an explicit IEEE intrinsic (__fdiv_rn, __frcp_rn, __fmul_rn): the
// reference rounds each fp32 operation correctly, and a contracted or approximate form would differ in the
// last bit for some inputs. Values are scaled by the correctly rounded reciprocal of their scale (one multiply
// per element; a division per element made the quantizing permute compute-bound).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fim {

constexpr float kFp8Max = 448.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kMinScale = 1.17549435e-38f;  // smallest normal fp32, 2**-126
constexpr float kFltMax = 3.40282347e+38f;

// min(1 / scale, FLT_MAX), correctly rounded: a zero or tiny scale saturates the values instead of making NaN.
__device__ __forceinline__ float inverse_scale(float scale) { return fminf(__frcp_rn(scale), kFltMax); }

// Dequantization scale from an amax: max(amax / divisor, 2**-126).
__device__ __forceinline__ float scale_from_amax(float amax, float divisor) {
  return fmaxf(__fdiv_rn(amax, divisor), kMinScale);
}

// The smallest power of two >= s, for a normal positive s (UE8M0-compatible scales).
__device__ __forceinline__ float round_up_pow2(float s) {
  uint32_t bits = __float_as_uint(s);
  if (bits & 0x007fffffu) bits = (bits + 0x007fffffu) & 0xff800000u;
  return __uint_as_float(bits);
}

// Two floats to two E4M3 bytes (a in the low byte), round-to-nearest-even, saturating at +-448.
__device__ __forceinline__ uint16_t fp8x2(float a, float b) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint8_t fp8(float a) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3)));
}

// Eight values (already divided by their scale) to eight E4M3 bytes, element 0 in the lowest byte.
__device__ __forceinline__ uint2 fp8x8(const float (&v)[8]) {
  uint2 out;
  out.x = fp8x2(v[0], v[1]) | (static_cast<uint32_t>(fp8x2(v[2], v[3])) << 16);
  out.y = fp8x2(v[4], v[5]) | (static_cast<uint32_t>(fp8x2(v[6], v[7])) << 16);
  return out;
}

// Nearest E2M1 code, ties to even, saturating at 6; sign in bit 3 (also for values that round to zero).
// The thresholds are the midpoints of the grid {0, .5, 1, 1.5, 2, 3, 4, 6}: strict where the lower
// neighbour has the even code, inclusive where the upper one has. NaN magnitudes encode as zero.
__device__ __forceinline__ uint32_t e2m1_code(float v) {
  const float a = fabsf(v);
  const uint32_t index =
      (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return index | ((__float_as_uint(v) >> 31) << 3);
}

// One 16-element NVFP4 block's E4M3 scale byte, from the block amax and the global (dequantization) scale.
__device__ __forceinline__ uint8_t nvfp4_block_scale(float block_amax, float global_scale) {
  return fp8(__fdiv_rn(block_amax, __fmul_rn(kE2M1Max, global_scale)));
}

// Eight values to eight E2M1 codes packed in 32 bits, element 2i in the low nibble of byte i. ``denom`` is
// float(block scale) * global scale; a block whose scale rounded to zero encodes as all-zero codes.
__device__ __forceinline__ uint32_t nvfp4x8(const float (&v)[8], float denom) {
  uint32_t packed = 0;
  if (denom > 0.0f) {
    const float inv = inverse_scale(denom);
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_code(__fmul_rn(v[i], inv)) << (4 * i);
  }
  return packed;
}

}  // namespace fim
