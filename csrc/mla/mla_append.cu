// MLA KV append: new tokens' latent (ckv, 512) and rope (kpe, 64) rows written into their slots of a paged
// cache, converted to the cache's element type on the way; FP8 pages are quantized with one per-tensor scale.
// Optionally the rope rows arrive unrotated and are rotated here by their tokens' positions (cos/sin table
// rows). Bit-exact with flashinfer_moe/reference_mla.py (append_kv, append_kv_rope).
//
// One thread moves eight consecutive channels of one token: 64 chunks of latent then 8 of rope per token,
// so a warp's loads and stores cover whole 16-byte vectors of consecutive rows.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.cuh"
#include "common/quant.cuh"
#include "common/vec.cuh"

namespace fim {
namespace mla {

// Cache element types: dtype.cuh's codes, plus E4M3 bytes.
constexpr int kFp8 = 3;
constexpr int kThreads = 256;
constexpr int kLatent = 512, kRope = 64;
constexpr int kLatentChunks = kLatent / 8, kChunks = (kLatent + kRope) / 8;

struct Fp8 {};  // tag type: E4M3 bytes

template <typename D>
struct Store8 {
  // Eight fp32 values (exact widenings of the source) to D, round-to-nearest-even as torch's .to(D).
  static __device__ __forceinline__ void vec(D* dst, const float (&v)[8], float) { store8(dst, narrow8<D>(v)); }
  static __device__ __forceinline__ void scalar(D* dst, const float (&v)[8], float) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = from_float<D>(v[i]);
  }
};

template <>
struct Store8<Fp8> {
  // x * (1 / scale), correctly rounded, then E4M3 with saturation at +-448 (the reference's order of operations).
  static __device__ __forceinline__ void vec(Fp8* dst, const float (&v)[8], float inv) {
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = __fmul_rn(v[i], inv);
    *reinterpret_cast<uint2*>(dst) = fp8x8(s);
  }
  static __device__ __forceinline__ void scalar(Fp8* dst, const float (&v)[8], float inv) {
    auto* bytes = reinterpret_cast<uint8_t*>(dst);
#pragma unroll
    for (int i = 0; i < 8; ++i) bytes[i] = fp8(__fmul_rn(v[i], inv));
  }
};

template <typename D>
__device__ __forceinline__ size_t elem_bytes() {
  return sizeof(D);
}
template <>
__device__ __forceinline__ size_t elem_bytes<Fp8>() {
  return 1;
}

struct Args {
  const void* ckv;  // [N, 512] rows of ckv_stride elements
  const void* kpe;  // [N, 64] rows of kpe_stride elements
  int64_t ckv_stride, kpe_stride;
  const void* slots;  // [N] int32 or int64
  int slots64;
  int64_t n;
  int64_t num_slots;  // pages * page_size; slots outside [0, num_slots) are not written
  int64_t page_size;
  void* cache;  // latent rows: cache + page * page_stride + offset * token_stride (elements)
  int64_t page_stride, token_stride;
  void* rope;  // rope rows, likewise (inside `cache` for the one-tensor layout)
  int64_t rope_page_stride, rope_token_stride;
  const float* scale;  // dequantization scale of the FP8 parts; null when no part is FP8
  // Rope rotation, when cos_sin is not null: row positions[t] of cos_sin holds 32 cosines then 32 sines.
  const void* positions;  // [N] int32 or int64; a token whose position is outside [0, max_pos) is not written
  int positions64;
  const void* cos_sin;  // [max_pos, 64] rows of cos_sin_stride elements, fp32/fp16/bf16
  int cos_sin_dtype;
  int64_t cos_sin_stride, max_pos;
  int interleaved;  // pairs (2i, 2i + 1) (GPT-J, DeepSeek-V3's); else (i, i + 32) (GPT-NeoX)
};

template <typename S, bool VEC>
__device__ __forceinline__ void load_row8(const S* src, float (&v)[8]) {
  if constexpr (VEC) {
    widen8(load8(src), v);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(src[k]);
  }
}

__device__ __forceinline__ double table_at(const void* row, int dtype, int i) {
  switch (dtype) {
    case kFloat32:
      return static_cast<const float*>(row)[i];
    case kFloat16:
      return __half2float(static_cast<const __half*>(row)[i]);
    default:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[i]);
  }
}

// x * c - y * s (and + for the second of a pair) in fp64, where the products of two fp32 values are exact, so
// the difference's is the one fp64 rounding whatever the evaluation order; then fp32. The reference computes
// the same, so the two agree bit for bit. The intrinsics only make the absence of contraction explicit.
__device__ __forceinline__ float rot_minus(double x, double c, double y, double s) {
  return __double2float_rn(__dsub_rn(__dmul_rn(x, c), __dmul_rn(y, s)));
}
__device__ __forceinline__ float rot_plus(double x, double c, double y, double s) {
  return __double2float_rn(__dadd_rn(__dmul_rn(x, c), __dmul_rn(y, s)));
}

// Rotates the eight rope channels 8 * chunk .. 8 * chunk + 7 of one token in place. `partner`: with the
// NeoX pairing, the channels 32 away (chunk ^ 4); unused otherwise.
__device__ __forceinline__ void rotate8(float (&v)[8], const float (&partner)[8], const void* row, int dtype, int chunk,
                                        bool interleaved) {
  float out[8];
  if (interleaved) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = chunk * 4 + j;
      const double c = table_at(row, dtype, i), s = table_at(row, dtype, kRope / 2 + i);
      out[2 * j] = rot_minus(v[2 * j], c, v[2 * j + 1], s);
      out[2 * j + 1] = rot_plus(v[2 * j + 1], c, v[2 * j], s);
    }
  } else {
    const bool first = chunk < 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = (chunk & 3) * 8 + j;
      const double c = table_at(row, dtype, i), s = table_at(row, dtype, kRope / 2 + i);
      out[j] = first ? rot_minus(v[j], c, partner[j], s) : rot_plus(v[j], c, partner[j], s);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = out[j];
}

template <typename S, typename DC, typename DR, bool VEC>
__global__ void __launch_bounds__(kThreads) append_kernel(Args a) {
  const float inv = a.scale != nullptr ? inverse_scale(*a.scale) : 1.0f;
  const int64_t items = a.n * kChunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const int64_t token = i / kChunks;
    const int chunk = static_cast<int>(i % kChunks);
    const int64_t slot = a.slots64 ? static_cast<const int64_t*>(a.slots)[token]
                                   : static_cast<int64_t>(static_cast<const int32_t*>(a.slots)[token]);
    if (slot < 0 || slot >= a.num_slots) continue;  // padding (negative), or a slot past the cache: never written
    int64_t pos = 0;
    if (a.cos_sin != nullptr) {
      pos = a.positions64 ? static_cast<const int64_t*>(a.positions)[token]
                          : static_cast<int64_t>(static_cast<const int32_t*>(a.positions)[token]);
      if (pos < 0 || pos >= a.max_pos) continue;  // no table row: the whole token is left unwritten
    }
    const int64_t page = slot / a.page_size, offset = slot % a.page_size;
    const bool latent = chunk < kLatentChunks;
    const int col = latent ? chunk * 8 : (chunk - kLatentChunks) * 8;
    const S* src = latent ? static_cast<const S*>(a.ckv) + token * a.ckv_stride + col
                          : static_cast<const S*>(a.kpe) + token * a.kpe_stride + col;
    float v[8];
    load_row8<S, VEC>(src, v);
    if (!latent && a.cos_sin != nullptr) {
      const int rope_chunk = chunk - kLatentChunks;
      float partner[8] = {};
      if (!a.interleaved) {
        load_row8<S, VEC>(static_cast<const S*>(a.kpe) + token * a.kpe_stride + (rope_chunk ^ 4) * 8, partner);
      }
      const void* row =
          static_cast<const char*>(a.cos_sin) + pos * a.cos_sin_stride * (a.cos_sin_dtype == kFloat32 ? 4 : 2);
      rotate8(v, partner, row, a.cos_sin_dtype, rope_chunk, a.interleaved != 0);
    }
    if (latent) {
      DC* dst = reinterpret_cast<DC*>(static_cast<char*>(a.cache) +
                                      (page * a.page_stride + offset * a.token_stride + col) * elem_bytes<DC>());
      if constexpr (VEC) {
        Store8<DC>::vec(dst, v, inv);
      } else {
        Store8<DC>::scalar(dst, v, inv);
      }
    } else {
      DR* dst =
          reinterpret_cast<DR*>(static_cast<char*>(a.rope) +
                                (page * a.rope_page_stride + offset * a.rope_token_stride + col) * elem_bytes<DR>());
      if constexpr (VEC) {
        Store8<DR>::vec(dst, v, inv);
      } else {
        Store8<DR>::scalar(dst, v, inv);
      }
    }
  }
}

template <typename S, typename DC, typename DR>
cudaError_t launch(const Args& a, int vec, cudaStream_t s) {
  const int64_t blocks = (a.n * kChunks + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks > 132 * 32 ? 132 * 32 : blocks);
  if (vec) {
    append_kernel<S, DC, DR, true><<<grid, kThreads, 0, s>>>(a);
  } else {
    append_kernel<S, DC, DR, false><<<grid, kThreads, 0, s>>>(a);
  }
  return cudaGetLastError();
}

template <typename S>
cudaError_t dispatch_cache(const Args& a, int cache_dtype, int rope_dtype, int vec, cudaStream_t s) {
  if (cache_dtype == kBFloat16 && rope_dtype == kBFloat16) return launch<S, __nv_bfloat16, __nv_bfloat16>(a, vec, s);
  if (cache_dtype == kFloat16 && rope_dtype == kFloat16) return launch<S, __half, __half>(a, vec, s);
  if (cache_dtype == kFp8 && rope_dtype == kFp8) return launch<S, Fp8, Fp8>(a, vec, s);
  if (cache_dtype == kFp8 && rope_dtype == kBFloat16) return launch<S, Fp8, __nv_bfloat16>(a, vec, s);
  if (cache_dtype == kFp8 && rope_dtype == kFloat16) return launch<S, Fp8, __half>(a, vec, s);
  return cudaErrorInvalidValue;
}

}  // namespace mla
}  // namespace fim

extern "C" {

// Every function returns a cudaError_t, 0 on success; arguments are validated in Python
// (flashinfer_moe/mla/append.py).

// Writes token t's ckv row (512) and kpe row (64) into slot slots[t] = page * page_size + offset. Source dtype
// (ckv and kpe alike): 0 fp32, 1 fp16, 2 bf16. Cache dtypes: 1 fp16, 2 bf16, 3 E4M3 (rope: the latent's, or
// fp16/bf16 beside an E4M3 latent). vec: every pointer and row stride 16-byte aligned. cos_sin not null: kpe
// rows are rotated by row positions[t] of cos_sin ([max_pos, 64] of cos_sin_dtype 0/1/2, 32 cosines then 32
// sines) first, with the pairs (2i, 2i + 1) when interleaved, else (i, i + 32).
int fim_mla_append(const void* ckv, const void* kpe, int src_dtype, int64_t ckv_stride, int64_t kpe_stride,
                   const void* slots, int slots64, int64_t n, void* cache, int cache_dtype, int64_t page_stride,
                   int64_t token_stride, void* rope, int rope_dtype, int64_t rope_page_stride,
                   int64_t rope_token_stride, int64_t num_pages, int64_t page_size, const float* scale, int vec,
                   const void* positions, int positions64, const void* cos_sin, int cos_sin_dtype,
                   int64_t cos_sin_stride, int64_t max_pos, int interleaved, void* stream) {
  using namespace fim::mla;
  if (n == 0 || num_pages == 0) return 0;
  if (page_size < 1) return cudaErrorInvalidValue;
  if (cos_sin != nullptr && (positions == nullptr || cos_sin_dtype < fim::kFloat32 || cos_sin_dtype > fim::kBFloat16))
    return cudaErrorInvalidValue;
  Args a{ckv,
         kpe,
         ckv_stride,
         kpe_stride,
         slots,
         slots64,
         n,
         num_pages * page_size,
         page_size,
         cache,
         page_stride,
         token_stride,
         rope,
         rope_page_stride,
         rope_token_stride,
         scale,
         positions,
         positions64,
         cos_sin,
         cos_sin_dtype,
         cos_sin_stride,
         max_pos,
         interleaved};
  auto s = static_cast<cudaStream_t>(stream);
  switch (src_dtype) {
    case fim::kFloat32:
      return dispatch_cache<float>(a, cache_dtype, rope_dtype, vec, s);
    case fim::kFloat16:
      return dispatch_cache<__half>(a, cache_dtype, rope_dtype, vec, s);
    case fim::kBFloat16:
      return dispatch_cache<__nv_bfloat16>(a, cache_dtype, rope_dtype, vec, s);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
