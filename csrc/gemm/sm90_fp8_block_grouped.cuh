// Hopper FP8 block-scaled grouped GEMM (DeepSeek-V3 scales) over the expert-major layouts, built from
// CUTLASS's warp-specialized pointer-array collectives: a TMA producer warp, consumer warpgroups issuing wgmma,
// fp32 promotion with the per-128 scales at every K block, and a TMA store of bf16.
//
//   out[rows of e] = (A[rows of e] * sa) @ (W[e] * sw)^T
//   A  [rows, K] e4m3, row-major; sa [rows, K / 128] fp32 (K-major, as our quantizer writes it)
//   W  [E, N, K] e4m3 (K-major "column-major B"); sw [E, N / 128, K / 128] fp32 (K-major)
//   out [rows, N] bf16
//
// Every group's problem shape and pointers are written on the device by a small setup kernel from the
// [E] counts (and the contiguous layout's [E + 1] offsets), so a call never syncs with the host and can be
// captured in a CUDA graph. Tiles of a group are clipped to its own rows by the per-group TMA descriptors,
// so rows that belong to no expert (layout padding) are never written.
//
// Each translation unit that includes this header instantiates one configuration and defines FIM_CONFIG.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "sm90_launch.cuh"

namespace fim {
namespace sm90_grouped {

using namespace cute;

constexpr int kScaleBlock = 128;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct Fp8BlockGrouped {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;  // elements per 16-byte access
  static constexpr int kAlignD = 8;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // per group: M, N, K

  // Both scale tensors K-major: that is how the activation quantizer and DeepSeek-V3 checkpoints store them.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  // The per-group argument arrays, carved out of the front of the caller's workspace.
  struct Groups {
    Shape3* shapes;
    const ElementA** a;
    const ElementB** b;
    const float** sfa;
    const float** sfb;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
  };

  static size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

  static size_t groups_bytes(int num_groups, Groups* g, char* base) {
    size_t off = 0;
    auto take = [&](auto*& field, size_t elem) {
      using T = std::remove_reference_t<decltype(field)>;
      if (g) field = reinterpret_cast<T>(base + off);
      off = align_up(off + elem * num_groups);
    };
    Groups dummy{};
    Groups& t = g ? *g : dummy;
    take(t.shapes, sizeof(Shape3));
    take(t.a, sizeof(void*));
    take(t.b, sizeof(void*));
    take(t.sfa, sizeof(void*));
    take(t.sfb, sizeof(void*));
    take(t.d, sizeof(void*));
    take(t.stride_a, sizeof(StrideA));
    take(t.stride_b, sizeof(StrideB));
    take(t.stride_d, sizeof(StrideD));
    take(t.layout_sfa, sizeof(LayoutSFA));
    take(t.layout_sfb, sizeof(LayoutSFB));
    return off;
  }

  // swizzle: 1, 2, 4 or 8 tiles in a row of the raster; raster: 0 lets CUTLASS choose, 1 along M, 2 along N.
  static typename Gemm::Arguments arguments(int num_groups, const Groups& g, int sm_count, int swizzle = 1,
                                            int raster = 1) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {num_groups, g.shapes, nullptr};  // no host shapes: the counts stay on the device
    args.mainloop = {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.ptr_D = g.d;
    args.epilogue.dD = g.stride_d;
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {_0{}, _0{}, 0};
    fusion.dBeta = {_0{}, _0{}, 0};
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = sm_count;
    args.scheduler.max_swizzle_size = swizzle;
    using Raster = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = raster == 0 ? Raster::Heuristic : raster == 2 ? Raster::AlongN : Raster::AlongM;
    return args;
  }
};

struct Problem {
  const void* a;
  const float* a_scale;
  const void* w;
  const float* w_scale;
  void* out;
  const int32_t* counts;   // [E]
  const int32_t* offsets;  // [E + 1] first row of each expert (contiguous), or null (masked)
  int capacity;            // masked: rows per expert in a, the bound of every count
  int num_groups, n, k;
  int swizzle, raster;  // tile order (see Fp8BlockGrouped::arguments)
};

template <class G>
__global__ void fill_groups(Problem p, typename G::Groups g) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.num_groups) return;
  const int kb = p.k / kScaleBlock, nb = p.n / kScaleBlock;
  int64_t first;
  int rows = p.counts[e];
  if (p.offsets) {
    first = p.offsets[e];
  } else {
    first = int64_t(e) * p.capacity;
    rows = rows < p.capacity ? rows : p.capacity;  // a count past capacity is clamped, never trusted
  }
  rows = rows > 0 ? rows : 0;
  g.shapes[e] = make_shape(rows, p.n, p.k);
  g.a[e] = static_cast<const typename G::ElementA*>(p.a) + first * p.k;
  g.sfa[e] = p.a_scale + first * kb;
  g.b[e] = static_cast<const typename G::ElementB*>(p.w) + int64_t(e) * p.n * p.k;
  g.sfb[e] = p.w_scale + int64_t(e) * nb * kb;
  g.d[e] = static_cast<typename G::ElementD*>(p.out) + first * p.n;
  typename G::StrideA sa{};
  get<0>(sa) = p.k;
  g.stride_a[e] = sa;
  typename G::StrideB sb{};
  get<0>(sb) = p.k;
  g.stride_b[e] = sb;
  typename G::StrideD sd{};
  get<0>(sd) = p.n;
  g.stride_d[e] = sd;
  g.layout_sfa[e] = G::ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, p.n, p.k, 1));
  g.layout_sfb[e] = G::ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, p.n, p.k, 1));
}

// Enough for every tile order, so a caller sizes its workspace once per (E, SMs).
template <class G>
int64_t workspace_bytes(int num_groups, int sm_count) {
  typename G::Groups g{};
  size_t most = 0;
  for (int swizzle = 1; swizzle <= 8; swizzle *= 2) {
    for (int raster = 0; raster <= 2; ++raster) {
      const size_t need = G::Gemm::get_workspace_size(G::arguments(num_groups, g, sm_count, swizzle, raster));
      most = need > most ? need : most;
    }
  }
  return int64_t(G::groups_bytes(num_groups, nullptr, nullptr) + G::align_up(most));
}

template <class G>
int run(const Problem& p, void* workspace, int64_t workspace_size, int sm_count, cudaStream_t stream) {
  if (p.num_groups < 1 || p.n % kScaleBlock || p.k % kScaleBlock || p.n < 1 || p.k < 1 || sm_count < 1 ||
      !sm90::valid_order(p.swizzle, p.raster)) {
    return cudaErrorInvalidValue;
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 256 || workspace_size < workspace_bytes<G>(p.num_groups, sm_count)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err =
      sm90::opt_in_shared_memory<cutlass::device_kernel<typename G::Kernel>>(int(G::Kernel::SharedStorageSize));
  if (err != cudaSuccess) return err;

  typename G::Groups g{};
  char* base = static_cast<char*>(workspace);
  const size_t own = G::groups_bytes(p.num_groups, &g, base);
  fill_groups<G><<<(p.num_groups + 127) / 128, 128, 0, stream>>>(p, g);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  auto args = G::arguments(p.num_groups, g, sm_count, p.swizzle, p.raster);
  void* cutlass_ws = base + own;
  if (G::Kernel::can_implement(args) != true) return cudaErrorInvalidValue;
  if (G::Kernel::initialize_workspace(args, cutlass_ws, stream) != cutlass::Status::kSuccess) {
    return cudaErrorUnknown;
  }
  auto params = G::Kernel::to_underlying_arguments(args, cutlass_ws);
  if (G::Gemm::run(params, stream) != cutlass::Status::kSuccess) {
    err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace sm90_grouped
}  // namespace fim

// One configuration's two entry points: fim_sm90_fp8_block_grouped_<name> and its _workspace query.
#define FIM_SM90_GROUPED_EXPORT(NAME, CONFIG)                                                                         \
  extern "C" int64_t fim_sm90_fp8_block_grouped_##NAME##_workspace(int num_groups, int sm_count) {                    \
    return fim::sm90_grouped::workspace_bytes<CONFIG>(num_groups, sm_count);                                          \
  }                                                                                                                   \
  extern "C" int fim_sm90_fp8_block_grouped_##NAME(                                                                   \
      const void* a, const float* a_scale, const void* w, const float* w_scale, void* out, const int32_t* counts,     \
      const int32_t* offsets, int capacity, int num_groups, int n, int k, int swizzle, int raster, void* workspace,   \
      int64_t workspace_size, int sm_count, void* stream) {                                                           \
    fim::sm90_grouped::Problem p{a,        a_scale,    w, w_scale, out,     counts, offsets,                          \
                                 capacity, num_groups, n, k,       swizzle, raster};                                  \
    return fim::sm90_grouped::run<CONFIG>(p, workspace, workspace_size, sm_count, static_cast<cudaStream_t>(stream)); \
  }
