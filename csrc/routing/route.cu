// Fused top-k routing: scoring (softmax | sigmoid), optional correction bias, optional group-limited
// selection, top-k, renormalisation and scaling in one launch, one warp per token, no host sync.
//
// Lane l holds experts e = i * 32 + l (i < VPL), so each load instruction of a warp is coalesced.
// Selection ties go to the lower expert (or group) index, which is what a stable descending sort gives;
// flashinfer_moe/reference.py implements the same order.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/dtype.cuh"
#include "common/warp.cuh"

namespace fim {
namespace routing {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxGroups = 32;  // one group per lane during group selection
constexpr int kMaxTopK = 32;    // one output column per lane

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
  float scale;
};

// Warp-wide argmax over (ordered key, index): the largest key, the lowest index among equal keys.
// Lanes with no candidate pass index UINT_MAX and key 0 (below every float's ordered value but one NaN).
__device__ __forceinline__ uint32_t warp_argmax(uint32_t key, uint32_t index, uint32_t* best_key) {
  const uint32_t kmax = __reduce_max_sync(kFullMask, key);
  *best_key = kmax;
  return __reduce_min_sync(kFullMask, key == kmax ? index : UINT_MAX);
}

template <typename T, int VPL>
__global__ void __launch_bounds__(kThreads) route_kernel(const RouteParams p) {
  static_assert(VPL >= 1 && VPL <= 32, "avail mask is 32 bits");
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;  // whole warps leave together, so the full-mask reductions stay valid

  const int E = p.num_experts;
  const T* row = static_cast<const T*>(p.logits) + t * p.row_stride;

  float score[VPL];
  float key[VPL];
  uint32_t avail = 0;  // bit i: expert i*32+lane exists, is in a kept group and is not taken yet
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int e = i * 32 + lane;
    const bool valid = e < E;
    key[i] = valid ? to_float(row[e]) : -INFINITY;  // the logit for now
    avail |= valid ? (1u << i) : 0u;
  }

  if (p.use_sigmoid) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) score[i] = 1.0f / (1.0f + expf(-key[i]));
  } else {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPL; ++i) m = fmaxf(m, key[i]);
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      score[i] = (avail >> i & 1u) ? expf(key[i] - m) : 0.0f;
      sum += score[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < VPL; ++i) score[i] = score[i] / sum;
  }

  // Selection key. Without a bias, softmax and sigmoid are monotone in the logit, so the logit itself
  // orders the experts and no rounding of the scores can create or break a tie. With a bias, the key is
  // score + bias and the weight stays the unbiased score.
  if (p.bias != nullptr) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int e = i * 32 + lane;
      key[i] = (avail >> i & 1u) ? score[i] + p.bias[e] : -INFINITY;
    }
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) key[i] = key[i] + 0.0f;  // -0 -> +0, so the integer order ties them

  if (p.num_groups > 1) {
    const int group_size = E / p.num_groups;
    int group[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) group[i] = (i * 32 + lane) / group_size;

    // Group score: the best key of the group, or with a bias the sum of its two best keys.
    float my_group_score = -INFINITY;  // lane g keeps group g's score
    for (int g = 0; g < p.num_groups; ++g) {
      float b1 = -INFINITY;
      float b2 = -INFINITY;
      int b1_index = INT_MAX;
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        if ((avail >> i & 1u) && group[i] == g) {
          if (b1_index == INT_MAX || key[i] > b1) {
            b2 = b1;
            b1 = key[i];
            b1_index = i * 32 + lane;
          } else if (key[i] > b2) {
            b2 = key[i];
          }
        }
      }
      uint32_t best;
      const uint32_t winner = warp_argmax(b1_index == INT_MAX ? 0u : float_to_ordered(b1),
                                          b1_index == INT_MAX ? UINT_MAX : static_cast<uint32_t>(b1_index), &best);
      float group_score = ordered_to_float(best);
      if (p.bias != nullptr && group_size >= 2) {
        // Second best of the group: the winner lane offers its own runner-up, the others their best.
        const bool is_winner_lane = static_cast<int>(winner & 31u) == lane;
        const float offer = is_winner_lane ? b2 : b1;
        // Every group has at least two experts, so a second best exists; a -inf offer from the winner lane
        // (no runner-up of its own) can only lose to it or equal it.
        const bool has_offer = is_winner_lane || b1_index != INT_MAX;
        const uint32_t second = __reduce_max_sync(kFullMask, has_offer ? float_to_ordered(offer) : 0u);
        group_score = group_score + ordered_to_float(second);
      }
      if (lane == g) my_group_score = group_score + 0.0f;
    }

    uint32_t kept_groups = 0;
    for (int r = 0; r < p.topk_group; ++r) {
      const bool candidate = lane < p.num_groups && !(kept_groups >> lane & 1u);
      uint32_t unused;
      const uint32_t g = warp_argmax(candidate ? float_to_ordered(my_group_score) : 0u,
                                     candidate ? static_cast<uint32_t>(lane) : UINT_MAX, &unused);
      kept_groups |= 1u << g;
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (!(kept_groups >> group[i] & 1u)) avail &= ~(1u << i);
    }
  }

  // Top-k, one winner per round; lane j keeps column j.
  float my_weight = 0.0f;
  int my_id = 0;
  for (int j = 0; j < p.top_k; ++j) {
    uint32_t local_key = 0;
    uint32_t local_index = UINT_MAX;
    float local_score = 0.0f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const uint32_t o = float_to_ordered(key[i]);
      if ((avail >> i & 1u) && (local_index == UINT_MAX || o > local_key)) {
        local_key = o;
        local_index = static_cast<uint32_t>(i * 32 + lane);
        local_score = score[i];
      }
    }
    uint32_t best;
    const uint32_t winner = warp_argmax(local_key, local_index, &best);
    const int owner = static_cast<int>(winner & 31u);
    const float w = __shfl_sync(kFullMask, local_score, owner);
    if (lane == owner) avail &= ~(1u << (winner >> 5));
    if (lane == j) {
      my_weight = w;
      my_id = static_cast<int>(winner);
    }
  }

  if (p.renormalize) {
    const float sum = warp_sum(lane < p.top_k ? my_weight : 0.0f);
    my_weight = my_weight / sum;
  }
  my_weight = my_weight * p.scale;
  if (lane < p.top_k) {
    p.weights[t * p.top_k + lane] = my_weight;
    p.ids[t * p.top_k + lane] = my_id;
  }
}

template <typename T>
cudaError_t launch_typed(const RouteParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(kThreads);
  const int vpl = (p.num_experts + 31) / 32;
  if (vpl <= 1) {
    route_kernel<T, 1><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 2) {
    route_kernel<T, 2><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 4) {
    route_kernel<T, 4><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 8) {
    route_kernel<T, 8><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 12) {
    route_kernel<T, 12><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 16) {
    route_kernel<T, 16><<<grid, block, 0, stream>>>(p);
  } else if (vpl <= 32) {
    route_kernel<T, 32><<<grid, block, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
  RouteParams p{logits, row_stride,  bias,        weights,    ids,        num_tokens, num_experts,
                top_k,  use_sigmoid, renormalize, num_groups, topk_group, scale};
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
