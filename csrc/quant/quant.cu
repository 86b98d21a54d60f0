// Quantization kernels that are not a permute: a tensor's amax turned into a scale (FP8 per-tensor and the
// NVFP4 global scale), FP8 weights with one scale per 128x128 block (DeepSeek-V3 weight_scale_inv), and
// NVFP4 dequantization. Bit-exact with flashinfer_moe/reference_quant.py.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.cuh"
#include "common/quant.cuh"
#include "common/vec.cuh"

namespace fim {
namespace quant {

constexpr int kThreads = 256;

// max |x| over n elements into *amax_bits (the fp32 bits of a non-negative float order like unsigned ints).
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* x, int64_t n, unsigned* amax_bits) {
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (VEC) {
    for (int64_t i = first; i < n / 8; i += stride) {
      float v[8];
      widen8(load8(x + i * 8), v);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
    }
  } else {
    for (int64_t i = first; i < n; i += stride) m = fmaxf(m, fabsf(to_float(x[i])));
  }
  const unsigned bits = __reduce_max_sync(0xffffffffu, __float_as_uint(m));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, bits);
}

__global__ void scale_from_amax_kernel(float* scale, float divisor) {
  *scale = scale_from_amax(*scale, divisor);  // *scale holds the amax's bits, which are the amax
}

// One block per (matrix, block row, block column): the tile's amax, then its elements divided by the scale.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_weights_kernel(const T* w, int64_t n, int64_t k, int bn, int bk, uint8_t* q, float* scales) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t nb = (n + bn - 1) / bn, kb = (k + bk - 1) / bk;
  const int64_t tile = blockIdx.x;
  const int64_t g = tile / (nb * kb), bi = tile / kb % nb, bj = tile % kb;
  const T* src = w + g * n * k;
  const int rows = static_cast<int>(min(static_cast<int64_t>(bn), n - bi * bn));
  const int cols = static_cast<int>(min(static_cast<int64_t>(bk), k - bj * bk));
  float m = 0.0f;
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int64_t r = bi * bn + idx / cols, c = bj * bk + idx % cols;
    m = fmaxf(m, fabsf(to_float(src[r * k + c])));
  }
  m = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, warp_max[i]);
  const float scale = scale_from_amax(m, kFp8Max);
  const float inv = inverse_scale(scale);
  if (threadIdx.x == 0) scales[tile] = scale;
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int64_t r = bi * bn + idx / cols, c = bj * bk + idx % cols;
    q[g * n * k + r * k + c] = fp8(__fmul_rn(to_float(src[r * k + c]), inv));
  }
}

// e2m1(code) * float(block scale) * global scale, eight codes (one 32-bit word) per thread.
__global__ void __launch_bounds__(kThreads) dequant_nvfp4_kernel(const uint32_t* packed, const uint8_t* block_scales,
                                                                 const float* global_scale, int64_t words, float* out) {
  constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float gs = *global_scale;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    const uint32_t codes = packed[i];
    const float s = fp8_to_float(block_scales[i / 2]);  // 16 elements per scale, 8 per word
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t code = codes >> (4 * e) & 0xfu;
      const float mag = kGrid[code & 7u];
      v[e] = __fmul_rn(__fmul_rn(code & 8u ? -mag : mag, s), gs);
    }
    store8(out + i * 8, narrow8<float>(v));
  }
}

int grid_for(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : blocks > 132 * 16 ? 132 * 16 : blocks);
}

template <typename T>
cudaError_t amax_scale(const void* x, int64_t n, int vec, float* scale, float divisor, cudaStream_t s) {
  cudaError_t err = cudaMemsetAsync(scale, 0, sizeof(float), s);
  if (err != cudaSuccess) return err;
  auto* bits = reinterpret_cast<unsigned*>(scale);
  if (n > 0) {
    if (vec) {
      amax_kernel<T, true><<<grid_for(n / 8), kThreads, 0, s>>>(static_cast<const T*>(x), n, bits);
    } else {
      amax_kernel<T, false><<<grid_for(n), kThreads, 0, s>>>(static_cast<const T*>(x), n, bits);
    }
  }
  scale_from_amax_kernel<<<1, 1, 0, s>>>(scale, divisor);
  return cudaGetLastError();
}

}  // namespace quant
}  // namespace fim

extern "C" {

// Every function returns a cudaError_t, 0 on success; arguments are validated in Python
// (flashinfer_moe/moe/quant.py).

// *scale = max(max|x| / divisor, 2**-126) over n elements of a contiguous tensor. vec: 16-byte aligned, n % 8 == 0.
int fim_amax_scale(const void* x, int dtype, int64_t n, int vec, float* scale, float divisor, void* stream) {
  using namespace fim::quant;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case fim::kFloat32:
      return amax_scale<float>(x, n, vec, scale, divisor, s);
    case fim::kFloat16:
      return amax_scale<__half>(x, n, vec, scale, divisor, s);
    case fim::kBFloat16:
      return amax_scale<__nv_bfloat16>(x, n, vec, scale, divisor, s);
    default:
      return cudaErrorInvalidValue;
  }
}

// w: [batch, n, k] contiguous; q: same shape, E4M3 bytes; scales: [batch, ceil(n / bn), ceil(k / bk)] fp32.
int fim_quantize_fp8_block(const void* w, int dtype, int64_t batch, int64_t n, int64_t k, int bn, int bk, void* q,
                           float* scales, void* stream) {
  using namespace fim::quant;
  if (batch == 0 || n == 0 || k == 0) return 0;
  if (bn < 1 || bk < 1) return cudaErrorInvalidValue;
  const int64_t tiles = batch * ((n + bn - 1) / bn) * ((k + bk - 1) / bk);
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  auto s = static_cast<cudaStream_t>(stream);
  auto* out = static_cast<uint8_t*>(q);
  switch (dtype) {
    case fim::kFloat32:
      block_weights_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(static_cast<const float*>(w), n, k, bn, bk,
                                                                             out, scales);
      break;
    case fim::kFloat16:
      block_weights_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(static_cast<const __half*>(w), n, k, bn,
                                                                             bk, out, scales);
      break;
    case fim::kBFloat16:
      block_weights_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(w), n, k,
                                                                             bn, bk, out, scales);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// packed: [rows, K / 2] bytes (4-byte aligned), block_scales: [rows, K / 16] E4M3, out: [rows, K] fp32.
int fim_dequantize_nvfp4(const void* packed, const void* block_scales, const float* global_scale, int64_t elements,
                         float* out, void* stream) {
  using namespace fim::quant;
  if (elements == 0) return 0;
  if (elements % 16 != 0) return cudaErrorInvalidValue;
  const int64_t words = elements / 8;
  dequant_nvfp4_kernel<<<grid_for(words), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint32_t*>(packed), static_cast<const uint8_t*>(block_scales), global_scale, words, out);
  return cudaGetLastError();
}

const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
