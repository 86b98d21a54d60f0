// What every kernel library exports besides its launchers.
#include <cuda_runtime.h>

extern "C" const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }
