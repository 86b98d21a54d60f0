// Host-side steps that both Hopper grouped-GEMM libraries (ours and the CUTLASS one) take before a launch.
#pragma once

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

}  // namespace sm90
}  // namespace fim
