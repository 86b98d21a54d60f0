// One-shot expert-parallel all-to-all over a symmetric workspace (every rank's buffer mapped by every rank).
//
// Dispatch: each sender writes its token rows (hidden bytes, scales, global ids, weights) straight into the
// receivers' buffers, one row per (token, receiver) in token order, then publishes, per receiver, the row
// count and a flag holding the call's epoch with a system-scope release store. Receivers wait on the flags
// with acquire loads and unpack. Combine goes back the same way: each receiver writes the row it computed
// for (source, slot) into the source's buffer, and the source sums its token's rows over the ranks.
//
// Epochs count calls (64-bit, so they never wrap) and live in device memory, so a captured CUDA graph
// advances them on every replay; nothing is reset between calls. Payload regions alternate by epoch parity:
// a sender can be one call ahead of a receiver (it has the receiver's flags of the current call) but never
// two, so the region it writes is never the one the receiver is reading.
//
// Every wait is bounded by %globaltimer. A wait that gives up records (code, phase, rank, peer, epoch) in a
// host-mapped error word (the first error only) and the kernel returns; later kernels of this workspace see
// the error pending and return at once, until the host clears it (recover()).

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/copy.cuh"
#include "common/dtype.cuh"
#include "common/sync.cuh"

namespace fim {
namespace a2a {

using comm::copy_to_all;
using comm::split;
using comm::warp_copy;

constexpr int kMaxRanks = 64;  // destination sets are 64-bit masks
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Workspace header (byte offsets). Must match flashinfer_moe/comm/p2p.py.
constexpr int64_t kDispatchFlagOff = 0;      // u64 [kMaxRanks]: epoch of the last dispatch each sender finished
constexpr int64_t kCombineFlagOff = 512;     // u64 [kMaxRanks]: same for combine
constexpr int64_t kCountOff = 1024;          // i32 [2][kMaxRanks]: rows each sender wrote, by epoch parity
constexpr int64_t kDispatchEpochOff = 1536;  // u64, local: this rank's dispatch calls
constexpr int64_t kCombineEpochOff = 1544;   // u64, local
constexpr int64_t kDispatchDoneOff = 1552;   // u32, local: blocks of the running send kernel that finished
constexpr int64_t kCombineDoneOff = 1556;    // u32, local
constexpr int64_t kClaimedOff = 1560;        // u32, local: an error was recorded
constexpr int64_t kTotalsOff = 1600;         // i32 [kMaxRanks], local: rows the running dispatch sends to each
constexpr int64_t kHandshakeFlagOff = 2048;  // u64 [kMaxRanks]
constexpr int64_t kHandshakeDataOff = 2560;  // i32 [kMaxRanks]
constexpr int64_t kHeaderBytes = 4096;

// Error word: [code, phase, rank, peer, epoch, detail]. Must match p2p.py.
enum Code : int { kNone = 0, kTimeout = 1, kCapacity = 2 };
enum Phase : int { kDispatch = 1, kCombine = 2, kHandshake = 3 };
enum Force : int { kForceNone = 0, kForceTimeout = 1, kForceFail = 2 };

struct Params {
  const int64_t* peers;  // [world] device table: base address of every rank's workspace as mapped here
  char* local;           // this rank's workspace
  long long* error;      // host-mapped error word
  int64_t hidden_bytes;  // bytes of one dispatched hidden row
  int64_t scale_bytes;   // room for one row's scales
  int64_t row_stride;    // bytes of one dispatch record
  int64_t combine_stride;
  int64_t dispatch_off;  // regions: dispatch [2][world][max_tokens] records, combine [2][world][max_tokens] rows
  int64_t combine_off;
  uint64_t timeout_ns;
  int rank;
  int world;
  int max_tokens;
  int top_k;
  int num_experts;
  int experts_per_rank;
};

static_assert(sizeof(Params) == 104, "Params must match its ctypes mirror in flashinfer_moe/comm/_kernels.py");

__host__ __device__ __forceinline__ int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
__device__ __forceinline__ int64_t scales_at(const Params& p) { return align16(p.hidden_bytes); }
__device__ __forceinline__ int64_t ids_at(const Params& p) { return scales_at(p) + align16(p.scale_bytes); }
__device__ __forceinline__ int64_t weights_at(const Params& p) { return ids_at(p) + align16(4 * p.top_k); }

template <typename T>
__device__ __forceinline__ T* at(char* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

__device__ __forceinline__ bool error_pending(const Params& p) {
  return *reinterpret_cast<volatile unsigned*>(p.local + kClaimedOff) != 0u;
}

// Records the first error of this workspace; later ones are dropped (the first is the cause).
__device__ void record_error(const Params& p, int code, int phase, int peer, uint64_t epoch, long long detail) {
  if (atomicCAS(at<unsigned>(p.local, kClaimedOff), 0u, 1u) != 0u) return;
  volatile long long* e = p.error;
  e[1] = phase;
  e[2] = p.rank;
  e[3] = peer;
  e[4] = static_cast<long long>(epoch);
  e[5] = detail;
  __threadfence_system();
  e[0] = code;  // last: the host reads the fields once it sees a code
  __threadfence_system();
}

__device__ __forceinline__ uint64_t dest_mask(const Params& p, const void* ids, int ids_64, int64_t t) {
  uint64_t mask = 0;
  for (int j = 0; j < p.top_k; ++j) {
    const int64_t i = t * p.top_k + j;
    const int64_t e = ids_64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int*>(ids)[i];
    if (e >= 0 && e < p.num_experts) mask |= 1ull << (e / p.experts_per_rank);
  }
  return mask;
}

// The end of a send kernel: once every block's writes are visible system-wide, the last block to finish
// publishes `flag_off[rank] = epoch` at every peer (after the row count, for dispatch) and advances the local
// epoch. Safe because send kernels never wait: every block reaches this point.
__device__ void publish(const Params& p, int64_t done_off, int64_t epoch_off, int64_t flag_off, bool with_counts,
                        uint64_t epoch) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(at<unsigned>(p.local, done_off), 1u);
    __threadfence();
    s_last = prev == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  const int parity = static_cast<int>(epoch & 1);
  for (int d = threadIdx.x; d < p.world; d += blockDim.x) {
    char* peer = reinterpret_cast<char*>(p.peers[d]);
    if (with_counts) {
      const int count = *reinterpret_cast<volatile int*>(p.local + kTotalsOff + 4 * d);
      *reinterpret_cast<volatile int*>(peer + kCountOff + 4 * (parity * kMaxRanks + p.rank)) = count;
    }
    store_release_sys_u64(at<uint64_t>(peer, flag_off) + p.rank, epoch);
  }
  if (threadIdx.x == 0) {
    *at<unsigned>(p.local, done_off) = 0u;  // the next send kernel of this kind starts after this one ends
    *reinterpret_cast<volatile uint64_t*>(p.local + epoch_off) = epoch;
  }
}

// ------------------------------------------------------------------------------------------------ dispatch

// Block b sends tokens [T*b/G, T*(b+1)/G). A token's slot at receiver d is the number of earlier tokens that
// go to d: counted for the tokens before the block's range, then scanned (warp ballots) within it.
// send_slot [T, world]: that slot, -1 where the token does not go (combine reads it back).
__global__ void __launch_bounds__(kThreads)
    dispatch_send_kernel(Params p, const char* hidden, const float* scales, const void* ids, int ids_64,
                         const float* weights, int num_tokens, int parts, int* send_slot) {
  __shared__ uint64_t s_epoch;
  __shared__ int s_skip;
  __shared__ int s_base[kMaxRanks];
  __shared__ int s_warp[kWarps][kMaxRanks];
  __shared__ char* s_dst[kWarps][kMaxRanks];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, world = p.world;
  if (tid == 0) {
    s_skip = error_pending(p);
    s_epoch = *reinterpret_cast<volatile uint64_t*>(p.local + kDispatchEpochOff) + 1;
  }
  for (int d = tid; d < world; d += kThreads) s_base[d] = 0;
  __syncthreads();
  if (s_skip) return;  // the peers time out and report it too; recover() clears it
  const uint64_t epoch = s_epoch;
  const int64_t block_row = (static_cast<int64_t>(epoch & 1) * world + p.rank) * p.max_tokens;
  const int begin = static_cast<int>(static_cast<int64_t>(num_tokens) * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(static_cast<int64_t>(num_tokens) * (blockIdx.x + 1) / gridDim.x);
  for (int t = tid; t < begin; t += kThreads) {
    for (uint64_t m = dest_mask(p, ids, ids_64, t); m; m &= m - 1) atomicAdd(&s_base[__ffsll(m) - 1], 1);
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int c0 = begin; c0 < end; c0 += kThreads) {
    const int t = c0 + tid;
    const bool valid = t < end;
    const uint64_t mask = valid ? dest_mask(p, ids, ids_64, t) : 0;
    for (int d = 0; d < world; ++d) {
      const unsigned ballot = __ballot_sync(~0u, (mask >> d) & 1);
      if (lane == 0) s_warp[warp][d] = __popc(ballot);
    }
    __syncthreads();
    for (int d = tid; d < world; d += kThreads) {  // exclusive scan over the warps, from the running base
      int run = s_base[d];
      for (int w = 0; w < kWarps; ++w) {
        const int c = s_warp[w][d];
        s_warp[w][d] = run;
        run += c;
      }
      s_base[d] = run;
    }
    __syncthreads();
    for (int d = 0; d < world; ++d) {
      const unsigned ballot = __ballot_sync(~0u, (mask >> d) & 1);
      if (valid)
        send_slot[static_cast<int64_t>(t) * world + d] =
            (mask >> d) & 1 ? s_warp[warp][d] + __popc(ballot & lanes_below) : -1;
    }
    __syncthreads();  // slots in memory for every warp of the block
    const int count = min(kThreads, end - c0);
    for (int unit = warp; unit < count * parts; unit += kWarps) {
      const int64_t tok = c0 + unit / parts;
      const int part = unit % parts;
      const uint64_t m = dest_mask(p, ids, ids_64, tok);
      int nd = 0;
      for (uint64_t r = m; r; r &= r - 1, ++nd) {
        const int d = __ffsll(r) - 1;
        if (lane == 0) {
          const int slot = send_slot[tok * world + d];
          s_dst[warp][nd] = reinterpret_cast<char*>(p.peers[d]) + p.dispatch_off + (block_row + slot) * p.row_stride;
        }
      }
      __syncwarp();
      copy_to_all(s_dst[warp], nd, 0, hidden + tok * p.hidden_bytes, p.hidden_bytes, part, parts, lane);
      if (part == 0) {
        if (scales != nullptr) {
          copy_to_all(s_dst[warp], nd, scales_at(p), reinterpret_cast<const char*>(scales) + tok * p.scale_bytes,
                      p.scale_bytes, 0, 1, lane);
        }
        for (int j = lane; j < p.top_k; j += 32) {
          const int64_t i = tok * p.top_k + j;
          const int id =
              ids_64 ? static_cast<int>(static_cast<const int64_t*>(ids)[i]) : static_cast<const int*>(ids)[i];
          const float w = weights[i];
          for (int q = 0; q < nd; ++q) {
            at<int>(s_dst[warp][q], ids_at(p))[j] = id;
            at<float>(s_dst[warp][q], weights_at(p))[j] = w;
          }
        }
      }
      __syncwarp();  // s_dst is rewritten for the warp's next unit
    }
    __syncthreads();  // s_warp is rewritten by the next chunk
  }
  if (blockIdx.x == gridDim.x - 1) {  // its range ends at T: s_base holds the totals
    for (int d = tid; d < world; d += kThreads) at<int>(p.local, kTotalsOff)[d] = s_base[d];
  }
  publish(p, kDispatchDoneOff, kDispatchEpochOff, kDispatchFlagOff, true, epoch);
}

// Waits for the count (and flag) of every sender of the current dispatch. Returns the count, 0 on a failure
// (recorded, *failed set).
__device__ int receive_count(const Params& p, int src, uint64_t epoch, bool wait, int* failed) {
  const uint64_t* flag = at<uint64_t>(p.local, kDispatchFlagOff) + src;
  if (wait && !wait_flag_u64_at_least(flag, epoch, p.timeout_ns)) {
    record_error(p, kTimeout, kDispatch, src, epoch, 0);
    *failed = 1;
    return 0;
  }
  const int count =
      *reinterpret_cast<volatile int*>(p.local + kCountOff + 4 * (static_cast<int>(epoch & 1) * kMaxRanks + src));
  if (count < 0 || count > p.max_tokens) {  // checked before any row is read or written
    record_error(p, kCapacity, kDispatch, src, epoch, count);
    *failed = 1;
    return 0;
  }
  return count;
}

// High-throughput: one block waits for every sender and reports the counts to the host
// (host_counts [2 * world]: rows received from each rank, then rows sent to each).
__global__ void dispatch_wait_kernel(Params p, int* host_counts) {
  __shared__ int s_failed;
  __shared__ int s_pending;
  if (threadIdx.x == 0) {
    s_failed = 0;
    s_pending = error_pending(p);
  }
  __syncthreads();
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(p.local + kDispatchEpochOff);
  for (int s = threadIdx.x; s < p.world; s += blockDim.x) {
    const int count = s_pending ? 0 : receive_count(p, s, epoch, true, &s_failed);
    reinterpret_cast<volatile int*>(host_counts)[s] = count;
    reinterpret_cast<volatile int*>(host_counts)[p.world + s] = at<int>(p.local, kTotalsOff)[s];
  }
  __threadfence_system();
}

// Unpacks the received records into the outputs, ranks ascending, tokens ascending within a rank.
// compact (high-throughput): rank s's rows start at the sum of the counts before s; else (low-latency) at
// s * max_tokens, and the rows past its count are padding (ids -1, weights 0). Global ids become local ones
// (-1 for experts on other ranks). wait: spin on the flags here (low-latency) or not (waited already).
__global__ void __launch_bounds__(kThreads)
    dispatch_recv_kernel(Params p, int wait, int compact, int64_t num_rows, int parts, char* out_hidden,
                         float* out_scales, int* out_ids, float* out_weights, int* recv_counts, int* recv_offsets,
                         int* tokens_per_expert) {
  __shared__ int s_failed;
  __shared__ int s_pending;
  __shared__ int s_count[kMaxRanks];
  __shared__ int s_off[kMaxRanks + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, world = p.world;
  if (tid == 0) {
    s_failed = 0;
    s_pending = error_pending(p);
  }
  __syncthreads();
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(p.local + kDispatchEpochOff);
  for (int s = tid; s < world; s += kThreads) s_count[s] = s_pending ? 0 : receive_count(p, s, epoch, wait, &s_failed);
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int s = 0; s < world; ++s) {
      if (s_failed) s_count[s] = 0;  // every row padding: nothing downstream reads past what arrived
      s_off[s] = compact ? run : s * p.max_tokens;
      run += s_count[s];
    }
    s_off[world] = compact ? run : world * p.max_tokens;
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (int s = tid; s <= world; s += kThreads) {
      recv_offsets[s] = s_off[s];
      if (s < world) recv_counts[s] = s_count[s];
    }
  }
  if (compact && s_failed) return;
  const int first = p.rank * p.experts_per_rank;
  const int64_t parity_row = static_cast<int64_t>(epoch & 1) * world;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarps + warp; unit < num_rows * parts;
       unit += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = unit / parts;
    const int part = static_cast<int>(unit % parts);
    int s = 0;
    while (s + 1 < world && r >= s_off[s + 1]) ++s;
    const int64_t i = r - s_off[s];
    if (i < s_count[s]) {
      char* rec = p.local + p.dispatch_off + ((parity_row + s) * p.max_tokens + i) * p.row_stride;
      warp_copy(out_hidden + r * p.hidden_bytes, rec, p.hidden_bytes, part, parts, lane);
      if (part == 0) {
        if (out_scales != nullptr) {
          warp_copy(reinterpret_cast<char*>(out_scales) + r * p.scale_bytes, rec + scales_at(p), p.scale_bytes, 0, 1,
                    lane);
        }
        for (int j = lane; j < p.top_k; j += 32) {
          const int e = at<int>(rec, ids_at(p))[j];
          const int local = e >= first && e < first + p.experts_per_rank ? e - first : -1;
          out_ids[r * p.top_k + j] = local;
          out_weights[r * p.top_k + j] = at<float>(rec, weights_at(p))[j];
          if (tokens_per_expert != nullptr && local >= 0) atomicAdd(&tokens_per_expert[local], 1);
        }
      }
    } else if (part == 0) {
      for (int j = lane; j < p.top_k; j += 32) {
        out_ids[r * p.top_k + j] = -1;
        out_weights[r * p.top_k + j] = 0.f;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------- combine

// Row r of x (received from rank s as its slot i) goes to rank s's combine region, block of this rank, slot i.
__global__ void __launch_bounds__(kThreads)
    combine_send_kernel(Params p, const char* x, int64_t row_bytes, const int* recv_offsets, const int* recv_counts,
                        int64_t num_rows, int parts) {
  __shared__ uint64_t s_epoch;
  __shared__ int s_skip;
  __shared__ int s_count[kMaxRanks];
  __shared__ int s_off[kMaxRanks + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, world = p.world;
  if (tid == 0) {
    s_skip = error_pending(p);
    s_epoch = *reinterpret_cast<volatile uint64_t*>(p.local + kCombineEpochOff) + 1;
  }
  for (int s = tid; s <= world; s += kThreads) {
    s_off[s] = recv_offsets[s];
    if (s < world) s_count[s] = min(recv_counts[s], p.max_tokens);
  }
  __syncthreads();
  if (s_skip) return;
  const uint64_t epoch = s_epoch;
  const int64_t block_row = (static_cast<int64_t>(epoch & 1) * world + p.rank) * p.max_tokens;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarps + warp; unit < num_rows * parts;
       unit += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = unit / parts;
    int s = 0;
    while (s + 1 < world && r >= s_off[s + 1]) ++s;
    const int64_t i = r - s_off[s];
    if (i < 0 || i >= s_count[s]) continue;  // low-latency padding
    char* dst = reinterpret_cast<char*>(p.peers[s]) + p.combine_off + (block_row + i) * p.combine_stride;
    warp_copy(dst, x + r * row_bytes, row_bytes, static_cast<int>(unit % parts), parts, lane);
  }
  publish(p, kCombineDoneOff, kCombineEpochOff, kCombineFlagOff, false, epoch);
}

// out[t] = sum over ranks d ascending (fp32) of the row d returned for token t, for the d that have one
// (send_slot[t, d] >= 0); tokens sent nowhere get zeros.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    combine_recv_kernel(Params p, const int* send_slot, int num_tokens, int hidden, int parts, T* out) {
  __shared__ int s_failed;
  __shared__ int s_pending;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, world = p.world;
  if (tid == 0) {
    s_failed = 0;
    s_pending = error_pending(p);
  }
  __syncthreads();
  if (s_pending) return;
  const uint64_t epoch = *reinterpret_cast<volatile uint64_t*>(p.local + kCombineEpochOff);
  for (int d = tid; d < world; d += kThreads) {
    if (!wait_flag_u64_at_least(at<uint64_t>(p.local, kCombineFlagOff) + d, epoch, p.timeout_ns)) {
      record_error(p, kTimeout, kCombine, d, epoch, 0);
      s_failed = 1;
    }
  }
  __syncthreads();
  if (s_failed) return;
  const char* region =
      p.local + p.combine_off + static_cast<int64_t>(epoch & 1) * world * p.max_tokens * p.combine_stride;
  const int64_t rank_stride = static_cast<int64_t>(p.max_tokens) * p.combine_stride;
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = (static_cast<int64_t>(hidden) * sizeof(T)) % 16 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  const int64_t width = vec ? hidden / kVec : hidden;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * kWarps + warp; unit < static_cast<int64_t>(num_tokens) * parts;
       unit += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t t = unit / parts;
    const int slot_lo = lane < world ? send_slot[t * world + lane] : -1;
    const int slot_hi = lane + 32 < world ? send_slot[t * world + lane + 32] : -1;
    int64_t begin, end;
    split(width, static_cast<int>(unit % parts), parts, &begin, &end);
    // The whole warp walks the columns together (lanes past the end idle), so that every lane takes part in
    // the slot shuffles below: a part narrower than 32 columns would otherwise leave lanes out of them.
    for (int64_t c0 = begin; c0 < end; c0 += 32) {
      const int64_t c = c0 + lane;
      const bool live = c < end;
      float acc[kVec];
#pragma unroll
      for (int n = 0; n < kVec; ++n) acc[n] = 0.f;
      for (int d = 0; d < world; ++d) {
        const int slot = __shfl_sync(~0u, d < 32 ? slot_lo : slot_hi, d & 31);
        if (slot < 0 || !live) continue;
        const char* row = region + d * rank_stride + static_cast<int64_t>(slot) * p.combine_stride;
        if (vec) {
          const int4 raw = reinterpret_cast<const int4*>(row)[c];
          const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int n = 0; n < kVec; ++n) acc[n] += to_float(v[n]);
        } else {
          acc[0] += to_float(reinterpret_cast<const T*>(row)[c]);
        }
      }
      if (!live) continue;
      if (vec) {
        int4 raw;
        T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int n = 0; n < kVec; ++n) v[n] = from_float<T>(acc[n]);
        reinterpret_cast<int4*>(out + t * hidden)[c] = raw;
      } else {
        out[t * hidden + c] = from_float<T>(acc[0]);
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------- handshake

// The live flag check over the mapped workspace, every pair both ways: thread d stores a payload into rank
// d's buffer and publishes it with a release atomic at system scope, then waits (acquire, bounded) for rank
// d's payload here. result [world]: 0 ok, 1 wrong payload, 2 timeout.
__global__ void handshake_kernel(Params p, uint64_t round, int force, int* result) {
  for (int d = threadIdx.x; d < p.world; d += blockDim.x) {
    char* peer = reinterpret_cast<char*>(p.peers[d]);
    const int token = static_cast<int>((round * 7919u + static_cast<uint64_t>(p.rank) * 104729u) & 0x3fffffff) | 1;
    if (force != kForceTimeout) {
      *reinterpret_cast<volatile int*>(peer + kHandshakeDataOff + 4 * p.rank) = force == kForceFail ? ~token : token;
      atomic_add_release_sys_u64(at<uint64_t>(peer, kHandshakeFlagOff) + p.rank, 1);
    }
    const int expected = static_cast<int>((round * 7919u + static_cast<uint64_t>(d) * 104729u) & 0x3fffffff) | 1;
    if (!wait_flag_u64_at_least(at<uint64_t>(p.local, kHandshakeFlagOff) + d, round, p.timeout_ns)) {
      result[d] = 2;
    } else {
      result[d] = *reinterpret_cast<volatile int*>(p.local + kHandshakeDataOff + 4 * d) == expected ? 0 : 1;
    }
  }
}

}  // namespace a2a
}  // namespace fim

using fim::a2a::kThreads;
using fim::a2a::Params;

extern "C" {

int64_t fim_a2a_header_bytes() { return fim::a2a::kHeaderBytes; }

int fim_a2a_max_ranks() { return fim::a2a::kMaxRanks; }

// Loads every kernel now: with lazy loading, a kernel's first launch waits for the kernels already running
// on the device, which may be waiting for this very launch on a peer.
int fim_a2a_preload() {
  cudaFuncAttributes attrs;
  const void* kernels[] = {
      reinterpret_cast<const void*>(fim::a2a::dispatch_send_kernel),
      reinterpret_cast<const void*>(fim::a2a::dispatch_wait_kernel),
      reinterpret_cast<const void*>(fim::a2a::dispatch_recv_kernel),
      reinterpret_cast<const void*>(fim::a2a::combine_send_kernel),
      reinterpret_cast<const void*>(fim::a2a::combine_recv_kernel<float>),
      reinterpret_cast<const void*>(fim::a2a::combine_recv_kernel<__half>),
      reinterpret_cast<const void*>(fim::a2a::combine_recv_kernel<__nv_bfloat16>),
      reinterpret_cast<const void*>(fim::a2a::handshake_kernel),
  };
  for (const void* k : kernels) {
    cudaError_t err = cudaFuncGetAttributes(&attrs, k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

int fim_a2a_dispatch_send(const Params* p, const void* hidden, const float* scales, const void* ids, int ids_64,
                          const float* weights, int num_tokens, int parts, int* send_slot, int grid, void* stream) {
  // A token takes at most one slot per destination, so this bound keeps every row inside this rank's block of
  // max_tokens rows in each peer's buffer; the callers check it too, the kernel trusts it.
  if (num_tokens < 0 || num_tokens > p->max_tokens) return cudaErrorInvalidValue;
  fim::a2a::dispatch_send_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *p, static_cast<const char*>(hidden), scales, ids, ids_64, weights, num_tokens, parts, send_slot);
  return cudaGetLastError();
}

int fim_a2a_dispatch_wait(const Params* p, int* host_counts, void* stream) {
  fim::a2a::dispatch_wait_kernel<<<1, 64, 0, static_cast<cudaStream_t>(stream)>>>(*p, host_counts);
  return cudaGetLastError();
}

int fim_a2a_dispatch_recv(const Params* p, int wait, int compact, int64_t num_rows, int parts, void* out_hidden,
                          float* out_scales, int* out_ids, float* out_weights, int* recv_counts, int* recv_offsets,
                          int* tokens_per_expert, int grid, void* stream) {
  fim::a2a::dispatch_recv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *p, wait, compact, num_rows, parts, static_cast<char*>(out_hidden), out_scales, out_ids, out_weights, recv_counts,
      recv_offsets, tokens_per_expert);
  return cudaGetLastError();
}

int fim_a2a_combine_send(const Params* p, const void* x, int64_t row_bytes, const int* recv_offsets,
                         const int* recv_counts, int64_t num_rows, int parts, int grid, void* stream) {
  fim::a2a::combine_send_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *p, static_cast<const char*>(x), row_bytes, recv_offsets, recv_counts, num_rows, parts);
  return cudaGetLastError();
}

// dtype: fim::DType of out (and of the rows in the combine region).
int fim_a2a_combine_recv(const Params* p, int dtype, const int* send_slot, int num_tokens, int hidden, int parts,
                         void* out, int grid, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case fim::kFloat32:
      fim::a2a::combine_recv_kernel<float>
          <<<grid, kThreads, 0, s>>>(*p, send_slot, num_tokens, hidden, parts, static_cast<float*>(out));
      break;
    case fim::kFloat16:
      fim::a2a::combine_recv_kernel<__half>
          <<<grid, kThreads, 0, s>>>(*p, send_slot, num_tokens, hidden, parts, static_cast<__half*>(out));
      break;
    case fim::kBFloat16:
      fim::a2a::combine_recv_kernel<__nv_bfloat16>
          <<<grid, kThreads, 0, s>>>(*p, send_slot, num_tokens, hidden, parts, static_cast<__nv_bfloat16*>(out));
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int fim_a2a_handshake(const Params* p, uint64_t round, int force, int* result, void* stream) {
  fim::a2a::handshake_kernel<<<1, 64, 0, static_cast<cudaStream_t>(stream)>>>(*p, round, force, result);
  return cudaGetLastError();
}

}  // extern "C"
