// Permute with fused quantization: each token row is read once, quantized once, and written to every row
// of the expert-major layout that holds one of its pairs (row_of[t, j] >= 0). With no row_of, row t goes to
// row t: that is the plain quantizer.
//
// A 2-D grid: one block per (token, tile of its row); each thread holds 16 consecutive elements. FP8 group
// scales reduce over the group_size / 16 lanes of a group (groups never straddle a warp: group_size divides
// 512); an NVFP4 block is exactly one thread's 16 elements.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.cuh"
#include "common/quant.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"

namespace fim {
namespace permute {

enum Mode : int { kCopy = 0, kFp8Group = 1, kFp8Tensor = 2, kNvfp4 = 3 };
constexpr int kMaxTopK = 64;
// Threads per block, each block one tile of a token's row, each thread kElems consecutive elements (two
// 16-byte loads of bf16). Small blocks keep more tokens in flight per SM: measured on an H200 at T = 4096,
// H = 7168, 128-thread tiles beat one 896-thread block per token by 10-15%; 64 threads of 16 elements tile
// 7168 exactly (7 tiles) and issue 16-byte FP8 stores.
constexpr int kThreads = 64;
constexpr int kElems = 16;

struct ScatterParams {
  const void* in;  // [T, H], row stride in_stride elements
  int64_t in_stride;
  const int32_t* row_of;  // [T, k], or nullptr for row t -> row t (k = 1)
  int top_k;
  int hidden;
  void* out;           // [rows, H] of T (copy) or bytes (fp8), [rows, H / 2] bytes (nvfp4)
  void* scales;        // fp8 group: float [rows, H / group_size]; nvfp4: E4M3 bytes [rows, H / 16]
  const float* scale;  // fp8 tensor: the dequantization scale; nvfp4: the global scale
  int group_size;
  int scale_pow2;
};

template <typename T, int MODE, bool VEC>
__global__ void __launch_bounds__(kThreads) scatter_kernel(const ScatterParams p) {
  __shared__ int32_t rows[kMaxTopK];
  const int64_t t = blockIdx.x;
  for (int j = threadIdx.x; j < p.top_k; j += blockDim.x) {
    rows[j] = p.row_of != nullptr ? p.row_of[t * p.top_k + j] : static_cast<int32_t>(t);
  }
  __syncthreads();
  bool any = false;
  for (int j = 0; j < p.top_k; ++j) any |= rows[j] >= 0;
  if (!any) return;  // no pair of this token lives here: skip reading it

  const T* src = static_cast<const T*>(p.in) + t * p.in_stride;
  const int H = p.hidden;
  if constexpr (!VEC) {  // unaligned rows or H % 16 != 0: element by element (copy and FP8 per-tensor only)
    const float inv = MODE == kFp8Tensor ? inverse_scale(*p.scale) : 1.0f;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < H; c += gridDim.y * blockDim.x) {
      const T v = src[c];
      for (int j = 0; j < p.top_k; ++j) {
        if (rows[j] < 0) continue;
        const int64_t at = static_cast<int64_t>(rows[j]) * H + c;
        if constexpr (MODE == kCopy) {
          static_cast<T*>(p.out)[at] = v;
        } else {
          static_cast<uint8_t*>(p.out)[at] = fp8(__fmul_rn(to_float(v), inv));
        }
      }
    }
  } else {
    if constexpr (MODE == kCopy) {
      // Two 8-element vectors a block-width apart, so each warp-wide load and store is one contiguous run.
      const int c0 = (blockIdx.y * blockDim.x * 2 + threadIdx.x) * 8, c1 = c0 + blockDim.x * 8;
      Vec8<T> raw[2];
      if (c0 < H) raw[0] = load8(src + c0);
      if (c1 < H) raw[1] = load8(src + c1);
      for (int j = 0; j < p.top_k; ++j) {
        if (rows[j] < 0) continue;
        T* dst = static_cast<T*>(p.out) + static_cast<int64_t>(rows[j]) * H;
        if (c0 < H) store8(dst + c0, raw[0]);
        if (c1 < H) store8(dst + c1, raw[1]);
      }
      return;
    }
    // This thread's 16 consecutive elements of the block's tile (blockIdx.y), both vectors loaded before
    // either is used. Every lane takes part in the group shuffles, idle ones holding zeros.
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * kElems;
    const bool active = c < H;
    Vec8<T> raw[2] = {};
    if (active) {
      raw[0] = load8(src + c);
      raw[1] = load8(src + c + 8);
    }
    float v[2][8];
    widen8(raw[0], v[0]);
    widen8(raw[1], v[1]);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fmaxf(fabsf(v[0][i]), fabsf(v[1][i])));
    if constexpr (MODE == kFp8Group || MODE == kFp8Tensor) {
      float scale;
      if constexpr (MODE == kFp8Tensor) {
        scale = *p.scale;
      } else {
        for (int offset = 1; offset < p.group_size / kElems; offset <<= 1) {
          amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
        }
        scale = scale_from_amax(amax, kFp8Max);
        if (p.scale_pow2) scale = round_up_pow2(scale);
      }
      // FP8 group scales are staged in shared memory and stored by consecutive threads, so that each block
      // writes its tile's scales of a row as one whole sector rather than 16-byte halves from two warps.
      __shared__ float tile_scales[kThreads];
      const int lanes = MODE == kFp8Group ? p.group_size / kElems : 1;
      if constexpr (MODE == kFp8Group) {
        if (active && (threadIdx.x & (lanes - 1)) == 0) tile_scales[threadIdx.x / lanes] = scale;
        __syncthreads();
      }
      if (active) {
        const float inv = inverse_scale(scale);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[0][i] = __fmul_rn(v[0][i], inv);
          v[1][i] = __fmul_rn(v[1][i], inv);
        }
      }
      const uint2 lo = fp8x8(v[0]), hi = fp8x8(v[1]);
      const uint4 q = make_uint4(lo.x, lo.y, hi.x, hi.y);
      const int groups = MODE == kFp8Group ? H / p.group_size : 0;
      const int first_group = MODE == kFp8Group ? blockIdx.y * blockDim.x / lanes : 0;
      const int tile_groups = MODE == kFp8Group ? min(static_cast<int>(blockDim.x) / lanes, groups - first_group) : 0;
      for (int j = 0; j < p.top_k; ++j) {
        if (rows[j] < 0) continue;
        const int64_t r = rows[j];
        if (active) *reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out) + r * H + c) = q;
        if (static_cast<int>(threadIdx.x) < tile_groups) {
          static_cast<float*>(p.scales)[r * groups + first_group + threadIdx.x] = tile_scales[threadIdx.x];
        }
      }
    } else {  // kNvfp4: this thread's 16 elements are exactly one block
      if (!active) return;
      const float global_scale = *p.scale;
      const uint8_t block_scale = nvfp4_block_scale(amax, global_scale);
      const float denom = __fmul_rn(fp8_to_float(block_scale), global_scale);
      const uint2 packed = make_uint2(nvfp4x8(v[0], denom), nvfp4x8(v[1], denom));
      for (int j = 0; j < p.top_k; ++j) {
        if (rows[j] < 0) continue;
        const int64_t r = rows[j];
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + r * (H / 2) + c / 2) = packed;
        static_cast<uint8_t*>(p.scales)[r * (H / 16) + c / 16] = block_scale;
      }
    }
  }
}

template <typename T, int MODE, bool VEC>
cudaError_t launch(const ScatterParams& p, int64_t num_tokens, cudaStream_t s) {
  const int per_thread = VEC ? kElems : 1;
  const int items = (p.hidden + per_thread - 1) / per_thread;
  const int threads = items < 32 ? 32 : items > kThreads ? kThreads : (items + 31) / 32 * 32;
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>((items + threads - 1) / threads));
  scatter_kernel<T, MODE, VEC><<<grid, threads, 0, s>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_mode(const ScatterParams& p, int mode, bool vec, int64_t num_tokens, cudaStream_t s) {
  switch (mode) {
    case kCopy:
      return vec ? launch<T, kCopy, true>(p, num_tokens, s) : launch<T, kCopy, false>(p, num_tokens, s);
    case kFp8Group:
      return vec ? launch<T, kFp8Group, true>(p, num_tokens, s) : cudaErrorInvalidValue;  // H % 16 == 0 always
    case kFp8Tensor:
      return vec ? launch<T, kFp8Tensor, true>(p, num_tokens, s) : launch<T, kFp8Tensor, false>(p, num_tokens, s);
    case kNvfp4:
      return vec ? launch<T, kNvfp4, true>(p, num_tokens, s) : cudaErrorInvalidValue;
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace permute
}  // namespace fim

extern "C" {

// Returns a cudaError_t; 0 on success. Arguments are validated in Python (flashinfer_moe/moe/permute.py).
// mode: 0 copy, 1 FP8 per-token-group, 2 FP8 per-tensor, 3 NVFP4. vec: rows are 16-byte aligned and
// H % 16 == 0 (required by the FP8 group and NVFP4 modes).
int fim_permute(const void* in, int dtype, int64_t in_stride, const int32_t* row_of, int top_k, int64_t num_tokens,
                int hidden, int mode, int vec, void* out, void* scales, const float* scale, int group_size,
                int scale_pow2, void* stream) {
  using namespace fim::permute;
  if (num_tokens == 0 || hidden == 0) return 0;
  if (num_tokens < 0 || num_tokens > INT32_MAX || top_k < 1 || top_k > kMaxTopK || hidden < 0 ||
      (row_of == nullptr && top_k != 1)) {
    return cudaErrorInvalidValue;
  }
  if (mode == kFp8Group &&
      (group_size < 16 || group_size > 256 || (group_size & (group_size - 1)) != 0 || hidden % group_size != 0)) {
    return cudaErrorInvalidValue;
  }
  if (mode == kNvfp4 && hidden % 16 != 0) return cudaErrorInvalidValue;
  ScatterParams p{in, in_stride, row_of, top_k, hidden, out, scales, scale, group_size, scale_pow2};
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case fim::kFloat32:
      return launch_mode<float>(p, mode, vec != 0, num_tokens, s);
    case fim::kFloat16:
      return launch_mode<__half>(p, mode, vec != 0, num_tokens, s);
    case fim::kBFloat16:
      return launch_mode<__nv_bfloat16>(p, mode, vec != 0, num_tokens, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // extern "C"
