// System-scope release/acquire primitives and a wall-clock bound for spin loops.
//
// Every spin loop in this library waits against %globaltimer (nanoseconds) so that a peer that never
// arrives turns into a reported timeout instead of a hung kernel.
#pragma once

#include <cstdint>

namespace fim {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int load_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int atomic_add_release_sys(int* p, int v) {
  int old;
  asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Spins until *flag >= target or timeout_ns elapse. Returns the last value read; *timed_out says which.
__device__ __forceinline__ int wait_flag_at_least(const int* flag, int target, uint64_t timeout_ns, bool* timed_out) {
  const uint64_t start = global_timer_ns();
  int v = load_acquire_sys(flag);
  while (v < target) {
    if (global_timer_ns() - start > timeout_ns) {
      *timed_out = true;
      return v;
    }
    __nanosleep(64);
    v = load_acquire_sys(flag);
  }
  *timed_out = false;
  return v;
}

__device__ __forceinline__ void store_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t atomic_add_release_sys_u64(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.add.release.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

// Spins until *flag >= target; false when timeout_ns elapsed first. 64-bit, so epochs never wrap.
__device__ __forceinline__ bool wait_flag_u64_at_least(const uint64_t* flag, uint64_t target, uint64_t timeout_ns) {
  if (load_acquire_sys_u64(flag) >= target) return true;
  const uint64_t start = global_timer_ns();
  while (load_acquire_sys_u64(flag) < target) {
    if (global_timer_ns() - start > timeout_ns) return false;
    __nanosleep(32);
  }
  return true;
}

}  // namespace fim
