// Expert-major layouts from topk_ids: pairs per expert, aligned expert offsets, the row of every (t, j) pair
// and the pair of every row, deterministic (ascending t * k + j within an expert), with no host sync.
//
// The T * k pairs are cut into chunks of consecutive pairs, one warp per chunk, in three phases:
//   1. count:  each warp counts its chunk's pairs per expert;
//   2. scan:   per expert, an exclusive prefix of the chunk counts (where each chunk starts inside the expert),
//              then the expert offsets (contiguous: padded counts, prefix-summed; masked: e * capacity);
//   3. rank:   each warp walks its chunk again, giving every pair its rank = chunk start + earlier pairs of the
//              same expert in the chunk, and writes row_of / source_of.
// Inside a warp, pairs with the same expert in one 32-pair step are found with __match_any_sync, and their
// order is the lane order, so ranks follow the pair order exactly. Small batches run the three phases in
// one block (one launch); large ones as three grid-wide launches.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/warp.cuh"

namespace fim {
namespace align {

constexpr int kWarpsPerBlock = 4;     // multi-launch phases 1 and 3
constexpr int kFusedWarps = 8;        // the one-block path
constexpr int kScanThreads = 1024;    // multi-launch phase 2
constexpr int kMaxExperts = 1024;     // per-warp shared counters: warps * E ints
constexpr int64_t kFusedMaxPairs = 16384;
constexpr int kTargetChunks = 264;    // two warps per SM on a 132-SM GPU

struct AlignParams {
  const void* ids;  // [N] int32 or int64, N = T * k
  int64_t num_pairs;
  int num_experts;
  int block_rows;  // contiguous: row alignment per expert
  int capacity;    // masked: slots per expert; < 0 selects the contiguous layout
  int chunk;       // pairs per chunk, a multiple of 32
  int num_chunks;
  int32_t* chunk_counts;       // [num_chunks, E] workspace: counts, then each chunk's start inside its expert
  int32_t* tokens_per_expert;  // [E]
  int32_t* expert_offsets;     // [E + 1]
  int32_t* row_of;             // [N]
  int32_t* source_of;          // [rows], preset to -1
  int32_t* status;             // [2]: overflow, invalid ids; preset to 0
};

template <typename IdT>
__device__ __forceinline__ int load_id(const AlignParams& p, int64_t i, bool* invalid) {
  const int64_t v = static_cast<const IdT*>(p.ids)[i];
  *invalid = v < -1 || v >= p.num_experts;
  return *invalid ? -1 : static_cast<int>(v);
}

// Phase 1 for chunk c, by one warp; hist is this warp's E shared counters.
template <typename IdT>
__device__ void count_chunk(const AlignParams& p, int c, int* hist) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < p.num_experts; e += 32) hist[e] = 0;
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(c) * p.chunk;
  const int64_t end = min(begin + p.chunk, p.num_pairs);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    bool invalid;
    const int e = i < end ? load_id<IdT>(p, i, &invalid) : -1;
    const unsigned peers = __match_any_sync(kFullMask, e);
    if (e >= 0 && lane == 31 - __clz(peers)) hist[e] += __popc(peers);
    __syncwarp();
  }
  int32_t* out = p.chunk_counts + static_cast<int64_t>(c) * p.num_experts;
  for (int e = lane; e < p.num_experts; e += 32) out[e] = hist[e];
}

// Exclusive prefix sum of data[0..n) in shared memory by the whole block; returns the total.
__device__ int block_exclusive_scan(int* data, int n, int* warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, tid * per_thread), end = min(n, begin + per_thread);
  int local = 0;
  for (int i = begin; i < end; ++i) local += data[i];
  int inclusive = local;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int v = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += v;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int v = __shfl_up_sync(kFullMask, w, offset);
      if (lane >= offset) w += v;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  int running = inclusive - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  const int total = warp_sums[warps - 1];
  for (int i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = running;
    running += v;
  }
  __syncthreads();
  return total;
}

// Phase 2, by one block. totals: E shared ints; warp_sums: 32 shared ints.
__device__ void scan_experts(const AlignParams& p, int* totals, int* warp_sums) {
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int running = 0;
    int32_t* col = p.chunk_counts + e;
#pragma unroll 8
    for (int c = 0; c < p.num_chunks; ++c) {
      const int v = col[static_cast<int64_t>(c) * E];
      col[static_cast<int64_t>(c) * E] = running;
      running += v;
    }
    totals[e] = running;
  }
  __syncthreads();
  if (p.capacity >= 0) {
    int dropped = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      p.tokens_per_expert[e] = min(totals[e], p.capacity);
      dropped += max(totals[e] - p.capacity, 0);
      p.expert_offsets[e] = e * p.capacity;
    }
    if (threadIdx.x == 0) p.expert_offsets[E] = E * p.capacity;
    dropped = warp_sum_int(dropped);
    if ((threadIdx.x & 31) == 0 && dropped > 0) atomicAdd(p.status, dropped);
    return;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    p.tokens_per_expert[e] = totals[e];
    totals[e] = (totals[e] + p.block_rows - 1) / p.block_rows * p.block_rows;
  }
  __syncthreads();
  const int total = block_exclusive_scan(totals, E, warp_sums);
  for (int e = threadIdx.x; e < E; e += blockDim.x) p.expert_offsets[e] = totals[e];
  if (threadIdx.x == 0) p.expert_offsets[E] = total;
}

// Phase 3 for chunk c, by one warp; next is this warp's E shared counters.
template <typename IdT>
__device__ void rank_chunk(const AlignParams& p, int c, int* next) {
  const int lane = threadIdx.x & 31;
  const int32_t* starts = p.chunk_counts + static_cast<int64_t>(c) * p.num_experts;
  for (int e = lane; e < p.num_experts; e += 32) next[e] = starts[e];
  __syncwarp();
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t begin = static_cast<int64_t>(c) * p.chunk;
  const int64_t end = min(begin + p.chunk, p.num_pairs);
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    bool invalid = false;
    const int e = i < end ? load_id<IdT>(p, i, &invalid) : -1;
    if (invalid) atomicAdd(p.status + 1, 1);
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int rank = e >= 0 ? next[e] + __popc(peers & lower_lanes) : -1;
    __syncwarp();  // every lane has read next[e] before its leader moves it on
    if (e >= 0 && lane == 31 - __clz(peers)) next[e] += __popc(peers);
    __syncwarp();
    if (i < end) {
      int row = -1;
      if (e >= 0) {
        if (p.capacity < 0) {
          row = p.expert_offsets[e] + rank;
        } else if (rank < p.capacity) {
          row = e * p.capacity + rank;
        }
      }
      p.row_of[i] = row;
      if (row >= 0) p.source_of[row] = static_cast<int32_t>(i);
    }
  }
}

template <typename IdT>
__global__ void __launch_bounds__(kFusedWarps * 32) align_fused_kernel(const AlignParams p) {
  extern __shared__ int smem[];  // kFusedWarps * E counters, E totals, 32 warp sums
  const int warp = threadIdx.x >> 5;
  int* mine = smem + warp * p.num_experts;
  int* totals = smem + kFusedWarps * p.num_experts;
  for (int c = warp; c < p.num_chunks; c += kFusedWarps) count_chunk<IdT>(p, c, mine);
  __syncthreads();
  scan_experts(p, totals, totals + p.num_experts);
  __syncthreads();
  for (int c = warp; c < p.num_chunks; c += kFusedWarps) rank_chunk<IdT>(p, c, mine);
}

template <typename IdT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) align_count_kernel(const AlignParams p) {
  extern __shared__ int smem[];
  const int c = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c < p.num_chunks) count_chunk<IdT>(p, c, smem + (threadIdx.x >> 5) * p.num_experts);
}

__global__ void __launch_bounds__(kScanThreads) align_scan_kernel(const AlignParams p) {
  extern __shared__ int smem[];
  scan_experts(p, smem, smem + p.num_experts);
}

template <typename IdT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) align_rank_kernel(const AlignParams p) {
  extern __shared__ int smem[];
  const int c = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c < p.num_chunks) rank_chunk<IdT>(p, c, smem + (threadIdx.x >> 5) * p.num_experts);
}

template <typename Kernel>
cudaError_t launch(Kernel kernel, int blocks, int threads, size_t smem, const AlignParams& p, cudaStream_t s) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<blocks, threads, smem, s>>>(p);
  return cudaGetLastError();
}

template <typename IdT>
cudaError_t run(AlignParams p, int64_t num_rows, cudaStream_t s) {
  cudaError_t err = cudaMemsetAsync(p.status, 0, 2 * sizeof(int32_t), s);
  if (err == cudaSuccess && num_rows > 0) err = cudaMemsetAsync(p.source_of, 0xff, num_rows * sizeof(int32_t), s);
  if (err != cudaSuccess) return err;
  const size_t E = p.num_experts;
  if (p.num_pairs <= kFusedMaxPairs) {
    const size_t smem = (kFusedWarps * E + E + 32) * sizeof(int);
    return launch(align_fused_kernel<IdT>, 1, kFusedWarps * 32, smem, p, s);
  }
  const int blocks = (p.num_chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t warp_smem = kWarpsPerBlock * E * sizeof(int);
  err = launch(align_count_kernel<IdT>, blocks, kWarpsPerBlock * 32, warp_smem, p, s);
  if (err == cudaSuccess) err = launch(align_scan_kernel, 1, kScanThreads, (E + 32) * sizeof(int), p, s);
  if (err == cudaSuccess) err = launch(align_rank_kernel<IdT>, blocks, kWarpsPerBlock * 32, warp_smem, p, s);
  return err;
}

}  // namespace align
}  // namespace fim

extern "C" {

// Workspace ints fim_moe_align needs for ``chunk_counts``.
int64_t fim_moe_align_workspace(int64_t num_pairs, int num_experts) {
  using namespace fim::align;
  const int64_t chunks_fused = kFusedWarps;
  const int64_t chunks = num_pairs <= kFusedMaxPairs ? chunks_fused : kTargetChunks + 1;
  return chunks * num_experts;
}

// Returns a cudaError_t; 0 on success. Arguments are validated in Python (flashinfer_moe/moe/layout.py).
// capacity < 0: contiguous layout aligned to block_rows; capacity >= 0: masked layout.
int fim_moe_align(const void* ids, int ids_int64, int64_t num_pairs, int num_experts, int block_rows, int capacity,
                  int32_t* workspace, int32_t* tokens_per_expert, int32_t* expert_offsets, int32_t* row_of,
                  int32_t* source_of, int64_t num_rows, int32_t* status, void* stream) {
  using namespace fim::align;
  if (num_experts < 1 || num_experts > kMaxExperts || block_rows < 1 || num_pairs < 0 || num_pairs > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  int64_t chunk;
  if (num_pairs <= kFusedMaxPairs) {
    chunk = (num_pairs + kFusedWarps - 1) / kFusedWarps;
  } else {
    chunk = (num_pairs + kTargetChunks - 1) / kTargetChunks;
  }
  chunk = (chunk + 31) / 32 * 32;
  if (chunk == 0) chunk = 32;
  AlignParams p{ids,
                num_pairs,
                num_experts,
                block_rows,
                capacity,
                static_cast<int>(chunk),
                static_cast<int>((num_pairs + chunk - 1) / chunk),
                workspace,
                tokens_per_expert,
                expert_offsets,
                row_of,
                source_of,
                status};
  auto s = static_cast<cudaStream_t>(stream);
  return ids_int64 ? run<int64_t>(p, num_rows, s) : run<int32_t>(p, num_rows, s);
}

}  // extern "C"
