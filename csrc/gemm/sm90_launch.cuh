// Host-side steps that the Hopper kernel libraries (the grouped GEMMs, ours and the CUTLASS one, and MLA decode)
// take before a launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fim {
namespace sm90 {

constexpr int kMaxDevices = 64;

// The tile orders both kernels accept: 1, 2, 4 or 8 tiles side by side; raster 0 (auto), 1 (m) or 2 (n).
inline bool valid_order(int swizzle, int raster) {
  return (swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8) && raster >= 0 && raster <= 2;
}

// Lets `Kernel` use `bytes` of dynamic shared memory (more than 48 KiB needs an opt-in). The opt-in is a host
// call, made once per process, kernel and device here, outside any stream capture a later call may be part of.
template <auto Kernel>
cudaError_t opt_in_shared_memory(int bytes) {
  static bool done[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!done[device]) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    done[device] = true;
  }
  return cudaSuccess;
}

using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

// The driver's tensor-map encoder, found once through the runtime (so that no library links libcuda itself);
// null where the driver has none.
inline EncodeTiled tensor_map_encoder() {
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
// (128-byte swizzled unless `swizzle` says otherwise); rows past `outer` read as zeros and are not written.
inline bool encode_2d(CUtensorMap* map, const void* base, CUtensorMapDataType type, uint32_t elem_bytes, uint64_t inner,
                      uint64_t outer, uint32_t box_inner, uint32_t box_outer, CUtensorMapL2promotion promotion,
                      CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  EncodeTiled fn = tensor_map_encoder();
  if (!fn) return false;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * elem_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  return fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace sm90
}  // namespace fim
