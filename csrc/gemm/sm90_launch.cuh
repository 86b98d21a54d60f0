// Host-side steps that the Hopper kernel libraries (the grouped GEMMs, ours and the CUTLASS one, and MLA decode)
// take before a launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

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

}  // namespace sm90
}  // namespace fim
