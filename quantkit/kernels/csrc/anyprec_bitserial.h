// Bit-serial any-precision matvec (flag POPC): batch 1, k <= 3, on the binary tensor cores.
// Included by anyprec.cu inside namespace anyprec (it uses kWarps, kThreads, pi, rotr, lut_row,
// centroid_bits, to_float, from_float).
//
// Why: the table-lookup kernel spends ~1.8 integer-ALU instructions per weight at k = 3 rebuilding
// codes and looking centroids up (BENCHMARKS.md, issue 9), which caps it near 3x cuBLAS fp16. Here
// no weight is decoded at all:
//
//   1. A row's centroid as a function of its code bits u_0..u_{k-1} (u_p = bit of plane p) is a
//      multilinear polynomial, c(u) = sum_S a_S prod_{p in S} u_p over the 2^k subsets S of planes,
//      with a_S the Moebius transform of the 2^k centroids. So
//          y_r = a_0(r) * sum(x) + sum_{S != 0} a_S(r) * (P_S x)_r,   P_S = AND of the planes in S,
//      2^k - 1 binary matvecs on words read straight from the planes (one LOP3 per product word).
//   2. x is taken over a block's span of columns as 24-bit two's-complement integers x_q = x * 2^e
//      (e from the span's largest |x|, so that one is 2^22 at most; integer arithmetic on the float's
//      bits, rounding the last kept bit). Bit b of x_q over 256 columns is column b of the B operand
//      of mma.m16n8k256.b1.and.popc, so one mma gives, for 16 rows, popc(P_S & X_b) for 8 bit planes
//      b; 3 mmas cover the 24 bits and
//          (P_S x_q)_r = sum_b w_b popc(P_S[r] & X_b),   w_b = 2^b (b < 23), w_23 = -2^23.
//   3. At k = 3 a 16 x 512 step of a warp costs 7 products x 3 bit groups x 2 halves = 42 binary
//      mmas, some LOP3 and integer adds, and no table (about 300 instructions per 8192 weights,
//      against ~1.8 ALU instructions per weight in the table kernel).
//
// Work split: a warp takes 16-row tiles and a span of `span` steps of 512 columns (the row's
// `splits` spans; block b takes span b % splits). The grid is one wave of resident blocks; the warps
// of a block take neighbouring tiles, and each warp walks its tiles tile0, tile0 + stride, ... and
// the span's steps of each, its plane words streaming through a ring of kPopcStages steps in shared
// memory (cp.async) across tile boundaries; lanes t = 0..3 of a row copy 16 bytes each, 64 bytes per
// row, plane and step. The block first turns x over its span into bit planes in shared memory (each
// warp transposes words warp, warp + 8, ... as 32 x 32 bit matrices, transpose_bits). Lane (g, t)
// holds rows g and g + 8 of the tile and words 4t..4t+3 of a step; mma half h takes words 4t+2h
// (the mma's k-slots 32t..) and 4t+2h+1 (k-slots 128+32t..), the b1 fragment layout of the PTX ISA,
// and x's B fragments are read from the same words. With one split a warp writes its rows of y; with
// more it adds them into an fp32 workspace, and the split that completes a tile (tile counter, as
// lutgemm.cu) adds the bias, writes y and zeroes the workspace for the next launch.
//
// Bit order: planes in the kernel layout are rotated by their index (plane p's bit s holds column
// pi((s - p) mod 32)); rotating plane p right by p aligns it with plane 0, whose bit s is column pi(s).
// The x bit planes are built in plane 0's order (lane j of the transposed matrix holds column pi(j)).

constexpr int kPopcStepWords = 16;  // 512 columns per step: two mma k-steps
constexpr int kPopcStages = 4;      // ring depth: steps of plane words in flight per warp
constexpr int kPopcMaxSpan = 8;     // steps per span at most (x bit planes in shared memory)
constexpr int kPopcXBits = 24;      // x_q: 24-bit two's complement
constexpr int kPopcMaxK = 3;
// shared row of one x bit plane: the span's words, padded by 16 so that the two bit planes a quarter
// warp reads (g, g + 1) fall in different banks
constexpr int kPopcXStride = kPopcMaxSpan * kPopcStepWords + 16;

struct PopcArgs {
  const void* x;           // T [1, >= 32 * W], zero past in_features
  const uint32_t* planes;  // kernel layout, int32 [>= K, M, wstride]
  int M, W, wstride;
  const uint16_t* lut;     // fp16 [M, 2^K]
  const void* bias;        // T [M] or nullptr
  void* out;               // T [1, M]
  float* ws;               // fp32 [M], zero between launches (splits > 1)
  int* counters;           // [ceil(M / 16)], zero between launches (splits > 1)
  int steps;               // ceil(W / kPopcStepWords)
  int span;                // steps per span, <= kPopcMaxSpan (popc_split)
  int splits;              // ceil(steps / span)
};

// int32 elements of the workspace for M rows: M fp32 sums, then one counter per 16-row tile
inline int64_t popc_workspace_elems(int64_t M) { return M + (M + 15) / 16; }

// d += popc(A & B) for a 16 x 256 bit tile A (rows g, g+8; k-slots 32t.., 128+32t..) and B = 8 bit columns
__device__ __forceinline__ void mma_b1(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Exponent field (fp32 bias, at least 1) of |v|'s bits: shared per block as the scale of x_q.
__device__ __forceinline__ int exponent_field(uint32_t abs_bits) { return max(int(abs_bits >> 23), 1); }

// round(v * 2^(148 - e_max)) for |v| < 2^(e_max - 126), by integer shifts of v's significand
// (no float overflow for any e_max); |result| <= 2^22.
__device__ __forceinline__ int fixed_point(float v, int e_max) {
  const uint32_t bits = __float_as_uint(v), abs_bits = bits & 0x7FFFFFFFu;
  const int e = exponent_field(abs_bits);
  const uint32_t sig = (abs_bits & 0x7FFFFFu) | (abs_bits >= 0x00800000u ? 0x800000u : 0u);
  const int shift = e_max + 2 - e;  // >= 2
  const int mag = shift > 25 ? 0 : int((sig + (1u << (shift - 1))) >> shift);
  return (bits >> 31) ? -mag : mag;
}

// The 32 x 32 bit matrix whose row j is lane j's v, transposed: lane b gets the word whose bit j is
// bit b of lane j's v. Five block swaps (16, 8, 4, 2, 1): at size s, a lane keeps its own half of
// each 2s-bit group and takes the other half from lane ^ s, rotated into place (right by s in the
// lanes with bit s, left in the others), one shuffle, one funnel shift and one LOP3 per stage.
__device__ __forceinline__ uint32_t transpose_bits(uint32_t v, int lane) {
  constexpr uint32_t kLow[5] = {0x0000FFFFu, 0x00FF00FFu, 0x0F0F0F0Fu, 0x33333333u, 0x55555555u};
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int s = 16 >> i;
    const bool upper = lane & s;
    const uint32_t keep = upper ? ~kLow[i] : kLow[i];
    const uint32_t other = rotr(__shfl_xor_sync(0xFFFFFFFFu, v, s), upper ? s : 32 - s);
    v = (v & keep) | (other & ~keep);
  }
  return v;
}

// a_S for the 2^K subsets S of planes (bit p of S = plane p) from a row's centroids lut[code], code
// = sum_{p in S} 2^(K-1-p) (plane 0 is the code's most significant bit), each first rounded to T
// as the other kernels and the reference path use them.
template <int K, typename T>
__device__ __forceinline__ void moebius(const uint4& row, float (&a)[1 << K]) {
  const uint32_t w[4] = {row.x, row.y, row.z, row.w};
#pragma unroll
  for (int s = 0; s < (1 << K); ++s) {
    // bitrev(s, K), spelt out so that it folds to a constant in the unrolled loop (w stays in registers)
    const int code = K == 1 ? s : K == 2 ? ((s & 1) << 1) | (s >> 1) : ((s & 1) << 2) | (s & 2) | (s >> 2);
    const uint16_t bits = centroid_bits<T>(uint16_t(w[code >> 1] >> (16 * (code & 1))));
    if constexpr (std::is_same<T, __half>::value) a[s] = __half2float(__ushort_as_half(bits));
    else a[s] = __uint_as_float(uint32_t(bits) << 16);
  }
#pragma unroll
  for (int p = 0; p < K; ++p)
#pragma unroll
    for (int s = 0; s < (1 << K); ++s)
      if (s & (1 << p)) a[s] -= a[s ^ (1 << p)];
}

// Shared memory of the ring: per warp, kPopcStages steps of 2K pieces (rows g / g + 8, plane p) of
// 16 bytes per lane, stored [piece][lane] so that a warp's 16-byte reads are conflict-free. Each lane
// reads back only what it copied itself, so cp.async.wait_group alone orders the two.
template <int K>
constexpr int popc_ring_bytes() { return kWarps * kPopcStages * 2 * K * 32 * 16; }

template <int K, typename T>
__global__ void __launch_bounds__(kThreads, 2) popc_kernel(const PopcArgs a) {
  static_assert(K >= 1 && K <= kPopcMaxK, "bit-serial kernel: k <= 3");
  constexpr int NS = 1 << K;     // subsets of planes, the empty one included
  constexpr int S = kPopcStages;
  extern __shared__ uint4 s_ring[];                                    // [warp][stage][piece][lane]
  __shared__ __align__(16) uint32_t s_x[kPopcXBits][kPopcXStride];  // [x bit][word of the span]
  __shared__ uint32_t s_absmax[kWarps];
  __shared__ long long s_xsum[kWarps];
  qk::allow_next_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x % a.splits;  // the span of columns of this block
  const int first = split * a.span, count = min(a.span, a.steps - first);
  // this warp's 16-row tiles: tile0, tile0 + tile_stride, ...; a block's warps take neighbouring tiles
  const int tiles = (a.M + 15) / 16, tile_stride = gridDim.x / a.splits * kWarps;
  const int tile0 = blockIdx.x / a.splits * kWarps + warp;
  const int units = tile0 < tiles ? ((tiles - 1 - tile0) / tile_stride + 1) * count : 0;  // (tile, step) pairs
  uint4* ring = s_ring + warp * (S * 2 * K * 32);
  const uint32_t plane_stride = uint32_t(a.M) * uint32_t(a.wstride);

  // Copies unit u's plane words into its ring stage (or just closes an empty group past the end).
  // 32-bit offsets: the host checks K * M * wstride < 2^31.
  int issue_tile = tile0, issue_step = 0;  // unit u = (tile, step) in issue order
  auto issue = [&](int u) {
    if (u < units) {
      const int word = (first + issue_step) * kPopcStepWords + 4 * t;  // wstride % 4 == 0: all 4 in or out
      uint4* stage = ring + (u % S) * (2 * K * 32);
#pragma unroll
      for (int rs = 0; rs < 2; ++rs) {
        const int r = issue_tile * 16 + 8 * rs + g;
        const bool ok = r < a.M && word < a.wstride;
        const uint32_t off = ok ? uint32_t(r) * uint32_t(a.wstride) + uint32_t(word) : 0u;
#pragma unroll
        for (int p = 0; p < K; ++p)
          qk::copy_async<16>(stage + (rs * K + p) * 32 + lane, a.planes + off + p * plane_stride, ok);
      }
      if (++issue_step == count) issue_step = 0, issue_tile += tile_stride;
    }
    qk::commit_async();
  };

  // 1. weights first (no earlier kernel writes them, so before the wait): the ring's first steps and
  // the first tile's centroids
#pragma unroll
  for (int u = 0; u < S - 1; ++u) issue(u);
  uint4 lut_next[2] = {lut_row<K>(a.lut, tile0 * 16 + g, a.M), lut_row<K>(a.lut, tile0 * 16 + 8 + g, a.M)};
  qk::wait_prior_grid();

  // 2. x over the span as bit planes: one scale (the largest |x|), then warp w transposes words
  // w, w + 8, ... (lane j: column pi(j)); lane b then holds bit plane b and stores it.
  constexpr int kWordsPerWarp = kPopcMaxSpan * kPopcStepWords / kWarps;
  const int span_words = count * kPopcStepWords, word0 = first * kPopcStepWords;
  float xv[kWordsPerWarp];
  uint32_t absmax = 0;
#pragma unroll
  for (int i = 0; i < kWordsPerWarp; ++i) {
    const int w = warp + kWarps * i, gw = word0 + w;
    xv[i] = w < span_words && gw < a.W ? to_float<T>(static_cast<const T*>(a.x)[32 * gw + pi(lane)]) : 0.f;
    absmax = max(absmax, __float_as_uint(xv[i]) & 0x7FFFFFFFu);
  }
  absmax = __reduce_max_sync(0xFFFFFFFFu, absmax);
  if (lane == 0) s_absmax[warp] = absmax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) absmax = max(absmax, s_absmax[w]);
  const int e_max = exponent_field(absmax);
  long long xsum = 0;  // |sum x_q| <= 4096 * 2^22
  const int my_words = (span_words - warp + kWarps - 1) / kWarps;  // warp-uniform
#pragma unroll
  for (int i = 0; i < kWordsPerWarp; ++i) {
    if (i < my_words) {
      const int xq = fixed_point(xv[i], e_max);
      xsum += __reduce_add_sync(0xFFFFFFFFu, xq);
      const uint32_t plane = transpose_bits(uint32_t(xq), lane);
      if (lane < kPopcXBits) s_x[lane][warp + kWarps * i] = plane;
    }
  }
  if (lane == 0) s_xsum[warp] = xsum;
  __syncthreads();
  xsum = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) xsum += s_xsum[w];
  const float x_scale = ldexpf(1.f, e_max - 148);  // x = x_q * 2^(e_max - 148)

  // 3. the units: per subset S, the product plane against x's bit planes. D column n of mma m is x
  // bit 8m + n and this lane holds columns 2t, 2t + 1, so sum_b w_b D_b = 4^t * (sum_m 256^m
  // (D_m,2t + 2 D_m,2t+1)), with -2 instead of 2 for bit 23 (m = 2, t = 3); per step D <= 512, so
  // the sum fits an int. The lane scale 4^t is applied once per tile.
  const int top = t == 3 ? -2 : 2;
  T* out = static_cast<T*>(a.out);
  const T* bias = static_cast<const T*>(a.bias);
  float coef[2][NS], acc[2] = {0.f, 0.f};
  int tile = tile0, step = 0;
  for (int u = 0; u < units; ++u) {
    issue(u + S - 1);
    if (step == 0) {  // a new tile: its coefficients, and the next tile's centroids on their way
      moebius<K, T>(lut_next[0], coef[0]);
      moebius<K, T>(lut_next[1], coef[1]);
      const int nt = tile + tile_stride;
      lut_next[0] = lut_row<K>(a.lut, nt * 16 + g, a.M);
      lut_next[1] = lut_row<K>(a.lut, nt * 16 + 8 + g, a.M);
    }
    qk::wait_async<S - 1>();
    const uint4* stage = ring + (u % S) * (2 * K * 32);
    uint32_t aligned[2][K][4];  // [rs][plane][word of the lane's four], rotated to plane 0's order
#pragma unroll
    for (int rs = 0; rs < 2; ++rs)
#pragma unroll
      for (int p = 0; p < K; ++p) {
        const uint4 v = stage[(rs * K + p) * 32 + lane];
        aligned[rs][p][0] = rotr(v.x, p);
        aligned[rs][p][1] = rotr(v.y, p);
        aligned[rs][p][2] = rotr(v.z, p);
        aligned[rs][p][3] = rotr(v.w, p);
      }
    uint32_t xb[3][4];  // x bit 8m + g over the lane's words 4t..4t+3 of this step
#pragma unroll
    for (int m = 0; m < 3; ++m) {
      const uint4 v = *reinterpret_cast<const uint4*>(&s_x[8 * m + g][step * kPopcStepWords + 4 * t]);
      xb[m][0] = v.x; xb[m][1] = v.y; xb[m][2] = v.z; xb[m][3] = v.w;
    }
#pragma unroll
    for (int s = 1; s < NS; ++s) {
      int d[3][4] = {};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t frag[4];  // (row g, word 4t+2h), (row g+8, word 4t+2h), (row g, 4t+2h+1), (row g+8, 4t+2h+1)
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          uint32_t v = 0xFFFFFFFFu;
#pragma unroll
          for (int p = 0; p < K; ++p)
            if (s & (1 << p)) v &= aligned[f & 1][p][2 * h + (f >> 1)];
          frag[f] = v;
        }
#pragma unroll
        for (int m = 0; m < 3; ++m) mma_b1(d[m], frag, xb[m][2 * h], xb[m][2 * h + 1]);
      }
      const int lo = d[0][0] + 2 * d[0][1] + 256 * (d[1][0] + 2 * d[1][1]) + 65536 * (d[2][0] + top * d[2][1]);
      const int hi = d[0][2] + 2 * d[0][3] + 256 * (d[1][2] + 2 * d[1][3]) + 65536 * (d[2][2] + top * d[2][3]);
      acc[0] = fmaf(coef[0][s], float(lo), acc[0]);
      acc[1] = fmaf(coef[1][s], float(hi), acc[1]);
    }
    if (++step < count) continue;

    // 4. the tile's rows: sums over the four lanes t; lane t = 0 holds rows g (rs 0) and g + 8 (rs 1)
    float sum[2];
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
      float v = acc[rs] * float(1 << (2 * t));
      if (t == 0) v = fmaf(coef[rs][0], float(xsum), v);  // a_0 * sum(x_q), once per row
      v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
      v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
      sum[rs] = v * x_scale;
      acc[rs] = 0.f;
    }
    if (a.splits == 1) {  // the whole row in this warp: write y
      if (t == 0)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
          const int r = tile * 16 + 8 * rs + g;
          if (r < a.M) out[r] = from_float<T>(bias != nullptr ? sum[rs] + to_float<T>(bias[r]) : sum[rs]);
        }
    } else {  // add into the workspace; the tile's last warp (of the splits) writes y and clears it
      if (t == 0)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs)
          if (tile * 16 + 8 * rs + g < a.M) atomicAdd(a.ws + tile * 16 + 8 * rs + g, sum[rs]);
      __syncwarp();
      int last = 0;
      if (lane == 0) {
        __threadfence();
        int old;
        asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(old) : "l"(a.counters + tile) : "memory");
        last = old + 1 == a.splits;
        if (last) a.counters[tile] = 0;
      }
      if (__shfl_sync(0xFFFFFFFFu, last, 0) && lane < 16 && tile * 16 + lane < a.M) {
        const int r = tile * 16 + lane;
        float v = __ldcg(a.ws + r);
        a.ws[r] = 0.f;
        if (bias != nullptr) v += to_float<T>(bias[r]);
        out[r] = from_float<T>(v);
      }
    }
    step = 0;
    tile += tile_stride;
  }
  qk::wait_async<0>();  // no copy outlives the block (the ring's last groups are empty)
}

// Resident blocks per SM of popc_kernel<K, T> (asked once per kernel and device).
template <int K, typename T>
int popc_blocks_per_sm(int device) {
  static std::atomic<int> known[64];
  int n = device >= 0 && device < 64 ? known[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, popc_kernel<K, T>, kThreads, popc_ring_bytes<K>()) !=
        cudaSuccess || n < 1)
      n = 1;
    if (device >= 0 && device < 64) known[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Splits of the row: enough that every resident warp gets a 16-row tile (fewer leave warps, and the
// bytes they would have in flight, idle; more cost atomics), and spans of at most kPopcMaxSpan steps.
inline void popc_split(PopcArgs& a, int warps_resident) {
  const int tiles = (a.M + 15) / 16;
  const int splits = std::min(a.steps, std::max((warps_resident + tiles - 1) / tiles, (a.steps + kPopcMaxSpan - 1) / kPopcMaxSpan));
  a.span = (a.steps + splits - 1) / splits;
  a.splits = (a.steps + a.span - 1) / a.span;
}

template <typename T, int K>
cudaError_t launch_popc(PopcArgs a, cudaStream_t stream, bool overlap, int device, int sms) {
  auto kernel = popc_kernel<K, T>;
  cudaError_t err = qk::configure_once<popc_kernel<K, T>>(popc_ring_bytes<K>(), 100);
  if (err != cudaSuccess) return err;
  const int slots = sms * popc_blocks_per_sm<K, T>(device);
  popc_split(a, slots * kWarps);
  const int tiles = (a.M + 15) / 16;
  const int per_split = std::min(slots / a.splits + (slots % a.splits != 0), (tiles + kWarps - 1) / kWarps);
  return qk::launch_kernel(kernel, a.splits * std::max(per_split, 1), kThreads, popc_ring_bytes<K>(), stream,
                           overlap && qk::overlap_supported<popc_kernel<K, T>>(device), a);
}
