// Fused GPTQ / k-OOC column loop: one launch runs one tile of columns for every row of every unit.
//
// GPTQ (Frantar et al. 2022) is sequential over the columns of W but independent over its rows once
// U = upper Cholesky factor of H^-1 is known (k-OOC paper, sec. 3.3 "row parallel"). A *unit* is one copy
// of W being quantized: the GPTQ run, or one OOC candidate with its own clear columns and high bit width
// ("selection parallel"). All units share U, so their rows are stacked into one [R, d] work matrix and
// rows of all units are the independent pieces of work. kernels/gptq_cuda.py walks the tiles; per tile
// [i1, i1 + width):
//   1. gptq_tile_kernel: every row runs the exact column loop inside the tile (quantize, error, update
//      the rest of the tile at once) and writes its codes, the tile's errors E = (w - q)/U_cc, and the
//      params of the groups that start here;
//   2. (Python) one cuBLAS GEMM applies the lazy update W[:, i1+width:] -= E @ U[tile, i1+width:].
// That is gptq_quantize's blocked loop with the per-column PyTorch ops fused into one launch per tile.
//
// Work split (TPR = threads per row, 4..32, chosen from the row count; NS = TILE/TPR register slots):
//
//   block = 256 threads = 256/TPR rows          one row's tile, TPR = 4:
//     warp 0: lanes 0..TPR-1    -> row 0          column  0 1 2 3 4 5 6 7 8 ...
//             lanes TPR..2TPR-1 -> row 1          lane    0 1 2 3 0 1 2 3 0 ...
//             ...                                 slot    0 0 0 0 1 1 1 1 2 ...
//
//   Column c lives in register slot c / TPR of lane c % TPR: interleaved, so the shrinking set of
//   "columns after c" stays spread over all lanes of the row. The U tile is staged once per block in
//   shared memory, permuted to [U row i][lane][slot], so a lane reads its slots of U row i as 16-byte
//   vectors and every row of the block reads the same addresses (broadcast).
//
// Per column c (the lanes of a row do it redundantly, in lockstep): x = w_c shuffled from its owner;
// q = clamp(round(x / s) + z, 0, maxq) with the group's (or, for a clear column, the high tier's) params;
// e = (x - (q - z) s) / U_cc; every lane updates its slots w_j -= e U_cj. Slots of finished columns are
// updated too (the vector loads start at a multiple of 16 bytes) but read U's zero lower triangle, so they
// keep their values; the owner then stores e in the slot of c and packs the code into a register.
//
// Fidelity: the arithmetic mirrors the PyTorch reference op by op — IEEE division, round half to even, no
// FMA contraction (__fmul_rn & co.: PyTorch runs each op as its own kernel, one rounding each), the scale
// rounded through fp16, x * (1/maxq) where PyTorch's CUDA division by a Python scalar does the same — so
// codes agree with the PyTorch loop up to the rounding of the GEMM and of reductions.

#include <ATen/core/Tensor.h>

#include "check.h"
#include "gptq_tuning.h"
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // the stream at::cuda::getCurrentCUDAStream() returns, without cuBLAS headers
#include <cuda_fp16.h>

#include <optional>
#include <type_traits>

namespace {

constexpr int TILE = 128;   // most columns per tile (the lazy block); gptq_cuda.TILE must agree
constexpr int BLOCK = GPTQ_BLOCK;  // threads per block (gptq_tuning.h)

// IEEE ops that nvcc never contracts into an FMA.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// torch: scale.to(float16).to(dtype); a double goes through float first, as c10::Half does
__device__ __forceinline__ float fp16_round(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ double fp16_round(double x) { return double(__half2float(__float2half_rn(float(x)))); }

template <typename T> struct Vec16;
template <> struct Vec16<float> { using type = float4; };
template <> struct Vec16<double> { using type = double2; };

template <typename T, int N>
__device__ __forceinline__ T vec_at(const typename Vec16<T>::type& v);
template <> __device__ __forceinline__ float vec_at<float, 0>(const float4& v) { return v.x; }
template <> __device__ __forceinline__ float vec_at<float, 1>(const float4& v) { return v.y; }
template <> __device__ __forceinline__ float vec_at<float, 2>(const float4& v) { return v.z; }
template <> __device__ __forceinline__ float vec_at<float, 3>(const float4& v) { return v.w; }
template <> __device__ __forceinline__ double vec_at<double, 0>(const double2& v) { return v.x; }
template <> __device__ __forceinline__ double vec_at<double, 1>(const double2& v) { return v.y; }

// Everything one tile launch needs. Row-major tensors; R = rows of the work matrix, G = groups per row.
template <typename T>
struct TileArgs {
  const T* w;                 // [R, d] working weights, fully updated for columns >= i1 (read only here)
  const T* u;                 // [d, d] upper Cholesky factor of H^-1 (already permuted for act-order)
  uint8_t* codes;             // [R, d] codes of the processed columns
  T* err;                     // [R, TILE] this tile's errors (w - q)/U_cc; scratch for group starts before
  T* scales;                  // [R, G] low-tier scale per group (input with static groups)
  T* zeros;                   // [R, G] low-tier integer zero per group (input with static groups)
  T* hscales;                 // [R] high-tier scale of the clear columns (1 until a unit's odd group)
  T* hzeros;                  // [R] high-tier zero (0 until then)
  T* loss;                    // [R] running sum of e^2 (gptq_loss = sum / 2)
  const uint8_t* clear;       // [units, d] 1 where a column is clear (high tier); nullptr: no clear columns
  const int32_t* high_bits;   // [units] bits of the clear columns; nullptr: low_bits
  const int32_t* col_group;   // [d] static groups: group of each processed column; nullptr: dynamic groups
  int64_t row_lo, row_hi;     // rows [row_lo, row_hi) are active in this tile
  int64_t rows_per_unit;      // k: unit of row r is r / k
  int d, G, i1, width, g, low_bits;
  bool sym, clip;
  T min_scale;                // formats.uniform.MIN_SCALE
  int clip_steps, clip_grid;  // CLIP_MAX_SHRINK * CLIP_GRID shrink steps of 1/CLIP_GRID
  T clip_norm;                // CLIP_NORM
};

template <typename T> struct Params { T scale, zero; };

// formats/uniform.py _params_for_range. On CUDA, PyTorch divides a tensor by a Python number as
// x * (1 / number) (BinaryDivTrueKernel), so (xmax - xmin) / maxq is a multiplication here too.
template <typename T>
__device__ Params<T> params_for_range(T xmin, T xmax, int maxq, bool sym, T min_scale) {
  const T inv = T(1) / T(maxq);
  const T scale = fp16_round(fmax(mul_rn(sub_rn(xmax, xmin), inv), min_scale));
  const T zero = sym ? T((maxq + 1) / 2) : fmin(fmax(rint(div_rn(-xmin, scale)), T(0)), T(maxq));
  return {scale, zero};
}

// uniform_params without the clip search: the range [xmin, xmax] already contains 0.
template <typename T>
__device__ void adjust_range(T& xmin, T& xmax, bool sym) {
  if (sym) {
    xmax = fmax(fabs(xmin), xmax);
    xmin = xmin < T(0) ? -xmax : xmin;
  }
  if (xmin == T(0) && xmax == T(0)) {  // an all-zero group gets [-1, 1]
    xmin = T(-1);
    xmax = T(1);
  }
}

template <typename T>
__device__ __forceinline__ T quantize(T x, T scale, T zero, T maxq) {
  return fmin(fmax(rint(div_rn(x, scale)) + zero, T(0)), maxq);  // round(x/s) + z is exact: integers
}

template <int TPR, typename V>
__device__ __forceinline__ V group_min(V v, unsigned mask) {
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) v = fmin(v, __shfl_xor_sync(mask, v, off, TPR));
  return v;
}
template <int TPR, typename V>
__device__ __forceinline__ V group_max(V v, unsigned mask) {
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) v = fmax(v, __shfl_xor_sync(mask, v, off, TPR));
  return v;
}
template <int TPR, typename V>
__device__ __forceinline__ V group_sum(V v, unsigned mask) {
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) v = add_rn(v, __shfl_xor_sync(mask, v, off, TPR));
  return v;
}

template <typename T> struct GroupParams { T s_lo, z_lo, s_hi, z_hi; bool odd; };

// Params of the group [c, gend) starting at tile column i (c = i1 + i): low tier from the non-clear
// columns, high tier from the clear ones (ooc_gptq), the low tier clip-searched if asked (uniform_params
// with clip_search). The group's current weights: tile columns [i, tend) in `scratch` (dumped by the
// lanes), columns past the tile in `wrow` (only when the group starts the tile: the host guarantees it, so
// those columns carry every earlier update). Kept out of line: it runs once per group.
template <typename T, int TPR>
__device__ __noinline__ GroupParams<T> group_params(const TileArgs<T>& a, const T* scratch, const T* wrow,
                                                    const uint8_t* crow, int i, int tend, int gend, int lane,
                                                    unsigned mask, int maxq_lo, int maxq_hi) {
  // starting at 0 = uniform_params' clamp(min, max=0) / clamp(max, min=0), and = masked_fill(.., 0)
  T lo_min = 0, lo_max = 0, hi_min = 0, hi_max = 0;
  int odd = 0;
  const int tile_end = a.i1 + a.width;
  for (int col = i + lane; col < tend; col += TPR) {
    const T v = scratch[col];
    if (crow != nullptr && crow[a.i1 + col]) {
      hi_min = fmin(hi_min, v); hi_max = fmax(hi_max, v); odd = 1;
    } else {
      lo_min = fmin(lo_min, v); lo_max = fmax(lo_max, v);
    }
  }
  for (int col = tile_end + lane; col < gend; col += TPR) {
    const T v = wrow[col];
    if (crow != nullptr && crow[col]) {
      hi_min = fmin(hi_min, v); hi_max = fmax(hi_max, v); odd = 1;
    } else {
      lo_min = fmin(lo_min, v); lo_max = fmax(lo_max, v);
    }
  }
  lo_min = group_min<TPR>(lo_min, mask);
  lo_max = group_max<TPR>(lo_max, mask);
  adjust_range(lo_min, lo_max, a.sym);
  Params<T> lo = params_for_range(lo_min, lo_max, maxq_lo, a.sym, a.min_scale);
  if (a.clip) {  // shrink the range by 1, 0.99, ..., keep the lowest sum |q(w) - w|^2.4 (strictly lower wins)
    T best = T(INFINITY);
    for (int step = 0; step < a.clip_steps; ++step) {
      const T shrink = T(1.0 - double(step) / double(a.clip_grid));  // Python float, cast by torch
      const Params<T> p = params_for_range(mul_rn(shrink, lo_min), mul_rn(shrink, lo_max), maxq_lo, a.sym,
                                           a.min_scale);
      T sum = 0;
      for (int col = i + lane; col < tend; col += TPR) {
        const T v = scratch[col];
        const T fq = mul_rn(sub_rn(quantize(v, p.scale, p.zero, T(maxq_lo)), p.zero), p.scale);
        sum = add_rn(sum, pow(fabs(sub_rn(fq, v)), a.clip_norm));
      }
      for (int col = tile_end + lane; col < gend; col += TPR) {
        const T v = wrow[col];
        const T fq = mul_rn(sub_rn(quantize(v, p.scale, p.zero, T(maxq_lo)), p.zero), p.scale);
        sum = add_rn(sum, pow(fabs(sub_rn(fq, v)), a.clip_norm));
      }
      sum = group_sum<TPR>(sum, mask);
      if (sum < best) {
        best = sum;
        lo = p;
      }
    }
  }
  GroupParams<T> out{lo.scale, lo.zero, T(1), T(0), false};
  if (__any_sync(mask, odd)) {  // ooc_gptq's `odd`: the group holds a clear column of this unit
    hi_min = group_min<TPR>(hi_min, mask);
    hi_max = group_max<TPR>(hi_max, mask);
    adjust_range(hi_min, hi_max, a.sym);
    const Params<T> hi = params_for_range(hi_min, hi_max, maxq_hi, a.sym, a.min_scale);
    out.s_hi = hi.scale;
    out.z_hi = hi.zero;
    out.odd = true;
  }
  return out;
}

template <int TPR>
__host__ __device__ constexpr int slots() { return TILE / TPR; }
template <typename T, int TPR>
__host__ __device__ constexpr int lane_stride() {  // one lane's run of slots in shared memory, padded against
                                                  // bank conflicts unless a run is exactly one 16-byte vector
  return slots<TPR>() * int(sizeof(T)) == 16 ? slots<TPR>() : slots<TPR>() + 16 / int(sizeof(T));
}
template <typename T, int TPR>
__host__ __device__ constexpr size_t smem_bytes() { return size_t(TILE) * TPR * lane_stride<T, TPR>() * sizeof(T); }

// Resident blocks per SM the registers must allow: GPTQ_MIN_BLOCKS_FP32 (gptq_tuning.h) where they fit
// without spilling (ptxas -v: fp32 with 8+ threads per row fits in 128 registers; fp32 with 4, and fp64,
// would spill), else 1.
template <typename T, int TPR>
__host__ __device__ constexpr int min_blocks() { return sizeof(T) == 4 && TPR >= 8 ? GPTQ_MIN_BLOCKS_FP32 : 1; }

template <typename T, int TPR>
__global__ void __launch_bounds__(BLOCK, min_blocks<T, TPR>()) gptq_tile_kernel(const __grid_constant__ TileArgs<T> a) {
  constexpr int NS = slots<TPR>();
  constexpr int VN = 16 / int(sizeof(T));
  constexpr int LD = lane_stride<T, TPR>();
  using V = typename Vec16<T>::type;
  static_assert(NS % VN == 0 && NS % 4 == 0, "slots must fill whole vectors and code words");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* us = reinterpret_cast<T*>(smem_raw);  // [TILE][TPR][LD]: us[(i*TPR + l)*LD + s] = U[i1+i][i1 + s*TPR + l]
  const int i1 = a.i1, width = a.width, d = a.d;
#pragma unroll 8  // independent loads in flight: the staging is latency-bound otherwise
  for (int idx = threadIdx.x; idx < width * TILE; idx += BLOCK) {
    const int i = idx / TILE, j = idx - i * TILE;
    // the zero lower triangle is what lets finished slots take the update unchanged
    const T v = (j >= i && j < width) ? a.u[int64_t(i1 + i) * d + i1 + j] : T(0);
    us[(i * TPR + j % TPR) * LD + j / TPR] = v;
  }
  __syncthreads();

  const int lane = threadIdx.x % TPR;
  const int64_t row = a.row_lo + (int64_t(blockIdx.x) * BLOCK + threadIdx.x) / TPR;
  if (row >= a.row_hi) return;  // whole row groups leave together; no block barrier follows
  unsigned mask = 0xffffffffu;  // the lanes of this row: shuffles and votes stay inside it
  if constexpr (TPR < 32) mask = ((1u << TPR) - 1u) << ((threadIdx.x % 32) & ~(TPR - 1));

  const int64_t unit = row / a.rows_per_unit;
  const T* wrow = a.w + row * d;
  const uint8_t* crow = a.clear != nullptr ? a.clear + unit * d : nullptr;
  T* scratch = a.err + row * TILE;
  const int maxq_lo = (1 << a.low_bits) - 1;
  const int maxq_hi = a.high_bits != nullptr ? (1 << a.high_bits[unit]) - 1 : maxq_lo;

  T w[NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    const int col = s * TPR + lane;
    w[s] = col < width ? wrow[i1 + col] : T(0);
  }
  uint32_t qp[NS / 4];
#pragma unroll
  for (int s = 0; s < NS / 4; ++s) qp[s] = 0;

  const bool first = i1 == 0;
  T s_hi = first ? T(1) : a.hscales[row];
  T z_hi = first ? T(0) : a.hzeros[row];
  T loss = first ? T(0) : a.loss[row];
  T s_lo = 0, z_lo = 0;
  if (a.col_group == nullptr && i1 % a.g != 0) {  // the group began in an earlier tile
    s_lo = a.scales[row * a.G + i1 / a.g];
    z_lo = a.zeros[row * a.G + i1 / a.g];
  }

#pragma unroll
  for (int s = 0; s < NS; ++s) {
#pragma unroll 1
    for (int l = 0; l < TPR; ++l) {
      const int i = s * TPR + l;
      if (i >= width) break;  // uniform over the block
      const int c = i1 + i;
      if (a.col_group != nullptr) {
        const int j = a.col_group[c];
        s_lo = a.scales[row * a.G + j];
        z_lo = a.zeros[row * a.G + j];
      } else if (c % a.g == 0) {  // a group starts: params from its current weights
        const int gend = min(c + a.g, d);
        const int tend = min(gend - i1, width);
#pragma unroll
        for (int s2 = 0; s2 < NS; ++s2) {
          const int col = s2 * TPR + lane;
          if (col >= i && col < tend) scratch[col] = w[s2];
        }
        __syncwarp(mask);
        const GroupParams<T> p = group_params<T, TPR>(a, scratch, wrow, crow, i, tend, gend, lane, mask, maxq_lo,
                                                      maxq_hi);
        s_lo = p.s_lo;
        z_lo = p.z_lo;
        if (p.odd) {
          s_hi = p.s_hi;
          z_hi = p.z_hi;
        }
        if (lane == 0) {
          a.scales[row * a.G + c / a.g] = s_lo;
          a.zeros[row * a.G + c / a.g] = z_lo;
        }
        __syncwarp(mask);
      }
      const bool is_clear = crow != nullptr && crow[c];
      const T sc = is_clear ? s_hi : s_lo;
      const T zc = is_clear ? z_hi : z_lo;
      const T maxq = T(is_clear ? maxq_hi : maxq_lo);
      const T x = __shfl_sync(mask, w[s], l, TPR);
      const T q = quantize(x, sc, zc, maxq);
      const T e = div_rn(sub_rn(x, mul_rn(sub_rn(q, zc), sc)), us[(i * TPR + l) * LD + s]);
      const T* urow = us + (i * TPR + lane) * LD;
#pragma unroll
      for (int s2 = (s / VN) * VN; s2 < NS; s2 += VN) {
        const V uv = *reinterpret_cast<const V*>(urow + s2);
        w[s2] = sub_rn(w[s2], mul_rn(e, vec_at<T, 0>(uv)));
        w[s2 + 1] = sub_rn(w[s2 + 1], mul_rn(e, vec_at<T, 1>(uv)));
        if constexpr (VN == 4) {
          w[s2 + 2] = sub_rn(w[s2 + 2], mul_rn(e, vec_at<T, 2>(uv)));
          w[s2 + 3] = sub_rn(w[s2 + 3], mul_rn(e, vec_at<T, 3>(uv)));
        }
      }
      if (lane == l) {  // column c is done: its slot keeps the error, its code goes into the packed word
        w[s] = e;
        qp[s / 4] |= uint32_t(q) << (8 * (s % 4));
      }
      loss = add_rn(loss, mul_rn(e, e));
    }
  }

#pragma unroll
  for (int s = 0; s < NS; ++s) {
    const int col = s * TPR + lane;
    if (col < width) {
      scratch[col] = w[s];
      a.codes[row * d + i1 + col] = uint8_t(qp[s / 4] >> (8 * (s % 4)));
    }
  }
  if (lane == 0) {
    a.hscales[row] = s_hi;
    a.hzeros[row] = z_hi;
    a.loss[row] = loss;
  }
}

template <typename T, int TPR>
void launch(const TileArgs<T>& args, int device) {
  constexpr size_t smem = smem_bytes<T, TPR>();
  int smem_max = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  QK_CHECK(smem <= size_t(smem_max), "gptq tile: needs ", smem, " bytes of shared memory per block (dtype size ",
              sizeof(T), ", threads per row ", TPR, "), the device allows ", smem_max,
              "; use more threads per row");
  auto kernel = gptq_tile_kernel<T, TPR>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t threads = (args.row_hi - args.row_lo) * TPR;
  const dim3 grid(unsigned((threads + BLOCK - 1) / BLOCK));
  kernel<<<grid, BLOCK, smem, c10::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Static groups (gptq_quantize with static_groups): the params of every group [j·g, min((j+1)·g, d)) of
// every row of w [R, d], from the weights as they are (formats/uniform.py grouped_uniform_params). One
// row group per TPR lanes, through the same group_params as the tile kernel's dynamic groups: a tile of
// width 0 at column 0 makes it read the whole group from `wrow`. Replaces the PyTorch search's 80 rounds
// of ~10 elementwise kernels over the whole matrix with one read of it.
template <typename T, int TPR>
__global__ void __launch_bounds__(BLOCK) gptq_group_params_kernel(const __grid_constant__ TileArgs<T> a,
                                                                 int64_t rows) {
  const int lane = threadIdx.x % TPR;
  const int64_t item = (int64_t(blockIdx.x) * BLOCK + threadIdx.x) / TPR;  // row * G + group
  if (item >= rows * a.G) return;  // a row group's lanes leave together
  unsigned mask = 0xffffffffu;
  if constexpr (TPR < 32) mask = ((1u << TPR) - 1u) << ((threadIdx.x % 32) & ~(TPR - 1));
  const int64_t row = item / a.G;
  const int j = int(item - row * a.G);
  const T* wrow = a.w + row * a.d + int64_t(j) * a.g;
  const int width = min(a.g, a.d - j * a.g);
  const int maxq = (1 << a.low_bits) - 1;
  const GroupParams<T> p = group_params<T, TPR>(a, nullptr, wrow, nullptr, 0, 0, width, lane, mask, maxq, maxq);
  if (lane == 0) {
    a.scales[item] = p.s_lo;
    a.zeros[item] = p.z_lo;
  }
}

template <typename T, int TPR>
void launch_group_params(const TileArgs<T>& args, int64_t rows) {
  const int64_t threads = rows * args.G * TPR;
  const dim3 grid(unsigned((threads + BLOCK - 1) / BLOCK));
  gptq_group_params_kernel<T, TPR><<<grid, BLOCK, 0, c10::cuda::getCurrentCUDAStream()>>>(args, rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_tpr(const TileArgs<T>& args, int64_t tpr, int device) {
  switch (tpr) {
    case 4: launch<T, 4>(args, device); break;
    case 8: launch<T, 8>(args, device); break;
    case 16: launch<T, 16>(args, device); break;
    case 32: launch<T, 32>(args, device); break;
    default: QK_CHECK(false, "gptq tile: threads per row must be 4, 8, 16 or 32, got ", tpr);
  }
}

// `op` names the entry point in every message ("gptq tile", "gptq group params").
void check_tensor(const char* op, const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                  const at::Device& device) {
  QK_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), ", w is on ", device);
  QK_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  QK_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  QK_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The work matrix both entry points take: a 2-D float32 / float64 CUDA tensor narrower than 2^31 columns, and the
// bit-width of its codes.
void check_weight(const char* op, const at::Tensor& w, int64_t bits) {
  QK_CHECK(w.is_cuda() && w.dim() == 2, op, ": w must be a 2-D CUDA tensor, got ", w.sizes(), " on ", w.device());
  QK_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble, op, ": w must be float32 or float64, got ",
           w.scalar_type());
  QK_CHECK(w.size(1) >= 1 && w.size(1) < (int64_t(1) << 31), op, ": bad width d=", w.size(1));
  QK_CHECK(bits >= 2 && bits <= 8, op, ": bits must be in 2..8, got ", bits);
}

// The quantizer's settings, the same in both entry points.
struct QuantizerSettings {
  int64_t bits;
  bool sym, clip;
  double min_scale;
  int64_t clip_steps, clip_grid;
  double clip_norm;

  template <typename T>
  void into(TileArgs<T>& a) const {
    a.low_bits = int(bits);
    a.sym = sym;
    a.clip = clip;
    a.min_scale = T(min_scale);
    a.clip_steps = int(clip_steps);
    a.clip_grid = int(clip_grid);
    a.clip_norm = T(clip_norm);
  }
};

// The arguments both entry points fill alike: w, the group parameters and their layout, the quantizer
template <typename T>
TileArgs<T> common_args(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, int64_t G, int64_t g,
                        const QuantizerSettings& quantizer) {
  TileArgs<T> a{};
  a.w = w.data_ptr<T>();
  a.scales = scales.data_ptr<T>();
  a.zeros = zeros.data_ptr<T>();
  a.d = int(w.size(1));
  a.G = int(G);
  a.g = int(std::min<int64_t>(g, w.size(1)));
  quantizer.into(a);
  return a;
}

// f(static_cast<T*>(nullptr)) with T = w's element type (float or double)
template <typename F>
void with_element_type(const at::Tensor& w, F&& f) {
  if (w.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<double*>(nullptr));
  }
}

}  // namespace

// One tile of the column loop for rows [row_lo, row_hi) of the work matrix w [R, d]: columns
// [i1, i2), i2 - i1 <= 128. See TileArgs for every tensor. A dynamic group that starts inside the tile
// must end inside it (gptq_cuda.tile_plan cuts tiles so); one that starts at i1 may run past i2.
void gptq_tile(const at::Tensor& w, const at::Tensor& u, const at::Tensor& codes, const at::Tensor& err,
               const at::Tensor& scales, const at::Tensor& zeros, const at::Tensor& hscales,
               const at::Tensor& hzeros, const at::Tensor& loss, const std::optional<at::Tensor>& clear,
               const std::optional<at::Tensor>& high_bits, const std::optional<at::Tensor>& col_group,
               int64_t row_lo, int64_t row_hi, int64_t rows_per_unit, int64_t i1, int64_t i2, int64_t g,
               int64_t low_bits, bool sym, bool clip, double min_scale, int64_t clip_steps, int64_t clip_grid,
               double clip_norm, int64_t tpr) {
  constexpr const char* op = "gptq tile";
  check_weight(op, w, low_bits);
  const int64_t R = w.size(0), d = w.size(1);
  QK_CHECK(g >= 1, "gptq tile: group size must be >= 1, got ", g);
  QK_CHECK(0 <= i1 && i1 < i2 && i2 <= d && i2 - i1 <= TILE, "gptq tile: columns [", i1, ", ", i2,
              ") must be a non-empty range of at most ", TILE, " inside [0, ", d, ")");
  QK_CHECK(0 <= row_lo && row_lo <= row_hi && row_hi <= R, "gptq tile: rows [", row_lo, ", ", row_hi,
              ") outside [0, ", R, ")");
  QK_CHECK(rows_per_unit >= 1 && R % rows_per_unit == 0, "gptq tile: ", R, " rows are not whole units of ",
              rows_per_unit);
  const auto dtype = w.scalar_type();
  const auto device = w.device();
  const int64_t G = scales.dim() == 2 ? scales.size(1) : -1;
  check_tensor(op, w, "w", dtype, {R, d}, device);
  check_tensor(op, u, "u", dtype, {d, d}, device);
  check_tensor(op, codes, "codes", at::kByte, {R, d}, device);
  check_tensor(op, err, "err", dtype, {R, TILE}, device);
  check_tensor(op, scales, "scales", dtype, {R, G}, device);
  check_tensor(op, zeros, "zeros", dtype, {R, G}, device);
  check_tensor(op, hscales, "hscales", dtype, {R}, device);
  check_tensor(op, hzeros, "hzeros", dtype, {R}, device);
  check_tensor(op, loss, "loss", dtype, {R}, device);
  const int64_t units = R / rows_per_unit;
  if (clear) check_tensor(op, *clear, "clear", at::kByte, {units, d}, device);
  if (high_bits) check_tensor(op, *high_bits, "high_bits", at::kInt, {units}, device);
  if (col_group) {
    check_tensor(op, *col_group, "col_group", at::kInt, {d}, device);
    QK_CHECK(!clear && !clip, "gptq tile: static groups take no clear columns and no clip search "
                "(their params come precomputed)");
  } else {
    QK_CHECK(G == (d + g - 1) / g, "gptq tile: scales must have ceil(d/g) = ", (d + g - 1) / g,
                " groups for d=", d, ", g=", g, ", got ", G);
    const int64_t last = ((i2 - 1) / g) * g;  // the last group start at or before i2 - 1
    QK_CHECK(last <= i1 || std::min(last + g, d) <= i2, "gptq tile: the group starting at column ", last,
                " runs past the tile end ", i2, "; a group may only cross a tile end when it starts the tile");
  }
  QK_CHECK(!(clip && clear), "gptq tile: the clip search is for plain GPTQ, not with clear columns");
  if (row_lo == row_hi) return;
  const c10::cuda::CUDAGuard guard(device);
  const QuantizerSettings quantizer{low_bits, sym, clip, min_scale, clip_steps, clip_grid, clip_norm};
  with_element_type(w, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TileArgs<T> a = common_args<T>(w, scales, zeros, G, g, quantizer);
    a.u = u.data_ptr<T>();
    a.codes = codes.data_ptr<uint8_t>();
    a.err = err.data_ptr<T>();
    a.hscales = hscales.data_ptr<T>();
    a.hzeros = hzeros.data_ptr<T>();
    a.loss = loss.data_ptr<T>();
    a.clear = clear ? clear->data_ptr<uint8_t>() : nullptr;
    a.high_bits = high_bits ? high_bits->data_ptr<int32_t>() : nullptr;
    a.col_group = col_group ? col_group->data_ptr<int32_t>() : nullptr;
    a.row_lo = row_lo;
    a.row_hi = row_hi;
    a.rows_per_unit = rows_per_unit;
    a.i1 = int(i1);
    a.width = int(i2 - i1);
    dispatch_tpr<T>(a, tpr, device.index());
  });
}

// Scales and zeros [R, G] of every group of g columns of w [R, d] (the last group may be shorter), clip-searched
// if asked: grouped_uniform_params' values up to the order of the search's sums.
void gptq_group_params(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, int64_t g,
                       int64_t bits, bool sym, bool clip, double min_scale, int64_t clip_steps, int64_t clip_grid,
                       double clip_norm, int64_t tpr) {
  constexpr const char* op = "gptq group params";
  check_weight(op, w, bits);
  const int64_t R = w.size(0), d = w.size(1);
  QK_CHECK(g >= 1 && g <= d, "gptq group params: group size must be in 1..", d, ", got ", g);
  const int64_t G = (d + g - 1) / g;
  check_tensor(op, scales, "scales", w.scalar_type(), {R, G}, w.device());
  check_tensor(op, zeros, "zeros", w.scalar_type(), {R, G}, w.device());
  QK_CHECK(w.is_contiguous(), "gptq group params: w must be contiguous");
  if (R == 0) return;
  const c10::cuda::CUDAGuard guard(w.device());
  const QuantizerSettings quantizer{bits, sym, clip, min_scale, clip_steps, clip_grid, clip_norm};
  with_element_type(w, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const TileArgs<T> a = common_args<T>(w, scales, zeros, G, g, quantizer);
    switch (tpr) {
      case 8: launch_group_params<T, 8>(a, R); break;
      case 16: launch_group_params<T, 16>(a, R); break;
      case 32: launch_group_params<T, 32>(a, R); break;
      default: QK_CHECK(false, "gptq group params: threads per group must be 8, 16 or 32, got ", tpr);
    }
  });
}
