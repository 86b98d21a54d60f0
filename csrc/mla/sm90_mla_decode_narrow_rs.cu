// Paged MLA decode on Hopper (sm_90a) for FP8 (E4M3) pages, bf16 queries and at most 32 (new token, head) rows: the
// narrow kernel's products (sm90_mla_decode_narrow.cu) without its fp16 image of each tile, whose writing and reading
// were most of that kernel's shared-memory traffic:
//   scores^T [64 tokens, 2N] = tile [64, 576] . [Q_hi; Q_lo]^T   FP8 wgmma, both operands in shared memory (16 rows)
//   scores [2N, 64 tokens]   = [Q_hi; Q_lo] . tile^T              FP8 wgmma, the queries' parts in registers (32 rows)
//   out^T [512, N]          += tile^T [512, 64] . P^T            fp16 wgmma, A widened from the FP8 bytes in registers
//                                                                 or (17-32 rows, PV8) FP8 wgmma, P^T in E4M3 and A the
//                                                                 FP8 bytes as they lie
// Q_hi and Q_lo are the bf16 queries (times a power of two per row) rounded to E4M3 and the remainder times 16:
// a bf16 value's 8 significant bits leave a remainder of at most 8 units of its last place, which E4M3 holds
// exactly, so Q_hi + Q_lo / 16 is the query itself and the scores take the FP8 tensor cores at no cost in accuracy
// (the softmax scale multiplies the fp32 scores). fp16 queries (11 significant bits) stay on the other kernel.
//
// Three warpgroups. The copying one (its registers given to the others) brings each tile into one of five buffers as
// a 128-byte swizzled [5 column blocks][64 rows][128 bytes] image (latent columns 0-511, then 448-575 for the rope): by
// TMA from one thread where the one-tensor cache's pages hold whole tiles, by TMA from each warp's lane 0 for its 16
// rows at pages of 16 and 32 tokens (one-tensor cache), else by cp.async token rows. The scoring one computes the
// scores and the online softmax and hands P^T and the rescale factors to the output warpgroup through two slots (four
// at 32 rows). The output warpgroup reads the tile's latent columns with ldmatrix.trans (tokens along wgmma's K side),
// widens them to fp16 in registers (E4M3 -> fp16 is exact) and accumulates the output, then frees the tile and the
// slot, so the scoring works on tile i + 1 while the output works on tile i (score_cols at 16 rows, score_rows at 32).
// Same schedule, workspace and combine as the other decode kernels.
#include "mla/sm90_mla_common.cuh"

namespace fim {
namespace sm90_mla {
namespace narrow_rs {

constexpr int kTileBytes = 5 * kBlock;                // [5 column blocks][64 rows][128 bytes]
constexpr int kRopeCol = 448;                         // the fifth block's first column: its bytes 64-127 are the rope
constexpr int kBarMax = 6, kBarQ = 8, kBarOut = 10;   // named barriers
constexpr int kBarTail = 11;                          // within the output warpgroup: a partial tile's tail cleared
constexpr int kScore = 0, kCopy = 2, kThreads = 384;  // the warpgroups (1: the output)
// P^T in E4M3 (PV8): the running maxima move where a score passes them by more than 2^kSlackPv8, and P^T is taken
// times 2^kShiftPv8 (at most 256, inside E4M3's 448), so that its values down to 2^-11 of the maxima keep their three
// mantissa bits (else most of a long sequence's weight would lie among subnormals and zeros).
constexpr float kSlackPv8 = 3.f, kShiftPv8 = 5.f;

// Q's FP8 parts [5 blocks][2N rows][128 bytes] (16 rows; at 32 they are the scoring warpgroup's registers), the tile
// buffers, P^T [kSlots][N rows][64 tokens], the rescale factors [kSlots][N], the maxima exchange [2][4][N] and the sums
// [4][N] (16 rows), the output factors [2][N], Q's row factors [N], the slots' flags [kSlots][4], barriers; 1024 bytes
// of slack for alignment. The queries are read from global memory where they are split, so the tile buffers take the
// rest: 5.
template <int N>
struct Layout {
  static constexpr int kStages = 5;
  // P^T and its factors, handed from the scoring warpgroup to the output one (four at 32 rows: 1.01-1.05x three at
  // page 64 on an H200, five no faster; 16 rows have room for two beside their five tile buffers)
  static constexpr int kSlots = N == 32 ? 4 : 2;
  static constexpr int q_block = 2 * N * 128;
  static constexpr int raw = N == 32 ? 0 : 5 * q_block;
  static constexpr int p = raw + kStages * kTileBytes;
  static constexpr int alpha = p + kSlots * N * 128;
  static constexpr int red = alpha + kSlots * N * 4;
  static constexpr int sums = red + 2 * 4 * N * 4;
  static constexpr int inv = sums + 4 * N * 4;
  static constexpr int rinv = inv + 2 * N * 4;
  static constexpr int moved = rinv + N * 4;  // [slot][4]: did the tile move the maxima (at 32 rows: a warp's rows')
  static constexpr int bars = moved + 16 * kSlots;
  static constexpr int bytes = bars + 8 * (2 * kStages + 2 * kSlots) + 1024;
  static_assert(raw % 1024 == 0 && p % 1024 == 0 && bars % 8 == 0, "swizzled operands start at an atom");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void sts64(uint32_t addr, uint32_t a, uint32_t b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Two floats to two E4M3 bytes (a in the low byte), rounded to nearest.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  uint16_t v;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(v) : "f"(b), "f"(a));
  return v;
}

// Whether `v` holds for any of the warpgroup's 128 threads (a barrier `id` over them).
__device__ __forceinline__ bool wg_any(bool v, int id) {
  uint32_t r;
  asm volatile("{ .reg .pred p, a; setp.ne.u32 p, %1, 0; bar.red.or.pred a, %2, 128, p; selp.u32 %0, 1, 0, a; }"
               : "=r"(r)
               : "r"(static_cast<uint32_t>(v)), "r"(id)
               : "memory");
  return r != 0;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(a), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t prmt2(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// A query row's factor: the largest power of two at most 448 / amax (its exponent bits), capped where amax is tiny or
// zero.
__device__ __forceinline__ float query_factor(float amax) {
  return amax > 0.f ? fminf(__int_as_float(__float_as_int(448.f / amax) & 0x7f800000), 0x1p100f) : 1.f;
}

// Two query values (times their row's factor) as their two E4M3 parts, a in the low byte of each: hi = e4m3(v) and
// lo = e4m3(16 (v - hi)).
__device__ __forceinline__ void split_pair(float a, float c, uint32_t& hi, uint32_t& lo) {
  hi = e4m3x2(a, c);
  const uint32_t hw = e4m3x2_to_f16x2(hi);
  const float2 hf = __half22float2(*reinterpret_cast<const __half2*>(&hw));
  lo = e4m3x2((a - hf.x) * 16.f, (c - hf.y) * 16.f);
}

// Q's two FP8 parts of the R query rows from the bf16 queries of sequence b (read from global memory;
// rows past the last read zeros) into a scoring warpgroup's [5][2R][128] image: warp w takes rows w, w + 4, ...;
// each row's factor, a power of two, puts its largest value at 224-448; s_rinv gets its inverse. Column c of the row
// lies in block c / 128 (c < 512) or 4 (the rope, bytes 64 on) of the image.
template <int R>
__device__ __forceinline__ void split_queries(const Params& p, int b, uint32_t s_q, float* s_rinv, int warp, int lane) {
  constexpr int q_block = 2 * R * 128;
  for (int n = warp; n < R; n += 4) {
    const bool ok = n < p.rows;
    const int qi = ok ? n / p.heads : 0, h = ok ? n % p.heads : 0;
    const uint16_t* qn = static_cast<const uint16_t*>(p.qn) + b * p.qn_b + qi * p.qn_s + h * p.qn_h;
    const uint16_t* qp = static_cast<const uint16_t*>(p.qp) + b * p.qp_b + qi * p.qp_s + h * p.qp_h;
    float v[3][8];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int ch = lane + 32 * j;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (ok && ch < kChunks) w = __ldg(reinterpret_cast<const uint4*>(ch < 64 ? qn + ch * 8 : qp + (ch - 64) * 8));
      const uint32_t in[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[k]));
        v[j][2 * k] = f.x;
        v[j][2 * k + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(v[j][2 * k]), fabsf(v[j][2 * k + 1])));
      }
    }
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, x));
    const float f = query_factor(amax);
    if (lane == 0) s_rinv[n] = 1.f / f;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int ch = lane + 32 * j;
      if (ch >= kChunks) continue;
      uint32_t hi[2], lo[2];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t h, l;
        split_pair(v[j][2 * k] * f, v[j][2 * k + 1] * f, h, l);
        if (k & 1) {
          hi[k >> 1] |= h << 16;
          lo[k >> 1] |= l << 16;
        } else {
          hi[k >> 1] = h;
          lo[k >> 1] = l;
        }
      }
      const int col = ch * 8;
      const int blk = col < 512 ? col >> 7 : 4, byte = col < 512 ? col & 127 : 64 + col - 512;
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        const int row = n + part * R;
        const uint32_t addr = s_q + blk * q_block + row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 8));
        sts64(addr, part ? lo[0] : hi[0], part ? lo[1] : hi[1]);
      }
    }
  }
}

// A tile's FP8 token rows by cp.async into the swizzled [5 blocks][64 rows][128 bytes] image, by the copying
// warpgroup: warp w's rows 16 w .. 16 w + 15 (their pages looked up three tiles ahead, `PagesAhead`), lane l the latent
// chunk l (block l / 8) and, for l < 4, rope chunk l (block 4, chunk 4 + l); rows past the sequence's end read zeros.
__device__ __forceinline__ void copy_rows_swizzled(const Params& p, uint32_t dst, const Rows& rows, int warp,
                                                   int lane) {
  const char* ckv = static_cast<const char*>(p.ckv) + lane * 16;
  const char* kpe = static_cast<const char*>(p.kpe) + (lane & 3) * 16;
  const uint32_t lat = dst + (lane >> 3) * kBlock, rope = dst + 4 * kBlock;
  const uint64_t l2 = sm90_wgmma::l2_evict_first();  // read once (read_once): 1.02-1.06x at page 1 on an H200
#pragma unroll 4
  for (int j = 0; j < 16; ++j) {
    const int r = warp * 16 + j;
    const int64_t off = __shfl_sync(0xffffffffu, rows.lat, j);
    const int64_t off_rope = __shfl_sync(0xffffffffu, rows.rope, j);
    const int bytes = __shfl_sync(0xffffffffu, rows.ok, j) ? 16 : 0;
    cp_async_16(lat + r * 128 + (((lane & 7) ^ (r & 7)) << 4), ckv + off, bytes, l2);
    if (lane < 4) cp_async_16(rope + r * 128 + (((4 + lane) ^ (r & 7)) << 4), kpe + off_rope, bytes, l2);
  }
}

// The five boxes of p.map_ckv (a box's rows: 64, or 16 for the 16-row map) into the swizzled image at `dst`, one per
// 128-byte column block (the fifth at kRopeCol: the rope in its upper half), from token `in_page` of page `pg`.
__device__ __forceinline__ void tile_boxes(const Params& p, uint32_t dst, uint64_t* bar, int in_page, int pg) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) tile_box(dst + kb * kBlock, &p.map_ckv, bar, kb * 128, in_page, pg, true);
  tile_box(dst + 4 * kBlock, &p.map_ckv, bar, kRopeCol, in_page, pg, true);
}

// A partial tile's latent rows from `valid` on cleared by the output warpgroup before it reads them (the page holds
// anything there, NaN included, and P^T's zeros times NaN are not 0), so that the fragments of full tiles, nearly all
// of them, take no masks. The scoring warpgroup may still be reading these rows: their scores are discarded.
__device__ __forceinline__ void clear_tail(uint32_t tile, int valid, int t) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int item = valid * 32 + t; item < kTile * 32; item += 128) {  // [row][4 blocks][8 chunks]
    const int r = item >> 5, blk = (item >> 3) & 3, c = item & 7;
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(tile + blk * kBlock + r * 128 + c * 16), "r"(zero.x),
                 "r"(zero.y), "r"(zero.z), "r"(zero.w)
                 : "memory");
  }
  fence_async_smem();  // these stores -> the TMA copy that refills this buffer once the tile is freed
  asm volatile("bar.sync %0, 128;" ::"r"(kBarTail) : "memory");
}

// The output warpgroup's fp16 fragments of k step kk (tokens 16 kk .. 16 kk + 15) for its 8 products, from the tile at
// `tile`. Warp w's ldmatrix.trans of column group grp covers latent bytes 128 grp + 32 w .. + 31 (16-byte chunks
// 8 grp + 2 w and + 1): a thread gets tokens 2q, 2q + 1 (and + 8) of latent columns 2g, 2g + 1 of each chunk. The
// even columns feed product 2 grp, the odd ones 2 grp + 1; rows g / g + 8 of warp w's 16 are chunk 0 / chunk 1.
__device__ __forceinline__ void values_fragments(uint32_t tile, int kk, int warp, int lane, uint32_t (&fr)[8][4]) {
  const int mi = lane >> 3, tok = 16 * kk + (mi & 1) * 8 + (lane & 7), cb = 2 * warp + (mi >> 1);
#pragma unroll
  for (int grp = 0; grp < 4; ++grp) {
    uint32_t r[4];
    ldsm_x4_trans(tile + grp * kBlock + tok * 128 + ((cb ^ (tok & 7)) << 4), r);
    // r: bytes (token 2q: column 2g, 2g + 1), (token 2q + 1: 2g, 2g + 1) -> (2g: tokens 2q, 2q + 1), (2g + 1: ...).
    // Fragment order: (row g, k 2q), (row g + 8, k 2q), (row g, k 2q + 8), (row g + 8, k 2q + 8).
    const int order[4] = {0, 2, 1, 3};
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const uint32_t x = prmt(r[order[a]], 0x3120);
      fr[2 * grp][a] = e4m3x2_to_f16x2(x & 0xffffu);
      fr[2 * grp + 1][a] = e4m3x2_to_f16x2(x >> 16);
    }
  }
}

// With P^T in E4M3 (PV8, 32 rows): the output warpgroup's FP8 fragments of k step s (tokens 32 s .. 32 s + 31) for
// its 8 products, as they lie: product mb's 16 rows are warp w's latent chunk 8 (mb >> 1) + 2 w + (mb & 1) (16
// columns), fragment row g its column 2 g and row g + 8 its column 2 g + 1. ldmatrix.trans of tokens 8 i .. 8 i + 7
// (matrix i) gives a thread tokens 2 q, 2 q + 1 of a column pair; two such matrices 8 tokens apart fill a register's
// four bytes, so k positions 4 q .. 4 q + 3 of each 16 are tokens 2 q, 2 q + 1, 2 q + 8, 2 q + 9: the order P^T is
// written in (score_rows), and no byte crosses a lane.
__device__ __forceinline__ void values_fragments_fp8(uint32_t tile, int s, int warp, int lane, uint32_t (&fr)[8][4]) {
  const int tok = 32 * s + 8 * (lane >> 3) + (lane & 7);
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int c = 2 * warp + (mb & 1);
    uint32_t r[4];
    ldsm_x4_trans(tile + (mb >> 1) * kBlock + tok * 128 + ((c ^ (tok & 7)) << 4), r);
    // r[i]: bytes (token 2q: column 2g, 2g + 1), (token 2q + 1: 2g, 2g + 1) of matrix i.
    fr[mb][0] = prmt2(r[0], r[1], 0x6420);
    fr[mb][1] = prmt2(r[0], r[1], 0x7531);
    fr[mb][2] = prmt2(r[2], r[3], 0x6420);
    fr[mb][3] = prmt2(r[2], r[3], 0x7531);
  }
}

// Query row n's end of a piece, from its running maximum m and sum (log2 units): the output warpgroup's factor
// (1 / norm, the sum of the weights the products took, times the cache's scale) in inv, and the LSE (natural log)
// where the sequence is not split, else the piece's (log2) for the combine.
__device__ __forceinline__ void finish_row(const Params& p, float* inv, int n, float m, float sum, float norm,
                                           int ntiles, int splits, int b, int64_t slot, float kv_scale) {
  const bool any = ntiles > 0 && sum > 0.f;
  inv[n] = any ? kv_scale / norm : 0.f;
  if (n >= p.rows) return;
  const float lse = any ? m + log2f(sum) : -INFINITY;
  if (splits == 1) {
    const int qi = n / p.heads, h = n % p.heads;
    if (p.lse != nullptr) p.lse[b * p.l_b + qi * p.l_s + h * p.l_h] = lse * 0.6931471805599453f;
  } else {
    p.part_lse[slot * p.rows + n] = lse;
  }
}

// This thread's A fragments of the 32-row scores: query row n's two FP8 parts (Q_hi in the fragment's row g, Q_lo
// in row g + 8) for the 18 k steps of 32 columns, read from global memory. Step k's registers 0 / 1 hold columns
// 32 k + 4 q .. + 3 of Q_hi / Q_lo, registers 2 / 3 the same 16 columns on; the row's factor (as split_queries')
// comes from the quad, whose four lanes hold its 576 columns between them. Returns the factor's inverse.
__device__ __forceinline__ float query_fragments(const Params& p, int b, int n, int q, uint32_t (&qa)[18][4]) {
  const bool ok = n < p.rows;
  const int qi = ok ? n / p.heads : 0, h = ok ? n % p.heads : 0;
  const uint16_t* qn = static_cast<const uint16_t*>(p.qn) + b * p.qn_b + qi * p.qn_s + h * p.qn_h;
  const uint16_t* qp = static_cast<const uint16_t*>(p.qp) + b * p.qp_b + qi * p.qp_s + h * p.qp_h;
  uint2 w[18][2];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 18; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = 32 * k + 16 * half + 4 * q;
      w[k][half] = ok ? __ldg(reinterpret_cast<const uint2*>(col < 512 ? qn + col : qp + col - 512)) : make_uint2(0, 0);
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k][half].x));
      const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k][half].y));
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(c.x), fabsf(c.y))));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float f = query_factor(amax);
#pragma unroll
  for (int k = 0; k < 18; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t in[2] = {w[k][half].x, w[k][half].y};
      uint32_t hi = 0, lo = 0;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[e]));
        uint32_t h, l;
        split_pair(v.x * f, v.y * f, h, l);
        hi |= h << (16 * e);
        lo |= l << (16 * e);
      }
      qa[k][2 * half] = hi;
      qa[k][2 * half + 1] = lo;
    }
  }
  return 1.f / f;
}

// The scoring warpgroup of 32 rows: scores [64, 64 tokens] = [Q_hi; Q_lo] [64, 576] . tile^T, the query parts as
// wgmma's A from registers (query row n's two parts in rows 16 (n / 8) + n % 8 and + 8, so a thread holds both of its
// row's parts) and the tile as B in shared memory: each tile is read once for all 32 rows, the queries take no shared
// memory (its room holds a fifth tile), and a query row's 64 scores lie in the four lanes of a quad, so its maxima
// and sums need no exchange between the warps, and a warp's rows move their maxima together.
template <class L, bool PV8>
__device__ __forceinline__ void score_rows(const Params& p, const Sched& sc, float kv_scale, uint32_t s_raw,
                                           uint32_t s_p, float* s_alpha, float* s_inv, int* s_moved, uint64_t* full,
                                           uint64_t* pfull, uint64_t* pempty, int warp, int lane) {
  constexpr int N = 32, kChains = 4, kStages = L::kStages, kSlots = L::kSlots;
  const int q = lane & 3, n = 8 * warp + (lane >> 2);  // this thread's query row
  uint32_t tiles_done = 0, pieces = 0;
  uint32_t ps = 0, pph = 0;  // the next P^T slot and its barriers' phase
  for (int cursor = sc.begin, b = sc.first; cursor < sc.end; ++b) {
    const int splits = sc.splits[b];
    const Piece pc = sc.piece(p, b, cursor);
    const int length = pc.length, tok_lo = pc.tok_lo, tok_hi = pc.tok_hi, ntiles = pc.ntiles;
    const int64_t slot = sc.slot(b, pc.seq_start);
    uint32_t qa[18][4];
    const float fac = query_fragments(p, b, n, q, qa) * p.qk_scale * kv_scale;
    const int vis = n < p.rows ? min(p.causal ? length - p.s_q + 1 + n / p.heads : length, tok_hi) : 0;
    float m = -INFINITY, l = 0.f, lr = 0.f;  // lr: the sum of P^T as rounded to E4M3 (PV8)
    for (int i = 0; i < ntiles; ++i) {
      const uint32_t g = tiles_done + i, s = g % kStages, tile = s_raw + s * kTileBytes;
      bar_wait(&full[s], (g / kStages) & 1);
      float part[kChains][32];
      const uint64_t dk = desc_k(__shfl_sync(0xffffffffu, tile, 0));
      wgmma_fence();
      // Steps 0-8 into chains 0 and 1, 9-17 into 2 and 3 (4-5 steps each): the first half's sums are added while
      // the second half's products run.
#pragma unroll
      for (int k = 0; k < 18; ++k) {
        const int blk = k < 16 ? k >> 2 : 4, kk = k < 16 ? k & 3 : k - 14;
        mma_scores_fp8_rs(part[(k >= 9 ? 2 : 0) + (k & 1)], qa[k], desc_at(dk, blk * kBlock + kk * 32),
                          k != 0 && k != 1 && k != 9 && k != 10);
        if (k == 8 || k == 17) wgmma_commit();
      }
      wgmma_wait<1>();
      fence_regs(part[0]);
      fence_regs(part[1]);
#pragma unroll
      for (int e = 0; e < 32; ++e) part[0][e] += part[1][e];
      wgmma_wait<0>();
      fence_regs(part[2]);
      fence_regs(part[3]);
      // Token 8 j + 2 q + e: Q_hi's score at index 4 j + e, Q_lo's at 4 j + 2 + e.
      const int t0 = tok_lo + i * kTile;
      float x[16], mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float hi = part[0][4 * j + e] + (part[2][4 * j + e] + part[3][4 * j + e]);
          const float lo = part[0][4 * j + 2 + e] + (part[2][4 * j + 2 + e] + part[3][4 * j + 2 + e]);
          x[2 * j + e] = t0 + 8 * j + 2 * q + e < vis ? (hi + lo * 0.0625f) * fac : -INFINITY;
          mx = fmaxf(mx, x[2 * j + e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Lazy maxima as in score_cols, decided per warp: P^T stays below 2^kSlack (PV8: 2^(kSlackPv8 + kShiftPv8)).
      const bool move = __any_sync(0xffffffffu, mx > m + (PV8 ? kSlackPv8 : kSlack));
      const uint32_t pt = s_p + ps * (N * 128);
      if (g >= kSlots) bar_wait(&pempty[ps], pph ^ 1);
      if (move) {
        const float mn = fmaxf(m, mx);
        const float alpha = exp2f(m - (mn == -INFINITY ? 0.f : mn));
        m = mn;
        l *= alpha;
        if constexpr (PV8) lr *= alpha;
        if (q == 0) s_alpha[ps * N + n] = alpha;
      }
      if (lane == 0) s_moved[4 * ps + warp] = move;
      const float u = (m == -INFINITY ? 0.f : m) - (PV8 ? kShiftPv8 : 0.f);
      const uint32_t row = pt + n * 128, sw = n & 7;
      if constexpr (PV8) {
        // P^T [n][64 bytes] in E4M3 (times 2^kShiftPv8), K-major, tokens in the fragments' order
        // (values_fragments_fp8): bytes 16 h + 4 q .. + 3 are tokens 16 h + 2 q, + 1, + 8, + 9. The output is
        // divided by the sum of the rounded weights (lr), which the products took, and the LSE takes the exact sum
        // (l): where the scores are nearly equal their roundings share a sign, which cancels in the ratio but not in
        // the LSE (0.013 off on the tests' N(0, 1) caches with lr alone).
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float p0 = exp2f(x[4 * h] - u), p1 = exp2f(x[4 * h + 1] - u);
          const float p2 = exp2f(x[4 * h + 2] - u), p3 = exp2f(x[4 * h + 3] - u);
          l += (p0 + p1) + (p2 + p3);
          const uint32_t a = e4m3x2(p0, p1), c = e4m3x2(p2, p3);
          const uint32_t ah = e4m3x2_to_f16x2(a), ch = e4m3x2_to_f16x2(c);
          const float2 af = __half22float2(*reinterpret_cast<const __half2*>(&ah));
          const float2 cf = __half22float2(*reinterpret_cast<const __half2*>(&ch));
          lr += (af.x + af.y) + (cf.x + cf.y);
          asm volatile("st.shared.u32 [%0], %1;" ::"r"(row + ((h ^ sw) << 4) + 4 * q), "r"(a | (c << 16)) : "memory");
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float p0 = exp2f(x[2 * j] - u), p1 = exp2f(x[2 * j + 1] - u);
          l += p0 + p1;
          // P^T [n][token], K-major for the values' B operand: tokens 8 j + 2 q, + 1 in one word.
          asm volatile("st.shared.u32 [%0], %1;" ::"r"(row + ((j ^ sw) << 4) + 4 * q), "r"(pack2<true>(p0, p1))
                       : "memory");
        }
      }
      fence_async_smem();  // P^T's stores -> the output warpgroup's wgmma reads
      sm90_wgmma::bar_arrive(&pfull[ps]);
      if (++ps == kSlots) ps = 0, pph ^= 1;
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if constexpr (PV8) {
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    }
    // (The sums are of P^T times 2^kShiftPv8 with PV8: the LSE's maximum takes the shift.)
    if (q == 0)
      finish_row(p, s_inv + (pieces & 1) * N, n, m - (PV8 ? kShiftPv8 : 0.f), l, PV8 ? lr : l, ntiles, splits, b, slot,
                 kv_scale);
    bar_sync_n(kBarOut, 256);
    tiles_done += ntiles;
    ++pieces;
    cursor = pc.piece_end;
  }
}

// The scoring warpgroup of 16 rows: scores^T [64 tokens, 32] = tile [64, 576] . [Q_hi; Q_lo]^T, the tile as wgmma's A
// and the query parts as B; a query row's 64 scores lie in the 8 lanes of one q in each warp, so its maxima and sums
// are exchanged between the warps through shared memory (s_red, s_sums).
template <class L>
__device__ __forceinline__ void score_cols(const Params& p, const Sched& sc, float kv_scale, uint32_t s_q,
                                           uint32_t s_raw, uint32_t s_p, float* s_alpha, float* s_red, float* s_sums,
                                           float* s_inv, float* s_rinv, int* s_moved, uint64_t* full, uint64_t* pfull,
                                           uint64_t* pempty, int warp, int lane) {
  constexpr int N = 16, kCols = N / 4, NB = 2 * N, kChains = 4, kStages = L::kStages, kSlots = L::kSlots;
  const int t = threadIdx.x & 127, q = lane & 3;
  uint32_t tiles_done = 0, pieces = 0;
  uint32_t ps = 0, pph = 0;  // the next P^T slot and its barriers' phase (kSlots need not be a power of two)
  for (int cursor = sc.begin, b = sc.first; cursor < sc.end; ++b) {
    const int splits = sc.splits[b];
    const Piece pc = sc.piece(p, b, cursor);
    const int length = pc.length, tok_lo = pc.tok_lo, tok_hi = pc.tok_hi, ntiles = pc.ntiles;
    const int64_t slot = sc.slot(b, pc.seq_start);

    wg_sync(kBarQ);  // the last piece's products are done with the parts
    split_queries<N>(p, b, s_q, s_rinv, warp, lane);
    fence_async_smem();  // the parts' stores -> the wgmma's reads
    wg_sync(kBarQ);

    // This thread's query rows (the accumulator's columns 8 j + 2 q + e: index 2 j + e, local row narrow_row) and
    // what they see.
    int vis[kCols];
    float m[kCols], l[kCols], fac[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int n = narrow_row(c, q);
      vis[c] = n < p.rows ? min(p.causal ? length - p.s_q + 1 + n / p.heads : length, tok_hi) : 0;
      m[c] = -INFINITY;
      l[c] = 0.f;
      fac[c] = s_rinv[n] * p.qk_scale * kv_scale;
    }
    const int ta = warp * 16 + (lane >> 2);  // this thread's tokens in a tile: ta, ta + 8
    for (int i = 0; i < ntiles; ++i) {
      const uint32_t g = tiles_done + i, s = g % kStages, tile = s_raw + s * kTileBytes;
      bar_wait(&full[s], (g / kStages) & 1);
      // 18 k steps (16 latent, 2 rope) in kChains independent accumulators, issued in turn.
      float part[kChains][NB / 2];
      // The tile's address through a shuffle, so that ptxas knows it is warp-uniform and keeps the descriptors
      // in uniform registers (else it moves each product's into them from ordinary ones: six instructions a product).
      const uint64_t dk = desc_k(__shfl_sync(0xffffffffu, tile, 0)), dq = desc_k(s_q);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 18; ++k) {
        const int blk = k < 16 ? k >> 2 : 4, kk = k < 16 ? k & 3 : k - 14;
        mma_scores_fp8<NB>(part[k % kChains], desc_at(dk, blk * kBlock + kk * 32),
                           desc_at(dq, blk * L::q_block + kk * 32), k >= kChains);
      }
      wgmma_commit();
      wgmma_wait<0>();
      float sc[NB / 2];
      sum_chains(part, sc);

      // Online softmax along the tokens: a query row's 64 scores lie in the 8 lanes of one q in each warp.
      const int t0 = tok_lo + i * kTile;
      float x0[kCols], x1[kCols], mx[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int k = 4 * (c >> 1) + (c & 1), kl = k + N / 2;  // Q_hi's column, Q_lo's
        x0[c] = t0 + ta < vis[c] ? (sc[k] + sc[kl] * 0.0625f) * fac[c] : -INFINITY;
        x1[c] = t0 + ta + 8 < vis[c] ? (sc[k + 2] + sc[kl + 2] * 0.0625f) * fac[c] : -INFINITY;
        mx[c] = fmaxf(x0[c], x1[c]);
#pragma unroll
        for (int x = 4; x <= 16; x <<= 1) mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], x));
      }
      // The running maxima move only where a score passes them by more than 2^kSlack, so P^T stays below 2^kSlack
      // (far inside fp16) and most tiles skip the exchange between the warps, and the output the rescaling.
      bool pass = false;
#pragma unroll
      for (int c = 0; c < kCols; ++c) pass |= mx[c] > m[c] + kSlack;
      const bool move = wg_any(pass, kBarMax);
      float* red = s_red + (g & 1) * 4 * N;
      if (move) narrow_share<N>(mx, red, warp, lane, q, kBarMax);
      const uint32_t pt = s_p + ps * (N * 128);
      if (g >= kSlots) bar_wait(&pempty[ps], pph ^ 1);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int n = narrow_row(c, q);
        if (move) {
          const float tile_max = fmaxf(fmaxf(red[n], red[N + n]), fmaxf(red[2 * N + n], red[3 * N + n]));
          const float mn = fmaxf(m[c], tile_max);
          const float alpha = exp2f(m[c] - (mn == -INFINITY ? 0.f : mn));
          m[c] = mn;
          l[c] *= alpha;
          if (warp == 0 && lane < 4) s_alpha[ps * N + n] = alpha;
        }
        const float u = m[c] == -INFINITY ? 0.f : m[c];
        x0[c] = exp2f(x0[c] - u);
        x1[c] = exp2f(x1[c] - u);
        l[c] += x0[c] + x1[c];
        // P^T [n][token], K-major for the values' B operand.
        const uint32_t row = pt + n * 128, sw = n & 7;
        sts16(row + (((ta >> 3) ^ sw) << 4) + (ta & 7) * 2, __half_as_ushort(__float2half_rn(x0[c])));
        sts16(row + ((((ta + 8) >> 3) ^ sw) << 4) + (ta & 7) * 2, __half_as_ushort(__float2half_rn(x1[c])));
      }
      if (t == 0) s_moved[4 * ps] = move;
      fence_async_smem();  // P^T's stores -> the output warpgroup's wgmma reads
      sm90_wgmma::bar_arrive(&pfull[ps]);
      if (++ps == kSlots) ps = 0, pph ^= 1;
    }

    narrow_sum_rows<N>(l, s_sums, warp, lane, q, kBarMax);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int n = narrow_row(c, q);
      const float sum = s_sums[n] + s_sums[N + n] + s_sums[2 * N + n] + s_sums[3 * N + n];
      if (warp == 0 && lane < 4)
        finish_row(p, s_inv + (pieces & 1) * N, n, m[c], sum, sum, ntiles, splits, b, slot, kv_scale);
    }
    bar_sync_n(kBarOut, 256);
    tiles_done += ntiles;
    ++pieces;
    cursor = pc.piece_end;
  }
}

// BOXES: p.runs (pages of 16 and 32 tokens), in its own instance: with the branch compiled in, the token rows'
// copy loop ran 1.03-1.09x slower at page 1 (an H200), the branch never taken.
// PV8 (32 rows): the values' product in FP8, P^T rounded to E4M3 (NARROW_PV8 in flashinfer_moe/mla/decode_sm90.py).
template <int N, bool BOXES, bool PV8>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_narrow_rs_kernel(const __grid_constant__ Params p) {
  using T = __nv_bfloat16;
  using L = Layout<N>;
  constexpr int kCols = N / 4;  // an output thread's query rows
  constexpr int kStages = L::kStages;
  constexpr int kSlots = L::kSlots;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = smem_u32(smem_raw);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_base);
  const uint32_t s_q = base, s_raw = base + L::raw, s_p = base + L::p;
  float* s_alpha = reinterpret_cast<float*>(smem + L::alpha);
  float* s_red = reinterpret_cast<float*>(smem + L::red);
  float* s_sums = reinterpret_cast<float*>(smem + L::sums);
  float* s_inv = reinterpret_cast<float*>(smem + L::inv);
  float* s_rinv = reinterpret_cast<float*>(smem + L::rinv);
  int* s_moved = reinterpret_cast<int*>(smem + L::moved);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);  // [kStages] a tile landed
  uint64_t* empty = full + kStages;                              // [kStages] the output warpgroup done with it
  uint64_t* pfull = empty + kStages;                             // [kSlots] P^T and the factors written
  uint64_t* pempty = pfull + kSlots;                             // [kSlots] the output warpgroup done with them

  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), t = tid & 127, warp = t >> 5;
  const int lane = tid & 31, q = lane & 3;
  const int prog = blockIdx.y;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&full[s], p.tma ? 1 : 128);
      bar_init(&empty[s], 128);
    }
    for (int s = 0; s < kSlots; ++s) {
      bar_init(&pfull[s], 128);
      bar_init(&pempty[s], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const Sched sc = sched_of(p, prog);

  // 224 registers for the output warpgroup (the output and two steps' fragments) and for the scoring one (232 at 32
  // rows: four chains of scores [64, 64] and the queries' fragments), 56 for the copying one (48 at 32 rows): the
  // 168 x 384 the CTA starts with. setmaxnreg.inc waits until the other warpgroups have given the registers back, so
  // budgets adding up to more would hang.
  constexpr int kRegsScore = N == 32 ? 232 : 224, kRegsOut = 224, kRegsCopy = N == 32 ? 48 : 56;
  constexpr int kLaunchRegs = (65536 / kThreads) & ~7;  // a thread's registers under __launch_bounds__(kThreads, 1)
  static_assert(kRegsScore + kRegsOut + kRegsCopy <= 3 * kLaunchRegs, "past the CTA's registers at launch");
  if (wg == kCopy) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegsCopy));
    if (p.tma && t != 0) return;
    // The copying warpgroup runs ahead through the pieces, bounded by the free buffers: by TMA (one thread; a tile's
    // 64 tokens lie in one page, and rows past the sequence's end come as the page holds them), or by cp.async token
    // rows (any page size and layout; rows past the end read zeros), warp w copying tokens 16 w .. 16 w + 15, or with
    // p.runs (pages of 16 and 32) the same rows by TMA boxes, which lie in one page.
    uint32_t g = 0;
    for (int cursor = sc.begin, b = sc.first; cursor < sc.end; ++b) {
      const Piece pc = sc.piece(p, b, cursor);
      const int tok_lo = pc.tok_lo, tok_hi = pc.tok_hi;
      const int32_t* bt_row = p.block_table + static_cast<int64_t>(b) * p.bt_b;
      PagesAhead<3> ahead;
      if (!p.tma) ahead.start(p, bt_row, tok_lo, tok_hi, warp, lane);
      for (int t0 = tok_lo; t0 < tok_hi; t0 += kTile, ++g) {
        const uint32_t s = g % kStages, dst = s_raw + s * kTileBytes;
        if (p.tma) {
          const int pg = bt_row[t0 >> p.page_shift], in_page = t0 & ((1 << p.page_shift) - 1);
          if (g >= kStages) bar_wait(&empty[s], ((g - kStages) / kStages) & 1);
          sm90_wgmma::bar_expect_tx(&full[s], kTileBytes);
          tile_boxes(p, dst, &full[s], in_page, pg);
          continue;
        }
        // Pages of 16 and 32 tokens (p.runs): a warp's 16 rows lie in one page, whose entry its lane 0 holds.
        const int tok = t0 + warp * 16;
        const bool boxes = BOXES && tok + 16 <= tok_hi;
        const int pg = boxes ? __shfl_sync(0xffffffffu, ahead.page[0], 0) : 0;
        if (g >= kStages) bar_wait(&empty[s], ((g - kStages) / kStages) & 1);
        const Rows rows = ahead.next(p, bt_row, t0, tok_hi, warp, lane, 1);
        if (boxes) {
          // `full` counts the 128 arrivals of token rows: this warp's lane 0 carries its rows' bytes.
          if (lane == 0) {
            const int in_page = tok & ((1 << p.page_shift) - 1);
            sm90_wgmma::bar_expect_tx(&full[s], 5 * 16 * 128);
            tile_boxes(p, dst + warp * 16 * 128, &full[s], in_page, pg);
          } else {
            sm90_wgmma::bar_arrive(&full[s]);
          }
          continue;
        }
        copy_rows_swizzled(p, dst, rows, warp, lane);
        cp_async_arrive(&full[s]);
      }
      cursor = pc.piece_end;
    }
    return;
  }
  const float kv_scale = p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value;
  // Each role walks the pieces on its own (ptxas gives a region one register budget, so the roles' loops are apart);
  // tiles_done and pieces keep the barriers' phases.
  if (wg == kScore) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegsScore));
    if constexpr (N == 32) {
      score_rows<L, PV8>(p, sc, kv_scale, s_raw, s_p, s_alpha, s_inv, s_moved, full, pfull, pempty, warp, lane);
    } else {
      score_cols<L>(p, sc, kv_scale, s_q, s_raw, s_p, s_alpha, s_red, s_sums, s_inv, s_rinv, s_moved, full, pfull,
                    pempty, warp, lane);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegsOut));
  uint32_t tiles_done = 0, pieces = 0;
  uint32_t ps = 0, pph = 0;  // as the scoring warpgroup's
  for (int cursor = sc.begin, b = sc.first; cursor < sc.end; ++b) {
    const int splits = sc.splits[b];
    const Piece pc = sc.piece(p, b, cursor);
    const int tok_lo = pc.tok_lo, tok_hi = pc.tok_hi, ntiles = pc.ntiles;
    const int64_t slot = sc.slot(b, pc.seq_start);

    float o[8][N / 2];
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) o[mb][i] = 0.f;
    for (int i = 0; i < ntiles; ++i) {
      const uint32_t g = tiles_done + i, s = g % kStages, tile = s_raw + s * kTileBytes;
      const uint32_t pt = s_p + ps * (N * 128);
      bar_wait(&pfull[ps], pph);
      bar_wait(&full[s], (g / kStages) & 1);  // the tile's bytes, for this warpgroup's own reads
      // The rows whose maxima the tile moved (at 32 rows a scoring warp's rows, output columns 2 w and 2 w + 1, move
      // together; at 16 all of them).
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (!s_moved[4 * ps + (N == 32 ? c >> 1 : 0)]) continue;
        const float alpha = s_alpha[ps * N + narrow_row(c, q)];
        const int k = 4 * (c >> 1) + (c & 1);
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) {
          o[mb][k] *= alpha;
          o[mb][k + 2] *= alpha;
        }
      }
      const int valid = tok_hi - (tok_lo + i * kTile);
      if (valid < kTile) clear_tail(tile, valid, t);
      uint32_t fr[2][8][4];
      if constexpr (PV8) {
        values_fragments_fp8(tile, 0, warp, lane, fr[0]);
        wgmma_fence();
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) mma_values_fp8_rs(o[mb], fr[0][mb], desc_k(pt));
        wgmma_commit();
        values_fragments_fp8(tile, 1, warp, lane, fr[1]);
        sm90_wgmma::bar_arrive(&empty[s]);  // the tile's last reads
        wgmma_fence();
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) mma_values_fp8_rs(o[mb], fr[1][mb], desc_k(pt + 32));
        wgmma_commit();
        wgmma_wait<0>();
      } else {
        values_fragments(tile, 0, warp, lane, fr[0]);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_fence();
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) mma_values_rs<N>(o[mb], fr[kk & 1][mb], desc_k(pt + kk * 32));
          wgmma_commit();
          if (kk < 3) values_fragments(tile, kk + 1, warp, lane, fr[(kk + 1) & 1]);
          if (kk == 2) sm90_wgmma::bar_arrive(&empty[s]);  // the tile's last reads (the products take registers)
          wgmma_wait<0>();
        }
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) fence_regs(o[mb]);
      sm90_wgmma::bar_arrive(&pempty[ps]);
      if (++ps == kSlots) ps = 0, pph ^= 1;
    }

    // out^T's columns are this thread's query rows; product mb = 2 grp + e holds latent columns 128 grp + 32 w +
    // 2 g + e (row g) and + 16 (row g + 8); with PV8 128 grp + 32 w + 16 e + 2 g (row g) and + 1 (row g + 8).
    bar_sync_n(kBarOut, 256);
    const float* inv = s_inv + (pieces & 1) * N;
    const int col0 = 32 * warp + 2 * (lane >> 2);
    constexpr int kOdd = PV8 ? 16 : 1, kNext = PV8 ? 1 : 16;  // product 2 grp + 1's first column, row g + 8's offset
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int n = narrow_row(c, q), k = 4 * (c >> 1) + (c & 1);
      if (n >= p.rows) continue;
      const float f = inv[n];
      const int qi = n / p.heads, h = n % p.heads;
      if (splits == 1) {
        T* out = static_cast<T*>(p.out) + b * p.o_b + qi * p.o_s + h * p.o_h + col0;
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) {
          const int col = 128 * (mb >> 1) + kOdd * (mb & 1);
          out[col] = static_cast<T>(o[mb][k] * f);
          out[col + kNext] = static_cast<T>(o[mb][k + 2] * f);
        }
      } else {
        float* out = p.part_out + (slot * p.rows + n) * 512 + col0;
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) {
          const int col = 128 * (mb >> 1) + kOdd * (mb & 1);
          out[col] = o[mb][k] * f;
          out[col + kNext] = o[mb][k + 2] * f;
        }
      }
    }
    tiles_done += ntiles;
    ++pieces;
    cursor = pc.piece_end;
  }
}

#else

template <int N, bool BOXES, bool PV8>
__global__ void mla_decode_narrow_rs_kernel(const __grid_constant__ Params p) {}

#endif

template <int N, bool BOXES, bool PV8 = false>
int launch_t(const Params& p, int programs, cudaStream_t stream) {
  constexpr int bytes = Layout<N>::bytes;
  static_assert(bytes <= 227 * 1024, "shared memory");
  cudaError_t err = sm90::opt_in_shared_memory<mla_decode_narrow_rs_kernel<N, BOXES, PV8>>(bytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  mla_decode_narrow_rs_kernel<N, BOXES, PV8><<<dim3(1, programs), kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace narrow_rs

// The pages as the 3-D tensor {byte, token in page, page} of the one-tensor FP8 cache (rows of 576 bytes), in boxes
// of 128 bytes x 64 tokens, 128-byte swizzled.
bool encode_fp8_tiles(CUtensorMap* map, const void* base, int page, int64_t num_pages, int64_t page_stride, bool runs) {
  sm90::EncodeTiled fn = sm90::tensor_map_encoder();
  if (fn == nullptr || (runs ? page < 16 || page >= kTile : page < kTile)) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kChunks * 8), static_cast<cuuint64_t>(page),
                              static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kChunks * 8), static_cast<cuuint64_t>(page_stride)};
  // 64 tokens of one page, or with `runs` (pages of 16 and 32 tokens) a copying warp's 16 rows, which lie in one page.
  const cuuint32_t box[3] = {128, static_cast<cuuint32_t>(runs ? 16 : kTile), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int launch_narrow_rs(const Params& p, int programs, cudaStream_t stream) {
  using narrow_rs::launch_t;
  if (p.rows > 16 && p.pv8)
    return p.runs ? launch_t<32, true, true>(p, programs, stream) : launch_t<32, false, true>(p, programs, stream);
  if (p.runs) return p.rows <= 16 ? launch_t<16, true>(p, programs, stream) : launch_t<32, true>(p, programs, stream);
  return p.rows <= 16 ? launch_t<16, false>(p, programs, stream) : launch_t<32, false>(p, programs, stream);
}

}  // namespace sm90_mla
}  // namespace fim
