// Hopper FP8 block-scaled grouped GEMM written directly in wgmma, TMA and mbarrier PTX (no CUTLASS).
//
//   out[rows of e] = (A[rows of e] * sa) @ (W[e] * sw)^T
//   A  [R, K] e4m3, row-major; sa [R, K / 128] fp32 (K-major)
//   W  [E, N, K] e4m3 (K-major); sw [E, N / 128, K / 128] fp32 (K-major)
//   out [R, N] bf16; rows that belong to no expert are never written
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
// the producer and leave through the TMA while the next tile's mainloop runs.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90_launch.cuh"

namespace fim {
namespace sm90_wgmma {

constexpr int kBlockK = 128;  // K depth of one stage = the scale block
constexpr int kMaxExperts = 1024;
constexpr int kThreads = 384;
constexpr int kMathWarps = 8;

struct Params {
  const float* sa;  // [R, K / 128]
  const float* sw;  // [E, N / 128, K / 128]
  __nv_bfloat16* out;
  const int32_t* counts;   // [E]
  const int32_t* offsets;  // [E + 1] (contiguous) or null (masked: expert e starts at e * capacity)
  int capacity;
  int num_groups, n, k;
  int swizzle, raster;
};

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
  static constexpr int kSmemBytes =
      1024 + kPipeBytes + 2 * STAGES * 8 + STAGES * kScaleFloats * 4 + (3 * kMaxExperts + 4) * 4 + kMathWarps * 1024;
  static_assert(kSmemBytes <= 232448, "more than an sm_90 CTA can opt in to");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
  } while (!done);
}

// A 4-byte copy into shared memory, tracked by the stage's barrier through cp_async_arrive.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

// The barrier counts one arrival when this thread's earlier cp.async copies land (no extra pending count).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// Stores the [16 rows][64 columns] bf16 box at `src` (128-byte swizzled) to `out` at (col, row) through the
// TMA, asynchronously, tracked as a bulk async-group; the tensor map clips rows and columns past its ends.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(col), "r"(row)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Returns once this thread's TMA stores have read their shared-memory source (not once they are written).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void sts(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Shared-memory matrix descriptor of a K-major tile stored as 128-byte rows with the 128-byte swizzle (what
// the TMA writes): 8-row atoms of 1024 bytes, so the stride between atoms is 1024; stepping K by 32 inside
// a row moves the start address, the hardware applying the swizzle on the address bits. The high word is a
// constant (atom stride, swizzle mode) and the low word is the start address / 16 plus a leading offset of 1,
// so a k step is an add of 2 to the low word: the loop builds no descriptor from scratch.
constexpr uint32_t kDescHi = (1024 >> 4) | (1u << 30);

// Shared-memory addresses here are below 256 KiB, so the 14-bit start field takes them whole.
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr) { return (addr >> 4) | (1u << 16); }

__device__ __forceinline__ uint64_t make_desc(uint32_t lo) { return (static_cast<uint64_t>(kDescHi) << 32) | lo; }

__device__ __forceinline__ float lds(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma boundaries.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

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
  int lo = 0, hi = p.num_groups - 1;  // the last expert whose first m tile is at or before key
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= key) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  e = lo;
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
// and column 8 * (i / 4) + 2 * (lane % 4) + i % 2: elements with bit 1 set are the lower row.
__device__ __forceinline__ void promote(float (&fin)[64], float (&d)[64], float s_top, float s_low) {
  fence_regs(d);
#pragma unroll
  for (int i = 0; i < 64; ++i) fin[i] = fmaf(d[i], (i & 2) ? s_low : s_top, fin[i]);
}

// Stores a warp's 16 rows x (8 * CHUNKS) accumulator columns as bf16 through a 1 KiB staging buffer of its own
// (shared address `stage`), 32 columns at a time, so that each global store writes whole 64-byte row segments
// (16 bytes per lane). A row's four 16-byte segments sit in the buffer rotated by (row / 2) % 4, which puts the
// 32 words a store instruction writes, and the 8 segments a quarter-warp reads back, in distinct banks. `out`
// points at the warp's first row and column; rows from `valid_rows` on (the expert's end) and columns from
// `cols` on (N) are skipped.
template <int CHUNKS>
__device__ __forceinline__ void store_tile(const float* fin, __nv_bfloat16* out, int64_t ld, int valid_rows, int cols,
                                           uint32_t stage, int lane) {
  static_assert(CHUNKS % 4 == 0, "32 columns per pass");
  const int row = lane / 4, pair = lane % 4, rot = (row >> 1) & 3;  // rows r and r + 8 share the rotation
  const uint32_t top = stage + (row * 16 + pair) * 4, low = top + 8 * 16 * 4;
#pragma unroll
  for (int pass = 0; pass < CHUNKS / 4; ++pass) {
    if (32 * pass >= cols) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float* f = fin + 4 * (4 * pass + j);
      __nv_bfloat162 t = __floats2bfloat162_rn(f[0], f[1]), l = __floats2bfloat162_rn(f[2], f[3]);
      sts(top + 16 * (j ^ rot), *reinterpret_cast<uint32_t*>(&t));
      sts(low + 16 * (j ^ rot), *reinterpret_cast<uint32_t*>(&l));
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < 2; ++it) {
      const int q = lane + 32 * it, r = q / 4, seg = q % 4;  // 4 segments of 16 bytes per row
      if (r < valid_rows) {
        const uint4 v = lds128(stage + r * 64 + 16 * (seg ^ ((r >> 1) & 3)));
        *reinterpret_cast<uint4*>(out + r * ld + 32 * pass + 8 * seg) = v;
      }
    }
    __syncwarp();
  }
}

// Byte offset of 16-byte chunk `c` (8 columns) of row `r` in a warp's four [16][64] bf16 boxes, as the TMA's
// 128-byte swizzle lays them out: chunk c % 8 of a 128-byte row sits at position (c % 8) ^ (r % 8).
__device__ __forceinline__ uint32_t box_offset(int r, int c) {
  return (c / 8) * 2048 + r * 128 + 16 * ((c % 8) ^ (r % 8));
}

// The asynchronous form of store_tile for a warp's 16 rows x 256 columns: the rows go to shared memory as four
// [16][64] bf16 boxes at `region` (8 KiB, 1024-byte aligned) in the TMA's 128-byte swizzle (16-byte chunk c of
// row r at chunk c ^ (r % 8): a store instruction's 32 words fall in distinct banks), then lane 0 hands each box
// to the TMA, which the warp does not wait for; the caller waits with bulk_wait_read before the region is
// written again. A warp whose rows pass the expert's end (rows from `valid_rows` on must stay untouched)
// copies its valid rows out itself instead, synchronously. `row` is the warp's first row of `out`, `col` its
// first column; columns from `cols` on (N) are skipped.
__device__ __forceinline__ void store_tile_async(const float* fin, uint32_t region, const CUtensorMap* map,
                                                 __nv_bfloat16* out, int64_t ld, int row, int col, int valid_rows,
                                                 int cols, int lane) {
  const int r = lane / 4;
  const uint32_t word = region + (lane % 4) * 4;
#pragma unroll
  for (int c = 0; c < 32; ++c) {  // 8 columns each
    const float* f = fin + 4 * c;
    __nv_bfloat162 t = __floats2bfloat162_rn(f[0], f[1]), l = __floats2bfloat162_rn(f[2], f[3]);
    sts(word + box_offset(r, c), *reinterpret_cast<uint32_t*>(&t));
    sts(word + box_offset(r + 8, c), *reinterpret_cast<uint32_t*>(&l));
  }
  if (valid_rows >= 16) {
    // The TMA reads through the async proxy: make the generic stores above visible to it.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (64 * b < cols) tma_store(map, region + b * 2048, col + 64 * b, row);
      }
      bulk_commit();
    }
    return;
  }
  __syncwarp();
  for (int q = lane; q < valid_rows * 32; q += 32) {
    const int rr = q / 32, c = q % 32;  // row, 16-byte chunk
    if (8 * c < cols) {
      const uint4 v = lds128(region + box_offset(rr, c));
      *reinterpret_cast<uint4*>(out + rr * ld + 8 * c) = v;
    }
  }
}

template <int BM, int BN, int STAGES, int SUB, bool ASYNC>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_block_grouped(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_w,
                      const __grid_constant__ CUtensorMap tma_out, const Params p) {
  using S = Shape<BM, BN, STAGES>;
  static_assert(SUB == 128 || (SUB == 64 && S::kWide), "64-column quarters exist for the 128 x 256 tile only");
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

  const int n_tiles = (p.n + BN - 1) / BN;
  const int total = tile_start[num_groups] * n_tiles;
  const int kblocks = p.k / kBlockK;

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp != 0) return;
    // One warp: lane 0 issues the TMA loads of a stage, every lane copies some of its scales (K-major scales
    // cannot be a TMA box: one column of them is one float per row).
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tma_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tma_w)) : "memory");
    }
    const int n_blocks = p.n / kBlockK;
    Ring r;
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      int e, mi, ni;
      locate(p, tile_start, n_tiles, t, e, mi, ni);
      const int rows = expert_rows[e], first = expert_first[e];
      const int a_row = first + mi * BM;
      const int w_row = e * p.n + ni * BN;
      // Rows past the expert copy row 0's scale: their results are never stored.
      const float* sa_src[BM / 32];
#pragma unroll
      for (int j = 0; j < BM / 32; ++j) {
        const int row = mi * BM + lane + 32 * j;
        sa_src[j] = p.sa + int64_t(first + (row < rows ? row : 0)) * kblocks;
      }
      const float* sw_src = p.sw + (int64_t(e) * n_blocks + min(ni * BN / kBlockK + lane, n_blocks - 1)) * kblocks;
      for (int kb = 0; kb < kblocks; ++kb) {
        bar_wait(&empty[r.stage], r.phase ^ 1);
        if (lane == 0) {
          uint8_t* dst = ring + r.stage * S::kStageBytes;
          bar_expect_tx(&full[r.stage], S::kStageBytes);
          tma_load(dst, &tma_a, &full[r.stage], kb * kBlockK, a_row);
          tma_load(dst + S::kABytes, &tma_w, &full[r.stage], kb * kBlockK, w_row);
        }
        float* sc = scales + r.stage * S::kScaleFloats;
#pragma unroll
        for (int j = 0; j < BM / 32; ++j) cp_async_4(sc + lane + 32 * j, sa_src[j] + kb);
        if (lane < BN / kBlockK) cp_async_4(sc + BM + lane, sw_src + kb);
        cp_async_arrive(&full[r.stage]);
        r.template next<STAGES>();
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
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
  Ring r;
  if constexpr (S::kWide) {
    // Each warpgroup owns 64 x 256. SUB = 128: two 128-column halves in turn through one accumulator. SUB = 64:
    // four 64-column quarters through two 32-register accumulators, quarter q promoted while quarter q + 1 runs.
    // The asynchronous epilogue (ASYNC): each math warp stages its 16 x 256 of the tile in the ring stages of
    // the tile's last kHold K blocks, which it keeps from the producer until the TMA has read them. The
    // release comes once the next tile's second block is issued (its first STAGES - kHold blocks load
    // meanwhile), so the stores overlap the next tile's mainloop instead of idling the tensor cores. Measured
    // slower for the quarters and for the 64 x 128-per-warpgroup tiles (docs/perf.md), so those store in place.
    static_assert(!ASYNC || SUB == 128, "the asynchronous epilogue is built for the halves variant only");
    constexpr int kRegion = 16 * 256 * 2;  // a warp's rows (store_tile_async)
    constexpr int kPerStage = S::kStageBytes / kRegion;
    constexpr int kHold = (kMathWarps + kPerStage - 1) / kPerStage;
    static_assert(kHold <= 2 && kHold + 2 <= STAGES, "the held stages must leave the next tile two to load into");
    const bool async_out = ASYNC && kblocks >= kHold;
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
          const float w0 = lds(sc + 4 * BM), w1 = lds(sc + 4 * (BM + 1));
          issue_group(acc0, a, b);
          issue_group(acc1, a, b + quarter);
          wgmma_wait<1>();
          add(acc0, 0, sa_top * w0, sa_low * w0);
          issue_group(acc0, a, b + 2 * quarter);
          wgmma_wait<1>();
          add(acc1, 1, sa_top * w0, sa_low * w0);
          issue_group(acc1, a, b + 3 * quarter);
          wgmma_wait<1>();
          add(acc0, 2, sa_top * w1, sa_low * w1);
          // The block's last quarter is not overlapped: ptxas serializes every wgmma of the kernel when a
          // group stays in flight across this loop's back edge here.
          wgmma_wait<0>();
          add(acc1, 3, sa_top * w1, sa_low * w1);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float w = lds(sc + 4 * (BM + h)), s_top = sa_top * w, s_low = sa_low * w;
            issue_group(acc, a, b + h * ((128 * kBlockK) >> 4));
            if (h == 0 && kb == release_at) release();
            wgmma_wait<0>();
            fence_regs(acc);
#pragma unroll
            for (int i = 0; i < 64; ++i) fin[64 * h + i] = fmaf(acc[i], (i & 2) ? s_low : s_top, fin[64 * h + i]);
          }
        }
        if (!hold(kb, stage) && lane == 0) bar_arrive(&empty[stage]);
        r.template next<STAGES>();
      }
      const int row0 = mi * BM + wm + (warp % 4) * 16, col0 = ni * BN;
      __nv_bfloat16* dst = p.out + (first + row0) * p.n + col0;
      if (async_out) {
        // Both warpgroups must be done reading the held stages before either writes into them.
        asm volatile("bar.sync 1, 256;" ::: "memory");
        const uint32_t stage = (held >> (8 * (mwarp / kPerStage))) & 0xff;
        const uint32_t region = smem_u32(ring) + stage * S::kStageBytes + (mwarp % kPerStage) * kRegion;
        store_tile_async(fin, region, &tma_out, dst, p.n, static_cast<int>(first) + row0, col0, rows - row0, p.n - col0,
                         lane);
        copying = held | kCopying;
        held = 0;
      } else {
        store_tile<32>(fin, dst, p.n, rows - row0, p.n - col0, store_stage, lane);
      }
    }
    release();
    bulk_wait_all();  // the kernel is done when its rows are written
    return;
  }
  float fin[64], acc0[64], acc1[64];
  // Promotes the block held in stage `st` (its wgmma group complete) and hands the stage back.
  auto finish = [&](float (&d)[64], int st) {
    const uint32_t sc = sc_base + st * S::kScaleFloats * 4;
    const float w = lds(sc + 4 * (BM + wn / kBlockK));
    promote(fin, d, lds(sc + 4 * row_in) * w, lds(sc + 4 * (row_in + 8)) * w);
    if (lane == 0) bar_arrive(&empty[st]);
  };
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
    store_tile<16>(fin, p.out + (first + row0) * p.n + col0, p.n, rows - row0, p.n - col0, store_stage, lane);
  }
}

#else

template <int BM, int BN, int STAGES, int SUB, bool ASYNC>
__global__ void fp8_block_grouped(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                                  const __grid_constant__ CUtensorMap, const Params) {}

#endif

// ---------------------------------------------------------------------------------------------- host side

using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

EncodeTiled encode_fn() {
  static EncodeTiled fn = []() -> EncodeTiled {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// A row-major 2-D tensor [outer, inner] of `elem_bytes`-byte elements, moved in boxes of [box_outer, box_inner]
// with the 128-byte swizzle; rows past `outer` read as zeros and are not written.
bool encode(CUtensorMap* map, const void* base, CUtensorMapDataType type, uint32_t elem_bytes, uint64_t inner,
            uint64_t outer, uint32_t box_inner, uint32_t box_outer, CUtensorMapL2promotion promotion) {
  EncodeTiled fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * elem_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  return fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// An e4m3 operand [outer, K], read a 128-deep K block of `box_outer` rows at a time.
bool encode_operand(CUtensorMap* map, const void* base, uint64_t k, uint64_t outer, uint32_t box_outer) {
  return encode(map, base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, k, outer, kBlockK, box_outer,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

template <int BM, int BN, int STAGES, int SUB, bool ASYNC>
int run(const void* a, const float* a_scale, const void* w, const float* w_scale, void* out, const int32_t* counts,
        const int32_t* offsets, int capacity, int num_groups, int rows, int n, int k, int swizzle, int raster,
        int sm_count, cudaStream_t stream) {
  using S = Shape<BM, BN, STAGES>;
  if (num_groups < 1 || num_groups > kMaxExperts || rows < 0 || n < kBlockK || k < kBlockK || n % kBlockK ||
      k % kBlockK || sm_count < 1 || !sm90::valid_order(swizzle, raster) || (!offsets && capacity < 0)) {
    return cudaErrorInvalidValue;
  }
  if (int64_t(num_groups) * n >= (int64_t(1) << 31) || int64_t(num_groups) * capacity >= (int64_t(1) << 31)) {
    return cudaErrorInvalidValue;  // TMA coordinates and first rows are 32-bit
  }
  if (rows == 0) return cudaSuccess;
  const cudaError_t err = sm90::opt_in_shared_memory<fp8_block_grouped<BM, BN, STAGES, SUB, ASYNC>>(S::kSmemBytes);
  if (err != cudaSuccess) return err;
  CUtensorMap map_a, map_w, map_out{};
  // The bf16 output is written in [16][64] boxes (store_tile_async), only by the asynchronous epilogue.
  if (!encode_operand(&map_a, a, k, rows, BM) || !encode_operand(&map_w, w, k, uint64_t(num_groups) * n, BN) ||
      (ASYNC &&
       !encode(&map_out, out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, n, rows, 64, 16, CU_TENSOR_MAP_L2_PROMOTION_NONE))) {
    return cudaErrorInvalidValue;
  }
  Params p{a_scale, w_scale, static_cast<__nv_bfloat16*>(out), counts, offsets, capacity, num_groups, n,
           k,       swizzle, raster == 0 ? 1 : raster};
  fp8_block_grouped<BM, BN, STAGES, SUB, ASYNC>
      <<<sm_count, kThreads, S::kSmemBytes, stream>>>(map_a, map_w, map_out, p);
  return cudaGetLastError();
}

}  // namespace sm90_wgmma
}  // namespace fim

#define FIM_SM90_WGMMA_EXPORT(NAME, BM, BN, STAGES, SUB, ASYNC)                                                       \
  extern "C" int fim_sm90_fp8_block_wgmma_##NAME(const void* a, const float* a_scale, const void* w,                  \
                                                 const float* w_scale, void* out, const int32_t* counts,              \
                                                 const int32_t* offsets, int capacity, int num_groups, int rows,      \
                                                 int n, int k, int swizzle, int raster, int sm_count, void* stream) { \
    return fim::sm90_wgmma::run<BM, BN, STAGES, SUB, ASYNC>(a, a_scale, w, w_scale, out, counts, offsets, capacity,   \
                                                            num_groups, rows, n, k, swizzle, raster, sm_count,        \
                                                            static_cast<cudaStream_t>(stream));                       \
  }

// The asynchronous epilogue only where it measured faster (docs/perf.md): 128 x 256 in halves.
FIM_SM90_WGMMA_EXPORT(m128n128, 128, 128, 6, 128, false)
FIM_SM90_WGMMA_EXPORT(m64n256, 64, 256, 5, 128, false)
FIM_SM90_WGMMA_EXPORT(m128n256, 128, 256, 4, 128, true)
FIM_SM90_WGMMA_EXPORT(m128n256s64, 128, 256, 4, 64, false)
