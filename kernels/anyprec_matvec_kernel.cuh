// The any-precision bitplane matvec kernel (Any-Precision LLM §5): y = x·W_kᵀ (+ bias) for 1..8 rows of
// x, straight from the top k bitplanes.
//
// y[b, r] = sum_c x[b, c] * lut_k[r, code_k(r, c)] runs on the tensor cores (mma.m16n8k16, fp32
// accumulation): the weights are the A operand (16 rows x 16 k-slots), x the B operand (16 k-slots
// x 8 batch columns), so batch 1..8 cost the same mma and only the decode (anyprec_decode.cuh) has to be
// fast.
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
#pragma once

#include "anyprec_decode.cuh"
#include "cp_async.cuh"
#include "grid_dependency.cuh"

namespace anyprec {

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
  // (anyprec_tuning.h) the warp splits into G = 4 / P lane groups and group h copies the items of row
  // slot h: every lane copies, half as many copy instructions at P = 2. Other blocks keep one group, with
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
      st[tile][rs] = {table_addr + uint32_t(lane) * 4 + table_offset<K, C::PAIR>(tile, rs)};
      if constexpr (C::PRMT_LUT) pt[tile][rs] = prmt_table<K, T>(lut_row<K>(args.lut, row0 + 16 * tile + 8 * rs + g, M));
    }
  if constexpr (!C::PRMT_LUT) {
    constexpr int items = TILES * C::TABLE_SLOTS * (1 << K) * 8;
    unsigned char* table = smem + (table_addr - red_addr);
    for (int i = threadIdx.x; i < items; i += kThreads)
      reinterpret_cast<uint4*>(table)[i] = table_fill<K, T, C::PAIR>(args.lut, row0, M, i);
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

}  // namespace anyprec
