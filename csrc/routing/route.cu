// Fused top-k routing: scoring (softmax | sigmoid), optional correction bias, optional group-limited
// selection, top-k, renormalisation and scaling in one launch, one warp per token, no host sync.
//
// Lane l holds experts e = i * 32 + l (i < VPL), so each load instruction of a warp is coalesced.
// Selection ties go to the lower expert (or group) index, which is what a stable descending sort gives;
// flashinfer_moe/reference.py implements the same order.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/dtype.cuh"
#include "common/warp.cuh"

namespace fim {
namespace routing {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxGroups = 32;            // one group per lane during group selection
constexpr int kMaxTopK = 32;              // one output column per lane
constexpr float kRenormEpsilon = 1e-20f;  // sigmoid renormalisation: w / (sum + 1e-20)

struct RouteParams {
  const void* logits;  // [T, E], row stride `row_stride` elements, unit column stride
  int64_t row_stride;
  const float* bias;  // [E] or nullptr
  float* weights;     // [T, k]
  int32_t* ids;       // [T, k]
  int num_tokens;
  int num_experts;
  int top_k;
  int use_sigmoid;
  int renormalize;
  int num_groups;  // 1 = no group limit
  int topk_group;
  int lanes_per_group;  // > 0: groups are runs of this many whole lanes (power of two); 0: general path
  float scale;
};

// Warp-wide argmax over (ordered key, index): the largest key, the lowest index among equal keys.
// Lanes with no candidate pass index UINT_MAX and key 0 (below every float's ordered value but one NaN).
__device__ __forceinline__ uint32_t warp_argmax(uint32_t key, uint32_t index, uint32_t* best_key) {
  const uint32_t kmax = __reduce_max_sync(kFullMask, key);
  *best_key = kmax;
  return __reduce_min_sync(kFullMask, key == kmax ? index : UINT_MAX);
}

// Loads this lane's VPL consecutive logits as fp32, with the widest vector loads the row's alignment allows;
// experts past the last one read as `pad`.
template <typename T, int VPL>
__device__ __forceinline__ void load_logits(const T* row, int lane, int num_experts, float pad, float (&out)[VPL]) {
  constexpr int kBytes = VPL * static_cast<int>(sizeof(T));
  constexpr int kVec = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4 : 2;
  using Vec = typename std::conditional<
      kVec == 16, uint4,
      typename std::conditional<kVec == 8, uint2,
                                typename std::conditional<kVec == 4, uint32_t, uint16_t>::type>::type>::type;
  const T* src = row + lane * VPL;
  const bool full = (lane + 1) * VPL <= num_experts;
  if (full && reinterpret_cast<uintptr_t>(src) % kVec == 0) {
    Vec buf[kBytes / kVec];
#pragma unroll
    for (int n = 0; n < kBytes / kVec; ++n) buf[n] = reinterpret_cast<const Vec*>(src)[n];
    const T* vals = reinterpret_cast<const T*>(buf);
#pragma unroll
    for (int i = 0; i < VPL; ++i) out[i] = to_float(vals[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VPL; ++i) out[i] = lane * VPL + i < num_experts ? to_float(src[i]) : pad;
  }
}

// Top-2 merge of (a1 >= a2) and (b1 >= b2).
__device__ __forceinline__ void merge_top2(float& a1, float& a2, float b1, float b2) {
  const float hi = fmaxf(a1, b1);
  a2 = fmaxf(fminf(a1, b1), fmaxf(a2, b2));
  a1 = hi;
}

// Lane l holds experts e = l * VPL + i (i < VPL): with groups of E/G consecutive experts, a group is then a
// run of whole lanes whenever VPL divides the group size, and its score is a few shuffles away
// (lanes_per_group > 0). Other group sizes take a general per-group loop.
template <typename T, int VPL>
__global__ void __launch_bounds__(kThreads) route_kernel(const RouteParams p) {
  static_assert(VPL >= 1 && VPL <= 32, "one lane holds at most 32 experts");
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;  // whole warps leave together, so the full-mask reductions stay valid

  const int E = p.num_experts;
  const int base = lane * VPL;
  float bias[VPL];
  if (p.bias != nullptr) {  // issued before the logits are consumed, so both loads are in flight together
#pragma unroll
    for (int i = 0; i < VPL; ++i) bias[i] = base + i < E ? p.bias[base + i] : 0.0f;
  }
  float key[VPL];  // the logits for now
  // Padding experts (never selectable): -inf keeps them out of the softmax's max. For the sigmoid, 0: a
  // score of 0 (from -inf) sends __fdiv_rn down its slow path, which cost Llama4 (16 experts, half the warp
  // padding) 10% at 64K tokens on an H100.
  load_logits<T, VPL>(static_cast<const T*>(p.logits) + t * p.row_stride, lane, E, p.use_sigmoid ? 0.0f : -INFINITY,
                      key);

  float score[VPL];
  if (p.use_sigmoid) {
    // sigmoid(x) = (x >= 0 ? 1 : e) / (1 + e) with e = exp(-|x|). For x < 0 that is exp(x) / (1 + exp(x)),
    // a normal float down to x = -87 and a subnormal one down to -103 (1 / (1 + exp(-x)) is already 0 below
    // -88.7, where exp(-x) overflows); -inf gives exactly 0, +inf exactly 1. No branch, and __fdiv_rn is the
    // correctly rounded `/` whatever the flags: the reference spells out the same expression, so on a GPU
    // the scores are the same bits.
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const float e = expf(-fabsf(key[i]));
      score[i] = __fdiv_rn(key[i] >= 0.0f ? 1.0f : e, 1.0f + e);
    }
  } else {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPL; ++i) m = fmaxf(m, key[i]);
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      score[i] = base + i < E ? expf(key[i] - m) : 0.0f;
      sum += score[i];
    }
    const float inv = __frcp_rn(warp_sum(sum));
#pragma unroll
    for (int i = 0; i < VPL; ++i) score[i] *= inv;
  }

  // Selection key. Without a bias, softmax and sigmoid are monotone in the logit, so the logit itself
  // orders the experts and no rounding of the scores can create or break a tie. With a bias, the key is
  // score + bias and the weight stays the unbiased score. +0.0f folds -0 into +0 so the two tie.
  // okey: the key as an order-preserving integer; 0 marks "not selectable" (below every real key).
  uint32_t okey[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    if (p.bias != nullptr) key[i] = score[i] + bias[i];
    key[i] = key[i] + 0.0f;
    okey[i] = base + i < E ? float_to_ordered(key[i]) : 0u;
  }

  if (p.num_groups > 1) {
    const int group_size = E / p.num_groups;
    const bool top2 = p.bias != nullptr && group_size >= 2;
    float my_group_score = -INFINITY;  // fast path: every lane of group g; general path: lane g
    int my_group;                      // the group whose score this lane holds, >= G for none
    if (p.lanes_per_group > 0) {
      float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < VPL; ++i) merge_top2(b1, b2, key[i], -INFINITY);
      for (int offset = 1; offset < p.lanes_per_group; offset <<= 1) {
        const float o1 = __shfl_xor_sync(kFullMask, b1, offset);
        const float o2 = __shfl_xor_sync(kFullMask, b2, offset);
        merge_top2(b1, b2, o1, o2);
      }
      my_group = lane / p.lanes_per_group;
      my_group_score = (top2 ? b1 + b2 : b1) + 0.0f;
    } else {
      my_group = lane;
      int group[VPL];
#pragma unroll
      for (int i = 0; i < VPL; ++i) group[i] = base + i < E ? (base + i) / group_size : -1;
      for (int g = 0; g < p.num_groups; ++g) {
        float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          if (group[i] == g) merge_top2(b1, b2, key[i], -INFINITY);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          const float o1 = __shfl_xor_sync(kFullMask, b1, offset);
          const float o2 = __shfl_xor_sync(kFullMask, b2, offset);
          merge_top2(b1, b2, o1, o2);
        }
        if (lane == g) my_group_score = (top2 ? b1 + b2 : b1) + 0.0f;
      }
    }

    uint32_t kept_groups = 0;
    for (int r = 0; r < p.topk_group; ++r) {
      const bool candidate = my_group < p.num_groups && !(kept_groups >> my_group & 1u);
      uint32_t unused;
      const uint32_t g = warp_argmax(candidate ? float_to_ordered(my_group_score) : 0u,
                                     candidate ? static_cast<uint32_t>(my_group) : UINT_MAX, &unused);
      kept_groups |= 1u << g;
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int g = p.lanes_per_group > 0 ? my_group : (base + i) / group_size;
      if (!(kept_groups >> g & 1u)) okey[i] = 0u;
    }
  }

  // Top-k, one winner per round; lane j keeps column j.
  float my_weight = 0.0f;
  int my_id = 0;
  for (int j = 0; j < p.top_k; ++j) {
    uint32_t local_key = 0u;
    int local_i = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (okey[i] > local_key) {  // strict: the lower index keeps a tie
        local_key = okey[i];
        local_i = i;
      }
    }
    uint32_t best;
    const uint32_t winner =
        warp_argmax(local_key, local_key != 0u ? static_cast<uint32_t>(base + local_i) : UINT_MAX, &best);
    const bool owner = static_cast<uint32_t>(base + local_i) == winner;
    float w = 0.0f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (owner && i == local_i) {
        w = score[i];
        okey[i] = 0u;
      }
    }
    w = __shfl_sync(kFullMask, w, static_cast<int>(winner) / VPL);
    if (lane == j) {
      my_weight = w;
      my_id = static_cast<int>(winner);
    }
  }

  if (p.renormalize) {
    // Sigmoid weights: w / (sum + 1e-20), as DeepSeek-V3 and SGLang do, so that a token whose k scores are
    // all 0 (logits below about -104) gets zero weights, not 0 / 0. Softmax weights: w / sum, as SGLang's
    // softmax top-k; the softmax of the top logit is at least 1/E, so that sum is never 0 without a bias.
    float sum = warp_sum(lane < p.top_k ? my_weight : 0.0f);
    if (p.use_sigmoid) sum += kRenormEpsilon;
    my_weight = __fdiv_rn(my_weight, sum);
  }
  my_weight = my_weight * p.scale;
  if (lane < p.top_k) {
    p.weights[t * p.top_k + lane] = my_weight;
    p.ids[t * p.top_k + lane] = my_id;
  }
}

template <typename T, int VPL>
cudaError_t launch_vpl(RouteParams p, cudaStream_t stream) {
  p.lanes_per_group = 0;
  if (p.num_groups > 1) {
    const int group_size = p.num_experts / p.num_groups;
    const int lanes = group_size / VPL;
    if (group_size % VPL == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0) p.lanes_per_group = lanes;
  }
  const dim3 grid(static_cast<unsigned>((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  route_kernel<T, VPL><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const RouteParams& p, cudaStream_t stream) {
  const int vpl = (p.num_experts + 31) / 32;
  if (vpl <= 1) return launch_vpl<T, 1>(p, stream);
  if (vpl <= 2) return launch_vpl<T, 2>(p, stream);
  if (vpl <= 4) return launch_vpl<T, 4>(p, stream);
  if (vpl <= 8) return launch_vpl<T, 8>(p, stream);
  if (vpl <= 12) return launch_vpl<T, 12>(p, stream);
  if (vpl <= 16) return launch_vpl<T, 16>(p, stream);
  if (vpl <= 32) return launch_vpl<T, 32>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace routing
}  // namespace fim

extern "C" {

// Returns a cudaError_t; 0 on success. Arguments are validated in Python (flashinfer_moe/moe/routing.py);
// the checks here only guard the kernel's own limits.
int fim_route(const void* logits, int dtype, int64_t row_stride, const float* bias, float* weights, int32_t* ids,
              int num_tokens, int num_experts, int top_k, int use_sigmoid, int renormalize, int num_groups,
              int topk_group, float scale, void* stream) {
  using namespace fim::routing;
  if (num_tokens == 0) return 0;
  if (num_experts < 1 || num_experts > 1024 || top_k < 1 || top_k > kMaxTopK || top_k > num_experts || num_groups < 1 ||
      num_groups > kMaxGroups || num_experts % num_groups != 0 || topk_group < 1 || topk_group > num_groups) {
    return cudaErrorInvalidValue;
  }
  RouteParams p{logits,
                row_stride,
                bias,
                weights,
                ids,
                num_tokens,
                num_experts,
                top_k,
                use_sigmoid,
                renormalize,
                num_groups,
                topk_group,
                /*lanes_per_group=*/0,
                scale};
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case fim::kFloat32:
      return launch_typed<float>(p, s);
    case fim::kFloat16:
      return launch_typed<__half>(p, s);
    case fim::kBFloat16:
      return launch_typed<__nv_bfloat16>(p, s);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
