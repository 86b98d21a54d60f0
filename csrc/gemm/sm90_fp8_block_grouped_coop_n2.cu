// The coop configuration in clusters of two CTAs on neighbouring column tiles, which share the
// activation tile (one TMA load multicast to both).
#include "gemm/sm90_fp8_block_grouped.cuh"

namespace {
using Config =
    fim::sm90_grouped::Fp8BlockGrouped<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                       cute::Shape<cute::_1, cute::_2, cute::_1>,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

FIM_SM90_GROUPED_EXPORT(coop_n2, Config)
