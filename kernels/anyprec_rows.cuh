// The row-per-lane any-precision matvec (FLAG_ROWS, widths 4..8): configuration, table, decode and the
// index maps of its fragments. Host-compilable: the CPU decode harness (tests/test_kernel_anyprec.py) runs
// this code; anyprec_rows.cu holds the kernel around it.
//
// Why: the shared-memory-table kernel (anyprec_matvec_kernel.cuh) gives lane (g, t) rows g and g + 8 of a
// 16-row tile, four lanes to a row, so each row's table is replicated four times to keep the lookups
// conflict-free (2^k x 16 bytes per row, 64 KB per 16-row tile at k = 8): the tables bound the resident
// blocks and the ring's depth, and are refilled for every 16 rows. Here every lane owns whole rows:
//
//   block = 64 rows (two 32-row groups), WARPS warps (8; 16 for code pairs up to batch 4) splitting the words of
//   those rows (word w of the block's column range goes to warp w % WARPS); lane l owns rows l and 32 + l.
//   table: word v * 32 + l holds the centroids of code bitrev(v) of row l (low half) and row 32 + l (high
//   half): one unreplicated table, 2^k x 2 bytes per row, and the 32 lanes of a lookup always read 32
//   different banks.
//   planes: the rows layout (anyprec_gemm.rows_layout), int32 [n, G, Wp, 32] with G = 2 * ceil(M / 64):
//   word w of row 32 * grp + l of "plane" p at ((p * G + grp) * Wp + w) * 32 + l. Planes 4..n-1 are the
//   kernel layout's words with the columns permuted by rows_sigma instead of pi (still rotated by p: bit s of
//   plane p holds column rows_sigma((s - p) mod 32)); the top four, which every width
//   here reads, are stored already merged: slot p < 4 holds U_p, the bits of planes 0..3 that merged words
//   j = p and j = p + 4 take (rows_merge), so a merged word costs k - 4 selects instead of k - 1 (k = 4:
//   none). A warp step (one word of 64 rows and k planes) is 2k whole 128-byte lines, copied with 16-byte
//   cp.async into a per-warp ring that keeps that order, so lane l reads its words from bank l.
//
// The mma (m16n8k16) with the weights as B and x as A: lane (g, t) holds B[2t, 2t+1][g] and B[2t+8, 2t+9][g],
// here four weights of its own row at the four columns c0..c3 of a merged word (codes of slots j, 8 + j,
// 16 + j, 24 + j: columns c, c + 1, c + 4, c + 5 with c = rows_col0(j) = 8 (j / 2) + 2 (j % 2)). Row m = 4b + t'
// of A holds x[b] at the k-slots of lanes with t = t' and zeros elsewhere, so D[4b + t'][n] is the dot product
// of batch row b with the row of lane 4n + t': one mma serves 32 rows x 4 columns x 4 batch rows, two serve
// batch 8. Only the 8 lanes with t = g % 4 hold non-zero A fragments; the others pass zeros.
// Batch class 2 passes the A fragment straight from the 16-byte x load of columns 8q..8q+7 (q = j / 2), as the
// registers (x pairs 8q, 8q + 2, 8q + 4, 8q + 6) with no moves: even j use a0 / a2 (columns c..c + 5 with
// c = 8q) and read D rows 0-7, odd j a1 / a3 (c = 8q + 2) and read D rows 8-15 of a second accumulator; the
// other half of each is garbage and never read (rows 8-15 would be batch rows 2-3).
//
// Code pairs (FLAG_CODE_PAIRS, k = 4): byte i of U_p rotated right by p (bits 8i + p .. 8i + p + 7 of U_p, mod 32)
// holds the codes of slots 8i + p and 8i + p + 4, columns c and c + 16 with c = 8 (p / 2) + 2 (p % 2) + (i % 2) +
// 4 (i / 2). A table of 256 entries per row, two fp16 / bf16 each (the centroids of the low and high nibble), gives
// a whole B register per lookup; entry e of rows l and 32 + l sit at bytes 256 e + 4 l and 256 e + 128 + 4 l, so the
// lookup's byte offset is one PRMT of byte i of the rotated U_p and the lane's offset, and the table, at a fixed
// offset past the ring, adds its address as the load's immediate: one PRMT and one load per two weights, against
// two shifts, two LOP3, two loads and a PRMT. mma (p, ii) takes bytes 2ii (B k-slots 2t, 2t + 1: columns c, c + 16)
// and 2ii + 1 (c + 1, c + 17); its A fragments pair x's columns the same way, two PRMTs per mma and batch-row
// source. The table is 64 KB per 64 rows, so 2 blocks are resident.
#pragma once

#include "anyprec_decode.cuh"

namespace anyprec {

// NB: the largest batch an instance serves, 2, 4 or 8 (A fragments a1 / a3 carry batch rows 2, 3 and a second
// mma per row half batch rows 4..7; batch class 2 uses a1 / a3 for odd merged words, in a second accumulator).
template <int K, int NB, int FLAGS>
struct RowsConfig {
  static_assert(K >= 4 && K <= 8, "the row-per-lane kernel serves widths 4..8");
  static_assert(NB == 2 || NB == 4 || NB == 8, "batch classes 2, 4 and 8");
  static constexpr bool PAIRS = (FLAGS & FLAG_CODE_PAIRS) != 0;
  static_assert(!PAIRS || K == 4, "code-pair tables at 4 bits only (2^(2k) entries per row)");
  static constexpr int NBG = NB == 8 ? 2 : 1;  // mma per row half and merged word
  static constexpr int SETS = NB == 2 && !PAIRS ? 2 : NBG;  // accumulators per row half
  // warps per block: PAIRS, whose 64 KB table allows only 2 resident blocks, runs more of them up to batch 4
  static constexpr int WARPS = PAIRS && NB <= 4 ? AP_ROWS_PAIRS_WARPS : 8;
  static constexpr int THREADS = WARPS * 32, ROWS = 64;
  static constexpr uint32_t MASK = (1u << K) - 1;
  static constexpr int LINES = 2 * K;  // 128-byte lines per warp step: (plane, group)
  static constexpr int STEP_BYTES = LINES * 128;
  static constexpr int CHUNKS = LINES * 8;  // 16-byte copies per warp step
  static constexpr int MIN_BLOCKS = PAIRS ? 2 : (K >= 7 ? 2 : 3) + ((FLAGS & FLAG_OCC) ? 1 : 0);
  // the table: 2^k words per lane, or with PAIRS 256 per lane and row half
  static constexpr int TABLE_WORDS = PAIRS ? 256 * 64 : (1 << K) * 32;
  static constexpr int TABLE_BYTES = TABLE_WORDS * 4;
  // A lookup's address is (code << 7 & mask) | (table | lane * 4), one LOP3, where the table starts at a multiple of
  // its own size in the shared window; otherwise the table's address is added (one more IMAD per weight, 13 % of
  // the loop). The window's base is known only to be 16-byte aligned, so the aligned start is found at run time
  // in TABLE_SLACK spare bytes: worth it up to AP_ROWS_TABLE_OR_MAX_K (8 KB of slack at k = 6), not at 7-8 whose
  // 16-32 KB would cost ring depth. PAIRS needs neither: its lookups take byte offsets from a table at a fixed offset
  // past the ring, whose address the compiler puts in the loads' immediate.
  static constexpr bool TABLE_OR = !PAIRS && K <= AP_ROWS_TABLE_OR_MAX_K;
  static constexpr int TABLE_SLACK = TABLE_OR ? TABLE_BYTES - 16 : 0;
  static constexpr bool DYNAMIC_TABLE = TABLE_OR || PAIRS;  // else static (64 KB would pass the static limit)
  // shared memory per block, all dynamic: the ring (the warps' partial sums reuse it at the end), then the
  // table (the block's sums, read by the cluster's first block, reuse it)
  static constexpr int RING_ROOM = 228 * 1024 / MIN_BLOCKS - 1024 - 16 - TABLE_BYTES - TABLE_SLACK;
  static constexpr int STAGES_FIT = RING_ROOM / (WARPS * STEP_BYTES);
  static constexpr int STAGES = STAGES_FIT >= AP_ROWS_STAGES ? AP_ROWS_STAGES : STAGES_FIT;
  static_assert(STAGES >= 2, "the ring needs two steps");
  static constexpr int WARP_RING_BYTES = STAGES * STEP_BYTES;
  static constexpr int RING_BYTES = WARPS * WARP_RING_BYTES;
  static constexpr int RED_BYTES = WARPS * 2 * NBG * 32 * 16;
  static constexpr int RING_AREA = RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES;
  static constexpr int DYN_BYTES = RING_AREA + (DYNAMIC_TABLE ? TABLE_SLACK + TABLE_BYTES : 0);  // else a static table
  static_assert(DYN_BYTES + (DYNAMIC_TABLE ? 16 : TABLE_BYTES) <= 227 * 1024, "a block's shared memory");
  static_assert(TABLE_WORDS >= ROWS * 8, "the partial sums of a cluster reuse the table");
};

// Byte offset of the table in the dynamic shared memory whose window address is `base` (DYNAMIC_TABLE): past the ring
// area, where TABLE_OR at the next multiple of the table's size.
template <int K, int NB, int FLAGS>
AP_HD uint32_t rows_table_offset(uint32_t base) {
  using C = RowsConfig<K, NB, FLAGS>;
  if (!C::TABLE_OR) return uint32_t(C::RING_AREA);
  const uint32_t end = base + uint32_t(C::RING_AREA);
  return ((end + uint32_t(C::TABLE_BYTES) - 1) & ~uint32_t(C::TABLE_BYTES - 1)) - base;
}

// Item i of the table fill of the block starting at row0: lane l = i % 32 and entries 8c..8c+7 (c = i / 32)
// of rows row0 + l and row0 + 32 + l, read as 16 bytes each (zeros past M), stored as 8 words at
// bitrev(v) * 32 + l (entry v of the stored order is code bitrev(v) of the table). Items: 2^K / 8 * 32.
template <int K, typename T, typename Store>
AP_HD void rows_table_fill(const uint16_t* lut, int row0, int M, int i, Store&& store) {
  const int l = i & 31, c = i >> 5;
  uint16_t lo[8] = {}, hi[8] = {};
  const int ra = row0 + l, rb = row0 + 32 + l;
#ifdef __CUDA_ARCH__
  if (ra < M) *reinterpret_cast<uint4*>(lo) = __ldg(reinterpret_cast<const uint4*>(lut + (size_t(ra) << K) + 8 * c));
  if (rb < M) *reinterpret_cast<uint4*>(hi) = __ldg(reinterpret_cast<const uint4*>(lut + (size_t(rb) << K) + 8 * c));
#else
  if (ra < M) std::memcpy(lo, lut + (size_t(ra) << K) + 8 * c, 16);
  if (rb < M) std::memcpy(hi, lut + (size_t(rb) << K) + 8 * c, 16);
#endif
#pragma unroll
  for (int e = 0; e < 8; ++e)
    store(int(bitrev(8 * c + e, K)) * 32 + l, uint32_t(centroid_bits<T>(lo[e])) | (uint32_t(centroid_bits<T>(hi[e])) << 16));
}

// Item i of the code-pair table's fill (PAIRS) of the block starting at row0: lane l = i % 32, row half
// h = (i / 32) % 2 (row row0 + 32h + l), high nibble n1 = i / 64; words e * 64 + 32 h + l, e = 16 n1 + n0 for
// n0 = 0..15, hold the centroids of codes bitrev(n0) (low half) and bitrev(n1) (high half), zeros past M.
// Items: 2 * 32 * 16.
template <typename T, typename Store>
AP_HD void rows_pair_table_fill(const uint16_t* lut, int row0, int M, int i, Store&& store) {
  const int l = i & 31, h = (i >> 5) & 1, n1 = i >> 6, r = row0 + 32 * h + l;
  uint16_t c[16] = {}, c_high = 0;  // c_high loaded on its own: indexing c by n1 would put c in local memory
#ifdef __CUDA_ARCH__
  if (r < M) {
    const uint4* src = reinterpret_cast<const uint4*>(lut + (size_t(r) << 4));
    reinterpret_cast<uint4*>(c)[0] = __ldg(src);
    reinterpret_cast<uint4*>(c)[1] = __ldg(src + 1);
    c_high = __ldg(lut + (size_t(r) << 4) + bitrev(n1, 4));
  }
#else
  if (r < M) {
    std::memcpy(c, lut + (size_t(r) << 4), 32);
    c_high = lut[(size_t(r) << 4) + bitrev(n1, 4)];
  }
#endif
  const uint32_t high = uint32_t(centroid_bits<T>(c_high)) << 16;
#pragma unroll
  for (int n0 = 0; n0 < 16; ++n0)
    store((16 * n1 + n0) * 64 + 32 * h + l, uint32_t(centroid_bits<T>(c[bitrev(n0, 4)])) | high);
}

// Batch rows of x this lane passes in batch group bg (NB = 8: bg = 1 adds 4): ra in a0 / a2, rb in a1 / a3, or -1
// for none (zeros). Only the lanes with t = g % 4 pass any.
AP_HD void rows_xrows(int lane, int bg, int B, int NB, int& ra, int& rb) {
  const int g = lane >> 2, t = lane & 3;
  const bool owner = t == (g & 3);
  const int ba = (g >> 2) + 4 * bg, bb = ba + 2;
  ra = owner && ba < B ? ba : -1;
  rb = NB >= 4 && owner && bb < B ? bb : -1;  // batch class 2: a1 / a3 stay zero, no loads
}

// x of one batch row at a word's 32 columns (xw 16-byte aligned) as 16 fp16x2 / bf16x2 words, or zeros where
// the lane passes none: loaded once per word (4 x 16 bytes) for batch classes 2 and 4.
template <typename T>
AP_HD void rows_xword(const T* xw, bool on, uint32_t (&v)[16]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint4 u = make_uint4(0, 0, 0, 0);
#ifdef __CUDA_ARCH__
    if (on) u = __ldg(reinterpret_cast<const uint4*>(xw) + q);
#else
    if (on) std::memcpy(&u, xw + 8 * q, 16);
#endif
    v[4 * q] = u.x; v[4 * q + 1] = u.y; v[4 * q + 2] = u.z; v[4 * q + 3] = u.w;
  }
}

// First column (within the word) of merged word j: its codes stand for columns c, c + 1, c + 4, c + 5
AP_HD constexpr int rows_col0(int j) { return 8 * (j >> 1) + 2 * (j & 1); }

// The rows layout's column permutation: slot position q = 8i + j (before the per-plane rotation) holds column
// rows_col0(j) + (i & 1) + 4 (i >> 1), i.e. q = (q4 .. q0) -> q3 + 2 q0 + 4 q4 + 8 q1 + 16 q2
// (anyprec_gemm.rows_layout applies the same formula).
AP_HD constexpr int rows_sigma(int q) {
  return ((q >> 3) & 1) + 2 * (q & 1) + 4 * ((q >> 4) & 1) + 8 * ((q >> 1) & 1) + 16 * ((q >> 2) & 1);
}

// A kernel-layout word of plane p (bit s = column pi((s - p) mod 32)) in the rows layout's order (bit s = column
// rows_sigma((s - p) mod 32)), before the pre-merge of the top four planes
AP_HD uint32_t rows_relayout(uint32_t kw, int p) {
  int pos_of_column[32] = {};
  for (int q = 0; q < 32; ++q) pos_of_column[pi(q)] = q;
  uint32_t out = 0;
  for (int s = 0; s < 32; ++s) {
    const int src = (pos_of_column[rows_sigma((s - p) & 31)] + p) & 31;
    out |= ((kw >> src) & 1u) << s;
  }
  return out;
}

// The A fragment pair of merged word j from rows_xword's words: columns c, c + 1 and c + 4, c + 5
AP_HD void rows_afrag_of(const uint32_t (&v)[16], int j, uint32_t& a_lo, uint32_t& a_hi) {
  a_lo = v[rows_col0(j) >> 1];
  a_hi = v[(rows_col0(j) + 4) >> 1];
}

// Batch class 2: the A fragment of merged word j is the 16-byte x load of columns 8 (j / 2) .. + 7 as it stands
AP_HD void rows_aquad_of(const uint32_t (&v)[16], int j, uint32_t (&a)[4]) {
  const int q = j >> 1;
  a[0] = v[4 * q]; a[1] = v[4 * q + 1]; a[2] = v[4 * q + 2]; a[3] = v[4 * q + 3];
}

// x of one batch row at columns 8q..8q + 7 of word xw (16-byte aligned) as 4 fp16x2 / bf16x2 words, or zeros where the
// lane passes none: the A fragment pairs of merged words 2q (words 0, 2) and 2q + 1 (words 1, 3).
template <typename T>
AP_HD void rows_xquad(const T* xw, bool on, int q, uint32_t (&v)[4]) {
  uint4 u = make_uint4(0, 0, 0, 0);
#ifdef __CUDA_ARCH__
  if (on) u = __ldg(reinterpret_cast<const uint4*>(xw) + q);
#else
  if (on) std::memcpy(&u, xw + 8 * q, 16);
#endif
  v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
}

// The A fragment pair of merged word j from rows_xquad's words of q = j / 2: columns c, c + 1 and c + 4, c + 5
AP_HD void rows_afrag_quad(const uint32_t (&v)[4], int j, uint32_t& a_lo, uint32_t& a_hi) {
  a_lo = v[j & 1];
  a_hi = v[2 + (j & 1)];
}

// The rows layout's U_p (p < 4) from the kernel layout's top four plane words P[0..3]: the bits at 4m + p + q
// (m = 0..7) of plane q, i.e. the code bits of planes 0..3 that merged words p and p + 4 hold
// (anyprec_gemm.rows_layout computes the same on the GPU).
AP_HD uint32_t rows_premerged(const uint32_t (&P)[4], int p) {
  uint32_t u = 0;
  for (int q = 0; q < 4; ++q) u |= P[q] & rotl_c(0x11111111u, p + q);
  return u;
}

// Merged word j (code of slot 8i + j at bits 8i + j .., plane p at bit 8i + j + p) from the rows layout's
// words: U_{j mod 4} has planes 0..3 in place, planes 4..K-1 are selected in (bits past a code: garbage).
// (a & m) | (b & ~m) as one LOP3 (left to itself the compiler splits the chain into and / or pairs)
AP_HD uint32_t select_bits(uint32_t a, uint32_t m, uint32_t b) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(d) : "r"(a), "r"(m), "r"(b));
  return d;
#else
  return (a & m) | (b & ~m);
#endif
}

template <int K>
AP_HD uint32_t rows_merge(const uint32_t (&R)[K], int j) {
  uint32_t acc = R[j & 3];
#pragma unroll
  for (int p = 4; p < K; ++p) acc = select_bits(R[p], rotl_c(0x01010101u, j + p), acc);
  return acc;
}

// Decode one word of this lane's two rows (R[h][p] = rows-layout word p of row 32h + lane) and hand the B fragments of
// each merged word j (b[h][0] = columns c0, c1, b[h][1] = c2, c3 of row 32h + lane) to mma(j, b).
// lookup(address) reads the table word at a shared-window address; lane_addr = the table's address | lane * 4 where
// OR (the table aligned to its size), else + lane * 4.
template <int K, bool OR, typename Lookup, typename Mma>
AP_HD void rows_decode_word(const uint32_t (&R)[2][K], uint32_t lane_addr, const Pow2& p2, Lookup&& lookup, Mma&& mma) {
  constexpr uint32_t MASK = (1u << K) - 1;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t b[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // code of slot 8i + j at bits 8i + j .. 8i + j + K - 1 (plane p at bit 8i + j + p)
      const uint32_t merged = rows_merge<K>(R[h], j);
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t code128 = code_at_bit7<K>(merged, 8 * i + j, p2) & (MASK << 7);
        w[i] = lookup(OR ? code128 | lane_addr : code128 + lane_addr);
      }
      const uint32_t sel = h == 0 ? 0x5410u : 0x7632u;  // row l: low halves; row 32 + l: high halves
      b[h][0] = prmt(w[0], w[1], sel);
      b[h][1] = prmt(w[2], w[3], sel);
    }
    mma(j, b);
  }
}

// Decode one word of this lane's two rows from the code-pair table (PAIRS; R[h][p] = U_p of row 32h + lane) and hand
// mma(p, ii, b) the B fragments of U_p's bytes 2ii (b[h][0]: columns c, c + 16) and 2ii + 1 (b[h][1]: c + 1, c + 17),
// c = 8 (p / 2) + 2 (p % 2) + 4 ii. lookup(offset) reads the table word at a byte offset; lane_off[h] = 128 h + 4 lane.
template <typename Lookup, typename Mma>
AP_HD void rows_decode_pairs(const uint32_t (&R)[2][4], const uint32_t (&lane_off)[2], Lookup&& lookup, Mma&& mma) {
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      uint32_t b[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t u = p == 0 ? R[h][p] : rotr(R[h][p], p);  // byte i = the codes of slots 8i + p, 8i + p + 4
#pragma unroll
        for (int r = 0; r < 2; ++r)  // offset = byte 2ii + r of u in byte 1, the lane's offset in byte 0
          b[h][r] = lookup(prmt(u, lane_off[h], 0x7604u | uint32_t((2 * ii + r) << 4)));
      }
      mma(p, ii, b);
    }
}

// The A fragment pair of mma (p, ii) (PAIRS) from one batch row's x at columns 8 (p / 2) .. + 7 (lo, rows_xquad of
// q = p / 2) and 16 more (hi, q = p / 2 + 2): columns (c, c + 16) and (c + 1, c + 17), c = 8 (p / 2) + 2 (p % 2) + 4 ii
AP_HD void rows_pair_afrag(const uint32_t (&lo)[4], const uint32_t (&hi)[4], int p, int ii, uint32_t& a_lo,
                           uint32_t& a_hi) {
  const int r = (p & 1) + 2 * ii;
  a_lo = prmt(lo[r], hi[r], 0x5410);
  a_hi = prmt(lo[r], hi[r], 0x7632);
}

// Where the block's partial sum of (row 32h + l, batch b) sits: C-fragment element e of lane src_lane in the
// accumulators of row half h and batch group b / 4 (batch class 2: after rows 8-15 of the odd merged words'
// accumulator are added to rows 0-7 of the first).
struct RowsSource { int src_lane, e; };
AP_HD RowsSource rows_source(int l, int b) {
  const int n = l >> 2, m = 4 * (b & 3) + (l & 3);  // D[m][n], m = 4 (b mod 4) + t', lane l = 4n + t'
  return {4 * (m & 7) + (n >> 1), (n & 1) + 2 * (m >> 3)};
}

// the batch class of a launch (RowsConfig's NB)
constexpr int rows_batch_class(int B) { return B <= 2 ? 2 : B <= 4 ? 4 : 8; }

// Instances built: widths 4..8, fp16 and bf16, batch classes 2, 4, 8, with or without FLAG_OCC, and at k = 4 with
// FLAG_CODE_PAIRS; `tiles` carries the number of blocks (a thread-block cluster, sm_90) that split a 64-row block's
// words, 1..8.
constexpr int kRowsMaxSplit = 8;
constexpr bool rows_rule(int k, int split, int flags) {
  return k >= 4 && k <= 8 && split >= 1 && split <= kRowsMaxSplit &&
         (flags == (7 | FLAG_ROWS) || flags == (7 | FLAG_ROWS | FLAG_OCC) ||
          (k == 4 && flags == (7 | FLAG_ROWS | FLAG_CODE_PAIRS)));
}

}  // namespace anyprec
