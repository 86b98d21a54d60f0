// Element types crossing the C ABI, and loads that widen them to fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fim {

// Must match flashinfer_moe/moe/_launch.py.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace fim
