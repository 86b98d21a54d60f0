// Hopper FP8 block-scaled grouped GEMM written directly in wgmma, TMA and mbarrier PTX (no CUTLASS).
//
//   out[rows of e] = (A[rows of e] * sa) @ (W[e] * sw)^T
//   A  [R, K] e4m3, row-major; sa [R, K / 128] fp32 (K-major)
//   W  [E, N, K] e4m3 (K-major), or packed for the 256-column tiles (w_packed); sw [E, N / 128, K / 128] fp32
//   out [R, N] bf16; rows that belong to no expert are never written
//
// or, for GEMM1 (W's rows [0, N / 2) the gate projection, [N / 2, N) the up projection), with the activation in
// the epilogue: out [R, N / 2] = act(gate, up) in bf16, fp32, or e4m3 with sa-style scales [R, N / 256] (one per
// row and 128 columns), which is GEMM2's input as it is; no [R, N] intermediate is written.
//
// Why a second kernel beside the CUTLASS one: its tiles are wider per warpgroup. Block scaling forces a
// promotion (scale and add into an fp32 accumulator) after every 128-deep K block, so a warpgroup holds the
// promoted accumulator and the wgmma accumulator in registers at once; CUTLASS's blockwise kernels stop at
// 64 x 128 per warpgroup. Here a warpgroup can own 64 x 256 and run it as two 128-column halves through one
// wgmma accumulator, which halves the shared-memory stages' activation bytes per FLOP and doubles the weight
// bytes in flight per stage (what decode, bound by weight bandwidth, needs).
//
// Structure: a persistent grid (one CTA per SM), three warpgroups per CTA. Warpgroup 0 gives its registers
// away; one warp of it runs the loads: lane 0 issues the TMA boxes of A and W into a ring of shared-memory
// stages, and every lane copies part of the stage's scales with cp.async (a column of K-major scales is one
// float per row, which a TMA box cannot be), all completing on the stage's mbarrier. Warpgroups 1 and 2 issue
// wgmma (m64n128k32, both operands from shared memory), promote, and store bf16 rows through a small staging
// buffer per warp with a row mask, so one TMA descriptor per operand serves every expert and rows of no
// expert are never written. Tiles are numbered expert by expert from the [E] counts on the device (each CTA
// scans them), so there is no host sync and no setup kernel, and a call can be captured in a CUDA graph.
//
// Four tile shapes: 128 x 128 (the warpgroups split the rows; each keeps two accumulators and promotes
// block kb - 1 while block kb runs), 64 x 256 (they split the columns, same scheme: decode-sized groups),
// 128 x 256 (they split the rows; each runs its two column halves in turn), and 128 x 256 in 64-column
// quarters (SUB = 64: two small accumulators, quarter q promoted while quarter q + 1 runs). The 128 x 256
// halves variant stores asynchronously instead (ASYNC): its rows are staged in ring stages it holds back from
// the producer and leave through the TMA while the next tile's mainloop runs. With an activation (GATED, the
// 256-column tiles only), a tile's W rows are 128 gate rows and the 128 matching up rows, interleaved in
// 64-row pieces (one TMA box through a 4-D view of W) so that every thread holds both values of each of its
// output columns (store_gated).

#include "sm90_launch.cuh"
#include "sm90_wgmma_common.cuh"
#include "sm90_wgmma_epilogue.cuh"

namespace fim {
namespace sm90_wgmma {

template <int BM, int BN, int STAGES>
struct Shape {
  static_assert((BM == 128 && (BN == 128 || BN == 256)) || (BM == 64 && BN == 256), "unsupported tile");
  // 128 x 256: each math warpgroup owns 64 x 256 and runs it as two 128-column halves through one accumulator;
  // otherwise each owns 64 x 128 with two accumulators.
  static constexpr bool kWide = BM == 128 && BN == 256;
  static constexpr int kABytes = BM * kBlockK;
  static constexpr int kBBytes = BN * kBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  // Per stage, beside the ring: the A scales of the tile's rows and the W scales of its 128-column blocks.
  static constexpr int kScaleFloats = BM + 4;  // two W scales, padded to keep 16-byte alignment
  // 1024 of slack to align the ring for the 128-byte swizzle, the barriers, the stage scales, per expert
  // the first m tile, the row count and the first row, then 1 KiB per math warp to stage its stores.
  // Last, two sets of 16 row maxima per math warp (the activation's FP8 output, 64-row tiles: see store_gated).
  static constexpr int kSmemBytes = 1024 + kPipeBytes + 2 * STAGES * 8 + STAGES * kScaleFloats * 4 +
                                    (3 * kMaxExperts + 4) * 4 + kMathWarps * 1024 + 2 * kMathWarps * 16 * 4;
  static_assert(kSmemBytes <= 232448, "more than an sm_90 CTA can opt in to");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ int rows_of(const Params& p, int e) {
  int rows = p.counts[e];
  if (!p.offsets) rows = rows < p.capacity ? rows : p.capacity;  // a count past capacity is clamped
  return rows > 0 ? rows : 0;
}

__device__ __forceinline__ int64_t first_row(const Params& p, int e) {
  return p.offsets ? int64_t(p.offsets[e]) : int64_t(e) * p.capacity;
}

// Tile t -> (expert, m tile, n tile). Tiles are numbered expert by expert; inside an expert they go in bands
// of `swizzle` tiles (n tiles for raster m, m tiles for raster n), so the tiles in flight share operands in L2.
__device__ __forceinline__ void locate(const Params& p, const int* tile_start, int n_tiles, int t, int& e, int& mi,
                                       int& ni) {
  const int key = t / n_tiles;
  e = last_at_or_before(tile_start, p.num_groups, key);  // the last expert whose first m tile is at or before key
  const int m_tiles = tile_start[e + 1] - tile_start[e];
  const int local = t - tile_start[e] * n_tiles;
  const int s = p.swizzle;
  if (p.raster == 2) {
    const int band = local / (s * n_tiles), r = local - band * s * n_tiles;
    const int h = min(s, m_tiles - band * s);
    mi = band * s + r % h;
    ni = r / h;
  } else {
    const int band = local / (s * m_tiles), r = local - band * s * m_tiles;
    const int w = min(s, n_tiles - band * s);
    ni = band * s + r % w;
    mi = r / w;
  }
}

struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  template <int STAGES>
  __device__ __forceinline__ void next() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// One 128-deep K block of a 64 x N tile (N = 128 with 64 accumulator registers, 64 with 32) as one wgmma
// group into `d`, A and W given by the descriptor low words of their first row in shared memory; the caller
// waits for it with wgmma_wait and fences `d`.
template <int R>
__device__ __forceinline__ void issue_group(float (&d)[R], uint32_t a_lo, uint32_t b_lo) {
  static_assert(R == 64 || R == 32, "64 x 128 or 64 x 64");
  fence_regs(d);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < kBlockK / 32; ++ks) {
    if constexpr (R == 64) {
      wgmma_m64n128k32(d, make_desc(a_lo + 2 * ks), make_desc(b_lo + 2 * ks), ks);
    } else {
      wgmma_m64n64k32(d, make_desc(a_lo + 2 * ks), make_desc(b_lo + 2 * ks), ks);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// `a_lo` and `b_lo`: descriptor low words of this warpgroup's A and W rows in stage 0.
template <int BM, int BN, int STAGES>
__device__ __forceinline__ int issue_block(float (&d)[64], uint64_t* full, Ring& r, uint32_t a_lo, uint32_t b_lo) {
  using S = Shape<BM, BN, STAGES>;
  const int stage = r.stage;
  bar_wait(&full[stage], r.phase);
  const uint32_t step = stage * (S::kStageBytes >> 4);
  issue_group(d, a_lo + step, b_lo + step);
  fence_regs(d);
  r.template next<STAGES>();
  return stage;
}

// Accumulator element i of a 64 x 128 wgmma tile sits at row (warp % 4) * 16 + lane / 4 + 8 * ((i / 2) % 2)
// and column 8 * (i / 4) + 2 * (lane % 4) + i % 2: elements with bit 1 set are the lower row. Columns 0-63
// (i < 32) take the scales `top`/`low`, columns 64-127 `top2`/`low2` (they differ for GEMM1's gate and up rows).
// `fin` is 64 registers of the promoted accumulator (a whole one, or a half of the 128 x 256 tile's).
__device__ __forceinline__ void promote(float* fin, float (&d)[64], float top, float low, float top2, float low2) {
  fence_regs(d);
#pragma unroll
  for (int i = 0; i < 64; ++i) fin[i] = fmaf(d[i], i < 32 ? ((i & 2) ? low : top) : ((i & 2) ? low2 : top2), fin[i]);
}

template <int BM, int BN, int STAGES, int SUB, bool ASYNC, bool GATED>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_block_grouped(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                      const __grid_constant__ CUtensorMap tma_out, const Params p) {
  using S = Shape<BM, BN, STAGES>;
  static_assert(SUB == 128 || (SUB == 64 && S::kWide), "64-column quarters exist for the 128 x 256 tile only");
  // GATED: GEMM1 with its activation (p.act) in the epilogue; a kernel of its own, so that the plain GEMM keeps
  // its registers.
  static_assert(!GATED || BN == 256, "the activation's epilogue needs 256-column tiles");
  constexpr bool gated = GATED;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + S::kPipeBytes);
  uint64_t* empty = full + STAGES;
  float* scales = reinterpret_cast<float*>(empty + STAGES);                     // [STAGES][BM + 2]
  int* tile_start = reinterpret_cast<int*>(scales + STAGES * S::kScaleFloats);  // [E + 1] first m tile
  int* expert_rows = tile_start + kMaxExperts + 4;  // [E] rows (clamped counts); +4 keeps 16-byte alignment
  int* expert_first = expert_rows + kMaxExperts;    // [E] first row

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;
  const int num_groups = p.num_groups;
  if (warp == 0) {
    const int per = (num_groups + 31) / 32, lo = min(lane * per, num_groups), hi = min(lo + per, num_groups);
    int mine = 0;
    for (int e = lo; e < hi; ++e) {
      const int rows = rows_of(p, e);
      expert_rows[e] = rows;
      expert_first[e] = static_cast<int>(first_row(p, e));
      mine += (rows + BM - 1) / BM;
    }
    int incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += v;
    }
    int at = incl - mine;
    for (int e = lo; e < hi; ++e) {
      tile_start[e] = at;
      at += (expert_rows[e] + BM - 1) / BM;
    }
    if (lane == 31) tile_start[num_groups] = incl;
  } else if (threadIdx.x == 32) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], 1 + 32);  // the TMA issuer's expect_tx, then each producer lane's scale copies
      bar_init(&empty[s], kMathWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  // Each role computes these itself, after giving away or taking registers: kept live across the split, they
  // were spilled in the 256-column kernels with an activation.
  auto tiling = [&](int& n_tiles, int& total, int& kblocks) {
    n_tiles = (p.n + BN - 1) / BN;
    total = tile_start[num_groups] * n_tiles;
    kblocks = p.k / kBlockK;
  };

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp != 0) return;
    int n_tiles, total, kblocks;
    tiling(n_tiles, total, kblocks);
    // One warp: lane 0 issues the TMA loads of a stage, every lane copies some of its scales (K-major scales
    // cannot be a TMA box: one column of them is one float per row).
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tma_a)) : "memory");
      if (!p.w_packed) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tma_w)) : "memory");
    }
    const int n_blocks = p.n / kBlockK;
    Ring r;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int e, mi, ni;
      locate(p, tile_start, n_tiles, t, e, mi, ni);
      const int rows = expert_rows[e], first = expert_first[e];
      const int a_row = first + mi * BM;
      // With an activation, the tile's 128 output columns take W rows ni * 128 + [0, 128) of the gate and the same
      // of the up projection, laid out per 128-row half as 64 gate rows, then their 64 up rows (store_gated).
      const int w_row = e * p.n + ni * (gated ? BN / 2 : BN);
      // Rows past the expert copy row 0's scale: their results are never stored. Rows, not pointers: this warp
      // runs on 40 registers.
      int sa_row[BM / 32];
#pragma unroll
      for (int j = 0; j < BM / 32; ++j) {
        const int row = mi * BM + lane + 32 * j;
        sa_row[j] = first + (row < rows ? row : 0);
      }
      const int sw_block = gated ? (lane == 0 ? ni : n_blocks / 2 + ni) : min(ni * BN / kBlockK + lane, n_blocks - 1);
      const float* sw_src = p.sw + (int64_t(e) * n_blocks + sw_block) * kblocks;
      // Packed W: the tile's first 32 KB piece (null without packed weights).
      const uint8_t* w_src = p.w_packed ? p.w_packed + int64_t((e * (p.n / BN) + ni) * kblocks) * S::kBBytes : nullptr;
      for (int kb = 0; kb < kblocks; ++kb) {
        bar_wait(&empty[r.stage], r.phase ^ 1);
        if (lane == 0) {
          uint8_t* dst = ring + r.stage * S::kStageBytes;
          bar_expect_tx(&full[r.stage], S::kStageBytes);
          tma_load(dst, &tma_a, &full[r.stage], kb * kBlockK, a_row);
          if (BN == 256 && w_src) {
            // The stage's W rows are 32 KB in a row, already in the swizzled order the shared memory needs (and,
            // with an activation, interleaved gate / up as below): one bulk copy moves them as they are. It
            // streamed 4-6% faster than the tensor TMA from the plain layout at decode sizes, and beat the
            // tensor TMA over the packed bytes at prefill sizes (docs/perf-notes.md).
            bulk_load(dst + S::kABytes, w_src + int64_t(kb) * S::kBBytes, S::kBBytes, &full[r.stage]);
          } else if constexpr (gated) {
            // One box for all four 64-row pieces: one instruction with a 256-row box streamed ~11% faster than
            // four of 64 rows (docs/perf-notes.md).
            tma_load_4d(dst + S::kABytes, &tma_w, &full[r.stage], kb * kBlockK, w_row / 64);
          } else {
            tma_load(dst + S::kABytes, &tma_w, &full[r.stage], kb * kBlockK, w_row);
          }
        }
        float* sc = scales + r.stage * S::kScaleFloats;
#pragma unroll
        for (int j = 0; j < BM / 32; ++j) cp_async_4(sc + lane + 32 * j, p.sa + int64_t(sa_row[j]) * kblocks + kb);
        if (lane < BN / kBlockK) cp_async_4(sc + BM + lane, sw_src + kb);
        cp_async_arrive(&full[r.stage]);
        r.template next<STAGES>();
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  int n_tiles, total, kblocks;
  tiling(n_tiles, total, kblocks);
  const int mw = wg - 1;
  const int wm = BM == 128 ? mw * 64 : 0;   // tile rows this warpgroup owns
  const int wn = BM == 128 ? 0 : mw * 128;  // tile columns this warpgroup owns
  const int row_in = wm + (warp % 4) * 16 + lane / 4;
  // Descriptor low words of this warpgroup's A and W rows in stage 0 (stage s adds s * kStageBytes / 16), and
  // the shared address of stage 0's scales: built once, so the loop only adds.
  const uint32_t ring_lo = desc_lo(smem_u32(ring));
  const uint32_t a_lo = ring_lo + ((wm * kBlockK) >> 4), b_lo = ring_lo + ((S::kABytes + wn * kBlockK) >> 4);
  const uint32_t sc_base = smem_u32(scales);
  const uint32_t store_stage = smem_u32(expert_first + kMaxExperts) + (warp - 4) * 1024;
  float* row_max = reinterpret_cast<float*>(expert_first + kMaxExperts + kMathWarps * 256);  // [2][8 warps][16]
  // With an activation the stage's two W scales are the gate's (slot 0: the first 64 columns of each 128-column
  // group) and the up's (slot 1: the other 64); without, one per 128-column group.
  Ring r;
  if constexpr (S::kWide) {
    // Each warpgroup owns 64 x 256. SUB = 128: two 128-column halves in turn through one accumulator. SUB = 64:
    // four 64-column quarters through two 32-register accumulators, quarter q promoted while quarter q + 1 runs.
    // The asynchronous epilogue (ASYNC): each math warp stages its 16 x 256 of the tile in the ring stages of
    // the tile's last kHold K blocks, which it keeps from the producer until the TMA has read them. The
    // release comes once the next tile's second block is issued (its first STAGES - kHold blocks load
    // meanwhile), so the stores overlap the next tile's mainloop instead of idling the tensor cores. Measured
    // slower for the quarters and for the 64 x 128-per-warpgroup tiles (docs/perf-notes.md), so those store in place.
    static_assert(!ASYNC || SUB == 128, "the asynchronous epilogue is built for the halves variant only");
    constexpr int kRegion = 16 * 256 * 2;  // a warp's rows (store_tile_async)
    constexpr int kPerStage = S::kStageBytes / kRegion;
    constexpr int kHold = (kMathWarps + kPerStage - 1) / kPerStage;
    static_assert(kHold <= 2 && kHold + 2 <= STAGES, "the held stages must leave the next tile two to load into");
    const bool async_out = ASYNC && kblocks >= kHold && p.out_kind != kOutF32;
    const int release_at = kblocks > 1 ? 1 : 0;
    const int mwarp = warp - 4;
    // Stages a byte each: `held` collects this tile's, `copying` (with kCopying set) the previous tile's until
    // they are released, which may come after this tile has begun holding.
    constexpr uint32_t kCopying = 1u << 31;
    uint32_t held = 0, copying = 0;
    // Whether block kb's stage is held for the epilogue (else the caller hands it back).
    auto hold = [&](int kb, int stage) {
      const int j = kb - (kblocks - kHold);
      if (!async_out || j < 0) return false;
      held |= uint32_t(stage) << (8 * j);
      return true;
    };
    auto release = [&]() {
      if (!(copying & kCopying)) return;
      bulk_wait_read();
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < kHold; ++j) bar_arrive(&empty[(copying >> (8 * j)) & 0xff]);
      }
      copying = 0;
    };
    float fin[128];
    [[maybe_unused]] float acc[64], acc0[32], acc1[32];
    // Adds quarter q's product (complete in `d`) into the promoted accumulator.
    [[maybe_unused]] auto add = [&](float (&d)[32], int q, float s_top, float s_low) {
      fence_regs(d);
#pragma unroll
      for (int i = 0; i < 32; ++i) fin[32 * q + i] = fmaf(d[i], (i & 2) ? s_low : s_top, fin[32 * q + i]);
    };
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int e, mi, ni;
      locate(p, tile_start, n_tiles, t, e, mi, ni);
      const int rows = expert_rows[e];
      const int64_t first = expert_first[e];
#pragma unroll
      for (int i = 0; i < 128; ++i) fin[i] = 0.f;
      for (int kb = 0; kb < kblocks; ++kb) {
        const int stage = r.stage;
        bar_wait(&full[stage], r.phase);
        const uint32_t step = stage * (S::kStageBytes >> 4), sc = sc_base + stage * S::kScaleFloats * 4;
        const uint32_t a = a_lo + step, b = b_lo + step;
        // Scales first: their shared-memory latency then hides behind the first group's issue.
        const float sa_top = lds(sc + 4 * row_in), sa_low = lds(sc + 4 * (row_in + 8));
        if constexpr (SUB == 64) {
          const uint32_t quarter = (64 * kBlockK) >> 4;
          // Quarters 1 and 2 swap their W scales with an activation (gate, up, gate, up instead of two
          // quarters per 128-row block).
          const float w0 = lds(sc + 4 * BM), w1 = lds(sc + 4 * (BM + 1));
          const float w_q1 = gated ? w1 : w0, w_q2 = gated ? w0 : w1;
          issue_group(acc0, a, b);
          issue_group(acc1, a, b + quarter);
          wgmma_wait<1>();
          add(acc0, 0, sa_top * w0, sa_low * w0);
          issue_group(acc0, a, b + 2 * quarter);
          wgmma_wait<1>();
          add(acc1, 1, sa_top * w_q1, sa_low * w_q1);
          issue_group(acc1, a, b + 3 * quarter);
          wgmma_wait<1>();
          add(acc0, 2, sa_top * w_q2, sa_low * w_q2);
          // The block's last quarter is not overlapped: ptxas serializes every wgmma of the kernel when a
          // group stays in flight across this loop's back edge here.
          wgmma_wait<0>();
          add(acc1, 3, sa_top * w1, sa_low * w1);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float w = lds(sc + 4 * (BM + (gated ? 0 : h))), w2 = lds(sc + 4 * (BM + (gated ? 1 : h)));
            const float s_top = sa_top * w, s_low = sa_low * w, s_top2 = sa_top * w2, s_low2 = sa_low * w2;
            issue_group(acc, a, b + h * ((128 * kBlockK) >> 4));
            if (h == 0 && kb == release_at) release();
            wgmma_wait<0>();
            promote(fin + 64 * h, acc, s_top, s_low, s_top2, s_low2);
          }
        }
        if (!hold(kb, stage) && lane == 0) bar_arrive(&empty[stage]);
        r.template next<STAGES>();
      }
      const int row0 = mi * BM + wm + (warp % 4) * 16, col0 = ni * BN;
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (first + row0) * p.n + col0;
      if (async_out) {
        // Both warpgroups must be done reading the held stages before either writes into them.
        asm volatile("bar.sync 1, 256;" ::: "memory");
        const uint32_t stage = (held >> (8 * (mwarp / kPerStage))) & 0xff;
        const uint32_t region = smem_u32(ring) + stage * S::kStageBytes + (mwarp % kPerStage) * kRegion;
        if constexpr (gated) {
          store_gated_async(fin, p, region, &tma_out, first + row0, ni * 128, ni, rows - row0, lane);
        } else {
          store_tile_async(fin, region, &tma_out, dst, p.n, static_cast<int>(first) + row0, col0, rows - row0,
                           p.n - col0, lane);
        }
        copying = held | kCopying;
        held = 0;
      } else if constexpr (gated) {
        store_gated<128>(fin, p, first + row0, ni * 128, ni, rows - row0, store_stage, lane, nullptr, nullptr, 0, true);
      } else {
        store_tile<kOutBf16, 32>(fin, dst, p.n, rows - row0, p.n - col0, store_stage, lane);
      }
    }
    release();
    bulk_wait_all();  // the kernel is done when its rows are written
    return;
  }
  float fin[64], acc0[64], acc1[64];
  // Promotes the block held in stage `st` (its wgmma group complete) and hands the stage back. The stage goes back
  // before the promotion, once its scales are in registers: the next load starts that much sooner, which
  // streamed decode-sized groups up to 4-7% faster (docs/perf-notes.md). (The 128-row tiles, bound by the tensor
  // cores' clock under the board's power limit, measured slower with it and keep their late release.)
  auto finish = [&](float (&d)[64], int st) {
    const uint32_t sc = sc_base + st * S::kScaleFloats * 4;
    const float w = lds(sc + 4 * (BM + (gated ? 0 : wn / kBlockK)));
    const float w2 = lds(sc + 4 * (BM + (gated ? 1 : wn / kBlockK)));
    const float top = lds(sc + 4 * row_in), low = lds(sc + 4 * (row_in + 8));
    __syncwarp();  // every lane's scales read before lane 0 releases the stage for the warp
    if (lane == 0) bar_arrive(&empty[st]);
    promote(fin, d, top * w, low * w, top * w2, low * w2);
  };
  int parity = 0;  // which set of row_max this tile uses
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int e, mi, ni;
    locate(p, tile_start, n_tiles, t, e, mi, ni);
    const int rows = expert_rows[e];
    const int64_t first = expert_first[e];

#pragma unroll
    for (int i = 0; i < 64; ++i) fin[i] = 0.f;

    // Block kb is issued into one accumulator while block kb - 1, in the other, is promoted.
    int st0 = issue_block<BM, BN, STAGES>(acc0, full, r, a_lo, b_lo), st1;
    int kb = 1;
#pragma unroll 1
    for (; kb + 1 < kblocks; kb += 2) {
      st1 = issue_block<BM, BN, STAGES>(acc1, full, r, a_lo, b_lo);
      wgmma_wait<1>();
      finish(acc0, st0);
      st0 = issue_block<BM, BN, STAGES>(acc0, full, r, a_lo, b_lo);
      wgmma_wait<1>();
      finish(acc1, st1);
    }
    if (kb < kblocks) {
      st1 = issue_block<BM, BN, STAGES>(acc1, full, r, a_lo, b_lo);
      wgmma_wait<1>();
      finish(acc0, st0);
      wgmma_wait<0>();
      finish(acc1, st1);
    } else {
      wgmma_wait<0>();
      finish(acc0, st0);
    }
    const int row0 = mi * BM + wm + (warp % 4) * 16, col0 = ni * BN + wn;
    if constexpr (gated) {
      // 64-row tiles: the warps 4 apart hold the same rows (warpgroups split the columns).
      const int mwarp = warp - 4;
      float* sets = row_max + parity * kMathWarps * 16;
      store_gated<64>(fin, p, first + row0, ni * 128 + wn / 2, ni, rows - row0, store_stage, lane,
                      BM == 64 ? sets + mwarp * 16 : nullptr, sets + (mwarp ^ 4) * 16, 2 + warp % 4,
                      BM == 128 || mw == 0);
      parity ^= 1;
    } else {
      store_tile<kOutBf16, 16>(fin, static_cast<__nv_bfloat16*>(p.out) + (first + row0) * p.n + col0, p.n, rows - row0,
                               p.n - col0, store_stage, lane);
    }
  }
}

#else

template <int BM, int BN, int STAGES, int SUB, bool ASYNC, bool GATED>
__global__ void fp8_block_grouped(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                                  const __grid_constant__ CUtensorMap, const Params) {}

#endif

// ---------------------------------------------------------------------------------------------- host side

// An e4m3 operand [outer, K], read a 128-deep K block of `box_outer` rows at a time.
bool encode_operand(CUtensorMap* map, const void* base, uint64_t k, uint64_t outer, uint32_t box_outer) {
  return sm90::encode_2d(map, base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, outer, kBlockK, box_outer,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// GEMM1's weights [E, N, K] (N = 2 I: gate rows, then up rows) as a 4-D tensor {K, 64 rows, gate or up, 64-row
// block of [E * N]}, so that one box {128, 64, 2, 2} at block b brings rows 64 b + [0, 64) of the gate, the same
// rows of the up projection (I rows on), then the next 64 of each: the interleaved order store_gated expects.
bool encode_gated_weights(CUtensorMap* map, const void* base, uint64_t k, uint64_t n, uint64_t num_groups) {
  sm90::EncodeTiled fn = sm90::tensor_map_encoder();
  if (!fn) return false;
  const cuuint64_t dims[4] = {k, 64, 2, num_groups * n / 64};
  const cuuint64_t strides[3] = {k, (n / 2) * k, 64 * k};
  const cuuint32_t box[4] = {kBlockK, 64, 2, 2};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int BM, int BN, int STAGES, int SUB, bool ASYNC, bool GATED>
int start(const CUtensorMap& map_a, const CUtensorMap& map_w, const CUtensorMap& map_out, const Params& p, int sm_count,
          cudaStream_t stream) {
  using S = Shape<BM, BN, STAGES>;
  constexpr auto kernel = fp8_block_grouped<BM, BN, STAGES, SUB, ASYNC, GATED>;
  const cudaError_t err = sm90::opt_in_shared_memory<kernel>(S::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<sm_count, kThreads, S::kSmemBytes, stream>>>(map_a, map_w, map_out, p);
  return cudaGetLastError();
}

template <int BM, int BN, int STAGES, int SUB, bool ASYNC>
int run(const void* a, const float* a_scale, const void* w, const float* w_scale, void* out, const int32_t* counts,
        const int32_t* offsets, int capacity, int num_groups, int rows, int n, int k, int swizzle, int raster, int act,
        float alpha, float limit, float* out_scale, int out_kind, int w_packed, int sm_count, cudaStream_t stream) {
  using S = Shape<BM, BN, STAGES>;
  if (num_groups < 1 || num_groups > kMaxExperts || rows < 0 || n < kBlockK || k < kBlockK || n % kBlockK ||
      k % kBlockK || sm_count < 1 || !sm90::valid_order(swizzle, raster) || (!offsets && capacity < 0)) {
    return cudaErrorInvalidValue;
  }
  // An activation needs 256-column tiles (one 128-column output group each) and N = 2 I with I a multiple of
  // 128; without one the output is bf16.
  const bool gated = act != kActNone;
  if (act < kActNone || act > kActClampedSilu || out_kind < kOutBf16 || out_kind > kOutE4m3 ||
      (gated && (BN != 256 || n % 256)) || (!gated && out_kind != kOutBf16) ||
      ((out_kind == kOutE4m3) != (out_scale != nullptr)) || (w_packed && (BN != 256 || n % 256))) {
    return cudaErrorInvalidValue;
  }
  // Packed W: its 32 KB pieces are numbered in 32 bits.
  const int64_t packed_pieces = int64_t(num_groups) * (n / 256) * (k / kBlockK);
  if (int64_t(num_groups) * n >= (int64_t(1) << 31) || int64_t(num_groups) * capacity >= (int64_t(1) << 31) ||
      (w_packed && packed_pieces >= (int64_t(1) << 31))) {
    return cudaErrorInvalidValue;  // TMA coordinates and first rows are 32-bit
  }
  if (rows == 0) return cudaSuccess;
  CUtensorMap map_a, map_w, map_out{};
  // The asynchronous epilogue's output boxes: 16 rows of 128 bytes (64 bf16 or 128 e4m3 columns); fp32 output
  // is stored in place.
  const uint64_t out_cols = gated ? n / 2 : n;
  const bool out_map = ASYNC && out_kind != kOutF32;
  const bool fp8_out = out_kind == kOutE4m3;
  if (!encode_operand(&map_a, a, k, rows, BM) ||
      !(w_packed || (gated ? encode_gated_weights(&map_w, w, k, n, num_groups)
                           : encode_operand(&map_w, w, k, uint64_t(num_groups) * n, BN))) ||
      (out_map &&
       !sm90::encode_2d(&map_out, out, fp8_out ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                        fp8_out ? 1 : 2, out_cols, rows, fp8_out ? 128 : 64, 16, CU_TENSOR_MAP_L2_PROMOTION_NONE))) {
    return cudaErrorInvalidValue;
  }
  Params p{a_scale,
           w_scale,
           out,
           out_scale,
           counts,
           offsets,
           capacity,
           num_groups,
           n,
           k,
           swizzle,
           raster == 0 ? 1 : raster,
           act,
           out_kind,
           alpha,
           limit,
           w_packed ? static_cast<const uint8_t*>(w) : nullptr};
  if constexpr (BN == 256) {
    if (gated) return start<BM, BN, STAGES, SUB, ASYNC, true>(map_a, map_w, map_out, p, sm_count, stream);
  }
  return start<BM, BN, STAGES, SUB, ASYNC, false>(map_a, map_w, map_out, p, sm_count, stream);
}

}  // namespace sm90_wgmma
}  // namespace fim

#define FIM_SM90_WGMMA_EXPORT(NAME, BM, BN, STAGES, SUB, ASYNC)                                                       \
  extern "C" int fim_sm90_fp8_block_wgmma_##NAME(                                                                     \
      const void* a, const float* a_scale, const void* w, const float* w_scale, void* out, const int32_t* counts,     \
      const int32_t* offsets, int capacity, int num_groups, int rows, int n, int k, int swizzle, int raster, int act, \
      float alpha, float limit, float* out_scale, int out_kind, int w_packed, int sm_count, void* stream) {           \
    return fim::sm90_wgmma::run<BM, BN, STAGES, SUB, ASYNC>(                                                          \
        a, a_scale, w, w_scale, out, counts, offsets, capacity, num_groups, rows, n, k, swizzle, raster, act, alpha,  \
        limit, out_scale, out_kind, w_packed, sm_count, static_cast<cudaStream_t>(stream));                           \
  }

// The asynchronous epilogue only where it measured faster (docs/perf-notes.md): 128 x 256 in halves.
FIM_SM90_WGMMA_EXPORT(m128n128, 128, 128, 6, 128, false)
FIM_SM90_WGMMA_EXPORT(m64n256, 64, 256, 5, 128, false)
FIM_SM90_WGMMA_EXPORT(m128n256, 128, 256, 4, 128, true)
FIM_SM90_WGMMA_EXPORT(m128n256s64, 128, 256, 4, 64, false)
