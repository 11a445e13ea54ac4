// Host emulation of the few CUDA features the LUT-GEMM kernels use, for their CPU test build
// (lutgemm_emu.cpp, compiled by tests/test_kernel_lutgemm.py with g++ -DLUTGEMM_HOST_EMU): every CUDA
// thread of a block is a std::thread, __syncthreads / __syncwarp are std::barriers, and the warp-collective
// mma exchanges its fragments through mma_exchange. Included by lutgemm_common.cuh only under
// LUTGEMM_HOST_EMU, after the CUDA fp16 / bf16 headers (which compile as plain C++).
#pragma once

#ifdef LUTGEMM_HOST_EMU
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <vector_functions.h>
#include <vector_types.h>
#undef __shared__
#define __shared__ static  // one copy per kernel instantiation; blocks are emulated one at a time
#define __launch_bounds__(...)
namespace emu {
inline thread_local uint3 tid, bid;
inline thread_local uint3 gdim, bdim;
inline thread_local std::barrier<>* bar = nullptr;
inline thread_local std::barrier<>* warp_bar = nullptr;
struct MmaExchange {  // fragments of one warp's mma, to emulate the warp-collective instruction
  uint32_t a[32][4];
  uint32_t b[32][2];
};
inline MmaExchange mma_exchange[32];
}  // namespace emu
#define threadIdx emu::tid
#define blockIdx emu::bid
#define gridDim emu::gdim
#define blockDim emu::bdim
inline void __syncthreads() { emu::bar->arrive_and_wait(); }
inline void __syncwarp() { emu::warp_bar->arrive_and_wait(); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned(v >> (s & 31));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = (uint64_t(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
#endif  // LUTGEMM_HOST_EMU
