// Combine: out[t] = (sum_j w[t, j] * y[row_of[t, j]]) * scale + residual[t], fp32 accumulation over j
// ascending, each product rounded before it is added (no FMA contraction), as the reference does; pairs with
// row -1 are skipped. One block per (token, tile of the row), 8 elements per thread, up to four rows' loads
// in flight at once.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.cuh"
#include "common/vec.cuh"

namespace fim {
namespace combine {

constexpr int kMaxTopK = 64;
constexpr int kRowsInFlight = 4;
// Threads per block, one block per (token, tile of its row): measured on an H200 at T = 4096, H = 7168,
// 128 threads reach the copy bandwidth where one 896-thread block per token stayed at 86% of it.
constexpr int kThreads = 128;

struct CombineParams {
  const void* y;          // [rows, H]
  const float* weights;   // [T, k]
  const int32_t* row_of;  // [T, k]
  const void* residual;   // [T, H] of the output type, or nullptr
  void* out;              // [T, H]
  int top_k;
  int hidden;
  float scale;
  int has_scale;
};

template <typename YT, typename OT, bool VEC>
__global__ void combine_kernel(const CombineParams p) {
  __shared__ int32_t rows[kMaxTopK];
  __shared__ float weights[kMaxTopK];
  const int64_t t = blockIdx.x;
  for (int j = threadIdx.x; j < p.top_k; j += blockDim.x) {
    rows[j] = p.row_of[t * p.top_k + j];
    weights[j] = p.weights[t * p.top_k + j];
  }
  __syncthreads();
  const int H = p.hidden;
  const YT* y = static_cast<const YT*>(p.y);
  OT* out = static_cast<OT*>(p.out) + t * H;
  const OT* residual = static_cast<const OT*>(p.residual);
  if constexpr (VEC) {
    for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8; c < H; c += gridDim.y * blockDim.x * 8) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int j0 = 0; j0 < p.top_k; j0 += kRowsInFlight) {
        Vec8<YT> buf[kRowsInFlight];
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int j = j0 + u;
          if (j < p.top_k && rows[j] >= 0) buf[u] = load8(y + static_cast<int64_t>(rows[j]) * H + c);
        }
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int j = j0 + u;
          if (j < p.top_k && rows[j] >= 0) {
            float v[8];
            widen8(buf[u], v);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(weights[j], v[i]));
          }
        }
      }
      if (p.has_scale) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fmul_rn(acc[i], p.scale);
      }
      if (residual != nullptr) {
        float r[8];
        widen8(load8(residual + t * H + c), r);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], r[i]);
      }
      store8(out + c, narrow8<OT>(acc));
    }
  } else {
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < H; c += gridDim.y * blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < p.top_k; ++j) {
        if (rows[j] >= 0)
          acc = __fadd_rn(acc, __fmul_rn(weights[j], to_float(y[static_cast<int64_t>(rows[j]) * H + c])));
      }
      if (p.has_scale) acc = __fmul_rn(acc, p.scale);
      if (residual != nullptr) acc = __fadd_rn(acc, to_float(residual[t * H + c]));
      out[c] = from_float<OT>(acc);
    }
  }
}

template <typename YT, typename OT>
cudaError_t launch(const CombineParams& p, int64_t num_tokens, bool vec, cudaStream_t s) {
  const int per_thread = vec ? 8 : 1;
  const int items = (p.hidden + per_thread - 1) / per_thread;
  const int threads = items < 32 ? 32 : items > kThreads ? kThreads : (items + 31) / 32 * 32;
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>((items + threads - 1) / threads));
  if (vec) {
    combine_kernel<YT, OT, true><<<grid, threads, 0, s>>>(p);
  } else {
    combine_kernel<YT, OT, false><<<grid, threads, 0, s>>>(p);
  }
  return cudaGetLastError();
}

template <typename YT>
cudaError_t launch_out(const CombineParams& p, int out_dtype, int64_t num_tokens, bool vec, cudaStream_t s) {
  switch (out_dtype) {
    case kFloat32:
      return launch<YT, float>(p, num_tokens, vec, s);
    case kFloat16:
      return launch<YT, __half>(p, num_tokens, vec, s);
    case kBFloat16:
      return launch<YT, __nv_bfloat16>(p, num_tokens, vec, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace combine
}  // namespace fim

extern "C" {

// Returns a cudaError_t; 0 on success. Arguments are validated in Python (flashinfer_moe/moe/permute.py).
// vec: y, residual and out rows are 16-byte aligned and H % 8 == 0.
int fim_combine(const void* y, int y_dtype, const float* weights, const int32_t* row_of, const void* residual,
                void* out, int out_dtype, int64_t num_tokens, int top_k, int hidden, float scale, int has_scale,
                int vec, void* stream) {
  using namespace fim::combine;
  if (num_tokens == 0 || hidden == 0) return 0;
  if (num_tokens < 0 || num_tokens > INT32_MAX || top_k < 0 || top_k > kMaxTopK || hidden < 0) {
    return cudaErrorInvalidValue;
  }
  CombineParams p{y, weights, row_of, residual, out, top_k, hidden, scale, has_scale};
  auto s = static_cast<cudaStream_t>(stream);
  switch (y_dtype) {
    case fim::kFloat32:
      return launch_out<float>(p, out_dtype, num_tokens, vec != 0, s);
    case fim::kFloat16:
      return launch_out<__half>(p, out_dtype, num_tokens, vec != 0, s);
    case fim::kBFloat16:
      return launch_out<__nv_bfloat16>(p, out_dtype, num_tokens, vec != 0, s);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
