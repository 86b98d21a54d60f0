// 128x128 tiles, two consumer warpgroups sharing each tile (64 rows each): prefill-sized groups.
#include "gemm/sm90_fp8_block_grouped.cuh"

namespace {
using Config =
    fim::sm90_grouped::Fp8BlockGrouped<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                       cute::Shape<cute::_1, cute::_1, cute::_1>,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

FIM_SM90_GROUPED_EXPORT(coop, Config)
