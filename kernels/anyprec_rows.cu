// The row-per-lane any-precision matvec kernel (FLAG_ROWS, widths 4..8; design in anyprec_rows.cuh), its
// instances and launch. Reached through anyprec.cu's launch_matvec, which has checked the arguments.
//
// A block covers 64 rows and, with a split of s > 1, every s-th run of WARPS words of them: the s blocks of a
// thread-block cluster (sm_90) share the rows, and the first adds the others' partial sums through
// distributed shared memory, so shapes with few rows still fill the GPU without a second kernel or atomics.

#include <cooperative_groups.h>

#include "kernel_attrs.h"

#include "anyprec_matvec_kernel.cuh"
#include "anyprec_launch.cuh"
#include "anyprec_rows.cuh"

namespace anyprec {

template <int K, typename T, int NB, int FLAGS>
__global__ void __launch_bounds__((RowsConfig<K, NB, FLAGS>::THREADS), (RowsConfig<K, NB, FLAGS>::MIN_BLOCKS))
    rows_kernel(const MatvecArgs args) {
  using C = RowsConfig<K, NB, FLAGS>;
  constexpr int S = C::STAGES, NBG = C::NBG;
  // the table: dynamic and aligned where lookups or its address in (TABLE_OR), dynamic past the ring with PAIRS, else
  // static (at batch 8 the compiler then folds its address into the lookups' uniform-register operand)
  __shared__ __align__(16) uint32_t static_table[C::DYNAMIC_TABLE ? 4 : C::TABLE_WORDS];
  extern __shared__ __align__(16) unsigned char ring_smem[];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring_smem));
  const uint32_t table_off = rows_table_offset<K, NB, FLAGS>(smem_base);
  uint32_t* table = C::DYNAMIC_TABLE ? reinterpret_cast<uint32_t*>(ring_smem + table_off) : static_table;
  qk::allow_next_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int M = args.M, W = args.W, split = gridDim.y, rank = blockIdx.y;
  const int row0 = 64 * blockIdx.x, groups = 2 * ((M + 63) / 64);
  // words of this warp: first, first + stride, ... below W
  const int first = warp + C::WARPS * rank, stride = C::WARPS * split;
  const int steps = first < W ? (W - first + stride - 1) / stride : 0;

  unsigned char* ring = ring_smem + warp * C::WARP_RING_BYTES;
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 4;
  // the chunks this lane copies per step: chunk c = lane + 32i -> line c / 8 = (plane, group), piece c % 8;
  // offsets in words without the step's word (32-bit: the host checks the planes' size)
  constexpr int MINE = (C::CHUNKS + 31) / 32;
  uint32_t src_off[MINE];
#pragma unroll
  for (int i = 0; i < MINE; ++i) {
    const int c = lane + 32 * i, line = c >> 3, p = line >> 1, h = line & 1;
    src_off[i] = (uint32_t(p * groups + 2 * blockIdx.x + h) * uint32_t(args.wstride)) * 32u + uint32_t(c & 7) * 4u;
  }
  auto issue = [&](int step, int stage) {
    const uint32_t word_off = uint32_t(first + stride * step) * 32u;
#pragma unroll
    for (int i = 0; i < MINE; ++i) {
      const int c = lane + 32 * i;
      if (C::CHUNKS % 32 == 0 || c < C::CHUNKS)
        qk::copy_async<16>(ring + stage * C::STEP_BYTES + c * 16, args.planes + src_off[i] + word_off, true);
    }
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < steps) issue(s, s);
    qk::commit_async();
  }

  const uint16_t* lut = args.lut;
  if constexpr (C::PAIRS) {
    for (int i = threadIdx.x; i < 2 * 32 * 16; i += C::THREADS)
      rows_pair_table_fill<T>(lut, row0, M, i, [&](int word, uint32_t v) { table[word] = v; });
  } else {
    for (int i = threadIdx.x; i < (1 << K) / 8 * 32; i += C::THREADS)
      rows_table_fill<K, T>(lut, row0, M, i, [&](int word, uint32_t v) { table[word] = v; });
  }
  __syncthreads();
  qk::wait_prior_grid();  // planes and tables are the weights; x and out belong to earlier kernels

  // x: the batch rows this lane passes in its A fragments (rows_xrows)
  const T* x = static_cast<const T*>(args.x);
  bool on_a[NBG], on_b[NBG];
  const T* xa[NBG];
  const T* xb[NBG];
#pragma unroll
  for (int bg = 0; bg < NBG; ++bg) {
    int ra, rb;
    rows_xrows(lane, bg, args.B, NB, ra, rb);
    on_a[bg] = ra >= 0;
    on_b[bg] = rb >= 0;
    xa[bg] = x + size_t(on_a[bg] ? ra : 0) * args.ldx;
    xb[bg] = x + size_t(on_b[bg] ? rb : 0) * args.ldx;
  }
  const uint32_t table_addr = C::DYNAMIC_TABLE ? smem_base + table_off : 0u;
  const uint32_t lane_addr = C::TABLE_OR ? table_addr | uint32_t(lane) * 4u : uint32_t(lane) * 4u;
  const uint32_t pair_off[2] = {uint32_t(lane) * 4u, uint32_t(lane) * 4u + 128u};  // PAIRS: rows l and 32 + l
  const char* table_bytes = reinterpret_cast<const char*>(table);
  // TABLE_OR: a window address; PAIRS: a byte offset into the dynamic table; else into the static table
  auto lookup = [&](uint32_t addr) {
    if constexpr (C::PAIRS) return *reinterpret_cast<const uint32_t*>(ring_smem + table_off + addr);
    return C::TABLE_OR ? lds32(addr) : *reinterpret_cast<const uint32_t*>(table_bytes + addr);
  };

  float acc[2][C::SETS][4] = {};
  int stage = 0;
  for (int s = 0; s < steps; ++s) {
    qk::wait_async<S - 2>();  // this lane's copies of step s have landed
    __syncwarp();             // ... and every other lane's; the stage step s - 1 used is free
    if (s + S - 1 < steps) issue(s + S - 1, stage == 0 ? S - 1 : stage - 1);
    qk::commit_async();
    uint32_t R[2][K];
#pragma unroll
    for (int p = 0; p < K; ++p)
#pragma unroll
      for (int h = 0; h < 2; ++h) R[h][p] = lds32(ring_addr + stage * C::STEP_BYTES + (p * 2 + h) * 128);
    const int w = first + stride * s;
    if constexpr (C::PAIRS) {
      // x per two U words: columns 8q..8q + 7 and 16 more (q = p / 2) of each batch-row source, A fragments by PRMT.
      // Up to batch 4, lanes without a batch row read kZeroX: one select per word instead of zeroing registers before
      // predicated loads (at batch 8 the compiler then branches around the loads, 10 % more instructions)
      constexpr bool PREDICATED = NB == 8;
      const T* zeros = reinterpret_cast<const T*>(kZeroX);
      const T* xwa[NBG];
      const T* xwb[NBG];
      bool la[NBG], lb[NBG];
#pragma unroll
      for (int bg = 0; bg < NBG; ++bg) {
        xwa[bg] = PREDICATED || on_a[bg] ? xa[bg] + 32 * w : zeros;
        xwb[bg] = PREDICATED || on_b[bg] ? xb[bg] + 32 * w : zeros;
        la[bg] = !PREDICATED || on_a[bg];
        lb[bg] = !PREDICATED || on_b[bg];
      }
      uint32_t lo[NBG][2][4], hi[NBG][2][4];
      rows_decode_pairs(R, pair_off, lookup, [&](int p, int ii, const uint32_t (&b)[2][2]) {
        if ((p & 1) == 0 && ii == 0) {
#pragma unroll
          for (int bg = 0; bg < NBG; ++bg) {
            rows_xquad(xwa[bg], la[bg], p >> 1, lo[bg][0]);
            rows_xquad(xwa[bg], la[bg], (p >> 1) + 2, hi[bg][0]);
            if constexpr (NB >= 4) {
              rows_xquad(xwb[bg], lb[bg], p >> 1, lo[bg][1]);
              rows_xquad(xwb[bg], lb[bg], (p >> 1) + 2, hi[bg][1]);
            }
          }
        }
#pragma unroll
        for (int bg = 0; bg < NBG; ++bg) {
          uint32_t a[4];
          rows_pair_afrag(lo[bg][0], hi[bg][0], p, ii, a[0], a[2]);
          if constexpr (NB >= 4) {
            rows_pair_afrag(lo[bg][1], hi[bg][1], p, ii, a[1], a[3]);
          } else {  // batch class 2: rows 8-15 of D (batch rows 2-3) are never read, so a1 / a3 hold whatever their
            asm("" : "=r"(a[1]), "=r"(a[3]));  // registers do: zeros would cost two moves per mma
          }
          mma16816<T>(acc[0][bg], a, b[0][0], b[0][1]);
          mma16816<T>(acc[1][bg], a, b[1][0], b[1][1]);
        }
      });
    } else if constexpr (NB == 2) {
      // the word's x of batch row ra, its 16-byte loads the A fragments as they stand (rows_aquad_of)
      uint32_t va[16];
      rows_xword(xa[0] + 32 * w, on_a[0], va);
      rows_decode_word<K, C::TABLE_OR>(R, lane_addr, args.pow2, lookup, [&](int j, const uint32_t (&b)[2][2]) {
        uint32_t a[4];
        rows_aquad_of(va, j, a);
        mma16816<T>(acc[0][j & 1], a, b[0][0], b[0][1]);
        mma16816<T>(acc[1][j & 1], a, b[1][0], b[1][1]);
      });
    } else if constexpr (NB == 4) {
      // the word's x, loaded once: batch rows ra (a0 / a2) and rb (a1 / a3)
      uint32_t va[16], vb[16];
      rows_xword(xa[0] + 32 * w, on_a[0], va);
      rows_xword(xb[0] + 32 * w, on_b[0], vb);
      rows_decode_word<K, C::TABLE_OR>(R, lane_addr, args.pow2, lookup, [&](int j, const uint32_t (&b)[2][2]) {
        uint32_t a[4];
        rows_afrag_of(va, j, a[0], a[2]);
        rows_afrag_of(vb, j, a[1], a[3]);
        mma16816<T>(acc[0][0], a, b[0][0], b[0][1]);
        mma16816<T>(acc[1][0], a, b[1][0], b[1][1]);
      });
    } else {
      // x per pair of merged words (16 bytes per batch row: 16 more registers, not 64)
      uint32_t qa[NBG][4], qb[NBG][4];
      rows_decode_word<K, C::TABLE_OR>(R, lane_addr, args.pow2, lookup, [&](int j, const uint32_t (&b)[2][2]) {
        if ((j & 1) == 0) {
#pragma unroll
          for (int bg = 0; bg < NBG; ++bg) {
            rows_xquad(xa[bg] + 32 * w, on_a[bg], j >> 1, qa[bg]);
            rows_xquad(xb[bg] + 32 * w, on_b[bg], j >> 1, qb[bg]);
          }
        }
#pragma unroll
        for (int bg = 0; bg < NBG; ++bg) {
          uint32_t a[4];
          rows_afrag_quad(qa[bg], j, a[0], a[2]);
          rows_afrag_quad(qb[bg], j, a[1], a[3]);
          mma16816<T>(acc[0][bg], a, b[0][0], b[0][1]);
          mma16816<T>(acc[1][bg], a, b[1][0], b[1][1]);
        }
      });
    }
    stage = stage + 1 == S ? 0 : stage + 1;
  }
  qk::wait_async<0>();
  if constexpr (NB == 2 && !C::PAIRS) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the odd merged words' sums sit in rows 8-15 of the second accumulator
      acc[h][0][0] += acc[h][1][2];
      acc[h][0][1] += acc[h][1][3];
    }
  }
  __syncthreads();  // every warp is done with the ring and the table

  // the warps' partial sums: [warp][h][bg][lane] float4, over the ring
  float4* red = reinterpret_cast<float4*>(ring_smem);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int bg = 0; bg < NBG; ++bg)
      red[((warp * 2 + h) * NBG + bg) * 32 + lane] = make_float4(acc[h][bg][0], acc[h][bg][1], acc[h][bg][2], acc[h][bg][3]);
  __syncthreads();
  const float* redf = reinterpret_cast<const float*>(red);
  float* part = reinterpret_cast<float*>(table);  // this block's sums, read by the cluster's first block
  T* out = static_cast<T*>(args.out);
  const T* bias = static_cast<const T*>(args.bias);
  const int items = 64 * args.B;  // item o: row 32h + l (o % 64), batch o / 64
  for (int o = threadIdx.x; o < items; o += C::THREADS) {
    const int r64 = o & 63, b = o >> 6, h = r64 >> 5;
    const RowsSource src = rows_source(r64 & 31, b);
    float sum = 0.f;
#pragma unroll
    for (int wp = 0; wp < C::WARPS; ++wp) sum += redf[(((wp * 2 + h) * NBG + (b >> 2)) * 32 + src.src_lane) * 4 + src.e];
    part[o] = sum;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  if (split > 1) cg::this_cluster().sync();  // every block's sums are in its shared memory
#endif
  if (rank == 0) {
    for (int o = threadIdx.x; o < items; o += C::THREADS) {
      const int row = row0 + (o & 63);
      if (row >= M) continue;
      float sum = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (split > 1) {
        for (int r = 0; r < split; ++r) sum += cg::this_cluster().map_shared_rank(part, r)[o];
      } else {
        sum = part[o];
      }
#else
      sum = part[o];
#endif
      if (bias != nullptr) sum += to_float<T>(bias[row]);
      out[size_t(o >> 6) * M + row] = from_float<T>(sum);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split > 1) cg::this_cluster().sync();  // the others' shared memory stays until the first has read it
#endif
}

template <typename T, int K, int NB, int FLAGS>
int launch_rows_instance(int split, const MatvecArgs& a, const Launch& on) {
  using C = RowsConfig<K, NB, FLAGS>;
  auto kernel = rows_kernel<K, T, NB, FLAGS>;
  constexpr int block_bytes = C::DYN_BYTES + (C::DYNAMIC_TABLE ? 16 : C::TABLE_BYTES) + 1024;
  const int carveout = std::min(100, (100 * C::MIN_BLOCKS * block_bytes + 228 * 1024 - 1) / (228 * 1024));
  if (qk::configure_once<rows_kernel<K, T, NB, FLAGS>>(C::DYN_BYTES, carveout) != cudaSuccess) return kLaunchFailed;
  cudaLaunchAttribute attributes[2] = {};
  int n = 0;
  if (on.overlap && qk::overlap_supported<rows_kernel<K, T, NB, FLAGS>>(on.device)) {
    attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (split > 1) {
    attributes[n].id = cudaLaunchAttributeClusterDimension;
    attributes[n].val.clusterDim.x = 1;
    attributes[n].val.clusterDim.y = unsigned(split);
    attributes[n].val.clusterDim.z = 1;
    ++n;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned((a.M + 63) / 64), unsigned(split));
  config.blockDim = dim3(C::THREADS);
  config.dynamicSmemBytes = C::DYN_BYTES;
  config.stream = on.stream;
  config.attrs = attributes;
  config.numAttrs = n;
  on.error = cudaLaunchKernelEx(&config, kernel, a);
  if (on.error != cudaSuccess) (void)cudaGetLastError();
  return on.error == cudaSuccess ? kOk : kLaunchFailed;
}

template <typename T, int NB, int FLAGS>
int launch_rows_k(int k, int split, const MatvecArgs& a, const Launch& on) {
  if constexpr ((FLAGS & FLAG_CODE_PAIRS) != 0) {
    return k == 4 ? launch_rows_instance<T, 4, NB, FLAGS>(split, a, on) : kUnsupported;
  } else {
    switch (k) {
      case 4: return launch_rows_instance<T, 4, NB, FLAGS>(split, a, on);
      case 5: return launch_rows_instance<T, 5, NB, FLAGS>(split, a, on);
      case 6: return launch_rows_instance<T, 6, NB, FLAGS>(split, a, on);
      case 7: return launch_rows_instance<T, 7, NB, FLAGS>(split, a, on);
      case 8: return launch_rows_instance<T, 8, NB, FLAGS>(split, a, on);
      default: return kUnsupported;
    }
  }
}

template <typename T, int FLAGS>
int launch_rows_flags(int k, int split, const MatvecArgs& a, const Launch& on) {
  switch (rows_batch_class(a.B)) {
    case 2: return launch_rows_k<T, 2, FLAGS>(k, split, a, on);
    case 4: return launch_rows_k<T, 4, FLAGS>(k, split, a, on);
    default: return launch_rows_k<T, 8, FLAGS>(k, split, a, on);
  }
}

// dtype: 0 = fp16, 1 = bf16; flags normalised; split = blocks per cluster (the op's `tiles`)
int launch_matvec_rows(int dtype, int k, int split, int flags, const MatvecArgs& a, const Launch& on) {
  if (!rows_rule(k, split, flags)) return kUnsupported;
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0 || a.ldx % 8 != 0) return kBadArgs;  // 16-byte x loads
  if (split > 1) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, on.device) != cudaSuccess || major < 9)
      return kUnsupported;  // clusters need sm_90
  }
  constexpr int occ = 7 | FLAG_ROWS | FLAG_OCC, pairs = 7 | FLAG_ROWS | FLAG_CODE_PAIRS;
  if (flags == pairs)
    return dtype == 0 ? launch_rows_flags<__half, pairs>(k, split, a, on)
                      : launch_rows_flags<__nv_bfloat16, pairs>(k, split, a, on);
  if (flags == occ)
    return dtype == 0 ? launch_rows_flags<__half, occ>(k, split, a, on) : launch_rows_flags<__nv_bfloat16, occ>(k, split, a, on);
  return dtype == 0 ? launch_rows_flags<__half, 7 | FLAG_ROWS>(k, split, a, on)
                    : launch_rows_flags<__nv_bfloat16, 7 | FLAG_ROWS>(k, split, a, on);
}

}  // namespace anyprec
