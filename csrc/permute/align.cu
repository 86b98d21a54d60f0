// Expert-major layouts from topk_ids: pairs per expert, aligned expert offsets, the row of every (t, j) pair
// and the pair of every row, deterministic (ascending t * k + j within an expert), with no host sync.
//
// The T * k pairs are cut into chunks of consecutive pairs, one warp per chunk, in three phases:
//   1. count:  each warp counts its chunk's pairs per expert;
//   2. prefix: per expert (one warp each), an exclusive prefix of the chunk counts (where each chunk starts
//              inside the expert) and its total; the expert offsets (contiguous: padded totals, prefix-summed;
//              masked: e * capacity) are then derived by every block of phase 3 from the totals;
//   3. rank:   each warp walks its chunk again, giving every pair its rank = chunk start + earlier pairs of the
//              same expert in the chunk, and writes row_of / source_of.
// Inside a warp, the lanes of one 32-pair step that share an expert are found with one ballot per bit of the
// expert id (much faster than __match_any_sync, which one block used to spend most of its time in), and
// their order is the lane order, so ranks follow the pair order exactly. Small batches run the three phases
// in one block (one launch); large ones as three grid-wide launches. Every shared-memory size stays under
// 48 KiB, so no launch needs an attribute call (which CUDA-graph capture would refuse).

#include <cuda_runtime.h>

#include <cstdint>

#include "common/warp.cuh"

namespace fim {
namespace align {

constexpr int kWarpsPerBlock = 4;   // multi-launch phases 1 and 3
constexpr int kMaxFusedWarps = 32;  // the one-block path
constexpr int kMaxExperts = 1024;
constexpr int kSmemBudget = 44 * 1024;  // under the 48 KiB that needs no opt-in (an opt-in cannot be captured)
constexpr int kPairsPerFusedWarp = 256;
constexpr int kTargetChunks = 264;  // two warps per SM on a 132-SM GPU
constexpr int kMaxChunkSlices = 9;  // chunks <= 9 * 32: each expert's chunk counts fit 9 registers per lane
constexpr int kBatch = 8;           // 32-pair steps whose id loads are issued together

struct AlignParams {
  const void* ids;  // [N] int32 or int64, N = T * k
  int64_t num_pairs;
  int num_experts;
  int block_rows;  // contiguous: row alignment per expert
  int capacity;    // masked: slots per expert; < 0 selects the contiguous layout
  int chunk;       // pairs per chunk, a multiple of 32
  int num_chunks;
  int32_t* chunk_counts;       // workspace [E, num_chunks]: counts, then each chunk's start inside its expert;
                               // then [E] expert totals (multi-launch path)
  int32_t* tokens_per_expert;  // [E]
  int32_t* expert_offsets;     // [E + 1]
  int32_t* row_of;             // [N]
  int32_t* source_of;          // [num_rows]
  int64_t num_rows;
  int32_t* status;  // [2]: overflow, invalid ids
};

// Loads this lane's ids of kBatch consecutive 32-pair steps at once (one memory latency instead of kBatch);
// ids outside [-1, E) become -1 and are flagged.
template <typename IdT>
__device__ __forceinline__ void load_batch(const AlignParams& p, int64_t base, int64_t end, int (&e)[kBatch],
                                           unsigned* invalid_mask) {
  const int lane = threadIdx.x & 31;
  IdT v[kBatch];
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int64_t i = base + b * 32 + lane;
    v[b] = i < end ? static_cast<const IdT*>(p.ids)[i] : IdT(-1);
  }
  *invalid_mask = 0;
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const bool bad = v[b] < -1 || v[b] >= p.num_experts;
    *invalid_mask |= static_cast<unsigned>(bad) << b;
    e[b] = bad ? -1 : static_cast<int>(v[b]);
  }
}

// source_of = -1 and status = 0, by the threads of the first `blocks` blocks, before any pair is placed.
__device__ void reset_outputs(const AlignParams& p, int blocks) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(blocks) * blockDim.x;
  const int64_t vectors = p.num_rows / 4;  // torch allocations are 16-byte aligned
  for (int64_t i = first; i < vectors; i += stride) reinterpret_cast<int4*>(p.source_of)[i] = make_int4(-1, -1, -1, -1);
  for (int64_t i = vectors * 4 + first; i < p.num_rows; i += stride) p.source_of[i] = -1;
  if (first == 0) p.status[0] = p.status[1] = 0;
}

// Phase 1 for chunk c, by one warp; hist is this warp's E shared counters (the order of the adds is free).
// The multi-launch path publishes them to the workspace; the one-block path keeps them in shared memory.
template <typename IdT, bool kPublish>
__device__ void count_chunk(const AlignParams& p, int c, int* hist) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < p.num_experts; e += 32) hist[e] = 0;
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(c) * p.chunk;
  const int64_t end = min(begin + p.chunk, p.num_pairs);
  for (int64_t base = begin; base < end; base += 32 * kBatch) {
    int e[kBatch];
    unsigned invalid;
    load_batch<IdT>(p, base, end, e, &invalid);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (e[b] >= 0) atomicAdd(hist + e[b], 1);
    }
  }
  if constexpr (kPublish) {
    __syncwarp();
    for (int e = lane; e < p.num_experts; e += 32) {
      p.chunk_counts[static_cast<int64_t>(e) * p.num_chunks + c] = hist[e];
    }
  }
}

// The lanes whose key equals this lane's, from one ballot per key bit (keys < 2**bits).
__device__ __forceinline__ unsigned lanes_with_same_key(int key, int bits) {
  unsigned peers = kFullMask;
  for (int b = 0; b < bits; ++b) {
    const bool bit = (key >> b) & 1;
    const unsigned set = __ballot_sync(kFullMask, bit);
    peers &= bit ? set : ~set;
  }
  return peers;
}

// Exclusive prefix sum of data[0..n) in shared memory by the whole block; returns the total.
__device__ int block_exclusive_scan(int* data, int n, int* warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, tid * per_thread), end = min(n, begin + per_thread);
  int local = 0;
  for (int i = begin; i < end; ++i) local += data[i];
  const int inclusive = warp_inclusive_sum(local);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int w = warp_inclusive_sum(lane < warps ? warp_sums[lane] : 0);
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

// Phase 2a for expert e, by one warp: its chunk counts (contiguous, loaded together) become each chunk's
// start inside the expert; returns the expert's total.
__device__ int prefix_over_chunks(const AlignParams& p, int e) {
  const int lane = threadIdx.x & 31;
  int32_t* col = p.chunk_counts + static_cast<int64_t>(e) * p.num_chunks;
  int v[kMaxChunkSlices];
#pragma unroll
  for (int s = 0; s < kMaxChunkSlices; ++s) v[s] = s * 32 + lane < p.num_chunks ? col[s * 32 + lane] : 0;
  int carry = 0;
#pragma unroll
  for (int s = 0; s < kMaxChunkSlices; ++s) {
    if (s * 32 >= p.num_chunks) break;  // warp-uniform
    const int inclusive = warp_inclusive_sum(v[s]);
    if (s * 32 + lane < p.num_chunks) col[s * 32 + lane] = carry + inclusive - v[s];
    carry += __shfl_sync(kFullMask, inclusive, 31);
  }
  return carry;
}

// Phase 2b, by one block: expert totals (E shared ints) become the experts' first rows (contiguous:
// prefix of the padded totals; masked: e * capacity), in place. Block 0 also writes the layout's
// tokens_per_expert, expert_offsets and overflow count.
__device__ void expert_offsets(const AlignParams& p, int* totals, int* warp_sums) {
  const int E = p.num_experts;
  const bool writer = blockIdx.x == 0;
  if (p.capacity >= 0) {
    int dropped = 0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int total = totals[e];
      if (writer) {
        p.tokens_per_expert[e] = min(total, p.capacity);
        p.expert_offsets[e] = e * p.capacity;
      }
      dropped += max(total - p.capacity, 0);
      totals[e] = e * p.capacity;
    }
    if (writer && threadIdx.x == 0) p.expert_offsets[E] = E * p.capacity;
    dropped = warp_sum_int(dropped);
    if (writer && (threadIdx.x & 31) == 0 && dropped > 0) atomicAdd(p.status, dropped);
    __syncthreads();
    return;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (writer) p.tokens_per_expert[e] = totals[e];
    totals[e] = (totals[e] + p.block_rows - 1) / p.block_rows * p.block_rows;
  }
  __syncthreads();
  const int total = block_exclusive_scan(totals, E, warp_sums);
  if (writer) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) p.expert_offsets[e] = totals[e];
    if (threadIdx.x == 0) p.expert_offsets[E] = total;
  }
}

// Phase 3 for chunk c, by one warp; first: the experts' first rows (shared); next: this warp's E shared
// counters, made the next row of each expert (contiguous) or its next slot (masked) from the chunk's starts,
// which the one-block path already holds there and the multi-launch path reads from the workspace.
template <typename IdT, bool kFromWorkspace>
__device__ void rank_chunk(const AlignParams& p, int c, const int* first, int* next) {
  const int lane = threadIdx.x & 31;
  const bool masked = p.capacity >= 0;
  for (int e = lane; e < p.num_experts; e += 32) {
    const int start = kFromWorkspace ? p.chunk_counts[static_cast<int64_t>(e) * p.num_chunks + c] : next[e];
    next[e] = masked ? start : first[e] + start;
  }
  __syncwarp();
  const int key_bits = 32 - __clz(p.num_experts);  // keys 0 .. E, E standing for "no expert"
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t begin = static_cast<int64_t>(c) * p.chunk;
  const int64_t end = min(begin + p.chunk, p.num_pairs);
  for (int64_t base = begin; base < end; base += 32 * kBatch) {
    int e[kBatch];
    unsigned invalid;
    load_batch<IdT>(p, base, end, e, &invalid);
    if (invalid) atomicAdd(p.status + 1, __popc(invalid));
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (base + b * 32 >= end) break;  // warp-uniform
      const int64_t i = base + b * 32 + lane;
      const unsigned peers = lanes_with_same_key(e[b] >= 0 ? e[b] : p.num_experts, key_bits);
      const int at = e[b] >= 0 ? next[e[b]] + __popc(peers & lower_lanes) : -1;
      __syncwarp();  // every lane has read next[e] before its leader moves it on
      if (e[b] >= 0 && lane == 31 - __clz(peers)) next[e[b]] += __popc(peers);
      __syncwarp();
      if (i < end) {
        int row = at;
        if (masked && e[b] >= 0) row = at < p.capacity ? e[b] * p.capacity + at : -1;
        p.row_of[i] = row;
        if (row >= 0) p.source_of[row] = static_cast<int32_t>(i);
      }
    }
  }
}

// The one-block path: one chunk per warp, every intermediate in shared memory (counts rows padded to E + 1
// ints, so that a warp reading one expert's count from every row hits distinct banks).
template <typename IdT>
__global__ void __launch_bounds__(kMaxFusedWarps * 32) align_fused_kernel(const AlignParams p) {
  extern __shared__ int smem[];  // warps x (E + 1) counts, E totals / first rows, 32 warp sums
  const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int E = p.num_experts, stride = E + 1;
  int* totals = smem + warps * stride;
  reset_outputs(p, 1);
  if (warp < p.num_chunks) {
    count_chunk<IdT, false>(p, warp, smem + warp * stride);
  } else {
    for (int e = lane; e < E; e += 32) smem[warp * stride + e] = 0;
  }
  __syncthreads();                         // also orders the resets before phase 3's writes
  for (int e = warp; e < E; e += warps) {  // prefix over the warps' counts, lane = chunk
    const int v = lane < warps ? smem[lane * stride + e] : 0;
    const int inclusive = warp_inclusive_sum(v);
    if (lane < warps) smem[lane * stride + e] = inclusive - v;
    if (lane == 31) totals[e] = inclusive;
  }
  __syncthreads();
  expert_offsets(p, totals, totals + E);
  __syncthreads();
  if (warp < p.num_chunks) rank_chunk<IdT, false>(p, warp, totals, smem + warp * stride);
}

template <typename IdT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) align_count_kernel(const AlignParams p) {
  extern __shared__ int smem[];
  reset_outputs(p, gridDim.x);  // phase 3 is a later launch, so these land first
  const int c = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c < p.num_chunks) count_chunk<IdT, true>(p, c, smem + (threadIdx.x >> 5) * p.num_experts);
}

// One warp per expert, over the whole grid; the totals go to the workspace row after the chunk counts.
__global__ void __launch_bounds__(kWarpsPerBlock * 32) align_prefix_kernel(const AlignParams p) {
  const int e = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (e >= p.num_experts) return;
  const int total = prefix_over_chunks(p, e);
  if ((threadIdx.x & 31) == 0) p.chunk_counts[static_cast<int64_t>(p.num_experts) * p.num_chunks + e] = total;
}

// Every block derives the experts' first rows from the totals (a few KiB from L2), then ranks its chunks.
template <typename IdT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) align_rank_kernel(const AlignParams p) {
  extern __shared__ int smem[];  // kWarpsPerBlock * E counters, E totals / first rows, 32 warp sums
  int* totals = smem + kWarpsPerBlock * p.num_experts;
  const int32_t* global_totals = p.chunk_counts + static_cast<int64_t>(p.num_experts) * p.num_chunks;
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) totals[e] = global_totals[e];
  __syncthreads();
  expert_offsets(p, totals, totals + p.num_experts);
  __syncthreads();
  const int c = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (c < p.num_chunks) rank_chunk<IdT, true>(p, c, totals, smem + (threadIdx.x >> 5) * p.num_experts);
}

// Warps of the one-block path: as many as 32 whose E + 1 counters each fit the shared-memory budget.
inline int fused_warps(int num_experts) {
  const int warps = (kSmemBudget / 4 - num_experts - 32) / (num_experts + 1);
  return warps < 1 ? 1 : warps > kMaxFusedWarps ? kMaxFusedWarps : warps;
}

template <typename IdT>
cudaError_t run(AlignParams p, bool fused, int warps, cudaStream_t s) {
  const size_t E = p.num_experts;
  if (fused) {
    align_fused_kernel<IdT><<<1, warps * 32, (warps * (E + 1) + E + 32) * sizeof(int), s>>>(p);
    return cudaGetLastError();
  }
  const int blocks = (p.num_chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const size_t warp_smem = kWarpsPerBlock * E * sizeof(int);
  align_count_kernel<IdT><<<blocks, kWarpsPerBlock * 32, warp_smem, s>>>(p);
  align_prefix_kernel<<<(p.num_experts + kWarpsPerBlock - 1) / kWarpsPerBlock, kWarpsPerBlock * 32, 0, s>>>(p);
  align_rank_kernel<IdT><<<blocks, kWarpsPerBlock * 32, warp_smem + (E + 32) * sizeof(int), s>>>(p);
  return cudaGetLastError();
}

}  // namespace align
}  // namespace fim

extern "C" {

// Returns a cudaError_t; 0 on success. Arguments are validated in Python (flashinfer_moe/moe/layout.py).
// capacity < 0: contiguous layout aligned to block_rows; capacity >= 0: masked layout. The workspace holds
// workspace_ints >= 265 * num_experts ints: the counts of every chunk (at most kTargetChunks) and the totals.
int fim_moe_align(const void* ids, int ids_int64, int64_t num_pairs, int num_experts, int block_rows, int capacity,
                  int32_t* workspace, int64_t workspace_ints, int32_t* tokens_per_expert, int32_t* expert_offsets,
                  int32_t* row_of, int32_t* source_of, int64_t num_rows, int32_t* status, void* stream) {
  using namespace fim::align;
  if (num_experts < 1 || num_experts > kMaxExperts || block_rows < 1 || num_pairs < 0 || num_pairs > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const int warps = fused_warps(num_experts);
  const bool fused = num_pairs <= static_cast<int64_t>(warps) * kPairsPerFusedWarp;
  int64_t chunk = (num_pairs + (fused ? warps : kTargetChunks) - 1) / (fused ? warps : kTargetChunks);
  chunk = chunk < 32 ? 32 : (chunk + 31) / 32 * 32;
  const int64_t chunks = (num_pairs + chunk - 1) / chunk;
  if ((chunks + 1) * num_experts > workspace_ints || chunks > kMaxChunkSlices * 32) return cudaErrorInvalidValue;
  AlignParams p{ids,
                num_pairs,
                num_experts,
                block_rows,
                capacity,
                static_cast<int>(chunk),
                static_cast<int>(chunks),
                workspace,
                tokens_per_expert,
                expert_offsets,
                row_of,
                source_of,
                num_rows,
                status};
  auto s = static_cast<cudaStream_t>(stream);
  return ids_int64 ? run<int64_t>(p, fused, warps, s) : run<int32_t>(p, fused, warps, s);
}

}  // extern "C"
