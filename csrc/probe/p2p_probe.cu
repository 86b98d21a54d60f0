// P2P capability probe: device attributes, peer access, and the live flag check shared by
// `flashinfer-moe probe` and the all-to-all backend choice.
//
// Live check: a kernel on the writer GPU stores a payload into the waiter GPU's memory and then publishes
// a flag there with a system-scope release atomic (a P2P atomic); a kernel on the waiter GPU spins on the
// flag with acquire loads, bounded by %globaltimer, and then checks the payload.

#include <cuda_runtime.h>

#include <cstdint>

#include "common/sync.cuh"

namespace fim {
namespace probe {

// Must match flashinfer_moe/comm/p2p_check.py.
enum Status : int { kOk = 0, kFail = 1, kTimeout = 2 };
enum Force : int { kForceNone = 0, kForceTimeout = 1, kForceFail = 2 };

// result: [status, flag value seen, payload seen, microseconds waited]
__global__ void wait_kernel(const int* flag, const int* payload, int token, uint64_t timeout_ns, int* result) {
  bool timed_out = false;
  const uint64_t start = global_timer_ns();
  const int seen = wait_flag_at_least(flag, 1, timeout_ns, &timed_out);
  const int got = *reinterpret_cast<const volatile int*>(payload);
  result[0] = timed_out ? kTimeout : (seen == 1 && got == token ? kOk : kFail);
  result[1] = seen;
  result[2] = got;
  result[3] = static_cast<int>((global_timer_ns() - start) / 1000);
}

__global__ void signal_kernel(int* remote_flag, int* remote_payload, int token, int force) {
  if (force == kForceTimeout) return;  // the flag never comes: the waiter must time out, not hang
  *remote_payload = force == kForceFail ? ~token : token;
  atomic_add_release_sys(remote_flag, 1);
}

// Ping-pong between two GPUs: each side publishes round n into the other's flag and waits for the
// other's round n. result: [status, rounds completed, nanoseconds for all rounds].
__global__ void pingpong_kernel(int* my_flag, int* peer_flag, int rounds, int initiator, uint64_t timeout_ns,
                                long long* result) {
  const uint64_t start = global_timer_ns();
  int n = 1;
  bool timed_out = false;
  for (; n <= rounds && !timed_out; ++n) {
    if (initiator) store_release_sys(peer_flag, n);
    wait_flag_at_least(my_flag, n, timeout_ns, &timed_out);
    if (!initiator && !timed_out) store_release_sys(peer_flag, n);
  }
  result[0] = timed_out ? kTimeout : kOk;
  result[1] = timed_out ? n - 2 : rounds;
  result[2] = static_cast<long long>(global_timer_ns() - start);
}

}  // namespace probe
}  // namespace fim

extern "C" {

int fim_probe_device_count(int* count) { return cudaGetDeviceCount(count); }

int fim_probe_pci_bus_id(int device, char* buf, int len) { return cudaDeviceGetPCIBusId(buf, len, device); }

// attrs: [can_access_peer, access_supported, native_atomics, performance_rank]
int fim_probe_pair_attributes(int device, int peer, int* attrs) {
  // A refused query is returned, not left in the runtime's last-error slot, where the caller's next launch
  // check would report it as that launch's failure.
  cudaError_t err = cudaDeviceCanAccessPeer(&attrs[0], device, peer);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  const cudaDeviceP2PAttr kinds[3] = {cudaDevP2PAttrAccessSupported, cudaDevP2PAttrNativeAtomicSupported,
                                      cudaDevP2PAttrPerformanceRank};
  for (int i = 0; i < 3; ++i) {
    err = cudaDeviceGetP2PAttribute(&attrs[1 + i], kinds[i], device, peer);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return err;
    }
  }
  return cudaSuccess;
}

// Lets kernels on `device` access memory of `peer` (context-wide, so torch's allocations benefit too).
int fim_probe_enable_peer_access(int device, int peer) {
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err != cudaSuccess) return err;
  err = cudaSetDevice(device);
  if (err == cudaSuccess) {
    err = cudaDeviceEnablePeerAccess(peer, 0);
    // Cleared either way: "already enabled" is no error for us, and a real failure is returned here rather
    // than left to surface at the caller's next launch check.
    if (err != cudaSuccess) cudaGetLastError();
    if (err == cudaErrorPeerAccessAlreadyEnabled) err = cudaSuccess;
  }
  cudaSetDevice(previous);
  return err;
}

// Loads the probe kernels into the current device's context. With lazy module loading (the default), the
// first launch of a kernel loads it, and loading waits for kernels already running on the device: a signal
// kernel launched for the first time while a waiter spins would then wait for the waiter's timeout.
int fim_probe_preload() {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaFuncGetAttributes(&attrs, fim::probe::wait_kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, fim::probe::signal_kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, fim::probe::pingpong_kernel);
  return err;
}

int fim_probe_launch_wait(const int* flag, const int* payload, int token, uint64_t timeout_ns, int* result,
                          void* stream) {
  fim::probe::wait_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(flag, payload, token, timeout_ns, result);
  return cudaGetLastError();
}

int fim_probe_launch_signal(int* remote_flag, int* remote_payload, int token, int force, void* stream) {
  fim::probe::signal_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(remote_flag, remote_payload, token, force);
  return cudaGetLastError();
}

int fim_probe_launch_pingpong(int* my_flag, int* peer_flag, int rounds, int initiator, uint64_t timeout_ns,
                              long long* result, void* stream) {
  fim::probe::pingpong_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(my_flag, peer_flag, rounds, initiator,
                                                                              timeout_ns, result);
  return cudaGetLastError();
}

const char* fim_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
