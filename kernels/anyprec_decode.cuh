// The any-precision decode: per-instance configuration (Config), the centroid tables, and the decode of
// a word's k plane words into the mma's A fragments. Host-compilable: the CPU decode harness
// (tests/test_kernel_anyprec.py) includes this header and runs it for every built instance.
//
// Decoding a word: the k plane words are merged ("bit-transposed") into words whose nibbles
// (k <= 4) or bytes (k >= 5) hold whole codes, 8 or 4 per merged word, then looked up:
//   k <= 3 and TLM: table in registers, PRMT (byte permute) looks up 4 codes per instruction:
//          one PRMT gathers the low bytes of 4 centroids, one the high bytes, two more
//          interleave them into the two fp16x2 registers the mma takes;
//   otherwise: one shared-memory load per code from a table replicated once per lane, each
//          lane's copy in its own bank (word = ((tile_row_slot * 2^k + code) * 32 + lane)),
//          so the 32 random lookups of a warp never conflict. With FLAG_PAIR the two row slots
//          of a tile share one table whose words hold the centroid of row g (low half) and of
//          row g + 8 (high half), word = ((tile * 2^k + code) * 32 + lane): half the bytes, the
//          same loads; the fragment packing picks the half of the lane's row slot.
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
#pragma once

#include <utility>

#include "anyprec_bits.cuh"
#include "anyprec_tuning.h"

namespace anyprec {

// Compile-time shape of one instance: k bits, TILES 16-row tiles per block, the FLAGS optimisations.
template <int K, int TILES, int FLAGS>
struct Config {
  static constexpr bool LAYOUT = FLAGS & FLAG_LAYOUT;
  static constexpr bool IBT = FLAGS & FLAG_IBT;
  static constexpr bool PRMT_LUT = (FLAGS & FLAG_TLM) && K <= 3;
  static constexpr bool PAIR = (FLAGS & FLAG_PAIR) && !PRMT_LUT;  // one table word serves rows g and g + 8
  static constexpr int TABLE_SLOTS = PAIR ? 1 : 2;                 // tables per tile
  static constexpr bool NIBBLE = K <= 4;                    // codes per merged word: 8 nibbles / 4 bytes
  static constexpr int MERGED = NIBBLE ? 4 : 8;             // merged words per 32-column word
  static constexpr int KT_PER_MERGED = NIBBLE ? 2 : 1;      // k-tiles (4 codes) per merged word
  static constexpr uint32_t BASE = NIBBLE ? 0x11111111u : 0x01010101u;
  static constexpr uint32_t MASK = (1u << K) - 1;
  static constexpr int TABLE_BYTES = PRMT_LUT ? 0 : TILES * TABLE_SLOTS * (1 << K) * 32 * 4;
  // The table starts at a multiple of 2^(K+7) in the shared window, so code * 128 and the lane's
  // bank offset are or-ed into its base (one LOP3 per lookup); the slack for that alignment is
  // allocated. At k = 8 the 32 KB of slack would cost a resident block: there the offset is added
  // (with FLAG_PAIR from k = 7 on, whose 16 KB of slack would otherwise cost a ring stage).
  static constexpr bool TABLE_OR = !PRMT_LUT && K < (PAIR ? 7 : 8);
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
  static constexpr int MIN_BLOCKS = (WARPS == 4 ? (K <= 3 ? AP_FOUR_WARPS_MIN_BLOCKS_SMALL : AP_FOUR_WARPS_MIN_BLOCKS)
                                   : K <= 7 ? AP_MIN_BLOCKS_SMALL : AP_MIN_BLOCKS) + ((FLAGS & FLAG_OCC) ? 1 : 0);
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

// Entry V of a register table (prmt_table): centroid bitrev_K(V) of the row's words w, its low byte into lo and its
// high byte into hi at byte V of the pair.
template <int K, typename T, int V>
AP_HD void prmt_table_entry(const uint32_t (&w)[4], uint32_t (&lo)[2], uint32_t (&hi)[2]) {
  constexpr int i = int(bitrev(V, K));
  const uint16_t e = centroid_bits<T>(uint16_t(w[i >> 1] >> (16 * (i & 1))));
  lo[V >> 2] |= uint32_t(e & 0xFF) << (8 * (V & 3));
  hi[V >> 2] |= uint32_t(e >> 8) << (8 * (V & 3));
}
template <int K, typename T, int... V>
AP_HD void prmt_table_entries(const uint32_t (&w)[4], uint32_t (&lo)[2], uint32_t (&hi)[2],
                              std::integer_sequence<int, V...>) {
  (prmt_table_entry<K, T, V>(w, lo, hi), ...);
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
    // entries by a pack expansion, so every index into w is a constant: a loop left w in local memory (bf16)
    prmt_table_entries<K, T>(w, lo, hi, std::make_integer_sequence<int, (1 << K)>{});
    return {lo[0], lo[1], hi[0], hi[1]};
  }
}

// entry v of one row in the mma's element type (bits), zero for rows >= M
template <int K, typename T>
AP_HD uint32_t table_entry(const uint16_t* lut, int row, int M, int v) {
  return row < M ? centroid_bits<T>(lut[size_t(row) * (1 << K) + bitrev(v, K)]) : 0u;
}

// byte offset of the table of (tile, row slot rs) inside the table area (FLAG_PAIR: both slots share one)
template <int K, bool PAIR = false>
AP_HD constexpr int table_offset(int tile, int rs) { return (PAIR ? tile : tile * 2 + rs) * (1 << K) * 128; }

// Fill item i of the table area of a block starting at row0: i = (table * 2^K + v) * 8 + g, one 16-byte
// store at uint4 index i of the 4 bank-replicated copies (lanes 4g..4g+3) of entry v of row g of that
// table (table = tile * 2 + rs), or with FLAG_PAIR (table = tile) of rows g and g + 8 packed low / high;
// g fastest keeps the 8 stores of a quarter-warp in distinct banks. Items: TILES * TABLE_SLOTS * 2^K * 8.
template <int K, typename T, bool PAIR>
AP_HD uint4 table_fill(const uint16_t* lut, int row0, int M, int i) {
  const int g = i & 7, ts = i >> (3 + K), v = (i >> 3) & ((1 << K) - 1);
  uint32_t e;
  if constexpr (PAIR) {
    const int row = row0 + 16 * ts + g;
    e = table_entry<K, T>(lut, row, M, v) | (table_entry<K, T>(lut, row + 8, M, v) << 16);
  } else {
    e = table_entry<K, T>(lut, row0 + 16 * (ts >> 1) + 8 * (ts & 1) + g, M, v);
  }
  return make_uint4(e, e, e, e);
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

// The two fp16x2 A registers of k-tile (j, h) for one row (row slot RS of the tile): pa = (f0, f1),
// pb = (f2, f3).
template <int K, int TILES, int FLAGS, int RS>
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
    // FLAG_PAIR: row slot 1's centroids are the high halves of the table words
    constexpr uint32_t sel = C::PAIR && RS == 1 ? 0x7632 : 0x5410;
    pa = prmt(w[0], w[1], sel);
    pb = prmt(w[2], w[3], sel);
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
        decode_ktile<K, TILES, FLAGS, 0>(R[tile][0], merged[tile][0], j, h, pt[tile][0], st[tile][0], p2, a[0], a[2]);
        decode_ktile<K, TILES, FLAGS, 1>(R[tile][1], merged[tile][1], j, h, pt[tile][1], st[tile][1], p2, a[1], a[3]);
        mma(tile, a, b01, b23);
      }
    }
  }
}

// Instances built: every width in fp16 and bf16 with all optimisations (TILES = 2 where the
// replicated tables fit, k <= 6); the ablations in fp16, k = 3..8, TILES = 1; the variants of the
// shared-memory-table widths k = 4..8 in fp16 and bf16, all optimisations plus FLAG_PAIR, with or
// without FLAG_OCC (TILES = 2 up to k = 7; anyprec_variants.cu builds them). `flags` is normalised
// first (TLM only changes k <= 3).
constexpr int normalize_flags(int k, int flags) { return k > 3 ? (flags | FLAG_TLM) : flags; }

constexpr bool variant_rule(int k, int tiles, int flags) {
  return (flags == (7 | FLAG_PAIR) || flags == (7 | FLAG_PAIR | FLAG_OCC)) && k >= 4 && k <= 8 &&
         (tiles == 1 || (tiles == 2 && k <= 7));
}

constexpr bool compiled_rule(bool half, int k, int tiles, int flags) {
  const bool prod = flags == 7 && (tiles == 1 || (tiles == 2 && k <= 6));
  const bool ablation = half && tiles == 1 && k >= 3 &&
                        (k <= 3 ? (flags == 6 || flags == 5 || flags == 3 || flags == 0)
                                : (flags == 6 || flags == 5 || flags == 4));
  return k >= 1 && k <= 8 && (prod || ablation || variant_rule(k, tiles, flags));
}

}  // namespace anyprec
