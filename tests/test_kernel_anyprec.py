"""Tests of the any-precision bitplane kernels (kernels/anyprec*.cu / .cuh) against the PyTorch reference.

The layout test runs anywhere and the decode emulation wherever nvcc is installed (no GPU);
the others need CUDA and the compiled extension and skip cleanly without them. Every kernel output
buffer is filled with NaN first, so an element the kernel fails to write shows up as a mismatch.
"""

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

from overlap_helpers import replay_chains
from quantkit.formats.anyprec import AnyPrecisionTensor, unpack_bitplanes
from quantkit.kernels import anyprec_gemm as ag
from quantkit.kernels import anyprec_variants, build
from quantkit.runtime.quant_linear import QuantLinear

pytestmark = pytest.mark.gpu

REL_TOL = 2e-3  # the largest relative error of a kernel output against the reference


@pytest.fixture(scope="module")
def ext(requires):
    return requires("anyprec")


def _artifact(rows, cols, seed_bits, parent_bits, seed=0, device="cpu"):
    """Random parent codes and random sorted tables: no quantization needed to test a kernel."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**parent_bits, (rows, cols), generator=g)
    luts = {b: torch.randn(rows, 2**b, generator=g).sort(dim=1).values * 0.05
            for b in range(seed_bits, parent_bits + 1)}
    qt = AnyPrecisionTensor.from_codes(codes, luts, seed_bits, parent_bits)
    return qt if device == "cpu" else qt.to(device)


def _rel_err(y, ref):
    """Norm-wise relative error against the fp32 reference rounded to y's dtype, as the PyTorch
    path returns it (bf16 rounding alone is ~1.6e-3 of the norm, too close to the bound)."""
    ref = ref.to(y.dtype).float()
    return ((y.float() - ref).norm() / ref.norm()).item()


def _reference(qt, x, bits, bias=None):
    """x @ W^T in fp32 with W's elements rounded to x.dtype, as the reference QuantLinear uses."""
    w = qt.dequantize(x.dtype, bits=bits).float()
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


def test_kernel_layout_is_the_documented_bit_permutation():
    g = torch.Generator().manual_seed(3)
    planes = torch.randint(-2**31, 2**31, (5, 7, 9), generator=g, dtype=torch.int64).to(torch.int32)
    out = ag.kernel_layout(planes)
    assert out.shape == (5, 7, 12) and out.dtype == torch.int32
    assert (out[:, :, 9:] == 0).all()
    src = planes.to(torch.int64) & 0xFFFFFFFF
    dst = out.to(torch.int64) & 0xFFFFFFFF
    for p in range(5):
        for s in range(32):
            want = (src[p] >> ag._pi((s - p) % 32)) & 1
            assert torch.equal((dst[p, :, :9] >> s) & 1, want), (p, s)
    # pi is a bijection of the 32 columns and pairs (q, q+8) are adjacent columns
    assert sorted(ag._pi(q) for q in range(32)) == list(range(32))
    assert all(ag._pi(q + 8) == ag._pi(q) + 1 for q in range(32) if not q & 8)


_HARNESS_COMMON = r"""
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

static float elem(uint16_t b, bool half) {
  uint32_t f = half ? half_to_float_bits(b) : uint32_t(b) << 16;
  float x; std::memcpy(&x, &f, 4); return x;
}

static uint16_t half_bits_of(int n) {  // fp16 bits of n / 1024 for |n| < 2048 (exact)
  if (n == 0) return 0;
  const unsigned a = unsigned(n < 0 ? -n : n);
  const int e = 31 - __builtin_clz(a);
  return uint16_t((n < 0 ? 0x8000 : 0) | ((e + 5) << 10) | ((a << (10 - e)) & 0x3FF));
}

struct Problem {
  int M, N, B, W, Wp;
  std::vector<int> codes; std::vector<uint32_t> nat, ker; std::vector<uint16_t> lut[9], x;
};

static Problem make(int M, int N, int B, bool half, unsigned seed) {
  std::mt19937 rng(seed);
  Problem P{M, N, B, (N + 31) / 32, 0, {}, {}, {}, {}, {}};
  P.Wp = (P.W + 3) / 4 * 4;
  P.codes.resize(size_t(M) * N);
  for (auto& c : P.codes) c = rng() & 255;
  P.nat.assign(size_t(8) * M * P.W, 0);
  P.ker.assign(size_t(8) * M * P.Wp, 0);
  for (int p = 0; p < 8; ++p)
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < N; ++c)
        if ((P.codes[size_t(r) * N + c] >> (7 - p)) & 1) P.nat[(size_t(p) * M + r) * P.W + c / 32] |= 1u << (c % 32);
  for (int p = 0; p < 8; ++p)  // the documented kernel layout: bit s <- natural bit pi((s - p) mod 32)
    for (size_t rw = 0; rw < size_t(M) * P.W; ++rw) {
      const uint32_t src = P.nat[size_t(p) * M * P.W + rw];
      uint32_t dst = 0;
      for (int s = 0; s < 32; ++s) dst |= ((src >> pi((s - p + 32) % 32)) & 1u) << s;
      P.ker[(size_t(p) * M + rw / P.W) * P.Wp + rw % P.W] = dst;
    }
  // small integers / 1024: exact in fp16 and bf16, so any difference is a decode error
  for (int k = 1; k <= 8; ++k) {
    P.lut[k].resize(size_t(M) << k);
    for (auto& e : P.lut[k]) e = half_bits_of(int(rng() % 255) - 127);
  }
  P.x.assign(size_t(B) * P.Wp * 32, 0);
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < N; ++c) {
      const uint16_t h = half_bits_of(int(rng() % 255) - 127);
      P.x[size_t(b) * P.Wp * 32 + c] = half ? h : float_bits_to_bf16(half_to_float_bits(h));
    }
  return P;
}

// the exact sum of x[b] and row r's k-bit centroids, as T
template <int K, typename T>
static double reference(const Problem& Pb, const uint16_t* lut, int b, int r) {
  const bool half = std::is_same<T, __half>::value;
  double s = 0;
  for (int c = 0; c < Pb.N; ++c) {
    const uint16_t e = centroid_bits<T>(lut[(size_t(r) << K) + (Pb.codes[size_t(r) * Pb.N + c] >> (8 - K))]);
    s += double(elem(e, half)) * elem(Pb.x[size_t(b) * Pb.Wp * 32 + c], half);
  }
  return s;
}

// the largest |out - reference| over every output, relative to the largest |reference|; 3e30 for a non-finite out
template <int K, typename T>
static double max_relative_error(const Problem& Pb, const uint16_t* lut, const double* out, int M) {
  double err = 0, scale = 0;
  for (int b = 0; b < Pb.B; ++b)
    for (int r = 0; r < M; ++r) {
      const double s = reference<K, T>(Pb, lut, b, r);
      const double got = out[size_t(b) * M + r];
      if (!std::isfinite(got)) return 3e30;
      err = std::max(err, std::fabs(got - s));
      scale = std::max(scale, std::fabs(s));
    }
  return err / scale;
}
"""

_HARNESS = r"""
// CPU emulation of one block of matvec_kernel: the kernel's own decode / table / x-fragment /
// reduction-index code, the mma from the PTX fragment layout of m16n8k16, a double reference.
#include "anyprec_decode.cuh"
using namespace anyprec;
""" + _HARNESS_COMMON + r"""
template <int K, typename T, int TILES, int FLAGS>
static double run(const Problem& Pb) {
  using C = Config<K, TILES, FLAGS>;
  constexpr int P = C::PIECES;
  const bool half = std::is_same<T, __half>::value, layout = FLAGS & FLAG_LAYOUT;
  const uint32_t* planes = layout ? Pb.ker.data() : Pb.nat.data();
  const int wstride = layout ? Pb.Wp : Pb.W, ldx = Pb.Wp * 32, M = Pb.M, W = Pb.W;
  const uint16_t* lut = Pb.lut[K].data();
  const T* x = reinterpret_cast<const T*>(Pb.x.data());
  static std::vector<unsigned char> window(1 << 22);
  host_shared_window = window.data();
  const uint32_t red_addr = 0x400 + 16 * (M % 5);
  const uint32_t table_addr =
      (red_addr + C::RED_BYTES + C::RING_BYTES + C::TABLE_ALIGN - 1) & ~uint32_t(C::TABLE_ALIGN - 1);
  if (table_addr + C::TABLE_BYTES > red_addr + C::SMEM_BYTES) return 1e30;
  Pow2 p2;
  for (int i = 0; i < 32; ++i) p2.v[i] = 1u << i;
  std::vector<double> out(size_t(Pb.B) * M, NAN);
  const int nchunks = (W + C::STEP_WORDS - 1) / C::STEP_WORDS;
  for (int row0 = 0; row0 < M; row0 += 16 * TILES) {
    if (!C::PRMT_LUT) {
      std::memset(window.data() + table_addr, 0xFF, C::TABLE_BYTES);  // poison: every entry must be filled
      for (int i = 0; i < TILES * C::TABLE_SLOTS * (1 << K) * 8; ++i)
        reinterpret_cast<uint4*>(window.data() + table_addr)[i] = table_fill<K, T, C::PAIR>(lut, row0, M, i);
    }
    std::vector<float> red(size_t(C::WARPS) * TILES * 32 * 4, 0.f);
    for (int warp = 0; warp < C::WARPS; ++warp) {
      double Cm[TILES][16][8] = {};
      for (int chunk = warp; chunk < nchunks; chunk += C::WARPS) {
        struct Rec { int tile; uint32_t a[4], b01, b23; };
        std::vector<Rec> recs[32];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane >> 2, t = lane & 3, w0 = chunk * C::STEP_WORDS + t;
          PrmtTable pt[TILES][2] = {};
          SmemTable st[TILES][2];
          for (int tile = 0; tile < TILES; ++tile)
            for (int rs = 0; rs < 2; ++rs) {
              st[tile][rs] = {table_addr + uint32_t(lane) * 4 + table_offset<K, C::PAIR>(tile, rs)};
              if constexpr (C::PRMT_LUT)
                pt[tile][rs] = prmt_table<K, T>(lut_row<K>(lut, row0 + 16 * tile + 8 * rs + g, M));
            }
          const T* xrow = g < Pb.B ? x + size_t(g) * ldx : nullptr;
          for (int v = 0; v < P; ++v) {  // the kernel's ring hands lane (g, t) words 4v + t of its step
            const int w = w0 + 4 * v;
            uint32_t R[TILES][2][K] = {};
            for (int tile = 0; tile < TILES; ++tile)
              for (int rs = 0; rs < 2; ++rs) {
                const int row = row0 + 16 * tile + 8 * rs + g;
                for (int p = 0; p < K; ++p)  // the ring zero-fills rows >= M and pieces past W
                  if (row < M && (w & ~3) < W) R[tile][rs][p] = planes[(size_t(p) * M + row) * wstride + w];
              }
            static const T zeros[32] = {};
            const T* xw = (xrow != nullptr && w < W) ? xrow + 32 * w : zeros;
            decode_word<K, TILES, FLAGS, T>(R, xw, pt, st, p2,
                [&](int tile, const uint32_t (&a)[4], uint32_t b01, uint32_t b23) {
                  recs[lane].push_back({tile, {a[0], a[1], a[2], a[3]}, b01, b23}); });
          }
        }
        for (size_t step = 0; step < recs[0].size(); ++step) {  // one mma per step, all lanes
          double A[16][16], Bm[16][8];
          const int tile = recs[0][step].tile;
          for (int lane = 0; lane < 32; ++lane) {
            if (recs[lane].size() != recs[0].size() || recs[lane][step].tile != tile) return 2e30;
            const auto& r = recs[lane][step];
            const int g = lane >> 2, t = lane & 3;
            auto lo = [&](uint32_t u) { return double(elem(u & 0xFFFF, half)); };
            auto hi = [&](uint32_t u) { return double(elem(u >> 16, half)); };
            A[g][2 * t] = lo(r.a[0]); A[g][2 * t + 1] = hi(r.a[0]);
            A[g + 8][2 * t] = lo(r.a[1]); A[g + 8][2 * t + 1] = hi(r.a[1]);
            A[g][2 * t + 8] = lo(r.a[2]); A[g][2 * t + 9] = hi(r.a[2]);
            A[g + 8][2 * t + 8] = lo(r.a[3]); A[g + 8][2 * t + 9] = hi(r.a[3]);
            Bm[2 * t][g] = lo(r.b01); Bm[2 * t + 1][g] = hi(r.b01);
            Bm[2 * t + 8][g] = lo(r.b23); Bm[2 * t + 9][g] = hi(r.b23);
          }
          for (int i = 0; i < 16; ++i)
            for (int n = 0; n < 8; ++n)
              for (int kk = 0; kk < 16; ++kk) Cm[tile][i][n] += A[i][kk] * Bm[kk][n];
        }
      }
      for (int tile = 0; tile < TILES; ++tile)
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane >> 2, t = lane & 3;
          float* d = &red[((size_t(warp) * TILES + tile) * 32 + lane) * 4];
          d[0] = Cm[tile][g][2 * t]; d[1] = Cm[tile][g][2 * t + 1];
          d[2] = Cm[tile][g + 8][2 * t]; d[3] = Cm[tile][g + 8][2 * t + 1];
        }
    }
    for (int o = 0; o < TILES * 16 * kMaxBatch; ++o) {
      const OutputItem it = output_item(o);
      const int row = row0 + 16 * it.tile + it.r16;
      if (it.b >= Pb.B || row >= M) continue;
      double s = 0;
      for (int w = 0; w < C::WARPS; ++w) s += red[((size_t(w) * TILES + it.tile) * 32 + it.src_lane) * 4 + it.e];
      out[size_t(it.b) * M + row] = s;
    }
  }
  return max_relative_error<K, T>(Pb, lut, out.data(), M);
}

static int checked = 0, failed = 0;
template <int K, typename T, int TILES, int FLAGS>
static void check(int M, int N, int B) {
  if constexpr (compiled_rule(std::is_same<T, __half>::value, K, TILES, FLAGS)) {
    if (!(FLAGS & FLAG_LAYOUT) && ((N + 31) / 32) % 4) return;  // natural layout: whole 16-byte rows
    const double e = run<K, T, TILES, FLAGS>(make(M, N, B, std::is_same<T, __half>::value, K * 977 + M));
    ++checked;
    if (!(e < 1e-6)) { ++failed; std::printf("FAIL K=%d half=%d TILES=%d FLAGS=%d M=%d N=%d B=%d err=%g\n", K,
                                            int(std::is_same<T, __half>::value), TILES, FLAGS, M, N, B, e); }
  }
}

template <int K, typename T, int TILES, int FLAGS>
static void shapes() { check<K, T, TILES, FLAGS>(37, 1000, 3); check<K, T, TILES, FLAGS>(40, 1024, 8); }

template <int K>
static void width() {
  shapes<K, __half, 1, 7>(); shapes<K, __nv_bfloat16, 1, 7>();
  shapes<K, __half, 2, 7>(); shapes<K, __nv_bfloat16, 2, 7>();
  shapes<K, __half, 1, 6>(); shapes<K, __half, 1, 5>(); shapes<K, __half, 1, 4>();
  shapes<K, __half, 1, 3>(); shapes<K, __half, 1, 0>();
  // the shared-memory-table variants (FLAG_PAIR, FLAG_OCC)
  shapes<K, __half, 1, 15>(); shapes<K, __nv_bfloat16, 1, 15>();
  shapes<K, __half, 2, 15>(); shapes<K, __nv_bfloat16, 2, 15>();
  shapes<K, __half, 1, 31>(); shapes<K, __nv_bfloat16, 1, 31>();
  shapes<K, __half, 2, 31>(); shapes<K, __nv_bfloat16, 2, 31>();
}

int main() {
  width<1>(); width<2>(); width<3>(); width<4>(); width<5>(); width<6>(); width<7>(); width<8>();
  std::printf("checked %d failed %d\n", checked, failed);
  return failed != 0 || checked < 160;
}
"""


def test_decode_logic_on_cpu_matches_reference(tmp_path, requires):
    """Compiles the kernel's decode code for the host (nvcc, no GPU needed) and runs a CPU
    emulation of one block per row tile for every built instance: bit-exact inputs, so any
    layout, transpose, table or fragment mistake shows as an error far above rounding."""
    nvcc = requires("nvcc")
    src = tmp_path / "harness.cu"
    src.write_text(_HARNESS)
    exe = tmp_path / "harness"
    build_cmd = [nvcc, "-std=c++17", "-O1", f"-I{build.SOURCE_DIR}", str(src), "-o", str(exe)]
    subprocess.run(build_cmd, check=True, capture_output=True, text=True, timeout=900)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


_ROWS_HARNESS = r"""
// CPU emulation of the row-per-lane kernel (anyprec_rows.cu): its own table fill, rows-layout merge, decode,
// A-fragment rows and partial-sum indexing, every warp of every block of a cluster split, the mma from the PTX
// fragment layout of m16n8k16 (weights as B, x as A), a double reference.
#include "anyprec_rows.cuh"
using namespace anyprec;
""" + _HARNESS_COMMON + r"""
template <int K, typename T, int NB, int FLAGS>
static double run_rows(const Problem& Pb, int split) {
  using C = RowsConfig<K, NB, FLAGS>;
  const bool half = std::is_same<T, __half>::value;
  const int M = Pb.M, W = Pb.W, Wp = Pb.Wp, G = 2 * ((M + 63) / 64), ldx = Wp * 32;
  // the rows layout from the kernel layout (anyprec_gemm.rows_layout)
  std::vector<uint32_t> rl(size_t(8) * G * Wp * 32, 0);
  for (int r = 0; r < M; ++r)
    for (int w = 0; w < Wp; ++w) {
      uint32_t P[8];
      for (int p = 0; p < 8; ++p) P[p] = Pb.ker[(size_t(p) * M + r) * Wp + w];
      for (int p = 0; p < 8; ++p) P[p] = rows_relayout(P[p], p);
      const uint32_t top[4] = {P[0], P[1], P[2], P[3]};
      for (int p = 0; p < 8; ++p)
        rl[((size_t(p) * G + r / 32) * Wp + w) * 32 + r % 32] = p < 4 ? rows_premerged(top, p) : P[p];
    }
  const uint16_t* lut = Pb.lut[K].data();
  const T* x = reinterpret_cast<const T*>(Pb.x.data());
  std::vector<uint32_t> table(C::TABLE_WORDS);
  // the kernel's placement of the table in a shared window whose dynamic part starts at an awkward 16-byte
  // multiple: inside the block's shared memory and, where lookups or its address in, aligned to its size
  // (otherwise lookups take byte offsets)
  const uint32_t window = 0x400 + 0x30 * K;
  const uint32_t table_addr = C::TABLE_OR ? window + rows_table_offset<K, NB, FLAGS>(window) : 0u;
  if (C::TABLE_OR && (table_addr - window + C::TABLE_BYTES > uint32_t(C::DYN_BYTES) ||
                      table_addr - window < uint32_t(C::RING_AREA) || table_addr % C::TABLE_BYTES != 0))
    return 2e30;
  if (C::PAIRS && rows_table_offset<K, NB, FLAGS>(window) + C::TABLE_BYTES > uint32_t(C::DYN_BYTES)) return 2e30;
  auto lookup = [&](uint32_t addr) {
    uint32_t v;
    std::memcpy(&v, reinterpret_cast<const char*>(table.data()) + (addr - table_addr), 4);
    return v;
  };
  Pow2 p2;
  for (int i = 0; i < 32; ++i) p2.v[i] = 1u << i;
  std::vector<double> out(size_t(Pb.B) * M, NAN);
  for (int blk = 0; blk < G / 2; ++blk) {
    const int row0 = 64 * blk;
    std::fill(table.begin(), table.end(), 0xFFFFFFFFu);  // poison: NaN halves wherever the fill missed
    if constexpr (C::PAIRS) {
      for (int i = 0; i < 2 * 32 * 16; ++i)
        rows_pair_table_fill<T>(lut, row0, M, i, [&](int word, uint32_t v) { table[word] = v; });
    } else {
      for (int i = 0; i < (1 << K) / 8 * 32; ++i)
        rows_table_fill<K, T>(lut, row0, M, i, [&](int word, uint32_t v) { table[word] = v; });
    }
    std::vector<double> part(64 * 8, 0.0);
    for (int rank = 0; rank < split; ++rank) {
      std::vector<float> red(size_t(C::WARPS) * 2 * C::NBG * 32 * 4, 0.f);
      for (int warp = 0; warp < C::WARPS; ++warp) {
        double D[2][2][16][8] = {};
        for (int w = warp + C::WARPS * rank; w < W; w += C::WARPS * split) {
          struct Rec { uint32_t b[2][2], a[2][4]; int set[2]; };
          std::vector<Rec> recs[32];
          for (int lane = 0; lane < 32; ++lane) {
            uint32_t R[2][K];
            for (int h = 0; h < 2; ++h)
              for (int p = 0; p < K; ++p) R[h][p] = rl[((size_t(p) * G + 2 * blk + h) * Wp + w) * 32 + lane];
            const uint32_t lane4 = uint32_t(lane) * 4u;
            const uint32_t lane_addr = C::TABLE_OR ? table_addr | lane4 : table_addr + lane4;
            // one mma's record: its B fragments and, per batch group, the A fragments a_of puts in from this lane's
            // batch rows (rows_xrows) and their x at word w
            auto record = [&](const uint32_t (&b)[2][2], auto&& a_of) {
              Rec rec{};
              for (int h = 0; h < 2; ++h) { rec.b[h][0] = b[h][0]; rec.b[h][1] = b[h][1]; }
              for (int bg = 0; bg < C::NBG; ++bg) {
                int ra, rb;
                rows_xrows(lane, bg, Pb.B, NB, ra, rb);
                const T* xa = x + size_t(ra < 0 ? 0 : ra) * ldx + 32 * w;
                const T* xb = x + size_t(rb < 0 ? 0 : rb) * ldx + 32 * w;
                rec.set[bg] = bg;
                a_of(rec, bg, ra, rb, xa, xb);
              }
              recs[lane].push_back(rec);
            };
            if constexpr (C::PAIRS) {  // the kernel's x quads and PRMT-paired A fragments, one accumulator
              const uint32_t pair_off[2] = {lane4, lane4 + 128u};
              rows_decode_pairs(R, pair_off, lookup, [&](int pu, int ii, const uint32_t (&b)[2][2]) {
                record(b, [&](Rec& rec, int bg, int ra, int rb, const T* xa, const T* xb) {
                  uint32_t lo[4], hi[4];
                  rows_xquad(xa, ra >= 0, pu >> 1, lo);
                  rows_xquad(xa, ra >= 0, (pu >> 1) + 2, hi);
                  rows_pair_afrag(lo, hi, pu, ii, rec.a[bg][0], rec.a[bg][2]);
                  if (NB >= 4) {
                    rows_xquad(xb, rb >= 0, pu >> 1, lo);
                    rows_xquad(xb, rb >= 0, (pu >> 1) + 2, hi);
                    rows_pair_afrag(lo, hi, pu, ii, rec.a[bg][1], rec.a[bg][3]);
                  } else {  // the kernel leaves a1 / a3 undefined: NaNs prove D rows 8-15 are never read
                    rec.a[bg][1] = rec.a[bg][3] = 0x7FC07FC0u;
                  }
                });
              });
              continue;
            }
            rows_decode_word<K, C::TABLE_OR>(R, lane_addr, p2, lookup, [&](int j, const uint32_t (&b)[2][2]) {
              record(b, [&](Rec& rec, int bg, int ra, int rb, const T* xa, const T* xb) {
                if (NB == 2) {  // the 16-byte x load as it stands; odd merged words in the second accumulator
                  uint32_t va[16];
                  rows_xword(xa, ra >= 0, va);
                  rows_aquad_of(va, j, rec.a[bg]);
                  rec.set[bg] = j & 1;
                } else if (NB == 4) {  // the kernel's per-word x loads
                  uint32_t va[16], vb[16];
                  rows_xword(xa, ra >= 0, va);
                  rows_xword(xb, rb >= 0, vb);
                  rows_afrag_of(va, j, rec.a[bg][0], rec.a[bg][2]);
                  rows_afrag_of(vb, j, rec.a[bg][1], rec.a[bg][3]);
                } else {  // per pair of merged words
                  uint32_t qa[4], qb[4];
                  rows_xquad(xa, ra >= 0, j >> 1, qa);
                  rows_xquad(xb, rb >= 0, j >> 1, qb);
                  rows_afrag_quad(qa, j, rec.a[bg][0], rec.a[bg][2]);
                  rows_afrag_quad(qb, j, rec.a[bg][1], rec.a[bg][3]);
                }
              });
            });
          }
          auto lo = [&](uint32_t u) { return double(elem(u & 0xFFFF, half)); };
          auto hi = [&](uint32_t u) { return double(elem(u >> 16, half)); };
          for (size_t j = 0; j < recs[0].size(); ++j)
            for (int h = 0; h < 2; ++h)
              for (int bg = 0; bg < C::NBG; ++bg) {
                double A[16][16], Bm[16][8];
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane >> 2, t = lane & 3;
                  const Rec& r = recs[lane][j];
                  A[g][2 * t] = lo(r.a[bg][0]); A[g][2 * t + 1] = hi(r.a[bg][0]);
                  A[g + 8][2 * t] = lo(r.a[bg][1]); A[g + 8][2 * t + 1] = hi(r.a[bg][1]);
                  A[g][2 * t + 8] = lo(r.a[bg][2]); A[g][2 * t + 9] = hi(r.a[bg][2]);
                  A[g + 8][2 * t + 8] = lo(r.a[bg][3]); A[g + 8][2 * t + 9] = hi(r.a[bg][3]);
                  Bm[2 * t][g] = lo(r.b[h][0]); Bm[2 * t + 1][g] = hi(r.b[h][0]);
                  Bm[2 * t + 8][g] = lo(r.b[h][1]); Bm[2 * t + 9][g] = hi(r.b[h][1]);
                }
                for (int m = 0; m < 16; ++m)
                  for (int n = 0; n < 8; ++n)
                    for (int kk = 0; kk < 16; ++kk) D[h][recs[0][j].set[bg]][m][n] += A[m][kk] * Bm[kk][n];
              }
        }
        if (NB == 2 && !C::PAIRS)  // the kernel's fold: rows 8-15 of the odd merged words' accumulator onto rows 0-7
          for (int h = 0; h < 2; ++h)
            for (int m = 0; m < 8; ++m)
              for (int n = 0; n < 8; ++n) D[h][0][m][n] += D[h][1][m + 8][n];
        for (int h = 0; h < 2; ++h)
          for (int bg = 0; bg < C::NBG; ++bg)
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane >> 2, t = lane & 3;
              float* d = &red[(((size_t(warp) * 2 + h) * C::NBG + bg) * 32 + lane) * 4];
              d[0] = D[h][bg][g][2 * t]; d[1] = D[h][bg][g][2 * t + 1];
              d[2] = D[h][bg][g + 8][2 * t]; d[3] = D[h][bg][g + 8][2 * t + 1];
            }
      }
      for (int o = 0; o < 64 * Pb.B; ++o) {
        const int r64 = o & 63, b = o >> 6, h = r64 >> 5;
        const RowsSource src = rows_source(r64 & 31, b);
        for (int wp = 0; wp < C::WARPS; ++wp)
          part[o] += red[(((size_t(wp) * 2 + h) * C::NBG + (b >> 2)) * 32 + src.src_lane) * 4 + src.e];
      }
    }
    for (int o = 0; o < 64 * Pb.B; ++o)
      if (row0 + (o & 63) < M) out[size_t(o >> 6) * M + row0 + (o & 63)] = part[o];
  }
  return max_relative_error<K, T>(Pb, lut, out.data(), M);
}

static int checked = 0, failed = 0;
template <int K, typename T, int FLAGS>
static void check(int M, int N, int B, int split) {
  const Problem P = make(M, N, B, std::is_same<T, __half>::value, K * 131 + M + split);
  double e;
  switch (rows_batch_class(B)) {
    case 2: e = run_rows<K, T, 2, FLAGS>(P, split); break;
    case 4: e = run_rows<K, T, 4, FLAGS>(P, split); break;
    default: e = run_rows<K, T, 8, FLAGS>(P, split);
  }
  ++checked;
  if (!(e < 1e-6)) { ++failed; std::printf("FAIL K=%d half=%d FLAGS=%d M=%d N=%d B=%d split=%d err=%g\n", K,
                                          int(std::is_same<T, __half>::value), FLAGS, M, N, B, split, e); }
}

template <int K, typename T, int FLAGS>
static void shapes() {
  // 37 rows: one block with rows past M; 130: three blocks, the last mostly empty; 96 columns: 3 words, fewer
  // than the warps; 1000 columns: 32 words with a partial last one; splits leave some warps without words
  check<K, T, FLAGS>(37, 1000, 1, 1); check<K, T, FLAGS>(130, 96, 2, 1); check<K, T, FLAGS>(70, 1024, 3, 3);
  check<K, T, FLAGS>(64, 2080, 4, 2); check<K, T, FLAGS>(100, 520, 5, 1); check<K, T, FLAGS>(33, 4096, 8, 8);
}

template <int K>
static void width() {
  shapes<K, __half, 7 | FLAG_ROWS>(); shapes<K, __nv_bfloat16, 7 | FLAG_ROWS>();
  shapes<K, __half, 7 | FLAG_ROWS | FLAG_OCC>();
}

int main() {
  width<4>(); width<5>(); width<6>(); width<7>(); width<8>();
  constexpr int pairs = 7 | FLAG_ROWS | FLAG_CODE_PAIRS;
  shapes<4, __half, pairs>(); shapes<4, __nv_bfloat16, pairs>();
  std::printf("checked %d failed %d\n", checked, failed);
  return failed != 0 || checked < 102;
}
"""


def test_rows_kernel_decode_on_cpu_matches_reference(tmp_path, requires):
    """The row-per-lane kernel's decode, table and index code compiled for the host (nvcc, no GPU) and run as a
    CPU emulation of every block, warp and cluster split for widths 4..8, batches 1..8, awkward shapes: bit-exact
    inputs, so a layout, merge, table, fragment or reduction mistake shows far above rounding."""
    nvcc = requires("nvcc")
    src = tmp_path / "rows_harness.cu"
    src.write_text(_ROWS_HARNESS)
    exe = tmp_path / "rows_harness"
    build_cmd = [nvcc, "-std=c++17", "-O1", f"-I{build.SOURCE_DIR}", str(src), "-o", str(exe)]
    subprocess.run(build_cmd, check=True, capture_output=True, text=True, timeout=900)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def _rows_sigma(q):
    """The rows layout's column of slot q, written out: merged word j = q % 8 holds columns c, c + 1, c + 4, c + 5
    (i = q // 8 = 0..3) with c = 8 (j // 2) + 2 (j % 2)."""
    j, i = q % 8, q // 8
    return 8 * (j // 2) + 2 * (j % 2) + [0, 1, 4, 5][i]


def test_rows_layout_is_the_documented_arrangement():
    """rows_layout: [n, G, W, 32] with rows past M zero, bit s of plane p = natural column sigma((s - p) mod 32)
    for planes 4.., and slot p < 4 the pre-merged U_p, checked bit by bit against the natural planes."""
    g = torch.Generator().manual_seed(5)
    planes = torch.randint(-2**31, 2**31, (6, 70, 8), generator=g, dtype=torch.int64).to(torch.int32)
    out = ag.rows_layout(ag.kernel_layout(planes))
    assert out.shape == (6, 4, 8, 32) and out.dtype == torch.int32
    flat = out.transpose(2, 3).reshape(6, 128, 8)
    assert (flat[:, 70:] == 0).all()
    nat = planes.to(torch.int64) & 0xFFFFFFFF
    got = flat[:, :70].to(torch.int64) & 0xFFFFFFFF
    assert sorted(_rows_sigma(q) for q in range(32)) == list(range(32))
    for p in range(6):
        for s in range(32):
            q = (s - p) % 4 if p < 4 else p  # bit s of U_p (p < 4) comes from plane q where s = 4m + p + q
            want = (nat[q] >> _rows_sigma((s - q) % 32)) & 1
            assert torch.equal((got[p] >> s) & 1, want), (p, s)
    with pytest.raises(ValueError, match="at least 4 planes"):
        ag.rows_layout(planes[:3])


def test_rows_copy_holds_the_widest_width_served_so_far():
    """The row kernel's copy of a module's planes grows with the widths served (at least 4 planes) and never shrinks;
    its planes are the full copy's: the top four are merged from planes 0..3 only."""
    qt = _artifact(70, 96, 3, 8, seed=11)
    kplanes = ag.kernel_layout(qt.planes)
    full = ag.rows_layout(kplanes)
    for bits, planes, made in ((4, 4, True), (3, 4, False), (6, 6, True), (5, 6, False), (None, 8, True),
                               (4, 8, False)):
        got, fresh = ag._rows_planes_of(kplanes, bits)
        assert got.shape[0] == planes and torch.equal(got, full[:planes]) and fresh == made, (bits, planes)
    kept, _ = ag._rows_planes_of(kplanes, 4)
    again, fresh = ag._rows_planes_of(kplanes, 7)
    assert again is kept and not fresh  # made once, kept with the planes


# flags None: the dispatch table's choice; the FLAG_PAIR and FLAG_ROWS variants exist for k >= 4 only
VARIANT_FLAGS = [None, ag.ALL_FLAGS, ag.ALL_FLAGS | ag.FLAG_PAIR, ag.ALL_FLAGS | ag.FLAG_PAIR | ag.FLAG_OCC,
                 ag.ALL_FLAGS | ag.FLAG_ROWS, ag.ALL_FLAGS | ag.FLAG_ROWS | ag.FLAG_OCC,
                 ag.ALL_FLAGS | ag.FLAG_ROWS | ag.FLAG_CODE_PAIRS]


@pytest.mark.parametrize("flags", VARIANT_FLAGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 32), (17, 100), (48, 576), (130, 1000), (64, 4096 + 64), (300, 2080),
                                       (8480, 96)])  # 8480 rows: two-tile blocks from batch 4 on
def test_matvec_matches_reference_for_every_width(ext, dtype, rows, cols, flags):
    qt = _artifact(rows, cols, 2, 8, seed=rows * cols, device="cuda")
    planes = ag.kernel_layout(qt.planes)
    words = -(-cols // 32)
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    bias = torch.randn(rows, generator=g, device="cuda").to(dtype)
    for bits in qt.supported_bits():
        if flags is not None and not ext.has_matvec(dtype, bits, 1, flags):
            continue
        for batch in (1, 3, 8):
            x = torch.randn(batch, cols, generator=g, device="cuda").to(dtype)
            out = torch.full((batch, rows), float("nan"), dtype=dtype, device="cuda")
            y = ag.matvec(x, planes, qt.luts[bits], bits, words, bias, flags=flags, out=out, ext=ext)
            ref = _reference(qt, x, bits, bias)
            assert torch.isfinite(y).all(), (bits, batch)
            assert _rel_err(y, ref) < REL_TOL, (bits, batch, _rel_err(y, ref))


def test_rows_kernel_under_inference_mode(ext):
    """Planes made under torch.inference_mode (as a decoder built there makes them) track no version counter;
    the row kernel's layout is still made once and kept."""
    qt = _artifact(64, 256, 4, 8, seed=5, device="cuda")
    flags = ag.ALL_FLAGS | ag.FLAG_ROWS
    if not ext.has_matvec(torch.float16, 8, 1, flags):
        pytest.skip("no row kernel built")
    with torch.inference_mode():
        planes = ag.kernel_layout(qt.planes)
        x = torch.randn(1, 256, device="cuda").half()
        first = ag.matvec(x, planes, qt.luts[8], 8, 8, None, flags=flags, ext=ext)
        again = ag.matvec(x, planes, qt.luts[8], 8, 8, None, flags=flags, ext=ext)
    assert planes.is_inference() and torch.equal(first, again)
    assert _rel_err(first, _reference(qt, x, 8)) < REL_TOL


def test_dispatch_table_serves_its_candidates(ext, monkeypatch):
    """A table naming each candidate for some (width, batch) of this GPU and the module's shape class: matvec
    launches exactly that instance, with its tile rule, and matches the reference; widths the table leaves out
    keep today's."""
    name = torch.cuda.get_device_name()
    names = [n for n in ag.CANDIDATES if n != "today"]
    # the code-pair instances exist at 4 bits only: they take 4 bits, the others rotate over 5..8
    pairs = [n for n in names if ag.CANDIDATES[n][0] & ag.FLAG_CODE_PAIRS]
    others = [n for n in names if n not in pairs]
    table = {bits: {batch: others[(3 * (bits - 5) + i) % len(others)] for i, batch in enumerate((1, 4, 8))}
             for bits in range(5, 9)}
    table[4] = {batch: pairs[i % len(pairs)] for i, batch in enumerate((1, 4, 8))}
    assert {n for per_batch in table.values() for n in per_batch.values()} == set(names)
    # the module (8480 x 256) is nearest the first class; the second is another shape's
    monkeypatch.setattr(anyprec_variants, "CHOICES", {name: {(6000, 300): table, (8480, 1024): {}}})
    monkeypatch.setattr(ag, "_variant_cache", {})
    launched = []

    class Recording:
        def __getattr__(self, attr):
            return getattr(ext, attr)

        def matvec(self, *a):
            launched.append((a[3], a[7], a[8]))
            return ext.matvec(*a)

    rows, cols = 8480, 256
    qt = _artifact(rows, cols, 3, 8, seed=7, device="cuda")
    planes = ag.kernel_layout(qt.planes)
    for bits in range(3, 9):
        for batch in (1, 4, 8):
            launched.clear()
            x = torch.randn(batch, cols, device="cuda").half()
            out = torch.full((batch, rows), float("nan"), dtype=torch.float16, device="cuda")
            y = ag.matvec(x, planes, qt.luts[bits], bits, cols // 32, out=out, ext=Recording())
            assert _rel_err(y, _reference(qt, x, bits)) < REL_TOL, (bits, batch)
            flags, tiles = ag.CANDIDATES[table[bits][batch] if bits >= 4 else "today"]
            if not ext.has_matvec(torch.float16, bits, 1, flags):  # a candidate built for other widths only
                flags, tiles = ag.CANDIDATES["today"]
            if tiles is None:
                tiles = ag.default_tiles(flags, bits, rows, cols // 32, batch, x.device, ext)
            assert launched == [(bits, flags, tiles)], (bits, batch, launched)


def test_one_bit_artifact(ext):
    qt = _artifact(40, 96, 1, 1, seed=5, device="cuda")
    x = torch.randn(2, 96, device="cuda").half()
    out = torch.full((2, 40), float("nan"), dtype=torch.float16, device="cuda")
    y = ag.matvec(x, ag.kernel_layout(qt.planes), qt.luts[1], 1, 3, out=out, ext=ext)
    assert _rel_err(y, _reference(qt, x, 1)) < REL_TOL


@pytest.mark.parametrize("flags", [ag.ALL_FLAGS | ag.FLAG_ROWS, ag.ALL_FLAGS | ag.FLAG_ROWS | ag.FLAG_OCC,
                                   ag.ALL_FLAGS | ag.FLAG_ROWS | ag.FLAG_CODE_PAIRS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_kernel_matches_reference_at_every_split(ext, dtype, flags):
    """The row-per-lane kernel at every cluster split 1..8 (sm_90; elsewhere split 1 only), batches 1..8, rows
    not a multiple of 64, a partial last word, from the rows layout and from the kernel layout (converted and
    kept), outputs poisoned before each launch."""
    rows, cols = 200, 2080
    qt = _artifact(rows, cols, 4, 8, seed=31, device="cuda")
    kplanes = ag.kernel_layout(qt.planes)
    rplanes = ag.rows_layout(kplanes)
    assert rplanes.shape == (8, 8, kplanes.shape[2], 32)
    words = -(-cols // 32)
    splits = range(1, ag.ROWS_MAX_SPLIT + 1) if torch.cuda.get_device_capability()[0] >= 9 else [1]
    g = torch.Generator(device="cuda").manual_seed(3)
    bias = torch.randn(rows, generator=g, device="cuda").to(dtype)
    widest = 0
    for bits in range(4, 9):
        if not ext.has_matvec(dtype, bits, 1, flags):
            continue  # code pairs: 4 bits only
        widest = bits
        for batch in (1, 2, 3, 5, 8):
            x = torch.randn(batch, cols, generator=g, device="cuda").to(dtype)
            ref = _reference(qt, x, bits, bias)
            for split in splits:
                for planes in (rplanes, kplanes):
                    out = torch.full((batch, rows), float("nan"), dtype=dtype, device="cuda")
                    y = ag.matvec(x, planes, qt.luts[bits], bits, words, bias, flags=flags, tiles=split, out=out,
                                  ext=ext)
                    assert torch.isfinite(y).all() and _rel_err(y, ref) < REL_TOL, (bits, batch, split)
    # converted once per width growth and kept with the planes: the widest width served so far
    assert kplanes._anyprec_rows_planes[1].shape == (widest,) + rplanes.shape[1:]
    x = torch.randn(1, cols, device="cuda").to(dtype)
    out = torch.empty(1, rows, dtype=dtype, device="cuda")
    with pytest.raises(RuntimeError, match="rows layout"):
        ext.matvec(x, kplanes, qt.luts[5], 5, words, None, out, flags, 1)
    with pytest.raises(RuntimeError, match="do not hold"):
        ext.matvec(x, rplanes[:, :6].contiguous(), qt.luts[5], 5, words, None, out, flags, 1)
    assert not ext.has_matvec(dtype, 3, 1, flags) and not ext.has_matvec(dtype, 5, 9, flags)


@pytest.mark.parametrize("flags", [0, 3, 4, 5, 6, 7, 15, 31, 39, 55, 103])
def test_every_built_variant_matches_reference(ext, flags):
    rows, cols = 72, 1024  # 32 words: the natural layout needs a multiple of 4
    qt = _artifact(rows, cols, 3, 8, seed=flags, device="cuda")
    planes = ag.kernel_layout(qt.planes) if flags & ag.FLAG_LAYOUT else qt.planes
    tested = 0
    for bits in range(3, 9):
        for tiles in (1, 2):
            if not ext.has_matvec(torch.float16, bits, tiles, flags):
                continue
            if flags & ag.FLAG_ROWS and tiles > 1 and torch.cuda.get_device_capability()[0] < 9:
                continue  # a split runs as a thread-block cluster: sm_90
            x = torch.randn(5, cols, device="cuda").half()
            out = torch.full((5, rows), float("nan"), dtype=torch.float16, device="cuda")
            y = ag.matvec(x, planes, qt.luts[bits], bits, cols // 32, flags=flags, tiles=tiles, out=out, ext=ext)
            assert _rel_err(y, _reference(qt, x, bits)) < REL_TOL, (bits, tiles)
            tested += 1
    if flags & ag.FLAG_CODE_PAIRS:  # 4 bits only, at splits 1 and 2 on sm_90
        assert tested >= (2 if torch.cuda.get_device_capability()[0] >= 9 else 1)
    else:
        assert tested >= 4  # every other flag set is built for several widths


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 5, 8])
def test_dequantize_kernel_is_exact(ext, dtype, bits):
    qt = _artifact(33, 1000, 2, 8, seed=bits, device="cuda")
    out = torch.full((33, 1000), float("nan"), dtype=dtype, device="cuda")
    w = ag.dequantize(qt.planes, qt.luts[bits], bits, 1000, dtype, out=out, ext=ext)
    assert torch.equal(w, qt.dequantize(dtype, bits=bits))


def test_quantlinear_serves_every_width_and_switches_at_run_time(ext, monkeypatch):
    qt = _artifact(96, 576, 3, 8, seed=11)
    bias = torch.randn(96) * 0.1
    layer = QuantLinear(qt, bias=bias, compute_dtype=torch.float16, bits=4).cuda()
    calls = []
    real = ag.matvec
    monkeypatch.setattr(ag, "matvec", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    x = torch.randn(2, 3, 576, device="cuda").half()  # leading dims flattened: 6 rows
    for bits in [4, 8, 3, 6]:
        layer.set_bits(bits)
        y = layer(x)
        assert y.shape == (2, 3, 96) and y.dtype == torch.float16
        ref = _reference(qt.to("cuda"), x.reshape(-1, 576), bits, bias.half().cuda()).reshape(2, 3, 96)
        assert _rel_err(y, ref) < REL_TOL, bits
    assert calls == [4, 8, 3, 6]  # the kernel served each width, no reload in between
    assert layer._anyprec_kernel_planes[1].shape[0] == 8  # one layout copy serves all widths


def test_large_batch_and_fp32_use_dequantize_and_the_weight_cache(ext):
    qt = _artifact(64, 256, 3, 6, seed=2)
    layer = QuantLinear(qt, compute_dtype=torch.float16, bits=5).cuda()
    rows = ag.MATVEC_MAX_ROWS["uncached"] + 1
    x = torch.randn(rows, 256, device="cuda").half()
    y = layer(x)
    assert _rel_err(y, _reference(qt.to("cuda"), x, 5)) < REL_TOL
    assert layer._cached[0] == (x.device, torch.float16, 5)
    layer.set_bits(6)  # a new width drops the cached 5-bit weight
    assert layer._cached is None
    x32 = torch.randn(3, 256, device="cuda")
    y32 = layer(x32)
    assert y32.dtype == torch.float32
    assert _rel_err(y32, _reference(qt.to("cuda"), x32, 6)) < 1e-5
    assert layer._cached[0] == (x.device, torch.float32, 6)


def test_matches_the_reference_path_of_the_same_module(ext):
    qt = _artifact(200, 4096, 3, 8, seed=9)
    bias = torch.randn(200)
    layer = QuantLinear(qt, bias=bias, compute_dtype=torch.bfloat16, bits=3).cuda()
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    y = layer(x)
    layer.use_kernels = False
    y_ref_path = layer(x)
    exact = _reference(qt.to("cuda"), x, 3, bias.bfloat16().cuda())
    assert _rel_err(y, exact) < REL_TOL
    # the reference path itself (cuBLAS, bf16 output) agrees with both up to bf16 rounding
    assert _rel_err(y_ref_path, exact) < 5e-3 and _rel_err(y, y_ref_path.float()) < 5e-3


def test_cuda_graph_capture_replays_the_kernel(ext):
    qt = _artifact(128, 2048, 3, 4, seed=4, device="cuda")
    planes = ag.kernel_layout(qt.planes)
    x = torch.randn(1, 2048, device="cuda").half()
    out = torch.empty(1, 128, dtype=torch.float16, device="cuda")
    ag.matvec(x, planes, qt.luts[3], 3, 64, out=out, ext=ext)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ag.matvec(x, planes, qt.luts[3], 3, 64, out=out, ext=ext)
    x.copy_(torch.randn(1, 2048, device="cuda").half())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, _reference(qt, x, 3)) < REL_TOL


@pytest.mark.parametrize("batch", [1, 8])
def test_overlapped_chain_waits_for_its_input(ext, batch):
    """With overlap (kernels/overlap.py) a matvec starts before the previous kernel ends and must wait
    for it before reading x: a chain of matvecs at k = 3, 4, 8, each on the previous one's output,
    eagerly and in a CUDA graph, with every output poisoned before each run; each link matches
    the reference on the input it got, and the chain equals the one launched without overlap bit for bit."""
    cols = 1024
    links = [(_artifact(cols, cols, 3, 8, seed=20 + bits, device="cuda"), bits) for bits in (3, 4, 8)]
    planes = [ag.kernel_layout(qt.planes) for qt, _ in links]
    x = torch.randn(batch, cols, device="cuda").half()
    outs = {flag: [torch.empty(batch, cols, dtype=torch.float16, device="cuda") for _ in links]
            for flag in (False, True)}

    def chain(flag):
        inp = x
        for (qt, bits), p, out in zip(links, planes, outs[flag]):
            ag.matvec(inp, p, qt.luts[bits], bits, cols // 32, out=out, ext=ext, overlapped=flag)
            inp = out

    for _ in replay_chains(chain, x, outs):
        inp = x
        for (qt, bits), out in zip(links, outs[True]):
            assert _rel_err(out, _reference(qt, inp, bits)) < REL_TOL
            inp = out
        for plain, overlapped in zip(outs[False], outs[True]):
            assert torch.equal(plain, overlapped)


def test_module_overlaps_once_its_planes_and_table_are_settled(ext, monkeypatch):
    """The matvec reads planes and table before waiting for the kernel before it (kernels/overlap.py):
    a module's first call with a (new) table launches without overlap, the next ones with it."""
    from quantkit.kernels import overlap

    monkeypatch.setattr(overlap.SWITCH, "on", True)  # whatever QUANTKIT_OVERLAP says
    layer = QuantLinear(_artifact(64, 256, 3, 8, seed=5), compute_dtype=torch.float16, bits=3).cuda()
    flags, real = [], ag.matvec
    monkeypatch.setattr(ag, "matvec", lambda *a, **kw: (flags.append(kw["overlapped"]), real(*a, **kw))[1])
    x = torch.randn(1, 256, device="cuda").half()
    outputs = [layer(x), layer(x)]
    layer.set_bits(4)
    outputs += [layer(x), layer(x)]
    assert flags == [False, True, False, True]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[2], outputs[3])


def test_fresh_rows_copy_launches_without_overlap(ext):
    """The row kernel reads its copy of the planes before waiting for the kernel before it: a launch that has just
    made (or widened) that copy goes without overlap, later ones with it."""
    flags = ag.ALL_FLAGS | ag.FLAG_ROWS
    if not ext.has_matvec(torch.float16, 4, 1, flags):
        pytest.skip("no row kernel built")
    launched = []

    class Recording:
        def __getattr__(self, attr):
            return getattr(ext, attr)

        def matvec(self, *a):
            launched.append(a[-1])
            return ext.matvec(*a)

    qt = _artifact(64, 256, 3, 8, seed=9, device="cuda")
    planes = ag.kernel_layout(qt.planes)
    x = torch.randn(1, 256, device="cuda").half()
    for bits in (4, 4, 6, 5, 6):
        y = ag.matvec(x, planes, qt.luts[bits], bits, 8, flags=flags, tiles=1, ext=Recording(), overlapped=True)
        assert _rel_err(y, _reference(qt, x, bits)) < REL_TOL, bits
    assert launched == [False, True, False, True, True]  # made at 4 bits, widened at 6, kept for 5 and 6


def test_bad_arguments_are_refused_with_the_shapes(ext):
    qt = _artifact(32, 128, 3, 4, device="cuda")
    planes = ag.kernel_layout(qt.planes)
    x = torch.randn(9, 128, device="cuda").half()
    out = torch.empty(9, 32, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="batch 9"):
        ext.matvec(x, planes, qt.luts[3], 3, 4, None, out, 7, 1)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        ext.matvec(x[:2].float(), planes, qt.luts[3], 3, 4, None, out[:2].float(), 7, 1)
    with pytest.raises(RuntimeError, match=r"lut must be .*\[32, 16\]"):
        ext.matvec(x[:2], planes, qt.luts[3], 4, 4, None, out[:2], 7, 1)
    with pytest.raises(RuntimeError, match="no kernel built"):
        ext.matvec(x[:2].bfloat16(), planes, qt.luts[3], 3, 4, None, out[:2].bfloat16(), 0, 1)
    assert not ext.has_matvec(torch.float16, 8, 2, 7)  # k = 8 tables do not fit twice


def test_unpack_matches_codes_read_by_the_dequantize_kernel(ext):
    # the dequantize kernel's bit order (plane p = code bit k-1-p) against the format's own
    qt = _artifact(8, 64, 4, 4, seed=1, device="cuda")
    lut = torch.arange(16, dtype=torch.float16, device="cuda").repeat(8, 1).contiguous()
    w = ag.dequantize(qt.planes, lut, 4, 64, torch.float32, ext=ext)
    assert torch.equal(w.long(), unpack_bitplanes(qt.planes, 64, 4))


def _dispatch_tool():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "anyprec_dispatch_table.py"
    spec = importlib.util.spec_from_file_location("anyprec_dispatch_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H100 = "NVIDIA H100 80GB HBM3"


def test_checked_in_dispatch_table_names_built_candidates():
    for gpu, table in anyprec_variants.CHOICES.items():
        assert gpu in anyprec_variants.SOURCES, gpu  # every entry says which run it came from
        for (rows, cols), per_width in table.items():
            assert rows > 0 and cols > 0, (gpu, rows, cols)
            for bits, per_batch in per_width.items():
                for batch, name in per_batch.items():
                    assert name in ag.CANDIDATES and 1 <= batch <= ag.MAX_BATCH, (gpu, bits, batch, name)
                    assert 4 <= bits <= 8 or name == "today", (gpu, bits, name)  # variants: k >= 4 only
    assert anyprec_variants.choice("a GPU the table does not name", 5, 1, 4096, 4096) == "today"


def test_shape_class_is_the_nearest_measured_shape_within_a_factor_of_two():
    shapes = [(4096, 4096), (11008, 4096), (4096, 11008), (28672, 8192)]
    cls = anyprec_variants.shape_class
    for s in shapes:
        assert cls(shapes, *s) == s
    assert cls(shapes, 6144, 4096) == (4096, 4096)  # log distance 0.41 against 0.58
    assert cls(shapes, 7000, 4096) == (11008, 4096)
    assert cls(shapes, 4096, 14336) == (4096, 11008)
    assert cls(shapes, 28672, 4096) == (28672, 8192)  # half the cols; 11008x4096 is 2.6x away in rows
    assert cls(shapes, 65536, 4096) is None
    assert cls([(4096, 4096)], 8192, 2048) == (4096, 4096)  # exactly 2x either way: still within
    assert cls([(4096, 4096)], 8193, 4096) is None
    assert cls(shapes, 576, 576) is None
    assert cls([], 4096, 4096) is None


def test_choose_variant_launches_what_the_table_names_for_the_shape(monkeypatch):
    """CPU part of the dispatch: for every measured shape of the checked-in H100 table, and one shape near
    each, choose_variant returns the named candidate's flags with its tile rule at every batch 1..8; far shapes
    keep today's."""
    class Built:
        def has_matvec(self, dtype, bits, tiles, flags):
            return True

    monkeypatch.setattr(ag, "_gpu_names", {0: H100})
    monkeypatch.setattr(ag, "_sm_counts", {0: 132})
    monkeypatch.setattr(ag, "_variant_cache", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    device = torch.device("cuda", 0)
    table = anyprec_variants.CHOICES["H100"]
    named = set()
    for rows, cols in table:
        for near in ((rows, cols), (rows * 5 // 4, cols * 7 // 8)):
            for bits in range(3, 9):
                for batch in range(1, 9):
                    per_batch = table[(rows, cols)].get(bits, {})
                    shared = per_batch.get(1) if per_batch.get(1) == per_batch.get(8) else None
                    # batches 2..7 are not in the table: they take what batch 1 and 8 share
                    name = per_batch.get(batch, shared if 1 < batch < 8 else None) or "today"
                    if near != (rows, cols) and anyprec_variants.shape_class(table, *near) != (rows, cols):
                        continue  # the nudged shape fell into a neighbour's class
                    named.add(name)
                    flags, tiles = ag.choose_variant(bits, near[0], batch, device, torch.float16, Built(),
                                                     near[1] // 32)
                    want_flags, want_tiles = ag.CANDIDATES[name]
                    if want_tiles is None:
                        want_tiles = ag.default_tiles(want_flags, bits, near[0], near[1] // 32, batch, device, Built())
                    assert (flags, tiles) == (want_flags, want_tiles), (near, bits, batch, name)
    assert {"today", "rows"} <= named  # the table does shape-dependent work
    for rows, cols in ((576, 576), (128256, 4096)):  # near no measured shape
        for bits in range(4, 9):
            assert ag.choose_variant(bits, rows, 1, device, torch.float16, Built(), cols // 32)[0] == ag.ALL_FLAGS


def _fake_run(times, device=H100):
    """A bench_anyprec_variants.py JSON from {(shape, bits, batch): {name: us}}."""
    return {"info": {"device": device, "date": "d", "commit": "c"},
            "rows": [{"shape": list(shape), "bits": bits, "batch": batch, "cublas_us": cands.get("cublas", 200.0),
                      "candidates": {name: {"us": us} for name, us in cands.items() if name != "cublas"}}
                     for (shape, bits, batch), cands in times.items()]}


def test_dispatch_tool_picks_per_shape_only_candidates_faster_in_every_run():
    tool = _dispatch_tool()
    big, small = (28672, 8192), (4096, 4096)
    a = _fake_run({
        (big, 6, 1): {"today": 100, "rows": 70, "rows_occ": 65, "pair": 97},
        (small, 6, 1): {"today": 10, "rows": 12, "pair": 9.5},  # rows loses here: the small class keeps pair
        (big, 6, 8): {"today": 100, "rows": 70},
        (small, 6, 8): {"today": 10, "rows": 9.9},  # 1 % is noise, not a gain
        (big, 7, 1): {"today": 100, "rows": 80, "rows_s1": 80},  # one instance under two names: the first
        (big, 7, 8): {"today": 100, "rows": 75, "rows_s1": 70},
        (small, 7, 1): {"today": 10, "rows": 8, "pair": 9},  # rows faster in run a only
    })
    b = _fake_run({
        (big, 6, 1): {"today": 101, "rows": 71, "rows_occ": 75, "pair": 97, "cublas": 190},  # rows_occ loses
        (small, 6, 1): {"today": 10, "rows": 12, "pair": 9.5},
        (big, 6, 8): {"today": 100, "rows": 71},
        (small, 6, 8): {"today": 10, "rows": 9.9},
        (big, 7, 1): {"today": 100, "rows": 80, "rows_s1": 80},
        (big, 7, 8): {"today": 100, "rows": 75, "rows_s1": 70},
        (small, 7, 1): {"today": 10, "rows": 11, "pair": 9},
    })
    cases = tool.combine([a["rows"], b["rows"]])
    chosen = tool.choose(cases, min_gain=0.02)
    evidence = tool.served(cases, chosen)
    assert chosen[big][6] == {1: "rows", 8: "rows"}  # only measured batches are written (2..7: see choice below)
    assert chosen[small][6] == {1: "pair"}
    assert chosen[big][7] == {1: "rows", 8: "rows_s1"}  # they differ: batches 2..7 keep today's kernel
    assert chosen[small][7] == {1: "pair"}
    kept = tool.choose(cases, min_gain=0.02, today_widths=(6,))  # 6 bits: today's everywhere
    assert all(6 not in per_shape for per_shape in kept.values()) and kept[big][7] == chosen[big][7]
    # the rule's promise: on every measured case the choice is no slower than today's kernel in any run
    for run in (a, b):
        for r in run["rows"]:
            name = chosen[tuple(r["shape"])].get(r["bits"], {}).get(r["batch"], "today")
            assert r["candidates"][name]["us"] <= r["candidates"]["today"]["us"], r
    rows = tool.summary(evidence)
    first = next(r for r in rows if r["shape"] == list(big) and r["bits"] == 6 and r["batch"] == 1)
    assert first["chosen"] == "rows" and first["today_us"] == 101 and first["chosen_us"] == 71
    # kernels at their slowest time, cuBLAS at its fastest
    assert first["chosen_x_cublas"] == round(190 / 71, 3) and first["today_x_cublas"] == round(190 / 101, 3)

    # --widths: only 7 bits from these runs; 6 bits keeps the table's entries, and the summary reports what is served
    table = {big: {6: {1: "rows_occ"}, 8: {1: "rows"}}, small: {6: {1: "pair_occ"}}}
    merged = tool.merge_widths(table, chosen, [7])
    assert merged[big] == {6: {1: "rows_occ"}, 7: chosen[big][7], 8: {1: "rows"}}
    assert merged[small] == {6: {1: "pair_occ"}, 7: chosen[small][7]}
    served = {(r["shape"][0], r["shape"][1], r["bits"], r["batch"]): r["chosen"]
              for r in tool.summary(tool.served(cases, merged))}
    assert served[big + (6, 1)] == "rows_occ" and served[big + (6, 8)] == "today" and served[big + (7, 8)] == "rows_s1"

    text = tool.render({"H100": chosen}, {"H100": {"device": H100, "date": "d", "commits": ["c"], "runs": 2}})
    namespace = {}
    exec(compile(text, "anyprec_variants", "exec"), namespace)
    assert all(namespace["choice"](H100, 6, b, 28672, 8192) == "rows" for b in range(1, 9))  # 1 and 8 agree
    assert namespace["choice"](H100, 6, 3, 22016, 8192) == "rows"  # nearest the big class
    assert [namespace["choice"](H100, 7, b, 28672, 8192) for b in (1, 2, 7, 8)] == ["rows", "today", "today",
                                                                                      "rows_s1"]  # they differ
    assert namespace["choice"](H100, 6, 1, 5120, 5120) == "pair"  # nearest the small class
    assert namespace["choice"](H100, 7, 3, 28672, 8192) == "today"
    assert namespace["choice"](H100, 6, 1, 512, 512) == "today"  # near no measured shape
    assert namespace["choice"]("NVIDIA H200", 6, 1, 28672, 8192) == "today"


def test_dispatch_tool_never_picks_a_candidate_slower_on_its_shape():
    """Random timings of two runs: every choice is at least min_gain faster than today's kernel on the
    shape it is named for, by the slowest time of each."""
    tool = _dispatch_tool()
    g = torch.Generator().manual_seed(3)
    shapes = [(4096, 4096), (11008, 4096), (28672, 8192)]
    runs = []
    for _ in range(2):
        times = {}
        for shape in shapes:
            for bits in (4, 8):
                for batch in (1, 8):
                    us = (50 + 100 * torch.rand(len(ag.CANDIDATES), generator=g)).tolist()
                    times[(shape, bits, batch)] = dict(zip(ag.CANDIDATES, us))
        runs.append(_fake_run(times)["rows"])
    chosen = tool.choose(tool.combine(runs), min_gain=0.02)
    assert any(per_width for per_width in chosen.values())  # random timings do pick something
    for shape in shapes:
        for bits in (4, 8):
            for batch in (1, 8):
                name = chosen[shape].get(bits, {}).get(batch)
                cases = [next(r for r in run if tuple(r["shape"]) == shape and (r["bits"], r["batch"]) == (bits, batch))
                         for run in runs]
                slowest = {n: max(c["candidates"][n]["us"] for c in cases) for n in ag.CANDIDATES}
                faster = [n for n in ag.CANDIDATES if slowest[n] <= 0.98 * slowest["today"]]
                if name is None:
                    assert not faster, (shape, bits, batch)
                else:
                    assert name in faster and slowest[name] == min(slowest[n] for n in faster), (shape, bits, batch)
