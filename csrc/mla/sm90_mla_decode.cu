// Paged MLA decode on Hopper (sm_90a): the absorbed attention of one split-KV piece per CTA step, bf16, fp16 or
// FP8 (E4M3) pages of any page size, 64 (new token, head) rows per CTA, 64-token tiles.
//
// Two consumer warpgroups share the output's 512 latent columns (a [64, 512] fp32 accumulator would not fit one
// warpgroup's registers): consumer 0 computes the scores of a tile (Q [64, 576] . K^T, both from shared memory),
// runs the online softmax, writes P (bf16/fp16) and the rows' rescale factors to shared memory and adds P . V to
// output columns [0, 256); consumer 1 adds P . V to columns [256, 512). V is the tile's first 512 columns, read in
// place as wgmma's MN-major B operand. The tiles come in two stages; the copies of tile i + 2 are issued as soon
// as both consumers are done with tile i, by cp.async, one token row (1152 bytes) per warp step, so any page size
// (1 included) loads the same way, or (bf16/fp16 pages where the host asks for it) by TMA boxes that one warp
// issues. Below 64 tokens a page, a whole tile whose pages' block-table entries are consecutive (a run: a pool's slots
// handed out in order) comes as a page of 64 would, by TMA boxes or (FP8, adjacent pages) one bulk copy. Who loads:
// - bf16/fp16 pages, and FP8 pages of up to kWsMinRows rows: consumer 1, between its products;
// - FP8 pages of more rows: a third warpgroup, the producer (few registers), which also widens the FP8 tiles, so
//   that neither consumer has a copy or conversion on its chain; a tile of the one-tensor cache comes as bulk
//   copies where the host asks for them (one at pages of 64 tokens and more, else one a page: PAGED).
//
// Shared memory (128-byte swizzled, 8-row atoms of 1024 bytes): Q and each stage as [9 column blocks][64 rows]
// [64 columns]; P as [64 rows][64 tokens]. The schedule (which pieces of which sequences a CTA walks) is the one
// of flashinfer_moe/mla/plan_kernel.py, and split pieces write the same workspace the Triton kernel does, merged
// by the same combine kernel.
//
// FP8 pages: a tile's copies land as plain [64 rows][576 bytes] in the upper half of its stage; the loading
// warpgroup widens them to fp16 in place (E4M3 -> fp16 is exact) and signals the stage's `ready` barrier; the
// queries are scaled by the softmax scale into fp16 once per piece, the products run in fp16 and the pages' factor
// multiplies the scores and the output.
#include "mla/sm90_mla_common.cuh"

namespace fim {
namespace sm90_mla {

// Q, two stages, P, then rescale factors, row maxima and sums (64 floats each) and the barriers; 1024 bytes of
// slack to align the base to an atom.
constexpr int kOffP = 3 * kImage;
constexpr int kOffAlpha = kOffP + kRows * 128;
constexpr int kOffM = kOffAlpha + 256;
constexpr int kOffL = kOffM + 256;
constexpr int kOffBar = kOffL + 256;
constexpr int kSmem = kOffBar + 64 + 1024;

// The producer warpgroup for FP8 pages of more than kWsMinRows rows (on an H100, docs/perf-notes.md: 1.28-1.43x faster
// at page 64 with its bulk copies, 1.12-1.18x at page 1 from 128 rows; for bf16 pages it measured no faster).
constexpr int kThreadsWs = 384, kWsMinRows = 32;
// A CTA of 384 threads starts with 168 registers a thread and may hold no more in all (setmaxnreg.inc spins for
// ever past that); ptxas spills below these.
constexpr int kRegsProducer = 120, kRegsConsumer = 192;
static_assert(kRegsProducer * 128 + kRegsConsumer * 256 <= 168 * kThreadsWs, "past the CTA's registers at launch");

// Named barriers (0 is __syncthreads'): P written (wg 0 -> wg 1), P read (wg 1 -> wg 0), the consumers' epilogue,
// a new piece (all warpgroups), within the widening warpgroup (FP8), within warpgroup 0 (Q scaling).
constexpr int kBarPReady = 1, kBarPFree = 2, kBarEpilogue = 3, kBarPiece = 6;
constexpr int kBarWiden = 4, kBarQ = 5;
constexpr int kBarEmpty = 7;  // without the producer: stage read (wg 0 -> wg 1), cheaper than the mbarrier

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The loading warpgroup widens a landed FP8 tile to fp16 in the stage's swizzled image, in place: columns 0-255
// first (their image ends below the FP8 rows), then the rest, read into registers before anyone writes over the FP8
// rows. Rows from `valid` on become zeros (a bulk copy brought them from the page as it is). ROLLED: the first
// half a chunk at a time (the producer has few registers; consumer 1 widens on the consumers' chain, so unrolls).
template <bool ROLLED>
__device__ __forceinline__ void widen_tile(uint32_t stage, int t, int valid) {
  const uint32_t fp8 = stage + kFp8Off;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll(ROLLED ? 1 : 8)
  for (int j = 0; j < 8; ++j) {  // 64 rows x 16 chunks of 16 bytes
    const int item = j * 128 + t, r = item >> 4, q = item & 15;
    const uint4 v = sm90_wgmma::lds128(fp8 + r * kChunks * 8 + q * 16);
    store_widened(stage, r, q, r < valid ? v : zero);
  }
  uint4 rest[10];
#pragma unroll
  for (int j = 0; j < 10; ++j) {  // 64 rows x 20 chunks
    const int item = j * 128 + t, r = item / 20, q = 16 + item % 20;
    rest[j] = sm90_wgmma::lds128(fp8 + r * kChunks * 8 + q * 16);
    if (r >= valid) rest[j] = zero;
  }
  asm volatile("bar.sync %0, 128;" ::"r"(kBarWiden) : "memory");
#pragma unroll
  for (int j = 0; j < 10; ++j) {
    const int item = j * 128 + t, r = item / 20, q = 16 + item % 20;
    store_widened(stage, r, q, rest[j]);
  }
}

// A tile's block-table entries as the loading warpgroup's warps hold them: lane l those of the tile's tokens l and
// 32 + l (0 from `hi` on), so that each warp holds all 64, tells a run from them alone (no barrier), and passes each
// token row's entry to the lane that copies it. D of them, the tiles ahead: token rows of bf16/fp16 pages look them
// up two tiles before their copies, for the reason PagesAhead gives (sm90_mla_common.cuh, whose one entry a lane the
// narrow kernel keeps); FP8 pages (the producer, whose registers a lookahead pushed into spills, 3-4% slower at page
// 16) look up as they copy: D = 1, loaded just before.
template <int D>
struct TilePages {
  int lo[D], hi[D];

  __device__ __forceinline__ static int entry(const Params& p, const int32_t* bt_row, int tok, int end) {
    return tok < end ? bt_row[tok >> p.page_shift] : 0;
  }
  __device__ __forceinline__ void load(int d, const Params& p, const int32_t* bt_row, int t0, int end, int lane) {
    lo[d] = entry(p, bt_row, t0 + lane, end);
    hi[d] = entry(p, bt_row, t0 + 32 + lane, end);
  }
  // A piece's first D tiles from token t0 on (tiles kTile apart).
  __device__ __forceinline__ void start(const Params& p, const int32_t* bt_row, int t0, int end, int lane) {
#pragma unroll
    for (int d = 0; d < D; ++d) load(d, p, bt_row, t0 + d * kTile, end, lane);
  }
  // The front tile (at t0): whether it is a run (p.runs: whole, t0 + 64 <= end, and its pages' entries consecutive
  // from `first`, its first page), the same answer in every warp.
  __device__ __forceinline__ bool run(const Params& p, int t0, int end, int lane, int& first) const {
    first = __shfl_sync(0xffffffffu, lo[0], 0);
    const int s = p.page_shift;
    return t0 + kTile <= end &&
           __all_sync(0xffffffffu, lo[0] == first + (lane >> s) && hi[0] == first + ((32 + lane) >> s));
  }
  // The front tile's rows this lane copies (token 16 warp + lane % 16, as look_up's), through its warp's shuffle.
  __device__ __forceinline__ Rows rows(const Params& p, int t0, int end, int warp, int lane, int elem) const {
    const int k = warp * 16 + (lane & 15);
    const int page = __shfl_sync(0xffffffffu, warp < 2 ? lo[0] : hi[0], k & 31);
    return rows_at(p, page, t0 + k, end, elem);
  }
  // The front tile done: the others move up, and the tile D on (at t0 + D * kTile) is looked up in its place.
  __device__ __forceinline__ void advance(const Params& p, const int32_t* bt_row, int t0, int end, int lane) {
#pragma unroll
    for (int d = 0; d + 1 < D; ++d) {
      lo[d] = lo[d + 1];
      hi[d] = hi[d + 1];
    }
    load(D - 1, p, bt_row, t0 + D * kTile, end, lane);
  }
};

// A run tile of bf16/fp16 pages by TMA, through the run maps: a box of 64 columns x the whole tile's 64 rows per
// column block (9), issued by the copier warp's first lanes; every other thread of the loading warpgroup arrives on
// `bar` (initialized for the 128 arrivals of token rows).
__device__ __forceinline__ void tma_run_tile(const Params& p, int first, uint32_t stage, uint64_t* bar, bool copier,
                                             int lane) {
  if (copier) {
    if (lane == 0) sm90_wgmma::bar_expect_tx(bar, kTile * kChunks * 16);
    __syncwarp();
    const bool once = read_once(p);
    if (lane < 8) tile_box(stage + lane * kBlock, &p.map_ckv, bar, lane * 64, 0, first, once);
    if (lane == 8) tile_box(stage + 8 * kBlock, &p.map_kpe, bar, 0, 0, first, once);
  }
  if (!copier || lane != 0) sm90_wgmma::bar_arrive(bar);
}

// The loading warpgroup: a tile into its stage, by TMA boxes (bf16/fp16) or bulk copies (FP8: one a tile, or with
// PAGED one a page, for pages below 64 tokens), issued by one warp, or by cp.async token rows (the whole warpgroup),
// run tiles (p.runs) excepted. With token rows of bf16/fp16 pages the tiles' block-table entries come from `ahead`,
// looked up two tiles before (a piece's tiles are issued in order).
template <bool FP8, bool PAGED>
__device__ __forceinline__ void issue_tile(const Params& p, const int32_t* bt_row, int t0, int hi, uint32_t stage,
                                           uint64_t* bar, bool tma, bool copier, int warp, int lane,
                                           TilePages<2>& ahead) {
  if (tma) {
    if constexpr (FP8) {
      if constexpr (PAGED) {
        if (copier) bulk_pages(p, bt_row, t0, hi, stage + kFp8Off, bar, lane);
      } else if (copier && lane == 0) {
        bulk_raw(p, bt_row, t0, stage + kFp8Off, bar);
      }
    } else if (copier) {
      tma_tile(p, bt_row, t0, hi, stage, bar, lane);
    }
    return;
  }
  int first;
  if constexpr (FP8) {
    TilePages<1> now;
    now.load(0, p, bt_row, t0, hi, lane);
    if (!PAGED && p.runs && now.run(p, t0, hi, lane, first)) {
      // The tile's 64 rows, adjacent in the pool (the host's condition): one bulk copy, as from a page of 64 (not by
      // bulk_raw, which reads the first entry again: the producer spilled 12 bytes more with it).
      if (copier && lane == 0) {
        sm90_wgmma::bar_expect_tx(bar, kRaw);
        tile_bulk(stage + kFp8Off, static_cast<const char*>(p.ckv) + static_cast<int64_t>(first) * p.ckv_p, kRaw, bar,
                  false);
      } else {
        sm90_wgmma::bar_arrive(bar);
      }
      return;
    }
    copy_rows_fp8(p, stage + kFp8Off, now.rows(p, t0, hi, warp, lane, 1), warp, lane);
  } else {
    const bool run = p.runs && ahead.run(p, t0, hi, lane, first);
    const Rows rows = ahead.rows(p, t0, hi, warp, lane, 2);
    ahead.advance(p, bt_row, t0, hi, lane);
    if (run) {
      tma_run_tile(p, first, stage, bar, copier, lane);
      return;
    }
    copy_rows(p, stage, rows, warp, lane);
  }
  cp_async_arrive(bar);
}

// The loading warpgroup, once tile g has landed: FP8 pages are widened (then `ready`); a piece's partial last tile
// that came by TMA or bulk copy has its rows past the sequence's end cleared (bf16/fp16: then `tail`): the copies
// take a page as it is, and P's zeros there would still meet whatever the page holds (0 x NaN is not 0).
template <bool FP8, bool WS>
__device__ __forceinline__ void prepare_tile(uint32_t base, uint64_t* full, uint64_t* ready, uint64_t* tail, uint32_t g,
                                             bool last_partial, int valid, int t) {
  if (!FP8 && !last_partial) return;
  const uint32_t s = g & 1, stage = base + (1 + s) * kImage;
  bar_wait(&full[s], (g >> 1) & 1);
  if constexpr (FP8) {
    widen_tile<WS>(stage, t, last_partial ? valid : kTile);
  } else {
    zero_rows(stage, valid, t);
  }
  fence_async_smem();  // these stores -> the consumers' wgmma reads
  sm90_wgmma::bar_arrive(FP8 ? &ready[s] : tail);
}

// With the producer: a consumer warp is done reading a stage; its lane 0 arrives on the stage's `empty` barrier
// (8 warps a phase), which the producer waits on before it refills the stage.
__device__ __forceinline__ void release_stage(uint64_t* empty, int lane) {
  if (lane == 0) sm90_wgmma::bar_arrive(empty);
}

// A new piece: once every warpgroup is done with the last one (Q and both stages), the loading warpgroup issues
// the piece's first two tiles and every thread its share of Q.
template <typename T, bool FP8, bool PAGED, int CTA>
__device__ __forceinline__ void begin_piece(const Params& p, const Piece& pc, const int32_t* bt_row, uint32_t base,
                                            uint64_t* full, uint64_t* qbar, uint32_t tiles_done, int b, int rb,
                                            bool loads, bool tma, bool copier, int tid, TilePages<2>& ahead) {
  asm volatile("bar.sync %0, %1;" ::"r"(kBarPiece), "n"(CTA) : "memory");
  const int warp = (tid & 127) >> 5, lane = tid & 31;
  if (!FP8 && loads && !tma) ahead.start(p, bt_row, pc.tok_lo, pc.tok_hi, lane);
  for (int i = 0; loads && i < 2 && i < pc.ntiles; ++i) {
    const uint32_t s = (tiles_done + i) & 1;
    issue_tile<FP8, PAGED>(p, bt_row, pc.tok_lo + i * kTile, pc.tok_hi, base + (1 + s) * kImage, &full[s], tma, copier,
                           warp, lane, ahead);
  }
  copy_queries<T, kRows, CTA>(p, base, rb * kRows, b, tid);
  cp_async_arrive(qbar);
}

// A consumer's output rows r0 (a0) and r1 (a1) into the maxima's new frame.
__device__ __forceinline__ void rescale(float (&o)[128], float a0, float a1) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= a0;
    o[4 * j + 1] *= a0;
    o[4 * j + 2] *= a1;
    o[4 * j + 3] *= a1;
  }
}

// QF16: fp16 queries and output (else bf16). FP8: E4M3 pages, widened to fp16 in shared memory, the products in
// fp16 (queries scaled into fp16 first). p.tma: the tiles by TMA boxes (bf16/fp16) or bulk copies (FP8 with WS),
// else by cp.async. WS: a third warpgroup, the producer, makes the copies (and widens FP8 tiles, clears TMA tails), so
// that the consumers keep no copy or conversion instruction on their chain; else consumer 1 does that work between its
// products. PAGED (FP8 with WS, pages below 64 tokens): the bulk copies one a page.
template <bool QF16, bool FP8, bool WS, bool PAGED>
__global__ void __launch_bounds__(WS ? kThreadsWs : kThreads, 1) mla_decode_kernel(const __grid_constant__ Params p) {
  constexpr bool F16 = QF16 || FP8;  // the products' input type
  constexpr int kCta = WS ? kThreadsWs : kThreads;
  using T = typename std::conditional<QF16, __half, __nv_bfloat16>::type;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t s_q = base, s_p = base + kOffP;
  float* s_alpha = reinterpret_cast<float*>(smem + kOffAlpha);
  float* s_m = reinterpret_cast<float*>(smem + kOffM);
  float* s_l = reinterpret_cast<float*>(smem + kOffL);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kOffBar);  // [2] stages landed
  uint64_t* qbar = full + 2;
  uint64_t* ready = full + 3;  // [2] FP8: the stage widened
  uint64_t* tail = full + 5;   // TMA (bf16/fp16): a piece's last tile, if partial, cleared past the sequence's end
  uint64_t* empty = full + 6;  // [2] both consumers done with the stage (for the producer)

  // The warpgroup index through a shuffle, so that the compiler knows it is warp-uniform (else it serializes
  // the wgmma in the roles' branches).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), t = tid & 127, warp = t >> 5;
  const int lane = tid & 31;
  const int rb = blockIdx.x, prog = blockIdx.y;
  // bf16/fp16: TMA boxes; FP8 with the producer: a tile of the one-tensor cache as one bulk copy.
  const bool tma = (!FP8 || WS) && p.tma;
  // The warp that issues the TMA tiles (the producer's first, else consumer 1's), as a shuffled (warp-uniform)
  // flag: a branch on the plain warp index makes ptxas serialize the wgmma.
  const bool copier = __shfl_sync(0xffffffffu, tid >> 5, 0) == (WS ? 8 : 4);
  if (tid == 0) {
    bar_init(&full[0], tma ? 1 : 128);
    bar_init(&full[1], tma ? 1 : 128);
    bar_init(tail, 128);
    bar_init(qbar, kCta);
    bar_init(&ready[0], 128);
    bar_init(&ready[1], 128);
    bar_init(&empty[0], 8);
    bar_init(&empty[1], 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const Sched sc = sched_of(p, prog);
  int cursor = sc.begin, b = sc.first;
  uint32_t tiles_done = 0;  // tiles this CTA consumed so far: the stages' and barriers' phases
  uint32_t pieces = 0;
  uint32_t tails = 0;  // partial last tiles so far (TMA): the `tail` barrier's phase
  TilePages<2> ahead;  // token rows: the next two tiles' block-table entries (issue_tile)

  if (WS && wg == 2) {
    // The producer: tile i + 1 is prepared while the consumers work on tile i, and tile i + 2 issued into tile
    // i's stage once they are done with it.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegsProducer));
    while (cursor < sc.end) {
      const Piece pc = sc.piece(p, b, cursor);
      const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_b;
      const bool partial = tma && pc.ntiles > 0 && pc.tail_valid < kTile;
      begin_piece<T, FP8, PAGED, kCta>(p, pc, bt_row, base, full, qbar, tiles_done, b, rb, true, tma, copier, tid,
                                       ahead);
      for (int i = -1; i < pc.ntiles; ++i) {
        const uint32_t g = tiles_done + i, s = g & 1;
        if (i + 1 < pc.ntiles)
          prepare_tile<FP8, WS>(base, full, ready, tail, g + 1, partial && i + 2 == pc.ntiles, pc.tail_valid, t);
        if (i >= 0 && i + 2 < pc.ntiles) {
          bar_wait(&empty[s], (g >> 1) & 1);
          issue_tile<FP8, PAGED>(p, bt_row, pc.tok_lo + (i + 2) * kTile, pc.tok_hi, base + (1 + s) * kImage, &full[s],
                                 tma, copier, warp, lane, ahead);
        }
      }
      tiles_done += pc.ntiles;  // (consumer 0 alone counts pieces and tails for its waits)
      cursor = pc.piece_end;
      ++b;
    }
    return;
  }

  if constexpr (WS) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegsConsumer));
  // This thread's two accumulator rows (wgmma's fragment: warp w holds rows 16 w .. 16 w + 15).
  const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8;
  const int row0 = rb * kRows + r0, row1 = rb * kRows + r1;
  const int qi0 = row0 / p.heads, qi1 = row1 / p.heads;
  float kv_scale = 1.f;
  if constexpr (FP8) kv_scale = p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value;
  const float score_scale = FP8 ? kv_scale : p.qk_scale;  // FP8: the queries carry qk_scale

  while (cursor < sc.end) {
    const int splits = sc.splits[b];
    const Piece pc = sc.piece(p, b, cursor);
    const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_b;
    const bool partial = tma && pc.ntiles > 0 && pc.tail_valid < kTile;

    begin_piece<T, FP8, PAGED, kCta>(p, pc, bt_row, base, full, qbar, tiles_done, b, rb, !WS && wg == 1, tma, copier,
                                     tid, ahead);

    // Rows see tokens below vis (the causal diagonal among the new tokens, and the piece's end).
    int vis0 = 0, vis1 = 0;
    if (row0 < p.rows) vis0 = min(p.causal ? pc.length - p.s_q + 1 + qi0 : pc.length, pc.tok_hi);
    if (row1 < p.rows) vis1 = min(p.causal ? pc.length - p.s_q + 1 + qi1 : pc.length, pc.tok_hi);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    if (wg == 0) {
      bar_wait(qbar, pieces & 1);
      if constexpr (FP8) {
        scale_queries_f16<QF16, kRows>(s_q, p.qk_scale, t);
        asm volatile("bar.sync %0, 128;" ::"r"(kBarQ) : "memory");
      }
      for (int i = 0; i < pc.ntiles; ++i) {
        const uint32_t g = tiles_done + i, s = g & 1;
        const uint32_t stage = base + (1 + s) * kImage;
        if (!FP8 && partial && i + 1 == pc.ntiles) {
          bar_wait(tail, tails & 1);
        } else {
          bar_wait(FP8 ? &ready[s] : &full[s], (g >> 1) & 1);
        }
        fence_async_smem();  // cp.async (or the widening's) writes -> wgmma's reads
        float sc[32];
        const uint64_t dq = desc_k(s_q), dk = desc_k(stage);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < 9; ++kb)
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            const uint32_t off = kb * kBlock + kk * 32;
            mma_scores<F16>(sc, desc_at(dq, off), desc_at(dk, off), kb | kk);
          }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sc);

        // Online softmax in base 2; a row's 64 scores are spread over the 4 threads of a quad.
        const int t0 = pc.tok_lo + i * kTile;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = t0 + j * 8 + (lane & 3) * 2 + e;
            sc[4 * j + e] = tok < vis0 ? sc[4 * j + e] * score_scale : -INFINITY;
            sc[4 * j + 2 + e] = tok < vis1 ? sc[4 * j + 2 + e] * score_scale : -INFINITY;
            mx0 = fmaxf(mx0, sc[4 * j + e]);
            mx1 = fmaxf(mx1, sc[4 * j + 2 + e]);
          }
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
          mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
          mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        // Lazy maxima, decided per warp: they move only where a score passes them by more than 2^kSlack (P then
        // stays below 2^kSlack, far inside bf16 and fp16), so that most tiles leave the output unscaled.
        const bool move = __any_sync(0xffffffffu, mx0 > m0 + kSlack || mx1 > m1 + kSlack);
        float a0 = 1.f, a1 = 1.f;
        if (move) {
          const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
          a0 = exp2f(m0 - (n0 == -INFINITY ? 0.f : n0));
          a1 = exp2f(m1 - (n1 == -INFINITY ? 0.f : n1));
          m0 = n0;
          m1 = n1;
        }
        const float u0 = m0 == -INFINITY ? 0.f : m0, u1 = m1 == -INFINITY ? 0.f : m1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            sc[4 * j + e] = exp2f(sc[4 * j + e] - u0);
            sc[4 * j + 2 + e] = exp2f(sc[4 * j + 2 + e] - u1);
            sum0 += sc[4 * j + e];
            sum1 += sc[4 * j + 2 + e];
          }
        }
        l0 = l0 * a0 + sum0;
        l1 = l1 * a1 + sum1;

        if (g > 0) named_sync(kBarPFree);  // consumer 1 has read the previous P
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint32_t col = (j ^ (r0 & 7)) * 16 + (lane & 3) * 4;  // r0 & 7 == r1 & 7
          sm90_wgmma::sts(s_p + r0 * 128 + col, pack2<F16>(sc[4 * j], sc[4 * j + 1]));
          sm90_wgmma::sts(s_p + r1 * 128 + col, pack2<F16>(sc[4 * j + 2], sc[4 * j + 3]));
        }
        if ((lane & 3) == 0) {
          s_alpha[r0] = a0;
          s_alpha[r1] = a1;
        }
        fence_async_smem();  // P's stores -> both warpgroups' wgmma reads
        named_arrive(kBarPReady);

        if (move) rescale(o, a0, a1);
        const uint64_t dp = desc_k(s_p), dv = desc_mn(stage);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) mma_values<F16>(o, desc_at(dp, kk * 32), desc_at(dv, kk * 2048), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        if constexpr (WS) {
          release_stage(&empty[s], lane);
        } else {
          named_arrive(kBarEmpty);
        }
      }
      // The row sums were per thread: add the quad's.
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
      }
      if ((lane & 3) == 0) {
        s_m[r0] = m0;
        s_m[r1] = m1;
        s_l[r0] = l0;
        s_l[r1] = l1;
      }
    } else {
      if (!WS && pc.ntiles > 0)
        prepare_tile<FP8, WS>(base, full, ready, tail, tiles_done, partial && pc.ntiles == 1, pc.tail_valid, t);
      for (int i = 0; i < pc.ntiles; ++i) {
        const uint32_t g = tiles_done + i, s = g & 1;
        const uint32_t stage = base + (1 + s) * kImage;
        named_sync(kBarPReady);
        const float a0 = s_alpha[r0], a1 = s_alpha[r1];
        if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) rescale(o, a0, a1);
        const uint64_t dp = desc_k(s_p), dv = desc_mn(stage + 4 * kBlock);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) mma_values<F16>(o, desc_at(dp, kk * 32), desc_at(dv, kk * 2048), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        if constexpr (WS) {
          release_stage(&empty[s], lane);
        } else {
          named_sync(kBarEmpty);  // consumer 0 is done with this stage too
        }
        named_arrive(kBarPFree);
        if constexpr (!WS) {
          if (i + 2 < pc.ntiles)
            issue_tile<FP8, PAGED>(p, bt_row, pc.tok_lo + (i + 2) * kTile, pc.tok_hi, stage, &full[s], tma, copier,
                                   warp, lane, ahead);
          if (i + 1 < pc.ntiles)
            prepare_tile<FP8, WS>(base, full, ready, tail, g + 1, partial && i + 2 == pc.ntiles, pc.tail_valid, t);
        }
      }
    }
    named_sync(kBarEpilogue);  // row maxima and sums in shared memory
    const float fm0 = s_m[r0], fm1 = s_m[r1], fl0 = s_l[r0], fl1 = s_l[r1];
    const float inv0 = pc.ntiles > 0 && fl0 > 0.f ? kv_scale / fl0 : 0.f;  // FP8: the values' factor too
    const float inv1 = pc.ntiles > 0 && fl1 > 0.f ? kv_scale / fl1 : 0.f;
    const float lse0 = pc.ntiles > 0 && fl0 > 0.f ? fm0 + log2f(fl0) : -INFINITY;
    const float lse1 = pc.ntiles > 0 && fl1 > 0.f ? fm1 + log2f(fl1) : -INFINITY;
    const int col0 = wg * 256 + (lane & 3) * 2;
    if (splits == 1) {
      T* out = static_cast<T*>(p.out);
      const int h0 = row0 % p.heads, h1 = row1 % p.heads;
      T* o0 = out + b * p.o_b + qi0 * p.o_s + h0 * p.o_h + col0;
      T* o1 = out + b * p.o_b + qi1 * p.o_s + h1 * p.o_h + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (row0 < p.rows) *reinterpret_cast<uint32_t*>(o0 + j * 8) = pack2<QF16>(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        if (row1 < p.rows)
          *reinterpret_cast<uint32_t*>(o1 + j * 8) = pack2<QF16>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      }
      if (p.lse != nullptr && wg == 0 && (lane & 3) == 0) {
        constexpr float kLn2 = 0.6931471805599453f;
        if (row0 < p.rows) p.lse[b * p.l_b + qi0 * p.l_s + h0 * p.l_h] = lse0 * kLn2;
        if (row1 < p.rows) p.lse[b * p.l_b + qi1 * p.l_s + h1 * p.l_h] = lse1 * kLn2;
      }
    } else {
      const int64_t slot = sc.slot(b, pc.seq_start);
      float* o0 = p.part_out + (slot * p.rows + row0) * 512 + col0;
      float* o1 = p.part_out + (slot * p.rows + row1) * 512 + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (row0 < p.rows) *reinterpret_cast<float2*>(o0 + j * 8) = make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        if (row1 < p.rows)
          *reinterpret_cast<float2*>(o1 + j * 8) = make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      }
      if (wg == 0 && (lane & 3) == 0) {
        if (row0 < p.rows) p.part_lse[slot * p.rows + row0] = lse0;
        if (row1 < p.rows) p.part_lse[slot * p.rows + row1] = lse1;
      }
    }
    tiles_done += pc.ntiles;
    tails += partial;
    ++pieces;
    cursor = pc.piece_end;
    ++b;
  }
}

#else

template <bool QF16, bool FP8, bool WS, bool PAGED>
__global__ void mla_decode_kernel(const __grid_constant__ Params p) {}

#endif

template <bool QF16, bool FP8, bool WS, bool PAGED = false>
int launch(const Params& p, int row_blocks, int programs, cudaStream_t stream) {
  cudaError_t err = sm90::opt_in_shared_memory<mla_decode_kernel<QF16, FP8, WS, PAGED>>(kSmem);
  if (err != cudaSuccess) return static_cast<int>(err);
  mla_decode_kernel<QF16, FP8, WS, PAGED><<<dim3(row_blocks, programs), WS ? kThreadsWs : kThreads, kSmem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// One of the page tensors (ckv or kpe: `cols` columns, strides in elements) as the 3-D tensor {column, token in
// page, page} of 16-bit elements, in boxes of 64 columns x min(page, 64) tokens (runs: x 64 / page pages).
bool encode_pages(CUtensorMap* map, const void* base, int cols, int page, int64_t num_pages, int64_t page_stride,
                  int64_t token_stride, bool runs) {
  sm90::EncodeTiled fn = sm90::tensor_map_encoder();
  if (fn == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(page),
                              static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(token_stride) * 2, static_cast<cuuint64_t>(page_stride) * 2};
  // A page's tokens (at most a tile's), or with `runs` (pages below a tile) a whole tile of consecutive pages.
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(page < kTile ? page : kTile),
                             static_cast<cuuint32_t>(runs ? kTile / page : 1)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90_mla
}  // namespace fim

extern "C" {

// Strides in elements: q_nope, q_pe (b, s, h), ckv and kpe (page, token), block table (b), out (b, s, h), lse (b, s,
// h). fp8: E4M3 pages (latent and rope) dequantized by *kv_scale (a device pointer) or, where it is null,
// kv_scale_value; narrow (with fp8, up to 32 rows): the kernel of sm90_mla_decode_narrow.cu with that many fp16
// stages (1 or 2; 2 only where its tiles come by bulk copies), or 3: the one of sm90_mla_decode_narrow_rs.cu for bf16
// queries, else 2 stages. Returns a cudaError_t code.
int fim_sm90_mla_decode(const void* qn, const void* qp, const void* ckv, const void* kpe, const int32_t* block_table,
                        const int32_t* seq_lens, const int32_t* sched, float* part_out, float* part_lse, void* out,
                        float* lse, const int64_t* strides, int batch, int s_q, int heads, int page_shift,
                        int max_tokens, int causal, float qk_scale, int fp16, int fp8, const float* kv_scale,
                        float kv_scale_value, int narrow, int64_t num_pages, int flags, int programs,
                        cudaStream_t stream) {
  // flags: bit 0 the tiles by TMA boxes or bulk copies; bit 1 run tiles (Params::runs) where tiles come as token
  // rows; bit 2 the narrow kernel's values' product in FP8 (Params::pv8).
  const bool tma = flags & 1, runs = flags & 2, pv8 = flags & 4;
  fim::sm90_mla::Params p{};
  p.qn = qn;
  p.qp = qp;
  p.ckv = ckv;
  p.kpe = kpe;
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.sched = sched;
  p.part_out = part_out;
  p.part_lse = part_lse;
  p.out = out;
  p.lse = lse;
  int64_t* fields[] = {&p.qn_b,  &p.qn_s, &p.qn_h, &p.qp_b, &p.qp_s, &p.qp_h, &p.ckv_p, &p.ckv_t, &p.kpe_p,
                       &p.kpe_t, &p.bt_b, &p.o_b,  &p.o_s,  &p.o_h,  &p.l_b,  &p.l_s,   &p.l_h};
  for (int i = 0; i < 17; ++i) *fields[i] = strides[i];
  p.batch = batch;
  p.rows = s_q * heads;
  p.heads = heads;
  p.s_q = s_q;
  p.page_shift = page_shift;
  p.max_tokens = max_tokens;
  p.causal = causal;
  p.qk_scale = qk_scale;
  p.kv_scale = kv_scale;
  p.kv_scale_value = kv_scale_value;
  p.pv8 = pv8;
  const int page = 1 << page_shift;
  // The one-tensor cache (pages of whole 576-byte token rows, kpe the last 64 columns of ckv's), 16-byte aligned as
  // bulk copies and TMA need: FP8 pages come by bulk copies there.
  const bool one_tensor = p.ckv_t == 576 && p.kpe_t == 576 && p.kpe_p == p.ckv_p && p.ckv_p % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(ckv) % 16 == 0 &&
                          static_cast<const char*>(kpe) == static_cast<const char*>(ckv) + 512;
  const bool bulk = tma && one_tensor;
  if (fp8 && narrow && p.rows <= 32) {
    // Bulk copies of whole rows in one page, so pages of 64 tokens and more: a copy a page below that measured
    // 0.97-1.08x its token rows at page 16 (16-32 rows, an H100) and made ptxas spill. Two fp16 stages only with
    // bulk copies: with token rows into half-tile buffers it measured 0.81-0.85x one stage (an H200).
    p.tma = bulk && page >= fim::sm90_mla::kTile;
    // narrow 3: for bf16 queries the kernel without fp16 images (its tiles by TMA where its map encodes, else by
    // cp.async token rows); fp16 queries take two fp16 stages.
    if (narrow == 3 && !fp16) {
      p.tma = p.tma && fim::sm90_mla::encode_fp8_tiles(&p.map_ckv, ckv, page, num_pages, p.ckv_p, false);
      // Pages of 16 and 32 tokens, one-tensor cache: a copying warp's 16 rows (one page's) by TMA boxes (16-byte
      // aligned base and strides). Below 16 tokens a page, a warp's rows whose pages are consecutive would come the
      // same way, but telling them by a vote cost page 1's shuffled pools 1.04-1.11x (an H200): token rows there.
      p.runs = runs && page >= 16 && page < fim::sm90_mla::kTile && one_tensor &&
               fim::sm90_mla::encode_fp8_tiles(&p.map_ckv, ckv, page, num_pages, p.ckv_p, true);
      return fim::sm90_mla::launch_narrow_rs(p, programs, stream);
    }
    return fim::sm90_mla::launch_narrow(p, fp16, narrow == 3 ? 2 : narrow, programs, stream);
  }
  const int row_blocks = (p.rows + fim::sm90_mla::kRows - 1) / fim::sm90_mla::kRows;
  using fim::sm90_mla::launch;
  // FP8 run tiles as one bulk copy: a tile's 64 rows of consecutive pages lie contiguous where the one-tensor cache's
  // pages are adjacent.
  p.runs = fp8 && runs && page < fim::sm90_mla::kTile && one_tensor && p.ckv_p == 576LL * page;
  if (fp8 && p.rows > fim::sm90_mla::kWsMinRows) {
    p.tma = bulk;
    // Pages below 64 tokens: a bulk copy per page, in their own instance (the per-page loop, compiled into the
    // one-copy instance, cost it 2-3% on an H100).
    if (bulk && page < fim::sm90_mla::kTile) {
      return fp16 ? launch<true, true, true, true>(p, row_blocks, programs, stream)
                  : launch<false, true, true, true>(p, row_blocks, programs, stream);
    }
    return fp16 ? launch<true, true, true>(p, row_blocks, programs, stream)
                : launch<false, true, true>(p, row_blocks, programs, stream);
  }
  if (fp8) {
    return fp16 ? launch<true, true, false>(p, row_blocks, programs, stream)
                : launch<false, true, false>(p, row_blocks, programs, stream);
  }
  // The TMA path where its descriptors encode (else the cp.async copies, which take any layout).
  p.tma = tma && fim::sm90_mla::encode_pages(&p.map_ckv, ckv, 512, page, num_pages, p.ckv_p, p.ckv_t, false) &&
          fim::sm90_mla::encode_pages(&p.map_kpe, kpe, 64, page, num_pages, p.kpe_p, p.kpe_t, false);
  // Else, pages below a tile: the run maps (whole tiles of consecutive pages) for run tiles.
  p.runs = !p.tma && runs && page < fim::sm90_mla::kTile &&
           fim::sm90_mla::encode_pages(&p.map_ckv, ckv, 512, page, num_pages, p.ckv_p, p.ckv_t, true) &&
           fim::sm90_mla::encode_pages(&p.map_kpe, kpe, 64, page, num_pages, p.kpe_p, p.kpe_t, true);
  return fp16 ? launch<true, false, false>(p, row_blocks, programs, stream)
              : launch<false, false, false>(p, row_blocks, programs, stream);
}

}  // extern "C"
