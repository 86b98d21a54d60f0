// Paged MLA decode on Hopper (sm_90a) for FP8 (E4M3) pages and at most 32 (new token, head) rows, e.g. 16 heads
// and one or two new tokens: the rows that read the cache at memory speed, where 64-row products would be three
// quarters padding. The products run transposed, with the rows as wgmma's N side (16 or 32):
//   scores^T [64 tokens, N] = tile [64, 576] . Q^T      (A: the widened tile, K-major; B: Q)
//   out^T [512, N]         += tile^T [512, 64] . P^T    (A: the tile's latent columns, MN-major; B: P^T)
// so the online softmax runs along the tokens (the accumulator's M side: four warps, maxima exchanged through
// shared memory).
//
// Warpgroup 0 computes; warpgroup 1 loads and widens. Tiles land as FP8 rows in raw buffers (cp.async, one token
// row per warp step, so any page size; from page 64 on, bulk copies of whole rows); warpgroup 1 reads a landed
// buffer into registers, refills it with the rows that many buffers on (its page lookups made one buffer earlier),
// and writes the fp16 image (E4M3 -> fp16 is exact) into the tile's stage once warpgroup 0 is done with that
// stage's previous tile. Shared memory holds one fp16 stage beside three raw buffers of whole tiles (STAGES 1: the
// widening and the products alternate) or two stages beside raw buffers of half tiles (STAGES 2: a tile's widening
// overlaps the previous tile's products; on an H200 1.04-1.09x one stage with bulk copies, 0.81-0.85x with token
// rows, which then have 1.5 tiles in flight instead of 3, so launch_narrow takes it with bulk copies only). The queries
// are scaled by the softmax scale into fp16 once per piece; the pages' factor multiplies the scores and the
// output. Same schedule, workspace and combine as the 64-row kernel (sm90_mla_decode.cu).
#include "mla/sm90_mla_common.cuh"

namespace fim {
namespace sm90_mla {
namespace narrow {

// STAGES 1: one fp16 stage beside three raw buffers of whole tiles, so that the widening and the products
// alternate. STAGES 2: two fp16 stages, so that warpgroup 1 widens a tile while warpgroup 0 multiplies the one
// before; there is room beside them only for raw buffers of half tiles (3 at 16 rows, 2 at 32).
template <int N, int STAGES>
struct Shape {
  static constexpr int seg = STAGES == 1 ? kTile : kTile / 2;  // tokens a raw buffer holds
  static constexpr int segs = kTile / seg;                     // raw buffers a tile
  static constexpr int bufs = STAGES == 1 || N == 16 ? 3 : 2;  // raw buffers in flight
  static constexpr int seg_bytes = seg * kChunks * 8;          // FP8 rows of 576 bytes
  static constexpr int per_thread = seg * kChunks / 2 / 128;   // 16-byte chunks a thread reads
  static constexpr int per_warp = seg / 4;                     // token rows a warp copies
};

// Q [9 blocks][N rows][64 columns], the fp16 stages, the raw buffers, P^T [N rows][64 tokens], the maxima exchange
// [2][4 warps][N], the sums [4][N], barriers; 1024 bytes of slack to align the base to an atom.
template <int N, int STAGES>
struct Layout {
  using S = Shape<N, STAGES>;
  static constexpr int q_block = N * 128;
  static constexpr int stage = 9 * q_block;
  static constexpr int raw = stage + STAGES * kImage;
  static constexpr int p = raw + S::bufs * S::seg_bytes;
  static constexpr int red = p + N * 128;
  static constexpr int sums = red + 2 * 4 * N * 4;
  static constexpr int bars = sums + 4 * N * 4;
  static constexpr int bytes = bars + 8 * (S::bufs + 2 * STAGES + 1) + 1024;
};

constexpr int kBarMax = 6, kBarP = 7, kBarRaw = 8, kBarQ = 9;  // named barriers within one warpgroup

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <bool QF16, int N, int STAGES>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_narrow_kernel(const __grid_constant__ Params p) {
  using T = typename std::conditional<QF16, __half, __nv_bfloat16>::type;
  using L = Layout<N, STAGES>;
  using S = Shape<N, STAGES>;
  constexpr int kCols = N / 4;              // query rows per thread
  constexpr int kChains = N == 16 ? 4 : 2;  // the scores' accumulators
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = smem_u32(smem_raw);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_base);
  const uint32_t s_q = base, s_raw = base + L::raw, s_p = base + L::p;
  float* s_red = reinterpret_cast<float*>(smem + L::red);
  float* s_sums = reinterpret_cast<float*>(smem + L::sums);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);  // [bufs] a raw buffer landed
  uint64_t* ready = full + S::bufs;                              // [STAGES] the fp16 image written
  uint64_t* empty = ready + STAGES;                              // [STAGES] warpgroup 0 done with the image
  uint64_t* qbar = empty + STAGES;

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), t = tid & 127, warp = t >> 5;
  const int lane = tid & 31, q = lane & 3;
  const int prog = blockIdx.y;
  // Bulk copies (p.tma); two stages take no other (launch_narrow), so their instances hold no cp.async path.
  const bool bulk = STAGES == 2 || p.tma;
  if (tid == 0) {
    for (int r = 0; r < S::bufs; ++r) bar_init(&full[r], bulk ? 1 : 128);
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&ready[s], 128);
      bar_init(&empty[s], 128);
    }
    bar_init(qbar, kThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const Sched sc = sched_of(p, prog);
  int cursor = sc.begin, b = sc.first;
  const float kv_scale = p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value;

  uint32_t tiles_done = 0, pieces = 0;  // the barriers' phases
  uint32_t raw_phases = 0;              // bit r: the raw buffer r's
  while (cursor < sc.end) {
    const int seq_start = sc.starts[b], seq_end = sc.ends[b], splits = sc.splits[b];
    const int piece_end = min(sc.end, seq_end);
    const int length = min(max(p.seq_lens[b], 0), p.max_tokens);
    const int tok_lo = max(cursor - seq_start - kOverhead, 0) * kUnit;
    const int tok_hi = min(max(piece_end - seq_start - kOverhead, 0) * kUnit, length);
    const int ntiles = tok_hi > tok_lo ? (tok_hi - tok_lo + kTile - 1) / kTile : 0;
    const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_b;

    __syncthreads();  // the previous piece is done with Q, the stages and the sums
    const int nsegs = ntiles * S::segs;
    const uint32_t seg0 = tiles_done * S::segs;  // raw buffer segments before this piece
    if (wg == 1) {
      for (int i = 0; i < S::bufs && i < nsegs; ++i) {
        const uint32_t r = (seg0 + i) % S::bufs, raw = s_raw + r * S::seg_bytes;
        if (bulk) {
          if (t == 0) bulk_raw<S::seg_bytes, true>(p, bt_row, tok_lo + i * S::seg, raw, &full[r]);
          continue;
        }
        const Rows rows = look_up<S::per_warp>(p, bt_row, tok_lo + i * S::seg, tok_hi, warp, lane, 1);
        copy_rows_fp8<S::per_warp>(p, raw, rows, warp, lane);
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
        const uint32_t g = tiles_done + i, stage = base + L::stage + (g % STAGES) * kImage;
        bar_wait(&ready[g % STAGES], (g / STAGES) & 1);
        fence_async_smem();
        // The 36 k steps in kChains independent accumulators, issued in turn: one chain of dependent small
        // products would wait out each product's latency.
        float part[kChains][N / 2];
        const uint64_t dk = desc_k(stage), dq = desc_k(s_q);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 36; ++k)
          mma_narrow<N, false>(part[k % kChains], desc_at(dk, (k >> 2) * kBlock + (k & 3) * 32),
                               desc_at(dq, (k >> 2) * L::q_block + (k & 3) * 32), k >= kChains);
        wgmma_commit();
        wgmma_wait<0>();
        float sc[N / 2];
        sum_chains(part, sc);

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
        narrow_share<N>(mx, red, warp, lane, q, kBarMax);
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
        const uint64_t dv = desc_mn(stage), dp = desc_k(s_p);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // the 8 accumulators in turn, for the same reason
#pragma unroll
          for (int mb = 0; mb < 8; ++mb)
            mma_narrow<N, true>(o[mb], desc_at(dv, mb * kBlock + kk * 2048), desc_at(dp, kk * 32), 1);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) fence_regs(o[mb]);
        sm90_wgmma::bar_arrive(&empty[g % STAGES]);
      }

      narrow_sum_rows<N>(l, s_sums, warp, lane, q, kBarMax);
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
      const int64_t slot = sc.slot(b, seq_start);
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
      // Each raw buffer: its rows into registers, the copies of the segment S::bufs on into the freed buffer (their
      // page lookups made one segment earlier, a global load in flight meanwhile), then the rows widened into the
      // tile's fp16 stage once warpgroup 0 is done with that stage's previous tile.
      Rows next{};
      if (!bulk && S::bufs < nsegs)
        next = look_up<S::per_warp>(p, bt_row, tok_lo + S::bufs * S::seg, tok_hi, warp, lane, 1);
      for (int i = 0; i < ntiles; ++i) {
        const uint32_t g = tiles_done + i, stage = base + L::stage + (g % STAGES) * kImage;
#pragma unroll
        for (int h = 0; h < S::segs; ++h) {
          const int j0 = i * S::segs + h;  // the segment in this piece
          const uint32_t r = (seg0 + j0) % S::bufs, raw = s_raw + r * S::seg_bytes;
          bar_wait(&full[r], (raw_phases >> r) & 1);
          raw_phases ^= 1u << r;
          uint4 v[S::per_thread];
#pragma unroll
          for (int j = 0; j < S::per_thread; ++j) v[j] = sm90_wgmma::lds128(raw + (j * 128 + t) * 16);
          wg_sync(kBarRaw);  // the buffer is read: its refill may start
          if (bulk) {
            // Rows past the sequence's end read zeros (the bulk copy took them from the page as they are).
            const int valid = tok_hi - tok_lo - j0 * S::seg;
#pragma unroll
            for (int j = 0; j < S::per_thread; ++j) {
              if ((j * 128 + t) / 36 >= valid) v[j] = make_uint4(0u, 0u, 0u, 0u);
            }
            if (t == 0 && j0 + S::bufs < nsegs)
              bulk_raw<S::seg_bytes, true>(p, bt_row, tok_lo + (j0 + S::bufs) * S::seg, raw, &full[r]);
          } else if (j0 + S::bufs < nsegs) {
            copy_rows_fp8<S::per_warp>(p, raw, next, warp, lane);
            cp_async_arrive(&full[r]);
            if (j0 + S::bufs + 1 < nsegs)
              next = look_up<S::per_warp>(p, bt_row, tok_lo + (j0 + S::bufs + 1) * S::seg, tok_hi, warp, lane, 1);
          }
          // Warpgroup 0 is done with this stage's previous tile.
          if (h == 0 && g >= STAGES) bar_wait(&empty[g % STAGES], ((g - STAGES) / STAGES) & 1);
#pragma unroll
          for (int j = 0; j < S::per_thread; ++j) {
            const int item = j * 128 + t;
            store_widened(stage, h * S::seg + item / 36, item % 36, v[j]);
          }
        }
        fence_async_smem();  // the widened rows -> warpgroup 0's wgmma reads
        sm90_wgmma::bar_arrive(&ready[g % STAGES]);
      }
    }
    tiles_done += ntiles;
    ++pieces;
    cursor = piece_end;
    ++b;
  }
}

#else

template <bool QF16, int N, int STAGES>
__global__ void mla_decode_narrow_kernel(const __grid_constant__ Params p) {}

#endif

template <bool QF16, int N, int STAGES>
int launch_t(const Params& p, int programs, cudaStream_t stream) {
  constexpr int bytes = Layout<N, STAGES>::bytes;
  static_assert(bytes <= 227 * 1024, "shared memory");
  cudaError_t err = sm90::opt_in_shared_memory<mla_decode_narrow_kernel<QF16, N, STAGES>>(bytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  mla_decode_narrow_kernel<QF16, N, STAGES><<<dim3(1, programs), kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <int STAGES>
int launch_rows(const Params& p, bool fp16, int programs, cudaStream_t stream) {
  if (p.rows <= 16) {
    return fp16 ? launch_t<true, 16, STAGES>(p, programs, stream) : launch_t<false, 16, STAGES>(p, programs, stream);
  }
  return fp16 ? launch_t<true, 32, STAGES>(p, programs, stream) : launch_t<false, 32, STAGES>(p, programs, stream);
}

}  // namespace narrow

int launch_narrow(const Params& p, bool fp16, int stages, int programs, cudaStream_t stream) {
  return stages == 2 && p.tma ? narrow::launch_rows<2>(p, fp16, programs, stream)
                              : narrow::launch_rows<1>(p, fp16, programs, stream);
}

}  // namespace sm90_mla
}  // namespace fim
