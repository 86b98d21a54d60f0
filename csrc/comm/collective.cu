// The collective all-to-all path's own kernels (flashinfer_moe/comm/collective.py on CUDA tensors): what dispatch
// sends is packed in one launch, what it received unpacked in one, and combine's sum over the ranks is one launch, so
// that an eager call is a handful of launches around the collective instead of dozens of small torch ops.
//
// A dispatched row, as it travels: [hidden bytes | ids int32 [k] | weights fp32 [k] | scales fp32 [groups]], each
// field from a 16-byte boundary of the row (offsets in collective.py's _RowFormat), rows a multiple of 16 bytes.
// Destination d's rows form one block of `send` from row offsets[d] (d * max_tokens in low-latency mode, the counts'
// exclusive prefix in high-throughput mode), tokens ascending; a token's slot in that block is the number of earlier
// tokens that go to d.

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/copy.cuh"
#include "common/dtype.cuh"

namespace fim {
namespace coll {

using comm::warp_copy;

constexpr int kMaxRanks = 64;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Format {
  int64_t row_bytes;     // a multiple of 16
  int64_t hidden_bytes;  // at 0
  int64_t ids_at, weights_at, scales_at;
  int64_t scale_bytes;  // 0: no scales
  int top_k;
};
static_assert(sizeof(Format) == 56, "Format must match its ctypes mirror in flashinfer_moe/comm/_kernels.py");

struct PackParams {
  Format f;
  const char* hidden;    // [T, hidden_bytes]
  const void* ids;       // [T, k] int32 or int64, global expert ids (-1 or out of range: nowhere)
  const float* weights;  // [T, k]
  const char* scales;    // [T, scale_bytes] or null
  char* send;            // [rows, row_bytes]
  int64_t* slot;         // [T, world]: the token's slot in each destination's block, -1 where it does not go
  int* counts;           // [world] (count_only): rows sent to each rank
  int64_t offsets[kMaxRanks];
  int num_tokens, world, num_experts, experts_per_rank, ids_64;
  int pad_to;      // low-latency: every block holds this many rows; those past its count get ids -1 and weights 0
  int count_only;  // only `counts`
};
static_assert(sizeof(PackParams) == 656, "PackParams must match its ctypes mirror in flashinfer_moe/comm/_kernels.py");

__device__ __forceinline__ bool goes_to(const PackParams& p, int64_t t, int d) {
  bool any = false;
  for (int j = 0; j < p.f.top_k; ++j) {
    const int64_t i = t * p.f.top_k + j;
    const int64_t e = p.ids_64 ? static_cast<const int64_t*>(p.ids)[i] : static_cast<const int*>(p.ids)[i];
    any |= e >= 0 && e < p.num_experts && e / p.experts_per_rank == d;
  }
  return any;
}

__device__ __forceinline__ int block_sum(int v, int* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  __syncthreads();  // s_warp free from any earlier use
  if (lane == 0) s_warp[warp] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kWarps; ++w) total += s_warp[w];
  return total;
}

// Block (d, c): destination d, tokens [T c / C, T (c + 1) / C). Slots: the tokens before the range that go to d are
// counted, then the range is scanned kThreads tokens a round (warp ballots), and each round's rows are copied by the
// block's warps, a row a warp.
__global__ void __launch_bounds__(kThreads) pack_kernel(const __grid_constant__ PackParams p) {
  __shared__ int s_warp[kWarps];
  __shared__ int s_token[kThreads];
  __shared__ int s_slot[kThreads];
  const int d = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int T = p.num_tokens, chunks = gridDim.y;
  const int lo = static_cast<int>(static_cast<int64_t>(T) * blockIdx.y / chunks);
  const int hi = static_cast<int>(static_cast<int64_t>(T) * (blockIdx.y + 1) / chunks);
  if (p.count_only) {
    int n = 0;
    for (int t = tid; t < T; t += kThreads) n += goes_to(p, t, d);
    n = block_sum(n, s_warp);
    if (tid == 0) p.counts[d] = n;
    return;
  }
  int before = 0;
  for (int t = tid; t < lo; t += kThreads) before += goes_to(p, t, d);
  int base = block_sum(before, s_warp);
  char* block = p.send + p.offsets[d] * p.f.row_bytes;
  for (int r0 = lo; r0 < hi; r0 += kThreads) {
    const int t = r0 + tid;
    const bool go = t < hi && goes_to(p, t, d);
    const unsigned ballot = __ballot_sync(~0u, go);
    __syncthreads();  // s_warp, s_token and s_slot free from the last round
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int below = base, round = 0;
    for (int w = 0; w < kWarps; ++w) {
      below += w < warp ? s_warp[w] : 0;
      round += s_warp[w];
    }
    const int k = below - base + __popc(ballot & ((1u << lane) - 1u));  // its place among the round's rows
    if (t < hi) p.slot[static_cast<int64_t>(t) * p.world + d] = go ? base + k : -1;
    if (go) {
      s_token[k] = t;
      s_slot[k] = base + k;
    }
    __syncthreads();
    for (int i = warp; i < round; i += kWarps) {
      const int64_t tok = s_token[i];
      char* row = block + static_cast<int64_t>(s_slot[i]) * p.f.row_bytes;
      warp_copy(row, p.hidden + tok * p.f.hidden_bytes, p.f.hidden_bytes, lane);
      if (p.f.scale_bytes) warp_copy(row + p.f.scales_at, p.scales + tok * p.f.scale_bytes, p.f.scale_bytes, lane);
      for (int j = lane; j < p.f.top_k; j += 32) {
        const int64_t e = tok * p.f.top_k + j;
        reinterpret_cast<int*>(row + p.f.ids_at)[j] =
            p.ids_64 ? static_cast<int>(static_cast<const int64_t*>(p.ids)[e]) : static_cast<const int*>(p.ids)[e];
        reinterpret_cast<float*>(row + p.f.weights_at)[j] = p.weights[e];
      }
    }
    base += round;
  }
  if (p.pad_to > 0) {
    // The block's padding rows (past the count of rows d receives from this rank), shared among its C blocks.
    int after = 0;
    for (int t = hi + tid; t < T; t += kThreads) after += goes_to(p, t, d);
    const int total = base + block_sum(after, s_warp);
    const int pad = p.pad_to - total;
    const int plo = total + static_cast<int>(static_cast<int64_t>(pad) * blockIdx.y / chunks);
    const int phi = total + static_cast<int>(static_cast<int64_t>(pad) * (blockIdx.y + 1) / chunks);
    for (int64_t i = static_cast<int64_t>(plo) * p.f.top_k + tid; i < static_cast<int64_t>(phi) * p.f.top_k;
         i += kThreads) {
      char* row = block + (i / p.f.top_k) * p.f.row_bytes;
      reinterpret_cast<int*>(row + p.f.ids_at)[i % p.f.top_k] = -1;
      reinterpret_cast<float*>(row + p.f.weights_at)[i % p.f.top_k] = 0.f;
    }
  }
}

// A row a warp: the hidden bytes and scales as they are, the ids made local (-1 for experts of other ranks),
// tokens_per_expert counted (zeroed by the caller).
__global__ void __launch_bounds__(kThreads)
    unpack_kernel(Format f, const char* recv, int64_t rows, int first, int experts_per_rank, char* out_hidden,
                  int* out_ids, float* out_weights, char* out_scales, int* tokens_per_expert) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = blockIdx.x * kWarps + (threadIdx.x >> 5); r < rows; r += static_cast<int64_t>(gridDim.x) * kWarps) {
    const char* row = recv + r * f.row_bytes;
    warp_copy(out_hidden + r * f.hidden_bytes, row, f.hidden_bytes, lane);
    if (f.scale_bytes) warp_copy(out_scales + r * f.scale_bytes, row + f.scales_at, f.scale_bytes, lane);
    for (int j = lane; j < f.top_k; j += 32) {
      const int e = reinterpret_cast<const int*>(row + f.ids_at)[j] - first;
      const bool mine = e >= 0 && e < experts_per_rank;
      out_ids[r * f.top_k + j] = mine ? e : -1;
      out_weights[r * f.top_k + j] = reinterpret_cast<const float*>(row + f.weights_at)[j];
      if (mine && tokens_per_expert != nullptr) atomicAdd(&tokens_per_expert[e], 1);
    }
  }
}

struct CombineOffsets {
  int64_t at[kMaxRanks];
};

// out[t] = sum over ranks d ascending (fp32, from 0) of back[offsets[d] + slot[t, d]] where the slot is not -1.
// A thread a vector of V elements.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) combine_kernel(const T* back, const int64_t* slot, CombineOffsets offsets,
                                                           int num_tokens, int world, int hidden, T* out) {
  const int64_t vecs = hidden / V, total = static_cast<int64_t>(num_tokens) * vecs;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = i / vecs, c = (i % vecs) * V;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int d = 0; d < world; ++d) {
      const int64_t s = slot[t * world + d];
      if (s < 0) continue;
      const T* src = back + (offsets.at[d] + s) * hidden + c;
      T x[V];
      if constexpr (V * sizeof(T) == 16) {
        *reinterpret_cast<int4*>(x) = *reinterpret_cast<const int4*>(src);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) x[v] = src[v];
      }
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += to_float(x[v]);
    }
    T y[V];
#pragma unroll
    for (int v = 0; v < V; ++v) y[v] = from_float<T>(acc[v]);
    if constexpr (V * sizeof(T) == 16) {
      *reinterpret_cast<int4*>(out + t * hidden + c) = *reinterpret_cast<const int4*>(y);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) out[t * hidden + c + v] = y[v];
    }
  }
}

template <typename T>
int launch_combine(const void* back, const int64_t* slot, const int64_t* offsets, int num_tokens, int world, int hidden,
                   void* out, int grid, cudaStream_t stream) {
  CombineOffsets o;
  for (int d = 0; d < world; ++d) o.at[d] = offsets[d];
  constexpr int V = 16 / sizeof(T);
  const bool vec =
      hidden % V == 0 && ((reinterpret_cast<uintptr_t>(back) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  if (vec) {
    combine_kernel<T, V><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(back), slot, o, num_tokens, world, hidden,
                                                        static_cast<T*>(out));
  } else {
    combine_kernel<T, 1><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(back), slot, o, num_tokens, world, hidden,
                                                        static_cast<T*>(out));
  }
  return cudaGetLastError();
}

}  // namespace coll
}  // namespace fim

extern "C" {

int fim_coll_pack(const fim::coll::PackParams* p, int chunks, void* stream) {
  if (p->world < 1 || p->world > fim::coll::kMaxRanks || p->num_tokens < 0 || p->f.row_bytes % 16) {
    return cudaErrorInvalidValue;
  }
  if (p->num_tokens == 0 && p->pad_to == 0 && !p->count_only) return cudaSuccess;
  fim::coll::pack_kernel<<<dim3(p->world, p->count_only ? 1 : chunks), fim::coll::kThreads, 0,
                           static_cast<cudaStream_t>(stream)>>>(*p);
  return cudaGetLastError();
}

int fim_coll_unpack(const fim::coll::Format* f, const void* recv, int64_t rows, int first, int experts_per_rank,
                    void* out_hidden, int* out_ids, float* out_weights, void* out_scales, int* tokens_per_expert,
                    int grid, void* stream) {
  if (rows == 0) return cudaSuccess;
  fim::coll::unpack_kernel<<<grid, fim::coll::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *f, static_cast<const char*>(recv), rows, first, experts_per_rank, static_cast<char*>(out_hidden), out_ids,
      out_weights, static_cast<char*>(out_scales), tokens_per_expert);
  return cudaGetLastError();
}

// dtype: fim::DType of back and out. offsets: [world] host array.
int fim_coll_combine(int dtype, const void* back, const int64_t* slot, const int64_t* offsets, int num_tokens,
                     int world, int hidden, void* out, int grid, void* stream) {
  if (world < 1 || world > fim::coll::kMaxRanks) return cudaErrorInvalidValue;
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case fim::kFloat32:
      return fim::coll::launch_combine<float>(back, slot, offsets, num_tokens, world, hidden, out, grid, s);
    case fim::kFloat16:
      return fim::coll::launch_combine<__half>(back, slot, offsets, num_tokens, world, hidden, out, grid, s);
    case fim::kBFloat16:
      return fim::coll::launch_combine<__nv_bfloat16>(back, slot, offsets, num_tokens, world, hidden, out, grid, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // extern "C"
