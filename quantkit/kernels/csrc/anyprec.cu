// Any-precision bitplane matvec (Any-Precision LLM §5) and the dequantize kernel for large batches.
//
// Inputs (quantkit/formats/anyprec.py): planes int32 [n, M, W'] of an n-bit parent, most significant
// plane first; bit j of planes[p, r, w] is plane p of column 32w+j (natural layout) or, in the
// kernel layout made once at load time (anyprec_gemm.kernel_layout, flag LAYOUT), of the column
// given by the bit permutation below. Serving k bits reads planes 0..k-1 only; the k-bit code is
// those k bits and its centroid is lut_k[r, code] (fp16 [M, 2^k]).
//
// y[b, r] = sum_c x[b, c] * lut_k[r, code_k(r, c)] runs on the tensor cores (mma.m16n8k16, fp32
// accumulation): the weights are the A operand (16 rows x 16 k-slots), x the B operand (16 k-slots
// x 8 batch columns), so batch 1..8 cost the same mma and only the decode has to be fast.
//
// Work split (one block of 8 warps, 256 threads, or 4 warps in two-tile blocks at k <= 4; TILES = 1 or
// 2 tiles of 16 rows per block; the picture shows 8 warps):
//
//   rows row0 .. row0+16*TILES-1                  columns, in steps of 4*P words (128*P columns)
//   +--------------------------------------+      step c is done by warp c % 8 (interleaved, so
//   | tile 0: 16 rows | w0 | w1 | ... | w7 |w0..   the 8 warps of a block stream neighbouring
//   | tile 1: 16 rows |  (same warp does all tiles of a step: x fragments are reused)
//   +--------------------------------------+      partial sums of the 8 warps are added in smem.
//
//   inside a warp, lane = 4g + t (mma "groupID" g, "threadID_in_group" t):
//     rows      g and g+8 of every tile       (the A rows this lane holds)
//     words     step*4P + 4v + t, v < P       (plane words arrive through a shared-memory ring)
//     batch     g                             (the B column this lane holds; zero when g >= B)
//   one 32-column word = 8 k-tiles of 4 weights; a k-tile gives this lane the pairs
//   (k-slots 2t,2t+1) and (2t+8,2t+9) of one mma, so every mma sums 4 lanes x 4 columns.
//
// Decoding a word: the k plane words are merged ("bit-transposed") into words whose nibbles
// (k <= 4) or bytes (k >= 5) hold whole codes, 8 or 4 per merged word, then looked up:
//   k <= 3 and TLM: table in registers, PRMT (byte permute) looks up 4 codes per instruction:
//          one PRMT gathers the low bytes of 4 centroids, one the high bytes, two more
//          interleave them into the two fp16x2 registers the mma takes;
//   otherwise: one shared-memory load per code from a table replicated once per lane, each
//          lane's copy in its own bank (word = ((tile_row_slot * 2^k + code) * 32 + lane)),
//          so the 32 random lookups of a warp never conflict.
// Codes are read with plane p as bit p (the reverse of the stored order); tables are filled
// in that bit-reversed order so no per-weight reversal is needed.
//
// The three optimisations of the paper are compile-time flags (benchmarks ablate them):
//   LAYOUT (paper's weight bitplane layout optimisation): a one-time permutation of each word's
//          bits so that the 4 columns of a k-tile are contiguous in x (one 8-byte load per
//          k-tile for k <= 4, two 4-byte loads for k >= 5, instead of four 2-byte loads), plus
//          a rotation of plane p by p bits so the bit-transpose needs no shifts.
//   IBT    (efficient bit-transpose): merged words built with one LOP3 per plane for 8 (or 4)
//          codes at once, instead of gathering each code bit by bit.
//   TLM    (merged table lookups): for k <= 3 the PRMT register table (4 lookups per
//          instruction) replaces one shared-memory lookup per weight. It has no effect at k >= 4.
//
// Hopper details (from the sm_90 SASS): the integer ALU pipe (LOP3 / PRMT / SHF, 64 lanes per
// clock per SM) is what limits the decode, so (1) the shared tables start at a 2^(k+7)-aligned
// shared address and a lookup address is one LOP3, code*128 | lane*4 | base (sm_90 keeps the
// shared window base in a register: otherwise one more add per lookup), and (2) the shifts
// that bring codes to bit 7 are IMAD / IMAD.HI by powers of two passed as a kernel parameter,
// which run on the otherwise idle FMA pipe. Per weight this leaves ~1.5 ALU instructions at
// k = 3, ~2.1 at k = 4, ~3.6 at k = 8.
// mma fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type".

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef ANYPREC_DECODE_ONLY  // for the PyTorch ops at the end; the CPU decode harness builds without torch
#include <ATen/core/Tensor.h>

#include "check.h"
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // the stream c10::cuda::getCurrentCUDAStream() returns, without cuBLAS headers

#include <optional>
#include <string>

#include "cp_async.h"
#include "grid_dependency.h"
#include "kernel_attrs.h"
#endif

#define AP_HD __host__ __device__ __forceinline__

#ifndef AP_COPY_ALL_LANES  // widths k up to which every lane copies ring pieces (see matvec_kernel)
#define AP_COPY_ALL_LANES 3
#endif

namespace anyprec {

constexpr int kMaxBatch = 8;  // the mma's N
constexpr int FLAG_LAYOUT = 1, FLAG_IBT = 2, FLAG_TLM = 4;

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

// ---------------------------------------------------------------------------------------------
// compile-time configuration

// Resident blocks per SM that registers and shared memory are sized for: AP_MIN_BLOCKS_SMALL for
// k <= 7, AP_MIN_BLOCKS at k = 8 (measurements in BENCHMARKS.md, issue 9).
#ifndef AP_MIN_BLOCKS_SMALL
#define AP_MIN_BLOCKS_SMALL 3
#endif
#ifndef AP_MIN_BLOCKS
#define AP_MIN_BLOCKS 2
#endif
// Two-tile blocks (batch 4-8 on the taller shapes) up to this width run 4 warps instead of 8, each
// with twice the column steps of its tile, and 5 (k <= 3, register tables) or 6 (k = 4) blocks share
// an SM. H100 A/B, eighteenth session (BENCHMARKS.md, issue 9): 5-13 % faster at k = 3 and 4; 6 blocks
// at k = 3 were 4-5 % slower on 28672x8192; k = 5 gained nothing; one-tile blocks of 4 warps were 1-21 %
// slower at batch 1.
#ifndef AP_FOUR_WARPS_MAX_K
#define AP_FOUR_WARPS_MAX_K 4
#endif

template <int K, int TILES, int FLAGS>
struct Config {
  static constexpr bool LAYOUT = FLAGS & FLAG_LAYOUT;
  static constexpr bool IBT = FLAGS & FLAG_IBT;
  static constexpr bool PRMT_LUT = (FLAGS & FLAG_TLM) && K <= 3;
  static constexpr bool NIBBLE = K <= 4;                    // codes per merged word: 8 nibbles / 4 bytes
  static constexpr int MERGED = NIBBLE ? 4 : 8;             // merged words per 32-column word
  static constexpr int KT_PER_MERGED = NIBBLE ? 2 : 1;      // k-tiles (4 codes) per merged word
  static constexpr uint32_t BASE = NIBBLE ? 0x11111111u : 0x01010101u;
  static constexpr uint32_t MASK = (1u << K) - 1;
  static constexpr int TABLE_BYTES = PRMT_LUT ? 0 : TILES * 2 * (1 << K) * 32 * 4;
  // The table starts at a multiple of 2^(K+7) in the shared window, so code * 128 and the lane's
  // bank offset are or-ed into its base (one LOP3 per lookup); the slack for that alignment is
  // allocated. At k = 8 the 32 KB of slack would cost a resident block: there the offset is added.
  static constexpr bool TABLE_OR = !PRMT_LUT && K < 8;
  static constexpr int TABLE_ALIGN = TABLE_OR ? (1 << (K + 7)) : 16;
  static constexpr int WARPS = TILES == 2 && K <= AP_FOUR_WARPS_MAX_K ? 4 : 8;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int RED_BYTES = WARPS * TILES * 32 * 4 * 4;
  // The ring (see the kernel): an item is one (tile, row slot, plane) of a lane; a warp step reads
  // PIECES 16-byte pieces (4 words of one row) per row and item, stage = all items of a step.
  static constexpr int ITEMS = TILES * 2 * K;
  static constexpr int stage_bytes(int pieces) { return WARPS * ITEMS * pieces * 32 * 4; }
  // resident blocks per SM the registers and shared memory are sized for (228 KB per SM, 1 KB of
  // it reserved per block)
  static constexpr int MIN_BLOCKS = WARPS == 4 ? (K <= 3 ? 5 : 6) : K <= 7 ? AP_MIN_BLOCKS_SMALL : AP_MIN_BLOCKS;
  static constexpr int SMEM_LIMIT = 228 * 1024 / MIN_BLOCKS - 1024;
  static constexpr int FIXED_BYTES = RED_BYTES + (PRMT_LUT ? 0 : TABLE_ALIGN + TABLE_BYTES);
#ifdef AP_PIECES
  static constexpr int PIECES = AP_PIECES;
#else
  static constexpr int PIECES = SMEM_LIMIT - FIXED_BYTES >= 3 * stage_bytes(2) ? 2 : 1;
#endif
#ifdef AP_STAGES
  static constexpr int STAGES = AP_STAGES;
#else
  static constexpr int STAGES = (SMEM_LIMIT - FIXED_BYTES) / stage_bytes(PIECES) >= 4 ? 4
                                : (SMEM_LIMIT - FIXED_BYTES) / stage_bytes(PIECES) >= 3 ? 3 : 2;
#endif
  static_assert(STAGES >= 2 && (PIECES == 1 || PIECES == 2 || PIECES == 4), "ring needs 2+ stages of 1, 2 or 4 pieces");
  static constexpr int STEP_WORDS = 4 * PIECES;  // words of each row per warp step
  static constexpr int WARP_RING_BYTES = STAGES * ITEMS * PIECES * 32 * 4;
  static constexpr int RING_BYTES = WARPS * WARP_RING_BYTES;
  static constexpr int SMEM_BYTES = RED_BYTES + RING_BYTES + (PRMT_LUT ? 0 : TABLE_ALIGN + TABLE_BYTES);
  static_assert(SMEM_BYTES <= 227 * 1024, "ring and tables exceed a block's shared memory (AP_PIECES / AP_STAGES)");
};

// positions (in a word, before the per-plane rotation) of the 4 codes of k-tile (j, h), in
// fragment order: f0, f1 -> fp16x2 for k-slots (2t, 2t+1); f2, f3 -> (2t+8, 2t+9)
AP_HD constexpr int frag_pos(bool nibble, int j, int h, int f) {
  // nibble: codes of merged word j sit at 4m + j (m = 0..7), k-tile h takes m = 4h..4h+3 and
  // pairs m with m+2; byte: codes at 8i + j (i = 0..3), pairs i with i+1
  return nibble ? 16 * h + j + ((f & 1) ? 8 : 0) + ((f & 2) ? 4 : 0)
                : j + ((f & 1) ? 8 : 0) + ((f & 2) ? 16 : 0);
}

// column (within the word) that the code at slot position q stands for
template <bool LAYOUT>
AP_HD constexpr int column_of(int q) { return LAYOUT ? pi(q) : q; }

// ---------------------------------------------------------------------------------------------
// tables

struct PrmtTable { uint32_t lo0, lo1, hi0, hi1; };  // low / high bytes of entries 0-3, 4-7
struct SmemTable { uint32_t lane_addr; };  // shared address of this lane's copy of entry 0

// The 2^K fp16 centroids of one row (K <= 3: at most 16 bytes, one aligned load), zero for rows >= M.
template <int K>
AP_HD uint4 lut_row(const uint16_t* lut, int row, int M) {
  static_assert(K <= 3, "register tables hold at most 8 entries");
  uint4 r = make_uint4(0, 0, 0, 0);
  if (row >= M) return r;
  const uint16_t* src = lut + size_t(row) * (1 << K);
#ifdef __CUDA_ARCH__
  if constexpr (K == 3) r = __ldg(reinterpret_cast<const uint4*>(src));
  else if constexpr (K == 2) { const uint2 u = __ldg(reinterpret_cast<const uint2*>(src)); r.x = u.x; r.y = u.y; }
  else r.x = __ldg(reinterpret_cast<const unsigned int*>(src));
#else
  std::memcpy(&r, src, 2 << K);
#endif
  return r;
}

// Register table of one row from its centroids (lut_row): entry v = centroid bitrev_K(v), zero past 2^K.
template <int K, typename T>
AP_HD PrmtTable prmt_table(const uint4& row) {
  const uint32_t w[4] = {row.x, row.y, row.z, row.w};
  if constexpr (K == 3 && std::is_same<T, __half>::value) {
    // w = (L0 H0 L1 H1) (L2 H2 L3 H3) (L4 H4 L5 H5) (L6 H6 L7 H7) bytes; entries 0-3 are centroids
    // 0 4 2 6, entries 4-7 are 1 5 3 7: eight byte permutes
    const uint32_t a = prmt(w[0], w[2], 0x5140), b = prmt(w[1], w[3], 0x5140);  // L0 L4 H0 H4, L2 L6 H2 H6
    const uint32_t c = prmt(w[0], w[2], 0x7362), d = prmt(w[1], w[3], 0x7362);  // L1 L5 H1 H5, L3 L7 H3 H7
    return {prmt(a, b, 0x5410), prmt(c, d, 0x5410), prmt(a, b, 0x7632), prmt(c, d, 0x7632)};
  } else {
    uint32_t lo[2] = {0, 0}, hi[2] = {0, 0};
#pragma unroll
    for (int v = 0; v < (1 << K); ++v) {
      const int i = bitrev(v, K);
      const uint16_t e = centroid_bits<T>(uint16_t(w[i >> 1] >> (16 * (i & 1))));
      lo[v >> 2] |= uint32_t(e & 0xFF) << (8 * (v & 3));
      hi[v >> 2] |= uint32_t(e >> 8) << (8 * (v & 3));
    }
    return {lo[0], lo[1], hi[0], hi[1]};
  }
}

// the 4 bank-replicated copies (lanes 4g..4g+3) of entry v of one row, as one 16-byte store
template <int K, typename T>
AP_HD uint4 smem_table_entry(const uint16_t* lut, int row, int M, int v) {
  const uint32_t e = row < M ? centroid_bits<T>(lut[size_t(row) * (1 << K) + bitrev(v, K)]) : 0u;
  return make_uint4(e, e, e, e);
}

// byte offset of the table of (tile, row slot rs) inside the table area
template <int K>
AP_HD constexpr int table_offset(int tile, int rs) { return (tile * 2 + rs) * (1 << K) * 128; }

// Fill item i = ((tile * 2 + rs) * 2^K + v) * 8 + g: one 16-byte store of the 4 copies of entry v
// of row g of (tile, rs), at uint4 index i; g fastest keeps the 8 stores of a quarter-warp in
// distinct banks. Returns the row offset within the block.
template <int K>
AP_HD int table_item(int i, int& v) {
  const int g = i & 7, ts = i >> (3 + K);
  v = (i >> 3) & ((1 << K) - 1);
  return 16 * (ts >> 1) + 8 * (ts & 1) + g;
}

// Output item o of a block = (tile, batch b, row r16 of the tile), r16 fastest for coalesced
// stores; its partial sums sit in C-fragment element e of lane src_lane of every warp
// (c0, c1 = row g, batch 2t, 2t+1; c2, c3 = row g+8).
struct OutputItem { int tile, r16, b, src_lane, e; };
AP_HD OutputItem output_item(int o) {
  const int r16 = o & 15, b = (o >> 4) & 7, tile = o >> 7;
  return {tile, r16, b, (r16 & 7) * 4 + (b >> 1), (r16 >> 3) * 2 + (b & 1)};
}

// ---------------------------------------------------------------------------------------------
// decode

// Merged word j of one row (IBT): code of slot q has plane p at bit (q + p) mod 32 (LAYOUT:
// planes are stored rotated, so one masked select per plane) or at bit 4m+p / 8i+p of its
// nibble / byte (natural layout: shift each plane into place first). Bits outside a code are
// garbage unless ZERO (the PRMT selector needs the unused high bits of each nibble clear).
template <int K, bool LAYOUT, bool NIBBLE, bool ZERO>
AP_HD uint32_t merge(const uint32_t (&R)[K], int j) {
  constexpr uint32_t BASE = NIBBLE ? 0x11111111u : 0x01010101u;
  if constexpr (LAYOUT) {
    uint32_t acc = ZERO ? (R[0] & rotl_c(BASE, j)) : R[0];
#pragma unroll
    for (int p = 1; p < K; ++p) {
      const uint32_t m = rotl_c(BASE, j + p);
      acc = (R[p] & m) | (acc & ~m);
    }
    return acc;
  } else {
    uint32_t acc = 0;
#pragma unroll
    for (int p = 0; p < K; ++p) {
      const uint32_t s = p >= j ? (R[p] << (p - j)) : (R[p] >> (j - p));
      acc |= s & (BASE << p);
    }
    return acc;
  }
}

// code (plane p at bit p) of the slot at position q, gathered bit by bit (IBT off)
template <int K, bool LAYOUT>
AP_HD uint32_t code_bitwise(const uint32_t (&R)[K], int q) {
  uint32_t v = 0;
#pragma unroll
  for (int p = 0; p < K; ++p) v |= ((R[p] >> (LAYOUT ? ((q + p) & 31) : q)) & 1u) << p;
  return v;
}

// The K-bit code starting at bit `start` (mod 32) of `merged`, moved to bit 7 (x128, one row of
// the lane-replicated table); bits around it are garbage for the caller's mask. Codes that do
// not wrap around bit 31 move by a plain shift on the FMA pipe, the others rotate (SHF).
template <int K>
AP_HD uint32_t code_at_bit7(uint32_t merged, int start, const Pow2& p2) {
  if (start + K <= 32) {
    if (start > 7) return shr_fma(merged, start - 7, p2);
    if (start < 7) return shl_fma(merged, 7 - start, p2);
    return merged;
  }
  return rotr(merged, (start - 7) & 31);
}

// The two fp16x2 A registers of k-tile (j, h) for one row: pa = (f0, f1), pb = (f2, f3).
template <int K, int TILES, int FLAGS>
AP_HD void decode_ktile(const uint32_t (&R)[K], uint32_t merged, int j, int h, const PrmtTable& pt,
                        const SmemTable& st, const Pow2& p2, uint32_t& pa, uint32_t& pb) {
  using C = Config<K, TILES, FLAGS>;
  if constexpr (C::PRMT_LUT) {
    // selector nibble i = code of slot i of the k-tile (slots 16h + 4i + j), fragment order
    // f0, f2, f1, f3 = slots 0, 1, 2, 3
    uint32_t sel;
    if constexpr (C::IBT) {
      // PRMT reads the low 16 bits: a plain right shift unless those bits wrap past bit 31
      const int s = 16 * h + (C::LAYOUT ? j : 0);
      sel = s == 0 ? merged : (s + 16 <= 32 ? shr_fma(merged, s, p2) : rotr(merged, s));
    } else {
      sel = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) sel |= code_bitwise<K, C::LAYOUT>(R, 16 * h + 4 * i + j) << (4 * i);
    }
    const uint32_t lo = prmt(pt.lo0, pt.lo1, sel), hi = prmt(pt.hi0, pt.hi1, sel);
    pa = prmt(lo, hi, 0x6240);  // slots 0, 2 = f0, f1
    pb = prmt(lo, hi, 0x7351);  // slots 1, 3 = f2, f3
  } else {
    uint32_t w[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int q = frag_pos(C::NIBBLE, j, h, f);
      uint32_t addr;
      if constexpr (C::IBT) {
        // the code starts at bit q (LAYOUT) or at its nibble / byte boundary; rotate it to
        // bit 7 (x128: one 32-lane row of the replicated table) and or in this lane's bank
        const int start = C::LAYOUT ? q : q - j;
        const uint32_t code128 = code_at_bit7<K>(merged, start, p2) & (C::MASK << 7);
        addr = C::TABLE_OR ? (code128 | st.lane_addr) : code128 + st.lane_addr;
      } else {
        addr = (code_bitwise<K, C::LAYOUT>(R, q) << 7) + st.lane_addr;
      }
      w[f] = lds32(addr);
    }
    pa = prmt(w[0], w[1], 0x5410);
    pb = prmt(w[2], w[3], 0x5410);
  }
}

// B fragment of k-tile (j, h): x at the columns of f0..f3 of this word (xw = x row + 32 * word)
template <typename T, bool LAYOUT, bool NIBBLE>
AP_HD void load_xfrag(const T* xw, int j, int h, uint32_t& b01, uint32_t& b23) {
  const int c0 = column_of<LAYOUT>(frag_pos(NIBBLE, j, h, 0)), c1 = column_of<LAYOUT>(frag_pos(NIBBLE, j, h, 1));
  const int c2 = column_of<LAYOUT>(frag_pos(NIBBLE, j, h, 2)), c3 = column_of<LAYOUT>(frag_pos(NIBBLE, j, h, 3));
  if (c1 == c0 + 1 && c2 == c0 + 2 && c3 == c0 + 3 && c0 % 4 == 0) {
    const uint2 u = ldx64(xw + c0);
    b01 = u.x;
    b23 = u.y;
  } else if (c1 == c0 + 1 && c3 == c2 + 1 && c0 % 2 == 0 && c2 % 2 == 0) {
    b01 = ldx32(xw + c0);
    b23 = ldx32(xw + c2);
  } else {
    b01 = ldx16(xw + c0) | (ldx16(xw + c1) << 16);
    b23 = ldx16(xw + c2) | (ldx16(xw + c3) << 16);
  }
}

// Decode one word of this lane (R[tile][rs][p] = plane p of rows g / g+8 of the tile) and hand the
// A and B fragments of each k-tile and tile to mma(tile, a[4], b01, b23). xw: x of this lane's batch
// row at the word's 32 columns, or 32 zeros (kZeroX) where the lane has no batch row or word: the
// loads then need no predicate (and no zeroing of their registers).
#pragma nv_exec_check_disable
template <int K, int TILES, int FLAGS, typename T, typename Mma>
AP_HD void decode_word(const uint32_t (&R)[TILES][2][K], const T* xw, const PrmtTable (&pt)[TILES][2],
                       const SmemTable (&st)[TILES][2], const Pow2& p2, Mma&& mma) {
  using C = Config<K, TILES, FLAGS>;
#pragma unroll
  for (int j = 0; j < C::MERGED; ++j) {
    uint32_t merged[TILES][2];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
      for (int rs = 0; rs < 2; ++rs)
        merged[tile][rs] = C::IBT ? merge<K, C::LAYOUT, C::NIBBLE, C::PRMT_LUT>(R[tile][rs], j) : 0u;
#pragma unroll
    for (int h = 0; h < C::KT_PER_MERGED; ++h) {
      uint32_t b01, b23;
      load_xfrag<T, C::LAYOUT, C::NIBBLE>(xw, j, h, b01, b23);
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
        uint32_t a[4];  // (row g, 2t..), (row g+8, 2t..), (row g, 2t+8..), (row g+8, 2t+8..)
        decode_ktile<K, TILES, FLAGS>(R[tile][0], merged[tile][0], j, h, pt[tile][0], st[tile][0], p2, a[0], a[2]);
        decode_ktile<K, TILES, FLAGS>(R[tile][1], merged[tile][1], j, h, pt[tile][1], st[tile][1], p2, a[1], a[3]);
        mma(tile, a, b01, b23);
      }
    }
  }
}

// Instances built: every width in fp16 and bf16 with all optimisations (TILES = 2 where the
// replicated tables fit, k <= 6); the ablations in fp16, k = 3..8, TILES = 1. `flags` is
// normalised first (TLM only changes k <= 3).
constexpr int normalize_flags(int k, int flags) { return k > 3 ? (flags | FLAG_TLM) : flags; }

constexpr bool compiled_rule(bool half, int k, int tiles, int flags) {
  const bool prod = flags == 7 && (tiles == 1 || (tiles == 2 && k <= 6));
  const bool ablation = half && tiles == 1 && k >= 3 &&
                        (k <= 3 ? (flags == 6 || flags == 5 || flags == 3 || flags == 0)
                                : (flags == 6 || flags == 5 || flags == 4));
  return k >= 1 && k <= 8 && (prod || ablation);
}

// Everything above runs on the host too (tests/test_kernel_anyprec.py compiles it with
// -DANYPREC_DECODE_ONLY into a CPU emulation of a warp and checks every instance's decode).
#ifndef ANYPREC_DECODE_ONLY

// ---------------------------------------------------------------------------------------------
// kernels

struct MatvecArgs {
  const void* x;        // T [B, ldx], columns >= 32 * W unused; rows 8-byte aligned
  int ldx;
  int B;                // 1..8
  const uint32_t* planes;  // int32 [>= K, M, wstride]
  int M, W, wstride;    // W = words to read per row (ceil(in_features / 32))
  const uint16_t* lut;  // fp16 [M, 2^K]
  const void* bias;     // T [M] or nullptr
  void* out;            // T [B, M]
  Pow2 pow2;            // pow2.v[i] = 1 << i (filled by launch_matvec)
};

// 32 zero activations: the x of lanes without a batch row or past the last word
__device__ __align__(16) const uint32_t kZeroX[16] = {};

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b01, uint32_t b23) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b01), "r"(b23));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b01), "r"(b23));
  }
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ __half from_float<__half>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// One block per tile of 16 * TILES rows; its C::WARPS warps (8, or 4 in small-k two-tile blocks) split
// the columns in steps of STEP_WORDS words (step c of the tile goes to warp c % WARPS) and add their
// partial sums at the end.
//
// The plane words reach the warps through a ring of STAGES steps in shared memory (cp.async), so
// up to STAGES - 1 steps are in flight per warp without holding registers. A warp step covers
// STEP_WORDS = 4 * PIECES consecutive words of each of the tile's rows, and lane (g, t) decodes
// words 4v + t (v < PIECES) of rows g and g + 8, so lanes that share t (whose fragments meet in one
// mma) always hold the same columns. Per item (tile, row slot, plane) a step is 8 rows x PIECES
// 16-byte pieces (4 words of one row), copied one per lane (lane 8v + r copies piece v of row r)
// and stored [v][row][t], so lane 4g + t reads word (v, g, t) from bank 4g + t. Lanes read words
// other lanes copied: each waits for its own copies, then the warp syncs.
// (Measured and dropped, 2026-11-24: persistent blocks looping over tiles, 6-12 % slower.)
template <int K, typename T, int TILES, int FLAGS>
__global__ void __launch_bounds__((Config<K, TILES, FLAGS>::THREADS), (Config<K, TILES, FLAGS>::MIN_BLOCKS))
    matvec_kernel(const MatvecArgs args) {
  using C = Config<K, TILES, FLAGS>;
  constexpr int kWarps = C::WARPS, kThreads = C::THREADS;
  constexpr int P = C::PIECES, S = C::STAGES, ITEMS = C::ITEMS;
  extern __shared__ __align__(16) unsigned char smem[];
  qk::allow_next_grid();  // the next kernel is scheduled only once every block has started: the last wave
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 * TILES;
  const int M = args.M, W = args.W;
  const int nsteps = (W + C::STEP_WORDS - 1) / C::STEP_WORDS;
  const int steps = warp < nsteps ? (nsteps - warp + kWarps - 1) / kWarps : 0;  // this warp's

  // shared memory: [partial sums, RED_BYTES] [ring, RING_BYTES] [alignment slack] [tables]
  const uint32_t red_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  unsigned char* ring = smem + C::RED_BYTES + warp * C::WARP_RING_BYTES;
  const uint32_t ring_addr = red_addr + C::RED_BYTES + warp * C::WARP_RING_BYTES + lane * 4;  // this lane's words
  const uint32_t table_addr =
      (red_addr + C::RED_BYTES + C::RING_BYTES + C::TABLE_ALIGN - 1) & ~uint32_t(C::TABLE_ALIGN - 1);

  // The piece this lane copies per item: row pr of the row slot, words 4 * pv.. of the step. Offsets
  // are 32-bit (the host checks k * M * wstride < 2^31).
  // At P < 4 one item needs only 8 * P lanes. In one-tile blocks (batch 1-2) up to k = AP_COPY_ALL_LANES
  // the warp splits into G = 4 / P lane groups and group h copies the items of row slot h: every lane
  // copies, half as many copy instructions at P = 2. A/B on the H100 (2026-11-26, k = 3): batch 1-2
  // 4-7 % faster on 4096x4096, 11008x4096 and 14336x4096, the same on 4096x11008 and 28672x8192. Two-tile
  // blocks (from 5 % faster to 2 % slower) and k = 4, 8 (2-5 % slower, H200) keep one group, with
  // 32 - 8P lanes idle.
  constexpr int G = K <= AP_COPY_ALL_LANES && TILES == 1 ? 4 / P : 1, SLOTS = TILES * 2, MINE = (SLOTS + G - 1) / G;
  const int pr = lane & 7, pv = (lane >> 3) & (4 / G - 1), h = lane / (8 * (4 / G));
  const uint32_t plane_stride = uint32_t(M) * uint32_t(args.wstride);
  uint32_t row_off[MINE];
  bool row_ok[MINE];
#pragma unroll
  for (int j = 0; j < MINE; ++j) {
    const int slot = h + G * j;  // = tile * 2 + rs
    const int row = row0 + 8 * slot + pr;
    row_ok[j] = slot < SLOTS && row < M;
    row_off[j] = row_ok[j] ? uint32_t(row) * uint32_t(args.wstride) + 4 * pv : 0u;
  }
  auto issue = [&](int step, int stage) {
    if (pv >= P) return;  // lanes without a piece (PIECES < 4)
    const int word = (warp + kWarps * step) * C::STEP_WORDS;  // + 4 * pv, in row_off
    const bool in_row = word + 4 * pv < W;
#pragma unroll
    for (int j = 0; j < MINE; ++j) {
      const int slot = h + G * j;
      if (G > 1 && slot >= SLOTS) continue;  // TILES = 1 at P = 1: half the groups have no slot
      const bool ok = row_ok[j] && in_row;
      const uint32_t off = ok ? row_off[j] + uint32_t(word) : 0u;
#pragma unroll
      for (int p = 0; p < K; ++p) {
        const int item = slot * K + p;
        qk::copy_async<16>(ring + (((stage * ITEMS + item) * P + pv) * 32 + pr * 4) * 4,
                           args.planes + off + (ok ? p * plane_stride : 0u), ok);
      }
    }
  };

  // prologue: S - 1 steps in flight (one commit group per step, empty past the warp's last step)
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < steps) issue(s, s);
    qk::commit_async();
  }

  // tables: k <= 3 in registers (each lane its rows g, g + 8), else in shared memory
  PrmtTable pt[TILES][2] = {};
  SmemTable st[TILES][2];
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      st[tile][rs] = {table_addr + uint32_t(lane) * 4 + table_offset<K>(tile, rs)};
      if constexpr (C::PRMT_LUT) pt[tile][rs] = prmt_table<K, T>(lut_row<K>(args.lut, row0 + 16 * tile + 8 * rs + g, M));
    }
  if constexpr (!C::PRMT_LUT) {
    constexpr int items = TILES * 2 * (1 << K) * 8;
    unsigned char* table = smem + (table_addr - red_addr);
    for (int i = threadIdx.x; i < items; i += kThreads) {
      int v;
      const int row = row0 + table_item<K>(i, v);
      reinterpret_cast<uint4*>(table)[i] = smem_table_entry<K, T>(args.lut, row, M, v);
    }
  }
  __syncthreads();
  qk::wait_prior_grid();  // planes and tables are the weights; x and out belong to earlier kernels

  const T* x = static_cast<const T*>(args.x);
  const T* xrow = g < args.B ? x + size_t(g) * args.ldx : nullptr;
  const T* zeros = reinterpret_cast<const T*>(kZeroX);
  float acc[TILES][4] = {};
  auto mma = [&](int tile, const uint32_t (&a)[4], uint32_t b01, uint32_t b23) { mma16816<T>(acc[tile], a, b01, b23); };
  int stage = 0;
  for (int s = 0; s < steps; ++s) {
    qk::wait_async<S - 2>();  // this lane's copies of step s have landed
    __syncwarp();             // ... and every other lane's; the stage step s - 1 used is free
    if (s + S - 1 < steps) issue(s + S - 1, stage == 0 ? S - 1 : stage - 1);
    qk::commit_async();
    const int w0 = (warp + kWarps * s) * C::STEP_WORDS + t;
#pragma unroll
    for (int v = 0; v < P; ++v) {
      uint32_t R[TILES][2][K];
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs)
#pragma unroll
          for (int p = 0; p < K; ++p)
            R[tile][rs][p] = lds32(ring_addr + ((stage * ITEMS + (tile * 2 + rs) * K + p) * P + v) * 128);
      const int w = w0 + 4 * v;
      const T* xw = (xrow != nullptr && w < W) ? xrow + 32 * w : zeros;
      decode_word<K, TILES, FLAGS, T>(R, xw, pt, st, args.pow2, mma);
    }
    stage = stage + 1 == S ? 0 : stage + 1;
  }
  qk::wait_async<0>();  // no copy may outlive the block (only empty groups remain here)

  // add the 8 warps' partial sums
  float4* red = reinterpret_cast<float4*>(smem);
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile)
    red[(warp * TILES + tile) * 32 + lane] = make_float4(acc[tile][0], acc[tile][1], acc[tile][2], acc[tile][3]);
  __syncthreads();
  const float* redf = reinterpret_cast<const float*>(red);
  T* out = static_cast<T*>(args.out);
  const T* bias = static_cast<const T*>(args.bias);
  for (int o = threadIdx.x; o < TILES * 16 * kMaxBatch; o += kThreads) {
    const OutputItem it = output_item(o);
    const int row = row0 + 16 * it.tile + it.r16;
    if (it.b >= args.B || row >= M) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += redf[((w * TILES + it.tile) * 32 + it.src_lane) * 4 + it.e];
    if (bias != nullptr) sum += to_float<T>(bias[row]);
    out[size_t(it.b) * M + row] = from_float<T>(sum);
  }
}

// bits of the stored fp16 centroid in the output type
template <typename OutT>
__device__ __forceinline__ uint32_t centroid_out_bits(uint16_t h) {
  if constexpr (std::is_same<OutT, float>::value) return half_to_float_bits(h);
  else return centroid_bits<OutT>(h);
}

// Dequantize k bits from natural-layout planes into out [M, N] (row-major). One block per
// (row, 128 words): the row's table goes to shared memory, each thread expands one word.
template <typename OutT>
__global__ void __launch_bounds__(128) dequant_kernel(const uint32_t* __restrict__ planes, int M, int W, int wstride,
                                                      int N, const uint16_t* __restrict__ lut, int K,
                                                      OutT* __restrict__ out) {
  constexpr int EB = sizeof(OutT);  // 2 or 4 bytes per element
  __shared__ uint32_t table[256];
  const int row = blockIdx.x;
  for (int i = threadIdx.x; i < (1 << K); i += blockDim.x) table[i] = centroid_out_bits<OutT>(lut[size_t(row) * (1 << K) + i]);
  __syncthreads();
  const int w = blockIdx.y * blockDim.x + threadIdx.x;
  if (w >= W) return;
  uint32_t R[8];
#pragma unroll
  for (int p = 0; p < 8; ++p) R[p] = p < K ? __ldg(planes + (size_t(p) * M + row) * wstride + w) : 0u;
  uint32_t vals[32];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // byte i of m = code of column 8i + j (stored order: plane p is code bit K-1-p)
    uint32_t m = 0;
#pragma unroll
    for (int p = 0; p < 8; ++p)
      if (p < K) m |= ((R[p] >> j) & 0x01010101u) << (K - 1 - p);
#pragma unroll
    for (int i = 0; i < 4; ++i) vals[8 * i + j] = table[(m >> (8 * i)) & 0xFF];
  }
  OutT* dst = out + size_t(row) * N + 32 * w;
  if (32 * w + 32 <= N && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    constexpr int PER = 16 / EB;  // elements per 16-byte store
#pragma unroll
    for (int i = 0; i < 32; i += PER) {
      uint32_t u[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) u[q] = EB == 4 ? vals[i + q] : (vals[i + 2 * q] | (vals[i + 2 * q + 1] << 16));
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(u[0], u[1], u[2], u[3]);
    }
  } else {
    for (int i = 0; i < 32 && 32 * w + i < N; ++i) {
      if constexpr (EB == 4) reinterpret_cast<uint32_t*>(dst)[i] = vals[i];
      else reinterpret_cast<uint16_t*>(dst)[i] = uint16_t(vals[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// launchers

bool has_matvec(int dtype, int k, int tiles, int flags) {
  return (dtype == 0 || dtype == 1) && compiled_rule(dtype == 0, k, tiles, normalize_flags(k, flags));
}

// Where a matvec launches: the stream, whether with overlap (grid_dependency.h) where the device and
// the instance allow it, and the launch's error when it failed.
struct Launch {
  cudaStream_t stream;
  bool overlap;
  int device;
  mutable cudaError_t error = cudaSuccess;
};

template <typename T, int K, int TILES, int FLAGS>
int launch_instance(const MatvecArgs& a, const Launch& on) {
  if constexpr (!compiled_rule(std::is_same<T, __half>::value, K, TILES, FLAGS)) {
    return kUnsupported;
  } else {
    using C = Config<K, TILES, FLAGS>;
    auto kernel = matvec_kernel<K, T, TILES, FLAGS>;
    // a carveout that holds MIN_BLOCKS blocks (the driver's default may keep more L1)
    const int carveout = std::min(100, (100 * C::MIN_BLOCKS * (C::SMEM_BYTES + 1024) + 228 * 1024 - 1) / (228 * 1024));
    if (qk::configure_once<matvec_kernel<K, T, TILES, FLAGS>>(C::SMEM_BYTES, carveout) != cudaSuccess) return kLaunchFailed;
    const int blocks = (a.M + 16 * TILES - 1) / (16 * TILES);
    const bool overlap = on.overlap && qk::overlap_supported<matvec_kernel<K, T, TILES, FLAGS>>(on.device);
    on.error = qk::launch_kernel(kernel, blocks, C::THREADS, C::SMEM_BYTES, on.stream, overlap, a);
    return on.error == cudaSuccess ? kOk : kLaunchFailed;
  }
}

template <typename T, int TILES, int FLAGS>
int launch_k(int k, const MatvecArgs& a, const Launch& s) {
  switch (k) {
    case 1: return launch_instance<T, 1, TILES, FLAGS>(a, s);
    case 2: return launch_instance<T, 2, TILES, FLAGS>(a, s);
    case 3: return launch_instance<T, 3, TILES, FLAGS>(a, s);
    case 4: return launch_instance<T, 4, TILES, FLAGS>(a, s);
    case 5: return launch_instance<T, 5, TILES, FLAGS>(a, s);
    case 6: return launch_instance<T, 6, TILES, FLAGS>(a, s);
    case 7: return launch_instance<T, 7, TILES, FLAGS>(a, s);
    case 8: return launch_instance<T, 8, TILES, FLAGS>(a, s);
    default: return kUnsupported;
  }
}

template <typename T, int TILES>
int launch_flags(int k, int flags, const MatvecArgs& a, const Launch& s) {
  switch (flags) {
    case 0: return launch_k<T, TILES, 0>(k, a, s);
    case 3: return launch_k<T, TILES, 3>(k, a, s);
    case 4: return launch_k<T, TILES, 4>(k, a, s);
    case 5: return launch_k<T, TILES, 5>(k, a, s);
    case 6: return launch_k<T, TILES, 6>(k, a, s);
    case 7: return launch_k<T, TILES, 7>(k, a, s);
    default: return kUnsupported;
  }
}

// dtype: 0 = fp16, 1 = bf16
int launch_matvec(int dtype, int k, int tiles, int flags, const MatvecArgs& args, const Launch& on) {
  MatvecArgs a = args;
  for (int i = 0; i < 32; ++i) a.pow2.v[i] = 1u << i;
  if (a.B < 1 || a.B > kMaxBatch || a.M < 1 || a.W < 1 || a.wstride < a.W || a.wstride % 4 != 0 || a.ldx < 32 * a.W)
    return kBadArgs;
  if (!has_matvec(dtype, k, tiles, flags)) return kUnsupported;
  flags = normalize_flags(k, flags);
  if (tiles == 1) return dtype == 0 ? launch_flags<__half, 1>(k, flags, a, on) : launch_flags<__nv_bfloat16, 1>(k, flags, a, on);
  return dtype == 0 ? launch_flags<__half, 2>(k, flags, a, on) : launch_flags<__nv_bfloat16, 2>(k, flags, a, on);
}

// dtype: 0 = fp16, 1 = bf16, 2 = fp32
int launch_dequant(int dtype, int k, const uint32_t* planes, int M, int W, int wstride, int N, const uint16_t* lut,
                   void* out, cudaStream_t stream) {
  if (k < 1 || k > 8 || M < 1 || W < 1 || wstride < W || N > 32 * W || N <= 32 * (W - 1)) return kBadArgs;
  const dim3 grid(M, (W + 127) / 128);
  if (dtype == 0) dequant_kernel<__half><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<__half*>(out));
  else if (dtype == 1) dequant_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<__nv_bfloat16*>(out));
  else if (dtype == 2) dequant_kernel<float><<<grid, 128, 0, stream>>>(planes, M, W, wstride, N, lut, k, static_cast<float*>(out));
  else return kUnsupported;
  return kOk;
}

#endif  // ANYPREC_DECODE_ONLY

}  // namespace anyprec

#ifndef ANYPREC_DECODE_ONLY
// ---------------------------------------------------------------------------------------------
// PyTorch ops (bound in anyprec.cpp): argument checks (shape, dtype, device, layout) before any
// launch, launch on the current stream, launcher status codes turned into messages. They live
// here, in the nvcc-compiled unit; their checks are QK_CHECKs (check.h says why).

namespace {

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return 0;
  if (t.scalar_type() == at::kBFloat16) return 1;
  if (t.scalar_type() == at::kFloat) return 2;
  return -1;
}

std::string status_text(int rc) {
  switch (rc) {
    case anyprec::kUnsupported: return "no compiled instance for this configuration";
    case anyprec::kBadArgs: return "arguments rejected by the launcher";
    case anyprec::kLaunchFailed: return "could not raise the kernel's shared-memory limit, or the launch failed";
    default: return "status " + std::to_string(rc);
  }
}

void check_planes(const at::Tensor& planes, const at::Tensor& lut, int64_t k, int64_t words) {
  QK_CHECK(planes.is_cuda() && planes.scalar_type() == at::kInt && planes.dim() == 3 && planes.is_contiguous(),
              "anyprec: planes must be a contiguous CUDA int32 tensor [n, M, words], got ", planes.sizes(), " ",
              planes.scalar_type(), planes.is_cuda() ? "" : " on CPU");
  QK_CHECK(k >= 1 && k <= 8 && k <= planes.size(0), "anyprec: bits=", k, " needs 1..8 and at most the ",
              planes.size(0), " stored planes");
  QK_CHECK(words >= 1 && words <= planes.size(2), "anyprec: words=", words, " but planes hold ", planes.size(2),
              " words per row");
  QK_CHECK(lut.is_cuda() && lut.scalar_type() == at::kHalf && lut.dim() == 2 && lut.is_contiguous() &&
                  lut.size(0) == planes.size(1) && lut.size(1) == (int64_t(1) << k),
              "anyprec: lut must be a contiguous CUDA fp16 tensor [", planes.size(1), ", ", int64_t(1) << k,
              "] for bits=", k, ", got ", lut.sizes(), " ", lut.scalar_type());
  QK_CHECK(lut.device() == planes.device(), "anyprec: lut on ", lut.device(), " but planes on ", planes.device());
  QK_CHECK(planes.size(1) <= INT32_MAX && planes.size(2) <= INT32_MAX, "anyprec: planes too large");
}

}  // namespace

// out[b, r] = sum_c x[b, c] * lut[r, code_k(r, c)] (+ bias[r]); x [B <= 8, ldx] holds at least
// 32 * words columns, zero past in_features; planes in the layout `flags` says (LAYOUT bit set:
// anyprec_gemm.kernel_layout). overlap: programmatic dependent launch on sm_90+ (grid_dependency.h).
// Returns out.
at::Tensor anyprec_matvec(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& lut, int64_t k,
                          int64_t words, const std::optional<at::Tensor>& bias, const at::Tensor& out, int64_t flags,
                          int64_t tiles, bool overlap) {
  check_planes(planes, lut, k, words);
  const int dt = dtype_code(x);
  QK_CHECK(x.is_cuda() && (dt == 0 || dt == 1) && x.dim() == 2 && x.is_contiguous(),
              "anyprec.matvec: x must be a contiguous CUDA fp16/bf16 tensor [B, columns], got ", x.sizes(), " ",
              x.scalar_type());
  QK_CHECK(x.device() == planes.device(), "anyprec.matvec: x on ", x.device(), " but planes on ", planes.device());
  const int64_t B = x.size(0), M = planes.size(1);
  QK_CHECK(B >= 1 && B <= anyprec::kMaxBatch, "anyprec.matvec: batch ", B, " outside 1..", anyprec::kMaxBatch);
  QK_CHECK(x.size(1) >= 32 * words && x.size(1) % 4 == 0,
              "anyprec.matvec: x has ", x.size(1), " columns; needs >= 32 * words = ", 32 * words,
              " and a multiple of 4 (pad in_features to whole words)");
  QK_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0, "anyprec.matvec: x must be 8-byte aligned");
  QK_CHECK(planes.size(2) % 4 == 0, "anyprec.matvec: planes have ", planes.size(2),
              " words per row; the kernel reads 16-byte vectors and needs a multiple of 4 (use kernel_layout)");
  QK_CHECK(out.is_cuda() && out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == B && out.size(1) == M && out.device() == x.device(),
              "anyprec.matvec: out must be a contiguous ", x.scalar_type(), " tensor [", B, ", ", M, "] on ",
              x.device(), ", got ", out.sizes(), " ", out.scalar_type());
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    QK_CHECK(b.is_cuda() && b.scalar_type() == x.scalar_type() && b.dim() == 1 && b.size(0) == M &&
                    b.is_contiguous() && b.device() == x.device(),
                "anyprec.matvec: bias must be a contiguous ", x.scalar_type(), " tensor [", M, "] on ", x.device(),
                ", got ", b.sizes(), " ", b.scalar_type());
    bias_ptr = b.data_ptr();
  }
  QK_CHECK(anyprec::has_matvec(dt, int(k), int(tiles), int(flags)), "anyprec.matvec: no kernel built for dtype=",
              x.scalar_type(), " bits=", k, " tiles=", tiles, " flags=", flags);
  QK_CHECK(x.size(1) <= INT32_MAX / 2, "anyprec.matvec: x row too long");
  QK_CHECK(k * M * planes.size(2) <= INT32_MAX, "anyprec.matvec: the top ", k, " planes hold ", k * M * planes.size(2),
           " words; the kernel's 32-bit offsets need fewer than 2^31 (split the layer)");
  QK_CHECK(reinterpret_cast<uintptr_t>(planes.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(lut.data_ptr()) % 16 == 0,
           "anyprec.matvec: planes and lut must be 16-byte aligned");

  const c10::cuda::CUDAGuard guard(x.device());
  anyprec::MatvecArgs a{x.data_ptr(), int(x.size(1)), int(B), reinterpret_cast<const uint32_t*>(planes.data_ptr()),
                        int(M), int(words), int(planes.size(2)), reinterpret_cast<const uint16_t*>(lut.data_ptr()),
                        bias_ptr, out.data_ptr(), {}};
  const anyprec::Launch on{c10::cuda::getCurrentCUDAStream(), overlap, x.device().index()};
  const int rc = anyprec::launch_matvec(dt, int(k), int(tiles), int(flags), a, on);
  QK_CHECK(rc == 0, "anyprec.matvec failed (", status_text(rc),
           on.error != cudaSuccess ? std::string(": ") + cudaGetErrorString(on.error) : std::string(), ") for x ",
           x.sizes(), ", planes ", planes.sizes(),
              ", bits=", k, ", words=", words, ", tiles=", tiles, ", flags=", flags);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// out [M, in_features] (fp16/bf16/fp32) = lut[r, code_k(r, c)] from natural-layout planes.
at::Tensor anyprec_dequantize(const at::Tensor& planes, const at::Tensor& lut, int64_t k, int64_t in_features,
                              const at::Tensor& out) {
  const int64_t words = (in_features + 31) / 32;
  check_planes(planes, lut, k, words);
  QK_CHECK(planes.size(2) == words, "anyprec.dequantize: planes have ", planes.size(2), " words per row but ",
              in_features, " columns need ", words, " (natural layout)");
  const int dt = dtype_code(out);
  const int64_t M = planes.size(1);
  QK_CHECK(out.is_cuda() && dt >= 0 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == in_features && out.device() == planes.device(),
              "anyprec.dequantize: out must be a contiguous fp16/bf16/fp32 tensor [", M, ", ", in_features, "] on ",
              planes.device(), ", got ", out.sizes(), " ", out.scalar_type());
  const c10::cuda::CUDAGuard guard(planes.device());
  const int rc = anyprec::launch_dequant(dt, int(k), reinterpret_cast<const uint32_t*>(planes.data_ptr()), int(M),
                                         int(words), int(words), int(in_features),
                                         reinterpret_cast<const uint16_t*>(lut.data_ptr()), out.data_ptr(),
                                         c10::cuda::getCurrentCUDAStream());
  QK_CHECK(rc == 0, "anyprec.dequantize failed (", status_text(rc), ") for planes ", planes.sizes(), ", bits=", k,
              ", in_features=", in_features);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

bool anyprec_has_matvec(at::ScalarType dtype, int64_t k, int64_t tiles, int64_t flags) {
  const int dt = dtype == at::kHalf ? 0 : dtype == at::kBFloat16 ? 1 : -1;
  return dt >= 0 && anyprec::has_matvec(dt, int(k), int(tiles), int(flags));
}
#endif  // ANYPREC_DECODE_ONLY
