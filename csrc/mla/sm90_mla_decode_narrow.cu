// Paged MLA decode on Hopper (sm_90a) for FP8 (E4M3) pages and at most 32 (new token, head) rows, e.g. 16 heads
// and one or two new tokens: the rows that read the cache at memory speed, where 64-row products would be three
// quarters padding. The products run transposed, with the rows as wgmma's N side (16 or 32):
//   scores^T [64 tokens, N] = tile [64, 576] . Q^T      (A: the widened tile, K-major; B: Q)
//   out^T [512, N]         += tile^T [512, 64] . P^T    (A: the tile's latent columns, MN-major; B: P^T)
// so the online softmax runs along the tokens (the accumulator's M side: four warps, maxima exchanged through
// shared memory).
//
// Warpgroup 0 computes; warpgroup 1 loads and widens. Tiles land as FP8 rows (cp.async, one token row per warp
// step, so any page size) in three raw buffers, three tiles in flight; warpgroup 1 reads a landed tile into
// registers, refills its buffer with the tile three on (its page lookups made a tile earlier), and writes the fp16
// image (E4M3 -> fp16 is exact) into the one stage once warpgroup 0 is done with the previous tile. Shared memory
// has room for one fp16 stage beside three raw buffers, so the widening and the products alternate; with two
// stages and one raw buffer the time was the same (measured). The queries are scaled by the softmax scale into
// fp16 once per piece; the pages' factor multiplies the scores and the output. Same schedule, workspace and
// combine as the 64-row kernel (sm90_mla_decode.cu).
#include "mla/sm90_mla_common.cuh"

namespace fim {
namespace sm90_mla {
namespace narrow {

constexpr int kRawBuffers = 3;  // FP8 tiles in flight

// Q [9 blocks][N rows][64 columns], the fp16 stage, the raw buffers, P^T [N rows][64 tokens], the maxima exchange
// [2][4 warps][N], the sums [4][N], barriers; 1024 bytes of slack to align the base to an atom.
template <int N>
struct Layout {
  static constexpr int q_block = N * 128;
  static constexpr int stage = 9 * q_block;
  static constexpr int raw = stage + kImage;
  static constexpr int p = raw + kRawBuffers * kRaw;
  static constexpr int red = p + N * 128;
  static constexpr int sums = red + 2 * 4 * N * 4;
  static constexpr int bars = sums + 4 * N * 4;
  static constexpr int bytes = bars + 8 * (kRawBuffers + 3) + 1024;
};

constexpr int kBarMax = 6, kBarP = 7, kBarRaw = 8, kBarQ = 9;  // named barriers within one warpgroup

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void wg_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

__device__ __forceinline__ void sts16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// FP8 rows of a tile into the raw buffer: warp w (of warpgroup 1) copies tokens 16 w .. 16 w + 15, each copy
// instruction 512 contiguous bytes of one row; tokens from `hi` on read zeros.
__device__ __forceinline__ void copy_raw(const Params& p, uint32_t raw, const Rows& rows, int warp, int lane) {
  copy_rows_fp8(p, raw - kFp8Off, rows, warp, lane);
}

template <bool QF16, int N>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_narrow_kernel(const __grid_constant__ Params p) {
  using T = typename std::conditional<QF16, __half, __nv_bfloat16>::type;
  using L = Layout<N>;
  constexpr int kCols = N / 4;              // query rows per thread
  constexpr int kChains = N == 16 ? 4 : 2;  // the scores' accumulators
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = smem_u32(smem_raw);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_base);
  const uint32_t s_q = base, s_raw = base + L::raw, s_p = base + L::p;
  float* s_red = reinterpret_cast<float*>(smem + L::red);
  float* s_sums = reinterpret_cast<float*>(smem + L::sums);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);  // [kRawBuffers] a raw buffer landed
  uint64_t* ready = full + kRawBuffers;                          // the fp16 image written
  uint64_t* empty = ready + 1;                                   // warpgroup 0 done with the image
  uint64_t* qbar = empty + 1;
  const uint32_t stage = base + L::stage;

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), t = tid & 127, warp = t >> 5;
  const int lane = tid & 31, q = lane & 3;
  const int prog = blockIdx.y;
  if (tid == 0) {
    for (int r = 0; r < kRawBuffers; ++r) bar_init(&full[r], p.tma ? 1 : 128);
    bar_init(ready, 128);
    bar_init(empty, 128);
    bar_init(qbar, kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int B = p.batch;
  const int chunk = p.sched[0], total = p.sched[1];
  const int32_t* starts = p.sched + 2;
  const int32_t* ends = starts + B;
  const int32_t* splits_of = ends + B;
  const int32_t* slot_of = splits_of + B;
  int cursor = prog * chunk;
  const int end = min(cursor + chunk, total);
  int b = slot_of[B + prog];
  const float kv_scale = p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value;

  uint32_t tiles_done = 0, pieces = 0;  // the barriers' phases
  uint32_t raw_phases = 0;              // bit r: the raw buffer r's
  while (cursor < end) {
    const int seq_start = starts[b], seq_end = ends[b], splits = splits_of[b];
    const int piece_end = min(end, seq_end);
    const int length = min(max(p.seq_lens[b], 0), p.max_tokens);
    const int tok_lo = max(cursor - seq_start - kOverhead, 0) * kUnit;
    const int tok_hi = min(max(piece_end - seq_start - kOverhead, 0) * kUnit, length);
    const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kTile - 1) / kTile : 0;
    const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_b;

    __syncthreads();  // the previous piece is done with Q, the stages and the sums
    if (wg == 1) {
      for (int i = 0; i < kRawBuffers && i < ntiles; ++i) {
        const uint32_t r = (tiles_done + i) % kRawBuffers;
        if (p.tma) {
          if (t == 0) bulk_raw(p, bt_row, tok_lo + i * kTile, s_raw + r * kRaw, &full[r]);
          continue;
        }
        copy_raw(p, s_raw + r * kRaw, look_up(p, bt_row, tok_lo + i * kTile, tok_hi, warp, lane, 1), warp, lane);
        cp_async_arrive(&full[r]);
      }
    }
    copy_queries<T, N>(p, s_q, 0, b, tid);
    cp_async_arrive(qbar);

    if (wg == 0) {
      // This thread's query rows (the accumulator's columns 8 j + 2 q + e: index 2 j + e) and what they see.
      int vis[kCols];
      float m[kCols], l[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int n = 8 * (c >> 1) + 2 * q + (c & 1);
        vis[c] = n < p.rows ? min(p.causal ? length - p.s_q + 1 + n / p.heads : length, tok_hi) : 0;
        m[c] = -INFINITY;
        l[c] = 0.f;
      }
      float o[8][N / 2];
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) o[mb][i] = 0.f;

      bar_wait(qbar, pieces & 1);
      scale_queries_f16<QF16, N>(s_q, p.qk_scale, t);
      wg_sync(kBarQ);

      const int ta = warp * 16 + (lane >> 2);  // this thread's tokens in a tile: ta, ta + 8
      for (int i = 0; i < ntiles; ++i) {
        const uint32_t g = tiles_done + i;
        bar_wait(ready, g & 1);
        fence_async_smem();
        // The 36 k steps in kChains independent accumulators, issued in turn: one chain of dependent small
        // products would wait out each product's latency.
        float part[kChains][N / 2];
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 36; ++k)
          mma_narrow<N, false>(part[k % kChains], desc_k(stage + (k >> 2) * kBlock + (k & 3) * 32),
                               desc_k(s_q + (k >> 2) * L::q_block + (k & 3) * 32), k >= kChains);
        wgmma_commit();
        wgmma_wait<0>();
        float sc[N / 2];
#pragma unroll
        for (int c = 0; c < kChains; ++c) fence_regs(part[c]);
#pragma unroll
        for (int e = 0; e < N / 2; ++e) {
          sc[e] = part[0][e];
#pragma unroll
          for (int c = 1; c < kChains; ++c) sc[e] += part[c][e];
        }

        // Online softmax along the tokens: a query row's 64 scores lie in the 8 lanes of one q in each warp.
        const int t0 = tok_lo + i * kTile;
        float mx[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int k = 4 * (c >> 1) + (c & 1);
          sc[k] = t0 + ta < vis[c] ? sc[k] * kv_scale : -INFINITY;
          sc[k + 2] = t0 + ta + 8 < vis[c] ? sc[k + 2] * kv_scale : -INFINITY;
          mx[c] = fmaxf(sc[k], sc[k + 2]);
#pragma unroll
          for (int x = 4; x <= 16; x <<= 1) mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], x));
        }
        float* red = s_red + (g & 1) * 4 * N;
        if (lane < 4) {
#pragma unroll
          for (int c = 0; c < kCols; ++c) red[warp * N + 8 * (c >> 1) + 2 * q + (c & 1)] = mx[c];
        }
        wg_sync(kBarMax);
        float alpha[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int n = 8 * (c >> 1) + 2 * q + (c & 1), k = 4 * (c >> 1) + (c & 1);
          const float tile_max = fmaxf(fmaxf(red[n], red[N + n]), fmaxf(red[2 * N + n], red[3 * N + n]));
          const float mn = fmaxf(m[c], tile_max);
          const float u = mn == -INFINITY ? 0.f : mn;
          alpha[c] = exp2f(m[c] - u);
          m[c] = mn;
          sc[k] = exp2f(sc[k] - u);
          sc[k + 2] = exp2f(sc[k + 2] - u);
          l[c] = l[c] * alpha[c] + sc[k] + sc[k + 2];
          // P^T [n][token], K-major for the values' B operand.
          const uint32_t row = s_p + n * 128, sw = n & 7;
          sts16(row + (((ta >> 3) ^ sw) << 4) + (ta & 7) * 2, __half_as_ushort(__float2half_rn(sc[k])));
          sts16(row + ((((ta + 8) >> 3) ^ sw) << 4) + (ta & 7) * 2, __half_as_ushort(__float2half_rn(sc[k + 2])));
        }
#pragma unroll
        for (int mb = 0; mb < 8; ++mb)
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const int k = 4 * (c >> 1) + (c & 1);
            o[mb][k] *= alpha[c];
            o[mb][k + 2] *= alpha[c];
          }
        fence_async_smem();  // P^T's stores -> the wgmma's reads
        wg_sync(kBarP);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // the 8 accumulators in turn, for the same reason
#pragma unroll
          for (int mb = 0; mb < 8; ++mb)
            mma_narrow<N, true>(o[mb], desc_mn(stage + mb * kBlock + kk * 2048), desc_k(s_p + kk * 32), 1);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) fence_regs(o[mb]);
        sm90_wgmma::bar_arrive(empty);
      }

      // Row sums: the 8 lanes of each q, then the four warps.
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) l[c] += __shfl_xor_sync(0xffffffffu, l[c], x);
      }
      if (lane < 4) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) s_sums[warp * N + 8 * (c >> 1) + 2 * q + (c & 1)] = l[c];
      }
      wg_sync(kBarMax);
      float inv[kCols], lse[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int n = 8 * (c >> 1) + 2 * q + (c & 1);
        const float sum = s_sums[n] + s_sums[N + n] + s_sums[2 * N + n] + s_sums[3 * N + n];
        const bool any = ntiles > 0 && sum > 0.f;
        inv[c] = any ? kv_scale / sum : 0.f;
        lse[c] = any ? m[c] + log2f(sum) : -INFINITY;
      }
      // out^T's columns are this thread's rows; its latent columns 64 mb + ta and + 8.
      const int64_t slot = slot_of[b] + prog - seq_start / chunk;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int n = 8 * (c >> 1) + 2 * q + (c & 1), k = 4 * (c >> 1) + (c & 1);
        if (n >= p.rows) continue;
        const int qi = n / p.heads, h = n % p.heads;
        if (splits == 1) {
          T* out = static_cast<T*>(p.out) + b * p.o_b + qi * p.o_s + h * p.o_h + ta;
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) {
            out[mb * 64] = static_cast<T>(o[mb][k] * inv[c]);
            out[mb * 64 + 8] = static_cast<T>(o[mb][k + 2] * inv[c]);
          }
          if (p.lse != nullptr && lane >> 2 == 0 && warp == 0)
            p.lse[b * p.l_b + qi * p.l_s + h * p.l_h] = lse[c] * 0.6931471805599453f;
        } else {
          float* out = p.part_out + (slot * p.rows + n) * 512 + ta;
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) {
            out[mb * 64] = o[mb][k] * inv[c];
            out[mb * 64 + 8] = o[mb][k + 2] * inv[c];
          }
          if (lane >> 2 == 0 && warp == 0) p.part_lse[slot * p.rows + n] = lse[c];
        }
      }
    } else {
      // Each tile: its raw rows into registers, the copies of the tile kRawBuffers on into the freed raw buffer (its
      // page lookups made one tile earlier, a global load in flight meanwhile), then the fp16 image once warpgroup 0
      // is done with that image's previous tile.
      Rows next{};
      if (!p.tma && kRawBuffers < ntiles)
        next = look_up(p, bt_row, tok_lo + kRawBuffers * kTile, tok_hi, warp, lane, 1);
      for (int i = 0; i < ntiles; ++i) {
        const uint32_t g = tiles_done + i, r = g % kRawBuffers;
        const uint32_t raw = s_raw + r * kRaw;
        bar_wait(&full[r], (raw_phases >> r) & 1);
        raw_phases ^= 1u << r;
        uint4 v[18];  // 64 rows x 36 chunks of 16 bytes, 18 per thread
#pragma unroll
        for (int j = 0; j < 18; ++j) v[j] = sm90_wgmma::lds128(raw + (j * 128 + t) * 16);
        wg_sync(kBarRaw);  // the buffer is read: its refill may start
        if (p.tma) {
          // Rows past the sequence's end read zeros (the bulk copy took them from the page as they are).
          const int valid = tok_hi - tok_lo - i * kTile;
#pragma unroll
          for (int j = 0; j < 18; ++j) {
            if ((j * 128 + t) / 36 >= valid) v[j] = make_uint4(0u, 0u, 0u, 0u);
          }
          if (t == 0 && i + kRawBuffers < ntiles)
            bulk_raw(p, bt_row, tok_lo + (i + kRawBuffers) * kTile, raw, &full[r]);
        } else if (i + kRawBuffers < ntiles) {
          copy_raw(p, raw, next, warp, lane);
          cp_async_arrive(&full[r]);
          if (i + kRawBuffers + 1 < ntiles)
            next = look_up(p, bt_row, tok_lo + (i + kRawBuffers + 1) * kTile, tok_hi, warp, lane, 1);
        }
        if (g >= 1) bar_wait(empty, (g - 1) & 1);  // warpgroup 0 is done with the previous tile
#pragma unroll
        for (int j = 0; j < 18; ++j) {
          const int item = j * 128 + t;
          store_widened(stage, item / 36, item % 36, v[j]);
        }
        fence_async_smem();  // the widened rows -> warpgroup 0's wgmma reads
        sm90_wgmma::bar_arrive(ready);
      }
    }
    tiles_done += ntiles;
    ++pieces;
    cursor = piece_end;
    ++b;
  }
}

#else

template <bool QF16, int N>
__global__ void mla_decode_narrow_kernel(const __grid_constant__ Params p) {}

#endif

template <bool QF16, int N>
int launch_t(const Params& p, int programs, cudaStream_t stream) {
  constexpr int bytes = Layout<N>::bytes;
  static_assert(bytes <= 227 * 1024, "shared memory");
  cudaError_t err = sm90::opt_in_shared_memory<mla_decode_narrow_kernel<QF16, N>>(bytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  mla_decode_narrow_kernel<QF16, N><<<dim3(1, programs), kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace narrow

int launch_narrow(const Params& p, bool fp16, int programs, cudaStream_t stream) {
  if (p.rows <= 16) {
    return fp16 ? narrow::launch_t<true, 16>(p, programs, stream) : narrow::launch_t<false, 16>(p, programs, stream);
  }
  return fp16 ? narrow::launch_t<true, 32>(p, programs, stream) : narrow::launch_t<false, 32>(p, programs, stream);
}

}  // namespace sm90_mla
}  // namespace fim
