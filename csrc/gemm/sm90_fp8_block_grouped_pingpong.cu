// 64x128 tiles, two consumer warpgroups on different tiles taking turns at the tensor cores: one's scale
// promotion and epilogue overlap the other's wgmma. Also wastes fewer rows on decode-sized groups.
#include "gemm/sm90_fp8_block_grouped.cuh"

namespace {
using Config = fim::sm90_grouped::Fp8BlockGrouped<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                                  cute::Shape<cute::_1, cute::_1, cute::_1>,
                                                  cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                                  cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

FIM_SM90_GROUPED_EXPORT(pingpong, Config)
