// Bit helpers, number conversions and loads of the any-precision kernels, for device and host alike: the
// host versions let the CPU decode harness (tests/test_kernel_anyprec.py) run the kernel's own decode.
//
// Inputs (quantkit/formats/anyprec.py): planes int32 [n, M, W'] of an n-bit parent, most significant
// plane first; bit j of planes[p, r, w] is plane p of column 32w+j (natural layout) or, in the
// kernel layout made once at load time (anyprec_gemm.kernel_layout, flag LAYOUT), of the column
// given by the bit permutation pi below. Serving k bits reads planes 0..k-1 only; the k-bit code is
// those k bits and its centroid is lut_k[r, code] (fp16 [M, 2^k]).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define AP_HD __host__ __device__ __forceinline__

namespace anyprec {

constexpr int kMaxBatch = 8;  // the mma's N
constexpr int FLAG_LAYOUT = 1, FLAG_IBT = 2, FLAG_TLM = 4;
// Variant flags of the shared-memory-table widths (k >= 4; anyprec_decode.cuh Config): FLAG_PAIR packs the
// tables of rows g and g + 8 into one 32-bit word (half the table bytes, so a deeper ring or more resident
// blocks), FLAG_OCC sizes registers and shared memory for one more resident block per SM.
constexpr int FLAG_PAIR = 8, FLAG_OCC = 16;
// The row-per-lane kernel of widths 4..8 (anyprec_rows.cuh): every lane owns whole rows, so one unreplicated
// table per row is read without bank conflicts; it reads the planes in the rows layout (anyprec_gemm.rows_layout).
// FLAG_OCC sizes it for one more resident block as well.
constexpr int FLAG_ROWS = 32;
// With FLAG_ROWS at k = 4: tables of code pairs, one 4-byte entry per two codes of a row (256 per row), so one
// lookup gives a whole B register of the mma and no byte permute is needed (anyprec_rows.cuh).
constexpr int FLAG_CODE_PAIRS = 64;

enum Status { kOk = 0, kUnsupported = 1, kBadArgs = 2, kLaunchFailed = 3 };

// ---------------------------------------------------------------------------------------------
// bit helpers (host versions let a CPU harness run the same decode code)

AP_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t src = (uint64_t(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xF;
    uint32_t byte = uint32_t(src >> (8 * (s & 7))) & 0xFF;
    if (s & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

AP_HD uint32_t rotr(uint32_t x, int s) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(x, x, s);
#else
  s &= 31;
  return s == 0 ? x : (x >> s) | (x << (32 - s));
#endif
}

// Powers of two passed as a kernel parameter: multiplying by a value the compiler cannot see
// turns a shift into IMAD / IMAD.HI, which run on the FMA pipe (idle here: the mma has its own)
// instead of the ALU pipe that PRMT / LOP3 / SHF saturate.
struct Pow2 { uint32_t v[32]; };

AP_HD uint32_t shl_fma(uint32_t x, int s, const Pow2& p2) {
#ifdef __CUDA_ARCH__
  return x * p2.v[s];
#else
  return uint32_t(uint64_t(x) * p2.v[s]);
#endif
}

AP_HD uint32_t shr_fma(uint32_t x, int s, const Pow2& p2) {  // 1 <= s <= 31
#ifdef __CUDA_ARCH__
  return __umulhi(x, p2.v[32 - s]);
#else
  return uint32_t((uint64_t(x) * p2.v[32 - s]) >> 32);
#endif
}

AP_HD constexpr uint32_t rotl_c(uint32_t x, int s) {
  return (s & 31) == 0 ? x : (x << (s & 31)) | (x >> (32 - (s & 31)));
}

AP_HD constexpr uint32_t bitrev(uint32_t v, int k) {
  uint32_t r = 0;
  for (int i = 0; i < k; ++i) r |= ((v >> i) & 1u) << (k - 1 - i);
  return r;
}

// The LAYOUT permutation: slot position q (bit q of a kernel-layout word, before the per-plane
// rotation) holds natural column pi(q) of the word. pi maps q = (q4 q3 q2 q1 q0) to
// q3 + 2 q2 + 4 q0 + 8 q1 + 16 q4, so the pairs (q, q+8) that share an fp16x2 register are
// adjacent columns, and for k <= 4 the two pairs (q, q+4) of a k-tile are adjacent as well.
// anyprec_gemm.kernel_layout applies the same formula.
AP_HD constexpr int pi(int q) {
  return ((q >> 3) & 1) + 2 * ((q >> 2) & 1) + 4 * (q & 1) + 8 * ((q >> 1) & 1) + 16 * ((q >> 4) & 1);
}

AP_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// fp16 bits -> fp32 bits, exact (subnormals included)
AP_HD uint32_t half_to_float_bits(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return sign | float_bits(float(man) * (1.0f / 16777216.0f));
  if (exp == 31) return sign | 0x7F800000u | (man << 13);
  return sign | ((exp + 112) << 23) | (man << 13);
}

// fp32 bits -> bf16 bits, round to nearest even (as torch's .to(torch.bfloat16))
AP_HD uint16_t float_bits_to_bf16(uint32_t f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((f >> 16) | 0x40);
  return uint16_t((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

// the stored fp16 centroid as the bits of the mma's element type
template <typename T>
AP_HD uint16_t centroid_bits(uint16_t h) {
  if constexpr (std::is_same<T, __half>::value) return h;
  else return float_bits_to_bf16(half_to_float_bits(h));
}

// ---------------------------------------------------------------------------------------------
// loads (host versions read plain memory)

template <typename T>
AP_HD uint32_t ldx16(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const unsigned short*>(p));
#else
  uint16_t u;
  std::memcpy(&u, p, 2);
  return u;
#endif
}

template <typename T>
AP_HD uint32_t ldx32(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const unsigned int*>(p));
#else
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
#endif
}

template <typename T>
AP_HD uint2 ldx64(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const uint2*>(p));
#else
  uint2 u;
  std::memcpy(&u, p, 8);
  return u;
#endif
}

inline unsigned char* host_shared_window = nullptr;  // a CPU harness's stand-in for shared memory

// 32-bit shared-window address: lets the table base be or-ed (not added) into each address
AP_HD uint32_t lds32(uint32_t addr) {
#ifdef __CUDA_ARCH__
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
#else
  uint32_t u;
  std::memcpy(&u, host_shared_window + addr, 4);
  return u;
#endif
}

}  // namespace anyprec
