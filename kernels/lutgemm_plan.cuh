// Launch planning of the LUT-GEMM kernels, shared by the CUDA launchers (lutgemm.cu) and the CPU
// emulation (lutgemm_emu.cpp): padded batch, row tiles and chunks, the kernels' parameters, grid size.
#pragma once

#include "lutgemm_lut_kernel.cuh"
#include "lutgemm_mma_kernel.cuh"

namespace lutgemm {

inline int padded_batch(int nb) { return nb <= 1 ? 1 : nb <= 2 ? 2 : nb <= 4 ? 4 : 8; }

// f(Cfg<bp>{}) for a padded batch bp: the LUT kernel's compile-time shape, asked at run time
template <class F>
inline int by_padded_batch(int bp, F f) {
  return bp == 1 ? f(Cfg<1>{}) : bp == 2 ? f(Cfg<2>{}) : bp == 4 ? f(Cfg<4>{}) : f(Cfg<8>{});
}
inline int chunk_cols(int bp) { return by_padded_batch(bp, [](auto c) { return decltype(c)::kChunkCols; }); }
inline int steps_per_plane(int bp) { return by_padded_batch(bp, [](auto c) { return decltype(c)::kSteps; }); }
inline int offset_steps(int bp) { return by_padded_batch(bp, [](auto c) { return decltype(c)::kOffsetSteps; }); }
inline int lut_smem_bytes(int bp) { return by_padded_batch(bp, [](auto c) { return decltype(c)::kSmemBytes; }); }

// The α layouts a launch of n columns may pass: alpha_planes = q (alpha [G, q, k]), or 1 (compact α [G, 1, k],
// α_i = 2^i·α_0) up to kCompactAlphaMaxBatch columns, served by the LUT kernel's COMPACT_ALPHA instances only.
inline bool alpha_layout_ok(int alpha_planes, int q, int n) {
  return alpha_planes == q || (alpha_planes == 1 && n <= kCompactAlphaMaxBatch);
}

// Row tiles of the LUT kernel.
inline int row_tiles(int k) { return (k + kTileRows - 1) / kTileRows; }
// Per-tile counters one launch may need (the tensor-core path has the smaller tiles).
inline int max_row_tiles(int k) { return (k + kMmaTileRows - 1) / kMmaTileRows; }

// Whether the tensor-core path can serve a weight: whole 128-column chunks per group.
inline bool mma_supported(int group_size, int groups) { return groups == 1 || group_size % 128 == 0; }

inline LutParams make_lut_params(const __half* x, int nb, int d, const uint32_t* qw, const __half* alpha,
                                 const __half* offset, const __half* bias, __half* y, float* ws, int* counters,
                                 int q, int W, int k, int G, int g) {
  LutParams p{};
  p.x = x, p.qw = qw, p.alpha = alpha, p.offset = offset, p.bias = bias, p.y = y, p.ws = ws, p.counters = counters;
  p.nb = nb, p.d = d, p.k = k, p.q = q, p.W = W;
  p.x_vec = d % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  p.group_magic = group_magic(g, G);
  for (int i = 0; i < 32; ++i) p.pow2[i] = 1u << i;
  p.n_rt = row_tiles(k);
  const int bp = padded_batch(nb), cw = chunk_cols(bp) / 32;
  p.n_ch = (W + cw - 1) / cw;
  p.planes = q + (offset != nullptr ? 1 : 0);
  // per chunk: NH steps per sign plane, then the offset plane's
  p.steps = (long long)p.n_rt * p.n_ch * (q * steps_per_plane(bp) + (p.planes - q) * offset_steps(bp));
  return p;
}

inline LutParams make_mma_params(LutParams p) {  // from make_lut_params: re-tile for bcq_mma_kernel
  p.n_rt = (p.k + kMmaTileRows - 1) / kMmaTileRows;
  p.n_ch = (p.W + kMmaChunkWords - 1) / kMmaChunkWords;
  p.steps = (long long)p.n_rt * p.n_ch;  // a step is a whole chunk, all planes
  return p;
}

inline int lut_grid(const LutParams& p, int max_blocks) {
  return int(p.steps < max_blocks ? p.steps : max_blocks);
}

}  // namespace lutgemm
