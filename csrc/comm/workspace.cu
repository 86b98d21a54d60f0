// Symmetric workspace: device memory that every rank of a group maps, exported with legacy CUDA IPC handles
// (one node) or FABRIC handles (the driver's multi-node NVLink path), plus mapped host memory for error words.
//
// The driver API is reached through the runtime's entry-point query, so the library needs no link against
// libcuda; a driver too old for a function simply reports FABRIC as unsupported.

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace {

// Driver errors are returned offset by this, so one error-string function can tell them from runtime errors.
constexpr int kDriverErrorBase = 100000;

template <typename Fn>
bool driver_fn(const char* name, Fn** fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &found);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &ptr, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || ptr == nullptr) {
    cudaGetLastError();
    return false;
  }
  *fn = reinterpret_cast<Fn*>(ptr);
  return true;
}

int driver_status(CUresult r) { return r == CUDA_SUCCESS ? 0 : kDriverErrorBase + static_cast<int>(r); }

// Makes `device` current for the scope: the caller's thread may have another one current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

CUmemAllocationProp fabric_prop(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

// Reserves an address range for `handle`, maps it and grants `device` read/write access.
int map_handle(int device, CUmemGenericAllocationHandle handle, size_t size, size_t align, void** ptr) {
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  if (!driver_fn("cuMemAddressReserve", &reserve) || !driver_fn("cuMemMap", &map) ||
      !driver_fn("cuMemSetAccess", &set_access) || !driver_fn("cuMemAddressFree", &address_free) ||
      !driver_fn("cuMemUnmap", &unmap)) {
    return driver_status(CUDA_ERROR_NOT_SUPPORTED);
  }
  CUdeviceptr base = 0;
  CUresult r = reserve(&base, size, align, 0, 0);
  if (r != CUDA_SUCCESS) return driver_status(r);
  r = map(base, size, 0, handle, 0);
  if (r != CUDA_SUCCESS) {
    address_free(base, size);
    return driver_status(r);
  }
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = set_access(base, size, &access, 1);
  if (r != CUDA_SUCCESS) {
    unmap(base, size);
    address_free(base, size);
    return driver_status(r);
  }
  *ptr = reinterpret_cast<void*>(base);
  return 0;
}

}  // namespace

extern "C" {

// ----------------------------------------------------------------------------------- legacy CUDA IPC

// Allocates `nbytes` of zeroed device memory on `device`; the zeroing has completed on return.
int fim_ws_alloc(int device, int64_t nbytes, void** ptr) {
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  cudaError_t err = cudaMalloc(ptr, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) return err;
  err = cudaMemset(*ptr, 0, static_cast<size_t>(nbytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(*ptr);
    *ptr = nullptr;
  }
  return err;
}

int fim_ws_free(int device, void* ptr) {
  DeviceScope scope(device);
  return cudaFree(ptr);
}

// handle: 64 bytes (cudaIpcMemHandle_t).
int fim_ws_ipc_handle(void* ptr, unsigned char* handle) {
  cudaIpcMemHandle_t h;
  cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
  if (err == cudaSuccess) std::memcpy(handle, &h, sizeof(h));
  return err;
}

int fim_ws_ipc_open(int device, const unsigned char* handle, void** ptr) {
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

int fim_ws_ipc_close(int device, void* ptr) {
  DeviceScope scope(device);
  return cudaIpcCloseMemHandle(ptr);
}

// ------------------------------------------------------------------------------------- FABRIC handles

int fim_ws_fabric_supported(int device, int* supported) {
  *supported = 0;
  decltype(&cuDeviceGetAttribute) get_attribute = nullptr;
  decltype(&cuDeviceGet) get_device = nullptr;
  if (!driver_fn("cuDeviceGetAttribute", &get_attribute) || !driver_fn("cuDeviceGet", &get_device)) return 0;
  CUdevice dev;
  CUresult r = get_device(&dev, device);
  if (r != CUDA_SUCCESS) return driver_status(r);
  r = get_attribute(supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev);
  return driver_status(r);
}

// Creates `nbytes` (rounded up to the granularity, returned in *size) of zeroed memory with a FABRIC handle,
// maps it on `device`, and exports the handle (64 bytes) for peers.
int fim_ws_fabric_alloc(int device, int64_t nbytes, void** ptr, int64_t* size, uint64_t* handle,
                        unsigned char* exported) {
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  if (!driver_fn("cuMemGetAllocationGranularity", &granularity) || !driver_fn("cuMemCreate", &create) ||
      !driver_fn("cuMemRelease", &release) || !driver_fn("cuMemExportToShareableHandle", &export_handle)) {
    return driver_status(CUDA_ERROR_NOT_SUPPORTED);
  }
  CUmemAllocationProp prop = fabric_prop(device);
  size_t align = 0;
  CUresult r = granularity(&align, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS) return driver_status(r);
  const size_t bytes = (static_cast<size_t>(nbytes) + align - 1) / align * align;
  CUmemGenericAllocationHandle h;
  r = create(&h, bytes, &prop, 0);
  if (r != CUDA_SUCCESS) return driver_status(r);
  CUmemFabricHandle fabric;
  r = export_handle(&fabric, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
  if (r != CUDA_SUCCESS) {
    release(h);
    return driver_status(r);
  }
  int status = map_handle(device, h, bytes, align, ptr);
  if (status != 0) {
    release(h);
    return status;
  }
  *size = static_cast<int64_t>(bytes);
  *handle = static_cast<uint64_t>(h);
  cudaError_t err = cudaMemset(*ptr, 0, bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return err;  // mapped: the caller releases it with fim_ws_fabric_release
  static_assert(sizeof(fabric) == 64, "FABRIC handles are 64 bytes");
  std::memcpy(exported, &fabric, sizeof(fabric));
  return 0;
}

int fim_ws_fabric_import(int device, const unsigned char* exported, int64_t size, void** ptr, uint64_t* handle) {
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) return scope.status();
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  if (!driver_fn("cuMemImportFromShareableHandle", &import_handle) || !driver_fn("cuMemRelease", &release) ||
      !driver_fn("cuMemGetAllocationGranularity", &granularity)) {
    return driver_status(CUDA_ERROR_NOT_SUPPORTED);
  }
  CUmemAllocationProp prop = fabric_prop(device);
  size_t align = 0;
  CUresult r = granularity(&align, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS) return driver_status(r);
  CUmemFabricHandle fabric;
  std::memcpy(&fabric, exported, sizeof(fabric));
  CUmemGenericAllocationHandle h;
  r = import_handle(&h, &fabric, CU_MEM_HANDLE_TYPE_FABRIC);
  if (r != CUDA_SUCCESS) return driver_status(r);
  int status = map_handle(device, h, static_cast<size_t>(size), align, ptr);
  if (status != 0) {
    release(h);
    return status;
  }
  *handle = static_cast<uint64_t>(h);
  return 0;
}

// Unmaps and releases a mapping made by fim_ws_fabric_alloc or fim_ws_fabric_import.
int fim_ws_fabric_release(int device, void* ptr, int64_t size, uint64_t handle) {
  DeviceScope scope(device);
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  if (!driver_fn("cuMemUnmap", &unmap) || !driver_fn("cuMemAddressFree", &address_free) ||
      !driver_fn("cuMemRelease", &release)) {
    return driver_status(CUDA_ERROR_NOT_SUPPORTED);
  }
  const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(ptr);
  CUresult r = CUDA_SUCCESS;
  if (ptr != nullptr) {
    r = unmap(base, static_cast<size_t>(size));
    CUresult r2 = address_free(base, static_cast<size_t>(size));
    if (r == CUDA_SUCCESS) r = r2;
  }
  CUresult r3 = release(static_cast<CUmemGenericAllocationHandle>(handle));
  return driver_status(r != CUDA_SUCCESS ? r : r3);
}

// ------------------------------------------------------------------------------- mapped host memory

// Zeroed page-locked host memory that kernels can write (its host address is also its device address).
int fim_ws_host_alloc(int64_t nbytes, void** ptr) {
  cudaError_t err = cudaHostAlloc(ptr, static_cast<size_t>(nbytes), cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) std::memset(*ptr, 0, static_cast<size_t>(nbytes));
  return err;
}

int fim_ws_host_free(void* ptr) { return cudaFreeHost(ptr); }

int fim_ws_memset(int device, void* ptr, int value, int64_t nbytes) {
  DeviceScope scope(device);
  cudaError_t err = cudaMemset(ptr, value, static_cast<size_t>(nbytes));
  return err == cudaSuccess ? cudaDeviceSynchronize() : err;
}

// A blocking copy between any two addresses (host, device, mapped peer), for the few header words the host
// reads and writes outside the kernels.
int fim_ws_copy(int device, void* dst, const void* src, int64_t nbytes) {
  DeviceScope scope(device);
  return cudaMemcpy(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDefault);
}

const char* fim_error_string(int error) {
  if (error >= kDriverErrorBase) {
    decltype(&cuGetErrorString) get_string = nullptr;
    const char* text = nullptr;
    if (driver_fn("cuGetErrorString", &get_string) &&
        get_string(static_cast<CUresult>(error - kDriverErrorBase), &text) == CUDA_SUCCESS && text != nullptr) {
      return text;
    }
    return "CUDA driver error";
  }
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // extern "C"
