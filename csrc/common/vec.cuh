// Eight consecutive elements moved as 16-byte vectors (two for fp32) and widened to / narrowed from fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace fim {

template <typename T>
struct Vec8;  // the raw storage of eight T

template <>
struct Vec8<float> {
  uint4 raw[2];
};
template <>
struct Vec8<__half> {
  uint4 raw[1];
};
template <>
struct Vec8<__nv_bfloat16> {
  uint4 raw[1];
};

// Plain loads: re-read rows (combine reads a token's rows once, permute reads a token once) gain nothing
// from L1, but the default policy costs nothing either.
template <typename T>
__device__ __forceinline__ Vec8<T> load8(const T* p) {
  Vec8<T> v;
  constexpr int n = sizeof(Vec8<T>) / sizeof(uint4);
#pragma unroll
  for (int i = 0; i < n; ++i) v.raw[i] = reinterpret_cast<const uint4*>(p)[i];
  return v;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const Vec8<T>& v) {
  constexpr int n = sizeof(Vec8<T>) / sizeof(uint4);
#pragma unroll
  for (int i = 0; i < n; ++i) reinterpret_cast<uint4*>(p)[i] = v.raw[i];
}

__device__ __forceinline__ void widen8(const Vec8<float>& v, float (&out)[8]) {
  const float* f = reinterpret_cast<const float*>(v.raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = f[i];
}

__device__ __forceinline__ void widen8(const Vec8<__half>& v, float (&out)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(v.raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void widen8(const Vec8<__nv_bfloat16>& v, float (&out)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(v.raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// fp32 -> T with round-to-nearest-even, as torch's .to(dtype) does.
__device__ __forceinline__ Vec8<float> narrow8(const float (&in)[8], float*) {
  Vec8<float> v;
  float* f = reinterpret_cast<float*>(v.raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = in[i];
  return v;
}

__device__ __forceinline__ Vec8<__half> narrow8(const float (&in)[8], __half*) {
  Vec8<__half> v;
  __half2* h = reinterpret_cast<__half2*>(v.raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
  return v;
}

__device__ __forceinline__ Vec8<__nv_bfloat16> narrow8(const float (&in)[8], __nv_bfloat16*) {
  Vec8<__nv_bfloat16> v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(v.raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return v;
}

template <typename T>
__device__ __forceinline__ Vec8<T> narrow8(const float (&in)[8]) {
  return narrow8(in, static_cast<T*>(nullptr));
}

}  // namespace fim
