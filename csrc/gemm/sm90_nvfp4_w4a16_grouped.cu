// Hopper NVFP4-weight (W4A16, and W4A8) grouped GEMM for decode-sized groups, over the masked or the contiguous layout.
//
//   out[r] = act(A[r] @ (e2m1(W[e]) * block_scale[e] * global_scale[e])^T)   for the rows r of group e:
//   offsets[e] + t (contiguous) or e * C + t (masked), t < min(counts[e], C)
//   A  [rows, K] bf16 (row-major); W [E, NW, K / 2] uint8, K-permuted (moe/packed_nvfp4.py); block_scale
//   [E, NW, K / 16] e4m3; global_scale [E] or [E, 2] (gate, up) fp32; out [rows, N] bf16 or fp32
//
// Why a kernel beside the Triton one: expanding 4-bit weights costs integer instructions per weight, and at
// decode those instructions, not the memory, set the time. Here the weights are wgmma's A operand (the weight
// rows are the 64-row M side, the few tokens the N side), so every weight is expanded exactly once, by the
// thread whose registers wgmma reads it from, and no expanded weight passes through shared memory. The
// K-permuted layout puts each thread's bytes of one 64-deep span together: one 8-byte shared-memory load per row
// and span. Its fragments can be double-buffered, so that a span's expansion overlaps the previous span's
// products, which the Triton kernel cannot do: with the prefill tiles (128 and 256 tokens) it leads the Triton
// kernel at every group size (moe/gemm_nvfp4_sm90.py, docs/perf.md).
//
// Expansion: a byte-permute lookup turns four bytes into four bf16x2 (two tables of the bf16 high and low
// bytes of the eight E2M1 magnitudes, the sign bits replicated into the high bytes), then one bf16x2 multiply
// by the block scale applies it exactly (E2M1 x E4M3 has at most 6 significant bits). Each warpgroup converts
// its block scales to those bf16x2 factors once per stage, into shared memory. Weights packed with split bits
// (moe/packed_nvfp4.py) skip the lookup: shifts and masks put each word's bits straight into bf16 pairs that
// read as the values times 2**-126, the factors carry 2**118 and the global scale 2**8 (expand4_split).
//
// W4A8 (kA8: e4m3 activations with one fp32 scale per row or per tensor, weights in W4A8 words): the FP8 wgmma is 32
// deep and the block scales change every 16 K, so each block scale is folded into an 8-entry e4m3 table of its
// weights' magnitudes (x 1/8), looked up by byte permutes (expand8_e4m3); the tables are copied per stage from those
// of all 256 scale bytes, built once per CTA. The activations' scales and the 8 are applied to the sums. Half the
// tensor-pipe instructions and half the activation bytes of W4A16: 1.2-1.3x W4A16 at 64 rows a group, 1.06-1.17x at
// 32, 1.02-1.16x at 8-16 (with TMA stages there; the latency between the stages and the products sets the time), an
// E4M3 rounding of each folded weight (docs/perf.md).
//
// Structure: two warpgroups per CTA (four for 64-token tiles; for 128, three without the activation and four with it
// where the grid's waves allow), 64 weight rows each (with an activation: the first half of the warpgroups the gate
// rows, the second half their up rows, the up accumulators passed to the gate warpgroups through shared memory at the
// end), CTAs per (column block, expert) along the group's token tiles as many as its mean size fills, each looping over
// every such tile (one at decode). A ring of shared-memory stages, each 256 K (prefill tiles: 128) of the activations
// (wgmma's B operand: 128-byte swizzled rows), the CTA's weight rows and their block scales, is filled with cp.async by
// the whole CTA, or (from 32-token tiles on, and every W4A8 tile) by TMA boxes that one thread issues. At 8-16 tokens
// the integer pipe (the expansion's masks and shifts) and the weight stream set the time; at 64 tokens, latency; at
// prefill, the tensor pipe and the stages' latency (docs/perf.md and docs/perf-notes.md have the profiles).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "sm90_launch.cuh"
#include "sm90_nvfp4_ptx.cuh"

namespace fim {
namespace sm90_nvfp4 {

// The prefill tiles: 128 and 256 tokens a CTA (256: wgmma's largest N), so that each expanded weight serves that
// many products; one CTA an SM, the stages refilled late (kLate), the output staged through shared memory.
// W4A8's 128-token tile (its largest) has the decode tiles' structure, three warpgroups (gated: two) and 256-deep
// stages, one CTA an SM: its FP8 activations take half the bytes, so such a stage fits where W4A16's does not. At 128
// rows a group on an H200: 1.02-1.11x the prefill tiles' structure, 0.99-1.06x four warpgroups with 128-deep stages,
// 0.98-1.03x itself with two fragment buffers (docs/perf-notes.md).
__host__ __device__ constexpr bool a8_t128(int t, bool a8) { return a8 && t == 128; }
__host__ __device__ constexpr bool prefill_tile(int t, bool a8 = false) { return t >= 128 && !a8_t128(t, a8); }
// K of one shared-memory stage of T-token tiles: 256 (four 64-deep spans), except for the prefill tiles, whose
// activations alone would take 64-128 KB a stage at that depth: 128 there (3 or 5 stages in the SM's shared memory).
__host__ __device__ constexpr int stage_k(int t, bool a8 = false) { return prefill_tile(t, a8) ? 128 : 256; }
// CTAs that take an SM alone (its registers and shared memory): three or four warpgroups, or 128 tokens and more
// (the prefill tiles, and W4A8's 128-token tile); the others two an SM.
__host__ __device__ constexpr bool one_cta_per_sm(int t, int w) { return w >= 3 || t >= 128; }
// Per CTA of W warpgroups (64 weight rows each) and stage K sk: a stage's weight bytes, their block scales, and
// those scales as duplicated bf16 pairs (scale_pairs).
__host__ __device__ constexpr int w_stage_bytes(int w, int sk) { return 64 * w * sk / 2; }
__host__ __device__ constexpr int s_stage_bytes(int w, int sk) { return 64 * w * sk / 16; }
__host__ __device__ constexpr int pair_bytes(int w, int sk) { return 64 * w * sk / 16 * 4; }
// W4A8: a weight row's e4m3 tables per stage (8 bytes a block of 16 K, see expand8_e4m3), padded by 16 bytes so that
// the two rows a quarter-warp reads fall into different banks; and the tables of all 256 scale bytes (2 KB, built
// once per CTA) they are copied from.
__host__ __device__ constexpr int table_row_bytes(int sk) { return sk / 2 + 16; }
constexpr int kScaleTableBytes = 256 * 8;
// Shared memory beside the stages: the scale pairs (W4A16) or the tables (W4A8).
__host__ __device__ constexpr int conv_bytes(int w, int sk, bool a8) {
  return a8 ? 64 * w * table_row_bytes(sk) + kScaleTableBytes : pair_bytes(w, sk);
}
// Warpgroups per CTA for T-token tiles: 4 for the 64-token tile, whose stages take the SM's shared memory alone (16
// warps to hide its latencies instead of 8, and each activation stage read for 256 weight rows, not 128: measured 10%
// faster on an H100; gated, two gate and two up warpgroups, 1.14-1.25x (W4A16) and 1.28-1.38x (W4A8) at 33-64 rows
// per group and 2048 output columns on H200s, 0.98-1.03x at 768, docs/perf-notes.md); 3 for the 128-token tile
// without the activation, for the same reasons (its 64 accumulators a thread fit 3 x 128 threads' registers, not
// 4 x 128: 1.01-1.11x at 100-128 rows per group on an H200); else 2 (gate and up rows pair warpgroups; the 256-token
// tile's 128 accumulators leave room for no more). WIDE: the gated 128-token tile on four (two gate, two up), which
// the launch picks where the grid's waves allow (moe/gemm_nvfp4_sm90.py): its CTAs take 128 output columns each, twice
// as long as two warpgroups' 64, and each activation stage is read for 256 weight rows (1.07-1.20x faster where the
// GPU stays full; its 64 accumulators a thread fit 512 threads with 256-264 bytes spilled in the epilogue alone).
template <int T, bool GATED, bool A8, bool WIDE = false>
constexpr int warpgroups_for() {
  static_assert(!WIDE || (T == 128 && GATED && !A8), "four warpgroups: the gated W4A16 128-token tile");
  if constexpr (a8_t128(T, A8)) return GATED ? 2 : 3;
  if constexpr (WIDE) return 4;
  return T == 64 ? 4 : (T == 128 && !GATED ? 3 : 2);
}
// Bytes of one stage of T-token tiles (activations, weights, block scales), and the output columns of a CTA (GATED:
// half its weight rows are up rows), for the kernel and its launch alike.
__host__ __device__ constexpr int stage_bytes(int t, int w, bool a8) {
  return t * stage_k(t, a8) * (a8 ? 1 : 2) + w_stage_bytes(w, stage_k(t, a8)) + s_stage_bytes(w, stage_k(t, a8));
}
__host__ __device__ constexpr int cols_per_cta(int w, bool gated) { return gated ? 32 * w : 64 * w; }
// Whether T-token tiles take their stages by TMA (ParamsTma, mbarriers) instead of cp.async: from 32 tokens on (at 64
// tokens 1.08-1.13x faster on an H200, whose cp.async addresses and predicates take issue slots from the expansion),
// and W4A8's smaller tiles too (1.03-1.10x at 8-16 rows a group on an H200; W4A16's 8- and 16-token tiles measured
// 0.95-1.04x there, and one thread's TMA issue then holds the CTA at each stage's barrier, docs/perf-notes.md).
__host__ __device__ constexpr bool tma_tiles(int t, bool a8) { return t >= 32 || a8; }

// The expansion's byte tables (bf16 low and high bytes of the E2M1 magnitudes), see expand4.
[[maybe_unused]] __device__ const uint32_t kTables[4] = {0xC0800000u, 0xC0804000u, 0x3F3F3F00u, 0x40404040u};

struct Params {
  const void* a;           // [rows, K] bf16 (W4A16) or e4m3 (W4A8)
  const uint8_t* w;        // [E, NW, K / 2], K-permuted
  const uint8_t* scale;    // [E, NW, K / 16] e4m3
  const float* gscale;     // [E, gscale_stride]
  const int32_t* counts;   // [E]
  const int32_t* offsets;  // [E] first row of each group (contiguous layout), or null (masked: e * capacity)
  void* out;               // [rows, n_out]
  int capacity, nw, k, n_out, gscale_stride;
  int act, out_f32;
  float alpha, limit;
  int num_experts;
  // Contiguous layout with fewer rows than experts: CTA row y serves the group that starts at row y (if any), so
  // that the grid has min(rows, E) CTA rows, not one per expert, most of them idle at decode.
  int row_map;
  // A group's rows past its last whole tile of split_tile tokens, when 1 .. tail_hi of them, are left to launches
  // of smaller tiles, each taking the groups whose rest is in (tail_lo, tail_hi] (tail: this launch is one), so that
  // a group a little past a tile (or a masked group far below its capacity) does not pay for a whole one.
  // split_tile 0: every row here.
  int split_tile, tail_lo, tail_hi, tail;
  // W4A8: the activations' dequantization scales, row r's at a_scale[r * a_scale_stride] (stride 0: per tensor).
  const float* a_scale;
  int a_scale_stride;
};
// Tiles of 32 tokens and more (kTma): the stages by TMA, from these maps (128-byte swizzle; boxes of [T rows, 64] of a,
// [64 rows, 128 bytes] of w, [64 rows, 16 bytes] of the block scales where s_tma, else those by cp.async). The smaller
// tiles' kernels take Params alone (the maps' 64-byte alignment would move every field's offset).
struct ParamsTma : Params {
  int s_tma;  // K a multiple of 256: the block scales' rows are then whole 16-byte units
  CUtensorMap map_a, map_w, map_s;
};
template <int T, bool A8>
using ParamsFor = typename std::conditional<tma_tiles(T, A8), ParamsTma, Params>::type;

// The weight layouts (moe/packed_nvfp4.py), each with its expansion: K-permuted bytes by byte lookup (W4A16), split
// bits (W4A16), and the W4A8 words (e4m3 by table lookup, FP8 activations).
enum Mode : int { kLookup = 0, kSplit = 1, kA8 = 2 };

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Four weight bytes -> four bf16x2 (byte j -> o[j], its low nibble in the low half), o[0..1] times the scale
// pair s01 and o[2..3] times s23. prmt with the 3-bit magnitude as selector reads the high and the low byte of
// the bf16 of each E2M1 magnitude (0, .5, 1, 1.5, 2, 3, 4, 6: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0) from two
// 8-byte tables; prmt's sign mode replicates each nibble's sign bit (from x << 4 and x) into a byte that is
// or-ed into the high bytes; two more prmt interleave low and high bytes into pairs.
// The lookup tables, kept in registers by the caller (materialized inside the asm they cost an instruction each
// per use).
struct Tables {
  uint32_t lo0, lo1, hi0, hi1;
};

__device__ __forceinline__ void expand4(const Tables& tb, uint32_t x, uint32_t s01, uint32_t s23, uint32_t& o0,
                                        uint32_t& o1, uint32_t& o2, uint32_t& o3) {
  asm("{\n"
      ".reg .b32 xm, xh, xs, l01, h01, l23, h23, s01, s23;\n"
      "and.b32 xm, %4, 0x77777777;\n"
      "shr.u32 xh, xm, 16;\n"
      "shl.b32 xs, %4, 4;\n"
      "prmt.b32 l01, %7, %8, xm;\n"
      "prmt.b32 h01, %9, %10, xm;\n"
      "prmt.b32 l23, %7, %8, xh;\n"
      "prmt.b32 h23, %9, %10, xh;\n"
      "prmt.b32 s01, xs, %4, 0xD9C8;\n"
      "prmt.b32 s23, xs, %4, 0xFBEA;\n"
      "lop3.b32 h01, h01, s01, 0x80808080, 0xF8;\n"
      "lop3.b32 h23, h23, s23, 0x80808080, 0xF8;\n"
      "prmt.b32 %0, l01, h01, 0x5140;\n"
      "prmt.b32 %1, l01, h01, 0x7362;\n"
      "prmt.b32 %2, l23, h23, 0x5140;\n"
      "prmt.b32 %3, l23, h23, 0x7362;\n"
      "mul.rn.bf16x2 %0, %0, %5;\n"
      "mul.rn.bf16x2 %1, %1, %5;\n"
      "mul.rn.bf16x2 %2, %2, %6;\n"
      "mul.rn.bf16x2 %3, %3, %6;\n"
      "}\n"
      : "=r"(o0), "=r"(o1), "=r"(o2), "=r"(o3)
      : "r"(x), "r"(s01), "r"(s23), "r"(tb.lo0), "r"(tb.lo1), "r"(tb.hi0), "r"(tb.hi1));
}

// Split-bits words (moe/packed_nvfp4.py): four bytes' eight E2M1 codes -> four bf16x2 by shifts, rotations and
// masks alone (each half: sign at bit 15, magnitude at bits 8..6, read as the value times 2**-126, code 1 a bf16
// subnormal), then times the scale pairs, which carry 2**118: the weights times 2**-8, exact. 7 integer-pipe
// instructions per 8 weights (5 masks, 2 rotations; the two left shifts may issue as IMAD) against the lookup's 15.
__device__ __forceinline__ void expand4_split(uint32_t y, uint32_t s01, uint32_t s23, uint32_t& o0, uint32_t& o1,
                                              uint32_t& o2, uint32_t& o3) {
  constexpr uint32_t kPair = 0x81C081C0u;
  const uint32_t p0 = y & kPair;
  const uint32_t p1 = (y << 4) & kPair;
  const uint32_t p2 = __funnelshift_l(y, y, 10) & kPair;
  const uint32_t p3 = ((y << 6) & 0x80C080C0u) | (__funnelshift_l(y, y, 14) & 0x01000100u);
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o0) : "r"(p0), "r"(s01));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o1) : "r"(p1), "r"(s01));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o2) : "r"(p2), "r"(s23));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(o3) : "r"(p3), "r"(s23));
}

// W4A8 words (moe/packed_nvfp4.py): eight weights of one row, four of a block (a) and four of the next (b), with
// their 3-bit magnitudes in nibbles 0..3 (a) and 4..7 (b) and their signs at the nibbles' top bits: a's at bits 7,
// 15, 23, 31, b's at bits 3, 11, 19, 27. -> the four e4m3 of a (byte j: weight j) and of b, each byte looked up in
// its block's table (ta: bytes 0..3 in ta.x, 4..7 in ta.y; entry m: e4m3(|e2m1 m| x block scale / 8)) with the
// sign or-ed in: 8 integer-pipe instructions per 8 weights, about the split bits' 7, without their multiplies.
__device__ __forceinline__ void expand8_e4m3(uint32_t y, uint2 ta, uint2 tb, uint32_t& a, uint32_t& b) {
  asm("{\n"
      ".reg .b32 sa, sb, ys;\n"
      "and.b32 sa, %2, 0x7777;\n"
      "prmt.b32 sa, %3, %4, sa;\n"
      "lop3.b32 %0, sa, %2, 0x80808080, 0xF8;\n"
      "shr.u32 sb, %2, 16;\n"
      "and.b32 sb, sb, 0x7777;\n"
      "prmt.b32 sb, %5, %6, sb;\n"
      "shl.b32 ys, %2, 4;\n"
      "lop3.b32 %1, sb, ys, 0x80808080, 0xF8;\n"
      "}\n"
      : "=r"(a), "=r"(b)
      : "r"(y), "r"(ta.x), "r"(ta.y), "r"(tb.x), "r"(tb.y));
}

// The W4A8 tables of all 256 scale bytes: entry 8 s + m = e4m3(|e2m1 m| x e4m3 s / 8), rounded to nearest and
// saturating (/ 8 keeps 6 x 448 in range; the accumulators take the 8 back). Scale bytes that are NaN give NaN's
// table. Built by every thread of the CTA, four entries a 4-byte store.
template <int kThreads>
__device__ __forceinline__ void build_scale_tables(uint32_t dst) {
  // |e2m1 m|: 0, .5, 1, 1.5, 2, 3, 4, 6.
  auto mag = [](int m) { return m < 2 ? 0.5f * m : ldexpf(1.0f + 0.5f * (m & 1), (m >> 1) - 1); };
  for (int i = threadIdx.x; i < kScaleTableBytes / 4; i += kThreads) {
    const int sb = i >> 1, m0 = 4 * (i & 1);
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(sb), __NV_E4M3);
    const float sc = __half2float(*reinterpret_cast<const __half*>(&h)) * 0.125f;
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(mag(m0) * sc, mag(m0 + 1) * sc), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(mag(m0 + 2) * sc, mag(m0 + 3) * sc), __NV_SATFINITE, __NV_E4M3);
    sts(dst + 4 * i, lo | (hi << 16));
  }
}

// Two E4M3 scales (the low 16 bits of v) -> a bf16x2 holding the first twice and one holding the second twice,
// times ``factor`` (1, or 2**118 for split bits: exact, an E4M3 is an fp16 and a bf16, and 448 * 2**118 is
// inside bf16's range).
__device__ __forceinline__ void scale_pairs(uint32_t v, float factor, uint32_t& p0, uint32_t& p1) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFF), __NV_E4M3);
  float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  f.x *= factor;
  f.y *= factor;
  const __nv_bfloat162 b0 = __floats2bfloat162_rn(f.x, f.x);
  const __nv_bfloat162 b1 = __floats2bfloat162_rn(f.y, f.y);
  p0 = *reinterpret_cast<const uint32_t*>(&b0);
  p1 = *reinterpret_cast<const uint32_t*>(&b1);
}

__device__ __forceinline__ float gated(float gate, float up, int act, float alpha, float limit) {
  if (act == 1) return gate / (1.0f + __expf(-gate)) * up;
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return g / (1.0f + __expf(-alpha * g)) * (u + 1.0f);
}

// The accumulators times the global scale (GATED: the gate warpgroups', through the activation with their up
// warpgroup's, passed through shared memory at `base`, [i][thread] so without bank conflicts; one CTA barrier).
// Returns whether this thread holds outputs: not up rows, and its warpgroup's columns exist.
template <int T, int W, bool GATED>
__device__ __forceinline__ bool scaled_outputs(const Params& p, float (&acc)[T / 2], uint32_t base, float g0, float g1,
                                               bool active) {
  constexpr int R = T / 2;
  if constexpr (GATED) {
    const int wg = threadIdx.x >> 7;
    const bool up_rows = W == 2 ? wg == 1 : wg >= W / 2;
    const uint32_t xchg = base + (wg % (W / 2)) * (R * 512) + 4 * (threadIdx.x & 127);
    if (up_rows && active) {
#pragma unroll
      for (int i = 0; i < R; ++i) sts(xchg + 512 * i, __float_as_uint(acc[i]));
    }
    __syncthreads();
    if (up_rows || !active) return false;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = gated(acc[i] * g0, lds(xchg + 512 * i) * g1, p.act, p.alpha, p.limit);
    return true;
  } else {
    if (!active) return false;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] *= g0;
    return true;
  }
}

// The prefill tiles' bf16 output: the scaled accumulators stored transposed into a [T, kCols] tile in shared memory
// by stmatrix, then written out by the whole CTA in 16-byte row pieces (its scalar stores of 2 bytes, four rows a
// warp instruction, measured 1.04-1.09x slower at K = 2048). Every stage has been read (the caller's barrier).
template <int T, int W, bool GATED>
__device__ __forceinline__ void epilogue_staged(const Params& p, float (&acc)[T / 2], uint32_t base, float g0, float g1,
                                                int64_t out_row0, int rows, bool active) {
  constexpr int R = T / 2, kCols = cols_per_cta(W, GATED), kThreads = 128 * W;
  // Rows padded by 16 bytes: a transposed 8 x 8 matrix's eight rows then fall into different banks.
  constexpr int kPitch = kCols * 2 + 16;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  // GATED: the exchange takes [0, W / 2 * R * 512) of the stages (a slot per gate warpgroup), the output tile the
  // bytes after it.
  const uint32_t tile = base + (GATED ? (W / 2) * R * 512 : 0);
  if (scaled_outputs<T, W, GATED>(p, acc, base, g0, g1, active)) {
    // Matrix (j, h): output columns warp * 16 + 8 h + (0..7) of the warpgroup's (GATED: of gate warpgroup wg's 64,
    // in the order of the CTA's gate rows), tokens 8 j + (0..7); this thread's
    // pair of it is acc[4 j + 2 h], acc[4 j + 2 h + 1]. One stmatrix takes (j, 0), (j, 1), (j + 1, 0), (j + 1, 1).
    const int m = lane >> 3;
    const uint32_t addr =
        tile + ((m >> 1) * 8 + (lane & 7)) * kPitch + ((GATED ? wg % (W / 2) : wg) * 64 + warp * 16 + 8 * (m & 1)) * 2;
#pragma unroll
    for (int j = 0; j < T / 8; j += 2)
      stmatrix_x4_trans(addr + 8 * j * kPitch, bf16x2_of(acc[4 * j], acc[4 * j + 1]),
                        bf16x2_of(acc[4 * j + 2], acc[4 * j + 3]), bf16x2_of(acc[4 * j + 4], acc[4 * j + 5]),
                        bf16x2_of(acc[4 * j + 6], acc[4 * j + 7]));
  }
  __syncthreads();
  constexpr int kChunks = kCols / 8;  // 16-byte pieces of a row
  const int col_cta = blockIdx.x * kCols;
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  for (int i = threadIdx.x; i < T * kChunks; i += kThreads) {
    const int t = i / kChunks, c = i % kChunks;
    if (t >= rows || col_cta + 8 * c >= p.n_out) continue;
    stg128(out + (out_row0 + t) * p.n_out + col_cta + 8 * c, lds128(tile + t * kPitch + 16 * c));
  }
  __syncthreads();  // the tile read before the next tile's stages land
}

#endif

// T: tokens per tile (wgmma's N); W: warpgroups (64 weight rows each; GATED: the first W / 2 hold gate rows, the
// others their up rows, in the same order); STAGES: shared-memory stages, each the activations, weights and scales
// of stage_k(T) K; MODE: the weight layout and its expansion (Mode).
template <int T, int W, bool GATED, int STAGES, int MODE>
__global__ void __launch_bounds__(128 * W, one_cta_per_sm(T, W) ? 1 : 2)
    nvfp4_grouped_kernel(const __grid_constant__ ParamsFor<T, MODE == kA8> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kThreads = 128 * W, kRowsCta = 64 * W;
  constexpr bool SPLIT = MODE == kSplit, A8 = MODE == kA8;
  constexpr int SK = stage_k(T, A8), kSpans = SK / 64;  // a stage's K and its 64-deep spans
  using AT = typename std::conditional<A8, uint8_t, __nv_bfloat16>::type;
  // The activations' 128-byte swizzle atoms: 64 K of bf16, 128 K of e4m3 (two spans).
  constexpr int kAtomK = 128 / sizeof(AT), kSpansAtom = kAtomK / 64;
  static_assert(SK == 128 || SK == 256, "a scale row per stage is 8 or 16 bytes");
  // A weight row's bytes, block scales and scale-pair bytes per stage.
  constexpr int kWRow = SK / 2, kSRow = SK / 16, kPRow = SK / 4;
  constexpr int kWStageBytes = w_stage_bytes(W, SK);
  constexpr int kCols = cols_per_cta(W, GATED);
  constexpr int R = T / 2;  // accumulator floats per thread
  constexpr float kScaleFactor = SPLIT ? 0x1p118f : 1.0f, kUnscale = SPLIT ? 256.0f : (A8 ? 8.0f : 1.0f);
  constexpr int kTRow = table_row_bytes(SK);  // W4A8: a row's tables in a stage
  // Fragment buffers: with two, a span's expansion runs while the previous span's wgmma group is in flight
  // (ptxas would otherwise give every span's fragments the same registers, see the span loop). Only for 8-token
  // tiles (W4A16: without the activation), and for the prefill tiles, whose products are long enough to hide a span's
  // expansion whole: elsewhere the extra 16 registers per thread, at the 128 that two CTAs per SM (or 512 threads)
  // allow, measured slower (W4A16's gated 8-token tile 266 against 236 us; every decode tile with two, on an H100: no
  // faster at 8 rows, 0.9-1.0x at 16-64, docs/perf-notes.md; W4A8's tiles of 16-128 tokens: 0.98-1.03x; on an H200
  // again, 0.95-0.99x at 16 and 1.00x at 32). W4A8's gated 8-token tile, whose e4m3 fragments take 8 registers a
  // buffer, 1.07-1.08x faster with two.
  constexpr int kBufs = (T == 8 && (!GATED || A8)) || prefill_tile(T, A8) ? 2 : 1;
  constexpr int kXBytes = T * SK * static_cast<int>(sizeof(AT));
  // The prefill tiles refill a stage's buffer in the middle of the next stage (after its first span's products
  // were issued and the last stage's have completed), not at its start: STAGES - 1 stages ahead instead of
  // STAGES - 2, which makes the difference between one stage and two where three stages are all that fit (T = 256:
  // 1.04-1.14x faster on five of six shapes on an H100, docs/perf-notes.md).
  constexpr bool kLate = prefill_tile(T, A8);
  static_assert(!kLate || (kSpans == 2 && kBufs == 2 && (W == 2 || W == 3 + GATED)),
                "two spans a stage, two fragment buffers");
  // ... and each thread copies one 4-byte piece of the block scales, of a row of its own warpgroup (thread t: row
  // t / 2), so that a warpgroup barrier makes a stage's scales visible to the warpgroup that converts them.
  static_assert(!kLate || kRowsCta * kSRow / 4 == kThreads, "one scale copy a thread");
  constexpr int kStageBytes = stage_bytes(T, W, A8);
  constexpr bool kTma = tma_tiles(T, A8);  // the stages by TMA boxes that one thread issues
  extern __shared__ uint8_t smem_raw[];

  // The grid: (column blocks, CTAs along a group, experts or rows), so that the CTAs running together share an
  // expert's weights across its token tiles (kept in L2) rather than sweep every expert's for one tile.
  const int grid_row = blockIdx.z, tile_cta = blockIdx.y, tile_ctas = gridDim.y;
  int e = grid_row;
  if (p.row_map) {
    // The last group starting at or before row y (group starts never decrease); an empty group shares its start
    // with the next, so the last of equal starts is the one holding rows.
    const int y = grid_row;
    e = last_at_or_before(p.offsets, p.num_experts, y);
    if (__ldg(p.offsets + e) != y) return;
  }
  int count = min(__ldg(p.counts + e), p.capacity);
  int64_t first_row = p.offsets ? __ldg(p.offsets + e) : static_cast<int64_t>(e) * p.capacity;
  if (T >= 32 && p.split_tile) {  // (the decode tiles of 8 and 16 take no part: their SASS stays as it was)
    const int rest = count % p.split_tile;
    if (p.tail) {
      const bool mine = rest > p.tail_lo && rest <= p.tail_hi;
      first_row += count - rest;
      count = mine ? rest : 0;
    } else if (rest <= p.tail_hi) {
      count -= rest;
    }
  }
  if (count <= 0) return;
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, q = lane & 3;
  // Output columns [col0, col0 + 64) of this warpgroup (GATED: those of its gate or up rows, the up rows being
  // n_out further).
  const int col0 = blockIdx.x * kCols + (GATED ? wg % (W / 2) : wg) * 64;
  const bool active = col0 < p.n_out;  // uniform per warpgroup
  const int half_k = p.k >> 1, groups = p.k >> 4, spans = p.k >> 6;
  const int stages = (p.k + SK - 1) / SK;
  const uint8_t* w_e = p.w + static_cast<int64_t>(e) * p.nw * half_k;
  const uint8_t* s_e = p.scale + static_cast<int64_t>(e) * p.nw * groups;

  // The weight row of the CTA's local row lr (< 64 W), or -1 past the last output column.
  auto weight_row = [&](int lr) {
    const int col = blockIdx.x * kCols + (GATED ? (lr & (kCols - 1)) : lr);  // GATED: kCols a power of two
    return col < p.n_out ? col + (GATED && lr >= kCols ? p.n_out : 0) : -1;
  };
  // This thread's two local rows (wgmma's rows lane / 4 and lane / 4 + 8 of its warp's 16); both have the
  // same residue modulo 4, which the weight stage's swizzle uses.
  const int lr0 = wg * 64 + warp * 16 + (lane >> 2);
  // Shared-memory offsets of this thread's weight bytes and scales within a stage (rows lr0 and lr0 + 8 are 8 kWRow
  // and 8 kPRow bytes further), and the low word of the descriptor of stage 0's first activation atom. The 32 bytes
  // of span d of row lr: cp.async (SK 256) puts them at 32 (d ^ lr % 4) (this thread's 8 at 8 q in them); the TMA's
  // swizzle (as wide as a row, kWRow bytes) puts 16-byte chunk c at c ^ ((kWRow lr / 128) % (kWRow / 16)) (this
  // thread's 8 bytes in chunk 2 d + q / 2, at 8 (q % 2)).
  const uint32_t w_thread = kXBytes + lr0 * kWRow + (kTma ? 8 * (q & 1) : 8 * q);
  const uint32_t w_swz = kTma ? ((lr0 * kWRow) >> 7) & (kWRow / 16 - 1) : lr0 & 3;
  // This thread's converted scale pairs (row lr0 + 8 j is 8 kPRow bytes further), and the raw scales it converts
  // for its warpgroup each stage (row wg * 64 + t / 2, its half of the row's groups by t % 2, t its index in the
  // warpgroup).
  // W4A8: the tables instead of the pairs (row lr at lr kTRow), then the 256 scale bytes' (scale_tables).
  const uint32_t pairs = base + STAGES * kStageBytes;  // conv_bytes(W, SK, A8)
  const uint32_t s_thread = pairs + lr0 * (A8 ? kTRow : kPRow);
  const uint32_t scale_tables = pairs + kRowsCta * kTRow;
  // kTma: [STAGES] mbarriers, a stage's TMA boxes landed, after the pairs; bit s of `phases` the parity of stage s's
  // next wait.
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + (pairs + conv_bytes(W, SK, A8) - smem_u32(smem_raw)));
  uint32_t phases = 0;
  if constexpr (A8) build_scale_tables<kThreads>(scale_tables);
  if constexpr (kTma) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; ++s) sm90_wgmma::bar_init(&full[s], 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
  }
  if constexpr (kTma || A8) __syncthreads();
  const int conv_row = wg * 64 + ((threadIdx.x & 127) >> 1), conv_half = threadIdx.x & 1;
  // The weights' shared-memory descriptors (K-major, 128-byte swizzle, sm90_wgmma::make_desc): their low word, the
  // start address / 16 with leading offset 1, is built once and stepped by adds (a 16-deep k step is 32 bytes).
  const uint32_t desc_lo0 = sm90_wgmma::desc_lo(base);

  // The expansion's tables, read from memory so that ptxas keeps them in registers instead of rebuilding each
  // constant before every use (16 instructions a span).
  const Tables tables{__ldg(kTables), __ldg(kTables + 1), __ldg(kTables + 2), __ldg(kTables + 3)};

  // This thread's copies of every stage, fixed for the CTA (weights: 128 rows x 8 chunks of 16 bytes; scales:
  // the rows x kSRow / 4 copies of 4 bytes, a row's scales being only 4-byte aligned), advanced by one stage's
  // bytes per stage. Chunk c of weight row lr lands at c ^ 2 (lr % 4), so that a half-warp's four rows read four
  // different bank ranges.
  // kTma: only the scales, where the TMA does not bring them.
  static_assert(kTma || SK == 256, "the weights' cp.async layout is that of 256-deep stages");
  constexpr int kWCopies = kTma ? 0 : kRowsCta * 8 / kThreads, kSCopies = kRowsCta * (kSRow / 4) / kThreads;
  // (16-byte chunks of a stage's activation rows, a whole number a thread.)
  constexpr int kXChunks = SK * static_cast<int>(sizeof(AT)) / 16, kXPerChunk = 16 / static_cast<int>(sizeof(AT));
  static_assert(kTma || T * kXChunks % kThreads == 0, "the activations' copies fill the threads");
  constexpr int kXCopies = kTma ? 0 : T * kXChunks / kThreads;
  const uint8_t* w_src[kWCopies > 0 ? kWCopies : 1];
  uint32_t w_dst[kWCopies > 0 ? kWCopies : 1];
  int w_lim[kWCopies > 0 ? kWCopies : 1];  // bytes of the row past the copy's start in stage 0 (<= 0: no such row)
#pragma unroll
  for (int m = 0; m < kWCopies; ++m) {
    const int i = threadIdx.x + m * kThreads, lr = i >> 3, c = i & 7;
    const int wr = weight_row(lr);
    w_src[m] = wr >= 0 ? w_e + static_cast<int64_t>(wr) * half_k + 16 * c : p.w;
    w_dst[m] = kXBytes + lr * 128 + ((c ^ (2 * (lr & 3))) << 4);
    w_lim[m] = wr >= 0 ? half_k - 16 * c : 0;
  }
  const uint8_t* s_src[kSCopies];
  uint32_t s_dst[kSCopies];
  int s_lim[kSCopies];
#pragma unroll
  for (int m = 0; m < kSCopies; ++m) {
    const int i = threadIdx.x + m * kThreads, lr = i / (kSRow / 4), c = i % (kSRow / 4);
    const int wr = weight_row(lr);
    s_src[m] = wr >= 0 ? s_e + static_cast<int64_t>(wr) * groups + 4 * c : p.scale;
    s_dst[m] = kXBytes + kWStageBytes + lr * kSRow + 4 * c;
    s_lim[m] = wr >= 0 ? groups - 4 * c : 0;
  }
  int tma_wgs = 0;  // kTma: warpgroups with weight rows (the others' boxes are not loaded)
  bool scales_by_tma = false;
  if constexpr (kTma) {
    for (int w = 0; w < W; ++w) tma_wgs += weight_row(64 * w) >= 0;
    scales_by_tma = p.s_tma && SK == 256;  // the TMA's boxes are 16 bytes wide at least
  }

  // A group larger than a tile runs as several tiles, this CTA taking every tile_ctas-th of them one after the
  // other, each reading its weight rows again (from L2 after the first).
  for (int t0 = tile_cta * T; t0 < count; t0 += tile_ctas * T) {
    // Activations: T rows x 32 chunks of 16 bytes per stage, 128-byte swizzled per 64-K atom (wgmma's B); rows
    // past the group are zero-filled.
    const AT* x_src[kXCopies > 0 ? kXCopies : 1];
    uint32_t x_dst[kXCopies > 0 ? kXCopies : 1];
    int x_lim[kXCopies > 0 ? kXCopies : 1];
#pragma unroll
    for (int m = 0; m < kXCopies; ++m) {
      const unsigned i = threadIdx.x + m * kThreads;
      const int t = i / kXChunks, chunk = i % kXChunks, c = chunk & 7;
      const bool row_ok = t0 + t < count;
      x_src[m] = row_ok ? static_cast<const AT*>(p.a) + (first_row + t0 + t) * p.k + kXPerChunk * chunk
                        : static_cast<const AT*>(p.a);
      x_dst[m] = (chunk >> 3) * (T * 128) + t * 128 + ((c ^ (t & 7)) << 4);
      x_lim[m] = row_ok ? p.k - kXPerChunk * chunk : 0;
    }
    auto load_stage = [&](int s) {
      if (s < stages) {
        const uint32_t buf = base + (s % STAGES) * kStageBytes;
        const int k0 = s * SK;
        if constexpr (kTma) {
          if (threadIdx.x == 0) {
            // kSpans [T, 64] boxes of activations (rows past the group hold other groups' rows or, past the tensor,
            // zeros: either reaches only output columns that are not stored) and each active warpgroup's weight rows
            // (and scales); the generic reads of this buffer ended at the barrier before.
            uint64_t* bar = &full[s % STAGES];
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            sm90_wgmma::bar_expect_tx(bar, kXBytes + tma_wgs * 64 * (kWRow + (scales_by_tma ? kSRow : 0)));
            uint8_t* dst = smem_raw + (buf - smem_u32(smem_raw));
#pragma unroll
            for (int a4 = 0; a4 < SK / kAtomK; ++a4)
              sm90_wgmma::tma_load(dst + a4 * T * 128, &p.map_a, bar, k0 + kAtomK * a4,
                                   static_cast<int>(first_row + t0));
            for (int w = 0; w < W; ++w) {
              const int wr = weight_row(64 * w);
              if (wr < 0) continue;
              sm90_wgmma::tma_load(dst + kXBytes + w * 64 * kWRow, &p.map_w, bar, k0 >> 1, e * p.nw + wr);
              if (scales_by_tma)
                sm90_wgmma::tma_load(dst + kXBytes + kWStageBytes + w * 64 * kSRow, &p.map_s, bar, k0 >> 4,
                                     e * p.nw + wr);
            }
          }
        }
#pragma unroll
        for (int m = 0; m < kXCopies; ++m) {
          const bool ok = k0 < x_lim[m];
          cp_async_16(buf + x_dst[m], ok ? x_src[m] + k0 : static_cast<const AT*>(p.a), ok ? 16 : 0);
        }
#pragma unroll
        for (int m = 0; m < kWCopies; ++m) {
          const bool ok = (k0 >> 1) < w_lim[m];
          cp_async_16(buf + w_dst[m], ok ? w_src[m] + (k0 >> 1) : p.w, ok ? 16 : 0);
        }
        if (!scales_by_tma) {
#pragma unroll
          for (int m = 0; m < kSCopies; ++m) {
            const bool ok = (k0 >> 4) < s_lim[m];
            cp_async_4(buf + s_dst[m], ok ? s_src[m] + (k0 >> 4) : p.scale, ok ? 4 : 0);
          }
        }
      }
      cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < STAGES - 2 + kLate; ++s) load_stage(s);

    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    // A 64-deep span's fragments: four k16 steps (bf16) or two k32 steps (e4m3).
    constexpr int kFrags = A8 ? 2 : 4;
    uint32_t af[kBufs][kFrags][4] = {};

    for (int st = 0; st < stages; ++st) {
      if constexpr (kLate) {
        // Stage st's scales, copied by this warpgroup's own threads, have landed; its threads are done with the
        // previous stage's scale pairs.
        cp_async_wait<STAGES - 2>();
        warpgroup_sync<W>(wg);
      } else {
        // Stage st - 2's buffer is refilled below: every warpgroup's wgmma groups but the last (on stage st - 1)
        // have completed once each thread passes this wait and the barrier.
        wgmma_wait<kBufs - 1>();
        cp_async_wait<STAGES - 3>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> wgmma's reads
        __syncthreads();
        load_stage(st + STAGES - 2);
      }
      if constexpr (kTma) {
        sm90_wgmma::bar_wait(&full[st % STAGES], (phases >> (st % STAGES)) & 1);
        phases ^= 1u << (st % STAGES);
      }
      const uint32_t buf = base + (st % STAGES) * kStageBytes;
      const uint32_t w_addr = buf + w_thread;
      if (active) {
        // The warpgroup's block scales of this stage, each converted once into the pairs its bf16x2 multiplies
        // take (converted by every thread that reads them, they cost 20 of a span's ~75 integer-pipe
        // instructions, the pipe that sets the time).
        const uint32_t raw_addr = buf + kXBytes + kWStageBytes + conv_row * kSRow + (kSRow / 2) * conv_half;
        if constexpr (A8) {
          // W4A8: the tables of this thread's kSRow / 2 blocks, copied from their scale bytes' (two 16-byte stores
          // per four blocks).
          const uint32_t dst = pairs + conv_row * kTRow + (kSRow / 2) * 8 * conv_half;
          uint32_t raw[2];
          if constexpr (SK == 256) {
            const uint2 r = lds64(raw_addr);
            raw[0] = r.x;
            raw[1] = r.y;
          } else {
            raw[0] = lds32(raw_addr);
          }
#pragma unroll
          for (int i = 0; i < kSRow / 8; ++i) {
            uint2 t[4];
#pragma unroll
            for (int b4 = 0; b4 < 4; ++b4) t[b4] = lds64(scale_tables + 8 * ((raw[i] >> (8 * b4)) & 0xFF));
            sts128(dst + 32 * i, t[0].x, t[0].y, t[1].x, t[1].y);
            sts128(dst + 32 * i + 16, t[2].x, t[2].y, t[3].x, t[3].y);
          }
        } else {
          const uint32_t dst = pairs + conv_row * kPRow + (kPRow / 2) * conv_half;
          uint32_t pr[8];
          if constexpr (SK == 256) {
            const uint2 raw = lds64(raw_addr);
            scale_pairs(raw.x, kScaleFactor, pr[0], pr[1]);
            scale_pairs(raw.x >> 16, kScaleFactor, pr[2], pr[3]);
            scale_pairs(raw.y, kScaleFactor, pr[4], pr[5]);
            scale_pairs(raw.y >> 16, kScaleFactor, pr[6], pr[7]);
            sts128(dst + 16, pr[4], pr[5], pr[6], pr[7]);
          } else {
            const uint32_t raw = lds32(raw_addr);
            scale_pairs(raw, kScaleFactor, pr[0], pr[1]);
            scale_pairs(raw >> 16, kScaleFactor, pr[2], pr[3]);
          }
          sts128(dst, pr[0], pr[1], pr[2], pr[3]);
        }
        warpgroup_sync<W>(wg);
      }
      const uint32_t desc_stage = desc_lo0 + ((st % STAGES) * kStageBytes >> 4);
#pragma unroll
      for (int d = 0; d < kSpans; ++d) {
        const int i = st * kSpans + d, b = kBufs == 2 ? (d & 1) : 0;
        if (kLate && d == 1) {
          // Every group on stage st - 1 has completed (the wait that ended span 0, in each warpgroup): its buffer
          // takes stage st + STAGES - 1, which so has STAGES - 1.5 stages' time to land.
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          __syncthreads();
          load_stage(st + STAGES - 1);
        }
        if (!active || i >= spans) continue;
        // The group that last read af[b] has completed (with one buffer: the previous span's, waited for here,
        // since ptxas gives every span's fragments the same registers; with two: the span before, waited for
        // at the end of the previous span).
        if constexpr (kBufs == 1) wgmma_wait<0>();
        // This thread's 8 bytes of span d in each of its rows (where w_thread's comment says).
        const uint32_t w_span = w_addr + (kTma ? ((2 * d + (q >> 1)) ^ w_swz) << 4 : (d ^ w_swz) << 5);
#pragma unroll
        for (int j = 0; j < 2 && A8; ++j) {
          // W4A8: word c of the 8 bytes is k step c (k 4 q .. + 3 of its first block, of its second 16 further),
          // with the tables of the span's blocks 2 c and 2 c + 1 (kTRow: the row's tables, 8 bytes a block).
          const uint2 wv = lds64(w_span + 8 * kWRow * j);
          const uint32_t tr = s_thread + 8 * kTRow * j + 32 * d;
          const uint4 t01 = lds128(tr), t23 = lds128(tr + 16);
          expand8_e4m3(wv.x, make_uint2(t01.x, t01.y), make_uint2(t01.z, t01.w), af[b][0][j], af[b][0][2 + j]);
          expand8_e4m3(wv.y, make_uint2(t23.x, t23.y), make_uint2(t23.z, t23.w), af[b][1][j], af[b][1][2 + j]);
        }
#pragma unroll
        for (int j = 0; j < 2 && !A8; ++j) {
          const uint2 wv = lds64(w_span + 8 * kWRow * j);
          const uint4 sp = lds128(s_thread + 8 * kPRow * j + 16 * d);  // groups 4 d ... 4 d + 3
          uint32_t o[4];
          if constexpr (SPLIT) {
            expand4_split(wv.x, sp.x, sp.y, o[0], o[1], o[2], o[3]);
          } else {
            expand4(tables, wv.x, sp.x, sp.y, o[0], o[1], o[2], o[3]);
          }
          af[b][0][j] = o[0];
          af[b][0][2 + j] = o[1];
          af[b][1][j] = o[2];
          af[b][1][2 + j] = o[3];
          if constexpr (SPLIT) {
            expand4_split(wv.y, sp.z, sp.w, o[0], o[1], o[2], o[3]);
          } else {
            expand4(tables, wv.y, sp.z, sp.w, o[0], o[1], o[2], o[3]);
          }
          af[b][2][j] = o[0];
          af[b][2][2 + j] = o[1];
          af[b][3][j] = o[2];
          af[b][3][2 + j] = o[3];
        }
        fence_regs(af[b]);
        fence_regs(acc);
        wgmma_fence();
        // The span's activations: its atom, and 64 bytes further for the second span of an e4m3 atom.
        const int x_off = (d / kSpansAtom) * T * 128 + (d % kSpansAtom) * 64;
#pragma unroll
        for (int c = 0; c < kFrags; ++c) {
          const uint64_t desc = sm90_wgmma::make_desc(desc_stage + ((x_off + 32 * c) >> 4));
          if constexpr (A8) {
            wgmma_rs_e4m3(acc, af[b][c], desc);
          } else {
            wgmma_rs(acc, af[b][c], desc);
          }
        }
        wgmma_commit();
        if constexpr (kBufs == 2) {
          // The previous span's group has completed; the empty asm that takes its fragments as operands keeps
          // ptxas from reusing their registers before this point.
          wgmma_wait<1>();
          fence_regs(af[b ^ 1]);
        }
      }
    }
    wgmma_wait<0>();
    cp_async_wait<0>();
    fence_regs(acc);
    __syncthreads();  // every stage read: the gated exchange below and the next tile reuse the buffers
    if constexpr (A8) {
      // The activations' row scales (tokens past the group: their outputs are not stored).
#pragma unroll
      for (int j = 0; j < T / 8; ++j) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int t = 8 * j + 2 * q + b;
          const float xs = t0 + t < count ? __ldg(p.a_scale + (first_row + t0 + t) * p.a_scale_stride) : 0.0f;
          acc[4 * j + b] *= xs;
          acc[4 * j + 2 + b] *= xs;
        }
      }
    }

    const float g0 = __ldg(p.gscale + e * p.gscale_stride) * kUnscale;
    auto up_scale = [&] {
      return GATED ? __ldg(p.gscale + e * p.gscale_stride + p.gscale_stride - 1) * kUnscale : 0.0f;
    };
    if constexpr (prefill_tile(T, A8)) {
      if (!p.out_f32) {
        const float g1 = up_scale();
        epilogue_staged<T, W, GATED>(p, acc, base, g0, g1, first_row + t0, count - t0, active);
        continue;
      }
    }
    // The scalar stores (the decode tiles; fp32 output). GATED: a second barrier before the next tile's stages, for
    // the threads that read the exchange.
    if (!scaled_outputs<T, W, GATED>(p, acc, base, g0, up_scale(), active)) {
      if constexpr (GATED) __syncthreads();
      continue;
    }
    const int64_t out_row0 = first_row + t0;
    const int col = col0 + warp * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < T / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int t = 8 * j + 2 * q + b;
          if (t0 + t >= count) continue;
          const float v = acc[4 * j + 2 * h + b];
          const int64_t index = (out_row0 + t) * p.n_out + col + 8 * h;
          if (p.out_f32) {
            static_cast<float*>(p.out)[index] = v;
          } else {
            static_cast<__nv_bfloat16*>(p.out)[index] = __float2bfloat16_rn(v);
          }
        }
      }
    }
    if constexpr (GATED) __syncthreads();  // warpgroup 0 has read the exchange before the next tile's stages
  }
#endif
}

// Stages: as many as fit beside another resident CTA (two per SM; three measured slower: the grids of decode shapes
// fall into fewer, less full waves), at least 3; a CTA alone on its SM (one_cta_per_sm) takes its shared memory.
template <int T, bool GATED, bool A8, bool WIDE>
constexpr int stages_for() {
  constexpr int W = warpgroups_for<T, GATED, A8, WIDE>();
  constexpr int budget = (one_cta_per_sm(T, W) ? 226 : 110) * 1024;
  constexpr int fit =
      (budget - conv_bytes(W, stage_k(T, A8), A8) - (tma_tiles(T, A8) ? 8 * 8 : 0)) / stage_bytes(T, W, A8);
  return fit < 3 ? 3 : (fit > 6 ? 6 : fit);
}

template <int T, bool GATED, int MODE, bool WIDE = false>
cudaError_t launch(const ParamsTma& p, int grid_rows, int grid_tiles, cudaStream_t stream) {
  constexpr bool A8 = MODE == kA8;
  constexpr int W = warpgroups_for<T, GATED, A8, WIDE>(), kStages = stages_for<T, GATED, A8, WIDE>();
  // The stages, the scale pairs, the stages' mbarriers (TMA), alignment. Not a byte more for the smaller tiles: two
  // CTAs of 8-token tiles fill the 196 KB shared-memory carveout exactly, and 32 bytes more each (the next carveout,
  // 228 KB, leaves L1 28 KB instead of 60) made them 1.06x slower on an H200.
  constexpr int kSmem =
      kStages * stage_bytes(T, W, A8) + conv_bytes(W, stage_k(T, A8), A8) + (tma_tiles(T, A8) ? 8 * kStages : 0) + 1024;
  constexpr int kCols = cols_per_cta(W, GATED);
  cudaError_t err = sm90::opt_in_shared_memory<nvfp4_grouped_kernel<T, W, GATED, kStages, MODE>>(kSmem);
  if (err != cudaSuccess) return err;
  // Token tiles before experts (see the kernel): 1.00-1.06x at prefill on an H200 (docs/perf-notes.md).
  const dim3 grid((p.n_out + kCols - 1) / kCols, grid_tiles, grid_rows);
  nvfp4_grouped_kernel<T, W, GATED, kStages, MODE>
      <<<grid, 128 * W, kSmem, stream>>>(static_cast<const ParamsFor<T, A8>&>(p));
  return cudaGetLastError();
}

template <bool GATED, int MODE>
cudaError_t launch_tile(const ParamsTma& p, int grid_rows, int grid_tiles, int tile, bool wide, cudaStream_t stream) {
  switch (tile) {
    case 8:
      return launch<8, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    case 16:
      return launch<16, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    case 32:
      return launch<32, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    case 64:
      return launch<64, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    case 128:
      if constexpr (GATED && MODE != kA8) {
        if (wide) return launch<128, GATED, MODE, true>(p, grid_rows, grid_tiles, stream);
      }
      return launch<128, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    case 256:  // (W4A8 stops at 128: 256 tokens' accumulators beside its tables spill)
      if constexpr (MODE == kA8)
        return cudaErrorInvalidValue;
      else
        return launch<256, GATED, MODE>(p, grid_rows, grid_tiles, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The TMA's maps of a (a8: e4m3), w and (K a multiple of 256) the block scales, for tiles of `tile` tokens (kTma).
cudaError_t encode_maps(ParamsTma& p, int rows, int tile, bool a8) {
  const uint64_t experts_rows = static_cast<uint64_t>(p.num_experts) * p.nw;
  p.s_tma = p.k % 256 == 0;
  const bool ok =
      sm90::encode_2d(&p.map_a, p.a, a8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a8 ? 1 : 2,
                      p.k, rows, a8 ? 128 : 64, tile, CU_TENSOR_MAP_L2_PROMOTION_L2_128B) &&
      sm90::encode_2d(&p.map_w, p.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.k / 2, experts_rows, stage_k(tile, a8) / 2, 64,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      stage_k(tile, a8) == 256 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B) &&
      (!p.s_tma || sm90::encode_2d(&p.map_s, p.scale, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.k / 16, experts_rows, 16, 64,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_SWIZZLE_NONE));
  if (!ok) return sm90::tensor_map_encoder() == nullptr ? cudaErrorNotSupported : cudaErrorInvalidValue;
  return cudaSuccess;
}

template <int MODE>
cudaError_t launch_act(const ParamsTma& p, int grid_rows, int grid_tiles, int tile, bool wide, cudaStream_t stream) {
  return p.act ? launch_tile<true, MODE>(p, grid_rows, grid_tiles, tile, wide, stream)
               : launch_tile<false, MODE>(p, grid_rows, grid_tiles, tile, wide, stream);
}

}  // namespace sm90_nvfp4
}  // namespace fim

// tile: tokens per CTA tile (8, 16, 32, 64, 128 or 256); act 0 (none: out [rows, nw]) or 1/2 (gated: out [rows, nw /
// 2]); wlayout (Mode): K-permuted bytes, split bits, or W4A8 words (moe/packed_nvfp4.py), the last with e4m3
// activations a and their fp32 scales a_scale (row r's at r * a_scale_stride; stride 0: one scale); offsets
// null for the masked layout (capacity C), else the contiguous layout's group starts, non-decreasing (capacity: a
// bound); rows: the rows of a (at least 1). K a multiple of 64, nw (and nw / 2 when gated) a multiple of 64, all
// pointers 16-byte aligned. split_tile, tail_lo, tail_hi, tail: see Params (split_tile 0, or larger than tail_hi;
// the launches of a split take the same split_tile, tiles of 32 or more, the first tail_lo 0 and the largest tail_hi,
// each tail launch its own range). wide: the gated W4A16 128-token tile on four warpgroups (warpgroups_for), else 0.
extern "C" int fim_sm90_nvfp4_w4a16_grouped(const void* a, const void* w, const void* scale, const float* gscale,
                                            int gscale_stride, const int32_t* counts, const int32_t* offsets, void* out,
                                            int out_f32, int num_experts, int rows, int capacity, int nw, int k,
                                            int act, float alpha, float limit, int tile, int wlayout, int split_tile,
                                            int tail_lo, int tail_hi, int tail, int wide, const float* a_scale,
                                            int a_scale_stride, void* stream) {
  using namespace fim::sm90_nvfp4;
  if (k % 64 || nw % 64 || (act && nw % 128) || capacity <= 0 || rows <= 0) return cudaErrorInvalidValue;
  if (wlayout < kLookup || wlayout > kA8 || (wlayout == kA8 && (a_scale == nullptr || a_scale_stride < 0)))
    return cudaErrorInvalidValue;
  if (wide && (tile != 128 || !act || wlayout == kA8)) return cudaErrorInvalidValue;
  // (A split needs tiles of 32 tokens or more in every launch: the smaller ones' kernels take every row.)
  if (split_tile < 0 || (split_tile && (tile < 32 || tail_lo < 0 || tail_hi <= tail_lo || tail_hi >= split_tile)) ||
      (tail && !split_tile))
    return cudaErrorInvalidValue;
  const int row_map = offsets != nullptr && rows < num_experts;
  ParamsTma p{};
  static_cast<Params&>(p) = Params{a,
                                   static_cast<const uint8_t*>(w),
                                   static_cast<const uint8_t*>(scale),
                                   gscale,
                                   counts,
                                   offsets,
                                   out,
                                   capacity,
                                   nw,
                                   k,
                                   act ? nw / 2 : nw,
                                   gscale_stride,
                                   act,
                                   out_f32,
                                   alpha,
                                   limit,
                                   num_experts,
                                   row_map,
                                   split_tile,
                                   tail_lo,
                                   tail_hi,
                                   tail,
                                   a_scale,
                                   a_scale_stride};
  if (tma_tiles(tile, wlayout == kA8)) {
    const cudaError_t err = encode_maps(p, rows, tile, wlayout == kA8);
    if (err != cudaSuccess) return err;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const int grid_rows = row_map ? rows : num_experts;
  // CTAs per (column block, expert) along the tokens, each taking every grid_tiles-th tile of its group: as many as
  // an expert's mean rows fill (masked: the capacity), so that balanced prefill groups spread over the whole GPU
  // while the CTAs of small or uneven groups loop instead of idling. (moe/gemm_nvfp4_sm90.py counts the same grid for
  // its warpgroup rule: change both.)
  const int64_t mean_rows = offsets ? (static_cast<int64_t>(rows) + num_experts - 1) / num_experts : capacity;
  const int64_t bound = std::min<int64_t>(tail ? tail_hi : mean_rows, capacity);
  const int grid_tiles = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((bound + tile - 1) / tile, 65535)));
  switch (wlayout) {
    case kSplit:
      return launch_act<kSplit>(p, grid_rows, grid_tiles, tile, wide, s);
    case kA8:
      return launch_act<kA8>(p, grid_rows, grid_tiles, tile, wide, s);
    default:
      return launch_act<kLookup>(p, grid_rows, grid_tiles, tile, wide, s);
  }
}
