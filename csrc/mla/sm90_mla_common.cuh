// Shared by the Hopper MLA decode kernels (sm90_mla_decode.cu: 64 rows per CTA; sm90_mla_decode_narrow.cu: FP8
// pages, up to 32 rows): the parameters, the tile copies and the shared-memory images.
//
// Shared-memory images are 128-byte swizzled, 8-row atoms of 1024 bytes: [9 column blocks][rows][64 columns] of
// 16-bit elements.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm/sm90_launch.cuh"
#include "gemm/sm90_nvfp4_ptx.cuh"
#include "gemm/sm90_wgmma_common.cuh"
#include "mla/sm90_mla_mma.cuh"

namespace fim {
namespace sm90_mla {

constexpr int kThreads = 256;
constexpr int kRows = 64;                  // (new token, head) rows per CTA
constexpr int kTile = 64;                  // tokens per tile
constexpr int kChunks = 72;                // 16-byte chunks per row of 576 (512 latent + 64 rope)
constexpr int kBlock = 8192;               // bytes of one 64-column block of 64 rows
constexpr int kImage = 9 * kBlock;         // Q or one stage
constexpr int kRaw = kTile * kChunks * 8;  // a tile's FP8 rows, [64][576] bytes
constexpr int kUnit = 64, kOverhead = 2;   // the schedule's cost model (flashinfer_moe/mla/plan_kernel.py)
constexpr float kSlack = 8.f;              // log2 of how far P may exceed 1 before the running maxima move

struct Params {
  // TMA path only: the latent and rope pages as 3-D tensors {column, token in page, page}, boxes of 64 columns
  // x min(page, 64) tokens, 128-byte swizzled (the images' layout). Run tiles of bf16/fp16 pages below 64 tokens
  // (`runs`): boxes of 64 columns x page tokens x 64 / page pages. The narrow kernel without fp16 images (FP8): map_ckv
  // alone, over bytes, as encode_fp8_tiles makes it.
  CUtensorMap map_ckv, map_kpe;
  const void* qn;   // [B, s_q, Hq, 512]
  const void* qp;   // [B, s_q, Hq, 64]
  const void* ckv;  // [P, page, >= 512]
  const void* kpe;  // [P, page, 64] (a view of ckv's last 64 columns for the one-tensor layout)
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* sched;
  float* part_out;                             // [S, M, 512]
  float* part_lse;                             // [S, M]
  void* out;                                   // [B, s_q, Hq, 512]
  float* lse;                                  // [B, s_q, Hq] or null
  int64_t qn_b, qn_s, qn_h, qp_b, qp_s, qp_h;  // strides in elements
  int64_t ckv_p, ckv_t, kpe_p, kpe_t, bt_b;
  int64_t o_b, o_s, o_h;
  int64_t l_b, l_s, l_h;
  int batch, rows, heads, s_q, page_shift, max_tokens, causal;
  int tma;  // bf16/fp16: tiles by TMA (map_ckv, map_kpe); FP8 (narrow kernel, producer): by bulk copies
  // Where tiles come as cp.async token rows (pages below 64 tokens): in the 64-row kernel, a whole tile whose pages'
  // block-table entries are consecutive (a run, as allocators hand out to a prompt's tokens) comes as a page-64 tile
  // would, by TMA boxes through the run maps (bf16/fp16) or as one bulk copy (FP8, pages adjacent in the pool). The
  // narrow kernel without fp16 images (FP8, pages of 16 and 32 tokens): each copying warp's 16 rows, which lie in one
  // page, by TMA boxes.
  int runs;
  float qk_scale;         // sm_scale * log2(e)
  const float* kv_scale;  // FP8 pages: the dequantization factor on the device, or null for kv_scale_value
  float kv_scale_value;
  int pv8;  // the narrow kernel of up to 32 rows (bf16 queries): P^T in E4M3 and the values' product in FP8
};

// The kernel for FP8 pages and at most 32 (new token, head) rows (sm90_mla_decode_narrow.cu), with one fp16 stage
// or two (`stages` 2, taken only where p.tma: bulk copies); returns a cudaError_t code.
int launch_narrow(const Params& p, bool fp16, int stages, int programs, cudaStream_t stream);

// The narrow kernel without fp16 images (sm90_mla_decode_narrow_rs.cu): bf16 queries, FP8 pages (latent and rope),
// up to 32 rows; tiles by TMA where p.tma (through p.map_ckv as encode_fp8_tiles makes it for the one-tensor cache,
// pages of 64 tokens and more), else by cp.async token rows or, where p.runs (pages of 16 and 32 tokens), each
// copying warp's 16 rows (one page's) by TMA through the map encode_fp8_tiles makes with `runs`; returns a cudaError_t
// code.
bool encode_fp8_tiles(CUtensorMap* map, const void* base, int page, int64_t num_pages, int64_t page_stride, bool runs);
int launch_narrow_rs(const Params& p, int programs, cudaStream_t stream);

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

using sm90_nvfp4::cp_async_16;
using sm90_nvfp4::wgmma_commit;
using sm90_nvfp4::wgmma_fence;
using sm90_wgmma::bar_init;
using sm90_wgmma::bar_wait;
using sm90_wgmma::cp_async_arrive;
using sm90_wgmma::fence_regs;
using sm90_wgmma::smem_u32;
using sm90_wgmma::wgmma_wait;

__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync_n(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Where a CTA's piece of sequence b lies: its tokens [tok_lo, tok_hi) of the sequence's `length`, in `ntiles`
// tiles, the last of which holds `tail_valid` tokens.
struct Piece {
  int seq_start, piece_end, length, tok_lo, tok_hi, ntiles, tail_valid;
};

__device__ __forceinline__ Piece piece_of(const Params& p, int b, int cursor, int end, int seq_start, int seq_end) {
  Piece pc;
  pc.seq_start = seq_start;
  pc.piece_end = min(end, seq_end);
  pc.length = min(max(p.seq_lens[b], 0), p.max_tokens);
  pc.tok_lo = max(cursor - seq_start - kOverhead, 0) * kUnit;
  pc.tok_hi = min(max(pc.piece_end - seq_start - kOverhead, 0) * kUnit, pc.length);
  pc.ntiles = pc.tok_hi > pc.tok_lo ? (pc.tok_hi - pc.tok_lo + kTile - 1) / kTile : 0;
  pc.tail_valid = pc.tok_hi - pc.tok_lo - (pc.ntiles - 1) * kTile;
  return pc;
}

// A CTA's share of the split-KV schedule (plan_kernel.py's `sched`: [chunk, total, starts[B], ends[B], splits[B],
// slot[B], first_seq[programs]]): cost units [begin, end) of program `prog`, from sequence `first` on.
struct Sched {
  const int32_t* starts;
  const int32_t* ends;
  const int32_t* splits;
  const int32_t* slots;
  int prog, chunk, begin, end, first;
  // This CTA's piece of sequence b from cost unit `cursor` on.
  __device__ __forceinline__ Piece piece(const Params& p, int b, int cursor) const {
    return piece_of(p, b, cursor, end, starts[b], ends[b]);
  }
  // The workspace slot of this CTA's piece of a split sequence b, whose costs start at unit seq_start.
  __device__ __forceinline__ int64_t slot(int b, int seq_start) const { return slots[b] + prog - seq_start / chunk; }
};

__device__ __forceinline__ Sched sched_of(const Params& p, int prog) {
  Sched s;
  const int B = p.batch;
  s.starts = p.sched + 2;
  s.ends = s.starts + B;
  s.splits = s.ends + B;
  s.slots = s.splits + B;
  s.prog = prog;
  s.chunk = p.sched[0];
  s.begin = prog * s.chunk;
  s.end = min(s.begin + s.chunk, p.sched[1]);
  s.first = s.slots[B + prog];
  return s;
}

// The score chains' sum, once their products are done: the chains' accumulators fenced, then added in chain order.
template <int C, int M>
__device__ __forceinline__ void sum_chains(float (&part)[C][M], float (&sc)[M]) {
#pragma unroll
  for (int c = 0; c < C; ++c) fence_regs(part[c]);
#pragma unroll
  for (int e = 0; e < M; ++e) {
    sc[e] = part[0][e];
#pragma unroll
    for (int c = 1; c < C; ++c) sc[e] += part[c][e];
  }
}

// One warpgroup's named barrier (the narrow kernels' warpgroups sync apart).
__device__ __forceinline__ void wg_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

__device__ __forceinline__ void sts16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// The narrow kernels (up to 32 query rows as wgmma's N side): a thread's column c of N / 4 is query row
// 8 (c / 2) + 2 q + c % 2 (q = lane % 4), the accumulator's index 4 (c / 2) + c % 2 for token ta and + 2 for ta + 8.
__device__ __forceinline__ int narrow_row(int c, int q) { return 8 * (c >> 1) + 2 * q + (c & 1); }

// Each warp's per-row values (a tile's maxima or the sums of its tokens, already reduced over the warp's lanes) into
// red[warp][row] by lanes 0-3 (q = lane), then the warpgroup's barrier `bar`; the caller adds a row's four.
template <int N>
__device__ __forceinline__ void narrow_share(const float (&v)[N / 4], float* red, int warp, int lane, int q, int bar) {
  if (lane < 4) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) red[warp * N + narrow_row(c, q)] = v[c];
  }
  wg_sync(bar);
}

// The sum over the tile's tokens of a thread's per-row values: the 8 lanes of each q, then the four warps (in
// s_sums) after the warpgroup's barrier `bar`.
template <int N>
__device__ __forceinline__ void narrow_sum_rows(float (&l)[N / 4], float* s_sums, int warp, int lane, int q, int bar) {
#pragma unroll
  for (int c = 0; c < N / 4; ++c) {
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1) l[c] += __shfl_xor_sync(0xffffffffu, l[c], x);
  }
  narrow_share<N>(l, s_sums, warp, lane, q, bar);
}

// Byte offset of 16-byte chunk c of row r in a [blocks][ROWS rows][64 columns] swizzled image.
template <int ROWS = kRows>
__device__ __forceinline__ uint32_t chunk_offset(int r, int c) {
  return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// K-major descriptor (128-byte swizzle, 1024-byte atom stride) and the MN-major one of the values, whose
// 64-column blocks are kBlock apart.
__device__ __forceinline__ uint64_t desc_k(uint32_t addr) { return sm90_wgmma::make_desc(sm90_wgmma::desc_lo(addr)); }
__device__ __forceinline__ uint64_t desc_mn(uint32_t addr) {
  return (static_cast<uint64_t>(sm90_wgmma::kDescHi) << 32) | (addr >> 4) | ((kBlock >> 4) << 16);
}
// A descriptor moved on by `bytes` (a multiple of 16 inside shared memory, so the 14-bit address field never
// carries). Loops build a tile's descriptors once and step them with this: rebuilt from the address before every
// wgmma, they cost ptxas about ten uniform instructions between consecutive products.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

template <bool F16>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (F16) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// A tile's copies are made by one warpgroup: its warp w copies tokens 16 w .. 16 w + 15, lane l their 16-byte chunks l,
// l + 32 (latent) and, for l < 8, 64 + l (rope), so that each copy instruction of a warp reads 512 contiguous
// bytes. Lane j < 16 looks token 16 w + j's row up (`Rows`) and the warp shares it; tokens from `hi` on read
// zeros. PER (look_up, copy_rows_fp8): token rows a warp copies, 16 for a whole tile (the narrow kernel's half-tile
// buffers take 8).
struct Rows {
  int64_t lat, rope;  // byte offsets of the latent and rope rows
  bool ok;
};

// The rows of token `tok` on page `page` (0 for tokens from `hi` on, whose copies read zeros).
__device__ __forceinline__ Rows rows_at(const Params& p, int64_t page, int tok, int hi, int elem) {
  Rows r;
  r.ok = tok < hi;
  const int64_t slot = r.ok ? tok & ((1 << p.page_shift) - 1) : 0;
  r.lat = (page * p.ckv_p + slot * p.ckv_t) * elem;
  r.rope = (page * p.kpe_p + slot * p.kpe_t) * elem;
  return r;
}

template <int PER = 16>
__device__ __forceinline__ Rows look_up(const Params& p, const int32_t* bt_row, int t0, int hi, int warp, int lane,
                                        int elem) {
  const int tok = t0 + warp * PER + (lane & (PER - 1));
  const int64_t page = tok < hi ? bt_row[tok >> p.page_shift] : 0;
  return rows_at(p, page, tok, hi, elem);
}

// The block-table entries of the next D tiles a warp copies by token rows, looked up D tiles ahead of their copies:
// at page 1 a tile's 64 entries are 256 bytes that no earlier tile touched, and a look_up made just before its copies
// put a DRAM read on the copier's path every tile (on an H200 the copying warps spent a third of their time there,
// and the tiles landed late). Lane j < PER holds the entry of token PER w + j of each tile; tokens from `hi` on: 0.
template <int D, int PER = 16>
struct PagesAhead {
  int page[D];

  __device__ __forceinline__ static int entry(const Params& p, const int32_t* bt_row, int t0, int hi, int warp,
                                              int lane) {
    const int tok = t0 + warp * PER + (lane & (PER - 1));
    return tok < hi ? bt_row[tok >> p.page_shift] : 0;
  }
  // A piece's first D tiles from token t0 on (tiles kTile apart).
  __device__ __forceinline__ void start(const Params& p, const int32_t* bt_row, int t0, int hi, int warp, int lane) {
#pragma unroll
    for (int d = 0; d < D; ++d) page[d] = entry(p, bt_row, t0 + d * kTile, hi, warp, lane);
  }
  // The rows of the tile at t0 (the oldest entry), and the entries of the tile D on looked up in its place.
  __device__ __forceinline__ Rows next(const Params& p, const int32_t* bt_row, int t0, int hi, int warp, int lane,
                                       int elem) {
    const Rows r = rows_at(p, page[0], t0 + warp * PER + (lane & (PER - 1)), hi, elem);
#pragma unroll
    for (int d = 0; d + 1 < D; ++d) page[d] = page[d + 1];
    page[D - 1] = entry(p, bt_row, t0 + D * kTile, hi, warp, lane);
    return r;
  }
};

__device__ __forceinline__ void copy_rows(const Params& p, uint32_t stage, const Rows& rows, int warp, int lane) {
  const char* ckv = static_cast<const char*>(p.ckv) + lane * 16;
  const char* kpe = static_cast<const char*>(p.kpe) + (lane & 7) * 16;
#pragma unroll 4
  for (int j = 0; j < 16; ++j) {
    const int r = warp * 16 + j;
    const int64_t lat = __shfl_sync(0xffffffffu, rows.lat, j);
    const int64_t rope = __shfl_sync(0xffffffffu, rows.rope, j);
    const int bytes = __shfl_sync(0xffffffffu, rows.ok, j) ? 16 : 0;
    cp_async_16(stage + chunk_offset(r, lane), ckv + lat, bytes);
    cp_async_16(stage + chunk_offset(r, lane + 32), ckv + lat + 512, bytes);
    if (lane < 8) cp_async_16(stage + chunk_offset(r, 64 + lane), kpe + rope, bytes);
  }
}

// Where the query rows fit one row block, one CTA reads each tile, once: its TMA boxes and bulk copies (`once`) ask L2
// to evict those lines first (on an H200 1.02-1.04x faster at 16-64 rows, bf16 and FP8 pages of 64). With several
// row blocks the CTAs of a sequence read each tile in turn from L2, and the copies keep the default policy
// (evict-first there measured 0.93-0.97x at 128 rows).
__device__ __forceinline__ bool read_once(const Params& p) { return p.rows <= kRows; }
__device__ __forceinline__ void tile_box(uint32_t dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                         bool once) {
  if (once) {
    sm90_wgmma::tma_load_3d(dst, map, bar, c0, c1, c2, sm90_wgmma::l2_evict_first());
  } else {
    sm90_wgmma::tma_load_3d(dst, map, bar, c0, c1, c2);
  }
}
__device__ __forceinline__ void tile_bulk(uint32_t dst, const void* src, uint32_t bytes, uint64_t* bar, bool once) {
  if (once) {
    sm90_wgmma::bulk_load(dst, src, bytes, bar, sm90_wgmma::l2_evict_first());
  } else {
    sm90_wgmma::bulk_load(dst, src, bytes, bar);
  }
}

// The tile at token t0 by TMA, issued by the 32 lanes of one warp, completing on `bar` (armed by lane 0 first
// with the bytes the warp issues): a box of min(page, 64) tokens x 64 columns per page and column block, each lane
// taking every 32nd page of the tile (9 boxes a tile at page 64 and up, 576 at page 1, 18 a lane). The boxes land
// at their rows' place in the 128-byte swizzled image, whose pattern follows the shared-memory address. Pages from
// token `hi` on are not read (zero_rows clears their rows).
__device__ __forceinline__ void tma_tile(const Params& p, const int32_t* bt_row, int t0, int hi, uint32_t stage,
                                         uint64_t* bar, int lane) {
  const int page = 1 << p.page_shift;
  const int rows = min(page, kTile);
  const int boxes = min((max(hi - t0, 0) + rows - 1) / rows, kTile / rows);  // pages of the tile that are read
  if (lane == 0) sm90_wgmma::bar_expect_tx(bar, boxes * rows * kChunks * 16);
  __syncwarp();
  const bool once = read_once(p);
  for (int k = lane; k < boxes; k += 32) {
    const int tok = t0 + k * rows;
    const int pg = bt_row[tok >> p.page_shift], slot = tok & (page - 1);
    const uint32_t dst = stage + k * rows * 128;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) tile_box(dst + kb * kBlock, &p.map_ckv, bar, kb * 64, slot, pg, once);
    tile_box(dst + 8 * kBlock, &p.map_kpe, bar, 0, slot, pg, once);
  }
}

// Rows `valid` .. 63 of a landed tile to zeros, by a warpgroup's thread t: the tokens past a sequence's end,
// which the TMA copied from their page as they are (or not at all). Their P is 0, but 0 x NaN is not.
__device__ __forceinline__ void zero_rows(uint32_t stage, int valid, int t) {
  for (int i = t; i < (kTile - valid) * kChunks; i += 128) {
    sm90_nvfp4::sts128(stage + chunk_offset(valid + i / kChunks, i % kChunks), 0u, 0u, 0u, 0u);
  }
}

// FP8 pages: a tile's copies land as [64 rows][576 bytes] at `raw` (the 64-row kernel: the upper half of its
// stage, kFp8Off on), each warp instruction reading 512 contiguous bytes of one row.
constexpr int kFp8Off = kImage / 2;  // the wide kernel's FP8 landing place in a stage

template <int PER = 16>
__device__ __forceinline__ void copy_rows_fp8(const Params& p, uint32_t raw, const Rows& rows, int warp, int lane) {
  const char* ckv = static_cast<const char*>(p.ckv) + lane * 16;
  const char* kpe = static_cast<const char*>(p.kpe) + (lane & 3) * 16;
  const uint32_t dst = raw + lane * 16;
#pragma unroll 4
  for (int j = 0; j < PER; ++j) {
    const int r = warp * PER + j;
    const int64_t lat = __shfl_sync(0xffffffffu, rows.lat, j);
    const int64_t rope = __shfl_sync(0xffffffffu, rows.rope, j);
    const int bytes = __shfl_sync(0xffffffffu, rows.ok, j) ? 16 : 0;
    cp_async_16(dst + r * kChunks * 8, ckv + lat, bytes);
    if (lane < 4) cp_async_16(dst + r * kChunks * 8 + 512, kpe + rope, bytes);
  }
}

// One-tensor FP8 cache, pages of 64 tokens and more: the BYTES / 576 rows from token t0 (a tile: 64, 36864 bytes)
// lie in one page, contiguous: one bulk copy, issued by one thread and completing on `bar` (armed here). Rows past
// the sequence's end come as the page holds them; the widening clears them. ONCE: evict-first (the narrow kernel's
// up to 32 rows; in the producer of the 64-row kernel the hint's registers pushed ptxas into more spills).
template <int BYTES = kRaw, bool ONCE = false>
__device__ __forceinline__ void bulk_raw(const Params& p, const int32_t* bt_row, int t0, uint32_t raw, uint64_t* bar) {
  const int64_t page = bt_row[t0 >> p.page_shift];
  const int slot = t0 & ((1 << p.page_shift) - 1);
  sm90_wgmma::bar_expect_tx(bar, BYTES);
  tile_bulk(raw, static_cast<const char*>(p.ckv) + page * p.ckv_p + slot * p.ckv_t, BYTES, bar, ONCE);
}

// Any page size, by the 32 lanes of one warp: below page 64, one bulk copy per page of the tile that holds tokens
// below `hi` (page * 576 contiguous bytes; two a lane at most), into the same plain [64 rows][576 bytes]; rows not
// copied are cleared by the widening. A copy costs its thread one instruction where cp.async token rows cost the
// warpgroup 36 a row.
__device__ __forceinline__ void bulk_pages(const Params& p, const int32_t* bt_row, int t0, int hi, uint32_t raw,
                                           uint64_t* bar, int lane) {
  const int page = 1 << p.page_shift;
  if (page >= kTile) {
    if (lane == 0) bulk_raw(p, bt_row, t0, raw, bar);
    return;
  }
  const int copies = min((max(hi - t0, 0) + page - 1) / page, kTile / page), bytes = page * kChunks * 8;
  if (lane == 0) sm90_wgmma::bar_expect_tx(bar, copies * bytes);
  __syncwarp();
  for (int k = lane; k < copies; k += 32) {
    const int64_t pg = bt_row[(t0 >> p.page_shift) + k];
    sm90_wgmma::bulk_load(raw + k * bytes, static_cast<const char*>(p.ckv) + pg * p.ckv_p, bytes, bar);
  }
}

// Two E4M3 values (the low 16 bits of `pair`, the first in the low byte) to two fp16 ones (exact).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t w;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(w) : "h"(static_cast<uint16_t>(pair)));
  return w;
}

// Eight E4M3 values (8 bytes) to eight fp16 ones (exact), as four 32-bit words.
__device__ __forceinline__ void e4m3x8_to_f16(uint32_t lo, uint32_t hi, uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = e4m3x2_to_f16x2(((i < 2 ? lo : hi) >> (16 * (i & 1))) & 0xffffu);
}

// 16 FP8 bytes of row r (columns 16 q .. 16 q + 15) into the fp16 image's chunks 2 q and 2 q + 1.
__device__ __forceinline__ void store_widened(uint32_t stage, int r, int q, uint4 v) {
  uint32_t a[4], b[4];
  e4m3x8_to_f16(v.x, v.y, a);
  e4m3x8_to_f16(v.z, v.w, b);
  sm90_nvfp4::sts128(stage + chunk_offset(r, 2 * q), a[0], a[1], a[2], a[3]);
  sm90_nvfp4::sts128(stage + chunk_offset(r, 2 * q + 1), b[0], b[1], b[2], b[3]);
}

// Q rows row0 .. row0 + ROWS - 1 of sequence b into their image, by all the CTA's THREADS threads; rows past the
// last one read zeros.
template <typename T, int ROWS, int THREADS = kThreads>
__device__ __forceinline__ void copy_queries(const Params& p, uint32_t s_q, int row0, int b, int tid) {
  constexpr int64_t elem = sizeof(T);
  for (int i = tid; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    const int row = row0 + r;
    const bool ok = row < p.rows;
    const int qi = ok ? row / p.heads : 0, h = ok ? row % p.heads : 0;
    const char* src =
        c < 64 ? static_cast<const char*>(p.qn) + (b * p.qn_b + qi * p.qn_s + h * p.qn_h + c * 8) * elem
               : static_cast<const char*>(p.qp) + (b * p.qp_b + qi * p.qp_s + h * p.qp_h + (c - 64) * 8) * elem;
    cp_async_16(s_q + chunk_offset<ROWS>(r, c), src, ok ? 16 : 0);
  }
}

// Q in place from the queries' dtype (fp16 where QF16, else bf16) to fp16 times `scale` (the softmax scale, for FP8
// pages: the scores' fp16 products then need only the pages' factor), by one warpgroup's thread t.
template <bool QF16, int ROWS>
__device__ __forceinline__ void scale_queries_f16(uint32_t s_q, float scale, int t) {
  for (int i = t; i < ROWS * kChunks; i += 128) {
    const uint32_t addr = s_q + chunk_offset<ROWS>(i / kChunks, i % kChunks);
    const uint4 v = sm90_wgmma::lds128(addr);
    uint32_t in[4] = {v.x, v.y, v.z, v.w}, out[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 f;
      if constexpr (QF16) {
        f = __half22float2(*reinterpret_cast<const __half2*>(&in[k]));
      } else {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[k]));
      }
      out[k] = pack2<true>(f.x * scale, f.y * scale);
    }
    sm90_nvfp4::sts128(addr, out[0], out[1], out[2], out[3]);
  }
  fence_async_smem();  // these stores -> the warpgroup's wgmma reads
}

#endif

}  // namespace sm90_mla
}  // namespace fim
