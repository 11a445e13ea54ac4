// Any-precision seed + incremental upscaling on the CPU (Any-Precision LLM §4; SqueezeLLM seed).
// Python caller: quantkit/methods/kmeans_native.py (which documents the arguments again); the plain-Python
// reference there computes the same results brute force, and the tests hold this file to it exactly.
//
// Every output row r of W [R, n] is an independent weighted 1-D clustering problem, so rows are spread
// over OpenMP threads; a row runs all its stages in one go while its arrays are in cache (joint needs a
// second pass over the rows), and the thread-seconds of every stage are returned:
//
//   prepare  sort the row (LSD radix sort of 64-bit keys: order-preserving float bits << 32 | column),
//            merge equal values (their weights add: an optimal 1-D partition never separates equal
//            values), and take fp64 prefix sums P0 = Σw, P1 = Σwx, P2 = Σwx² over the m distinct values.
//            Any run [i, j) of sorted values then has weighted SSE S(i, j) = ΔP2 − ΔP1²/ΔP0 in O(1).
//   seed     the exact weighted k-means optimum with K = 2^s clusters: in 1-D optimal clusters are runs,
//            F_k(j) = min_i F_{k-1}(i) + S(i, j), and S is Monge, so the argmin i is non-decreasing in j
//            and each layer costs O(m log m) evaluations of S (dp_layer). Rows j of a layer whose value
//            exceeds an upper bound on the optimum are pruned (a few Lloyd steps give the bound), which skips
//            ~30 % of them. joint also needs the 2K optimum: the same layers, continued (kmeans_dp_more),
//            bounded by the split result's (s+1)-bit SSE and, in layer k > K, starting at the K optimum's
//            (k-K)-th cut.
//   split    per extra bit, every run is cut in two at the exact weighted 2-means optimum of its own
//            members (scan of all cuts), children 2j, 2j+1 refine run j: codes nest, code_b = code_p >> (p-b).
//   joint    (optional) nested partitions chosen for J = Σ_b λ_b SSE_b over b = s..p (joint_row), then the
//            seed tolerance: rows go back to split until the matrix's seed-width SSE is within it.
//   finish   b-bit tables = weighted means of the b-bit runs, per-level SSE, parent codes per column.
//
// A clustering of a row is stored as its leaf cuts: cuts[0] = 0 <= cuts[1] <= ... <= cuts[2^p] = m,
// leaf l = sorted distinct values [cuts[l], cuts[l+1]); the b-bit run j is [cuts[j·2^(p-b)], cuts[(j+1)·2^(p-b)]).
// Ties go to the lowest index everywhere and sums over rows are serial, so results do not depend on the
// thread count. Every pruning and search bound below keeps the first argmin of each scan (in exact
// arithmetic), so the results are those of the brute-force reference.
//
// Instruction sets: the algorithms (the part of this file after "#else  // ANYPREC_ISA_PASS") are compiled
// twice, by including this file into itself: plain (namespace generic) and with AVX2 enabled (namespace
// avx2), where the scans "first argmin of a cost over a run of candidates" evaluate four candidates per
// step. Both compute every cost with the same IEEE operations in the same order (no FMA contraction:
// neither target enables FMA), so they return the same bits; AVX2 is used where the CPU has it (the build
// itself stays portable: no -march flags). Memory: per thread O(n); with joint 16 bytes per weight while a
// matrix is processed, kept between calls (up to kArenaMaxBytes) so that it is not faulted in again for
// every matrix.

#ifndef ANYPREC_ISA_PASS
// ============================================================================ common part (compiled once)

#ifndef ANYPREC_CPU_CORE_ONLY  // defined only to build the algorithms without torch, for profiling
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include "check.h"  // QK_CHECK: messages with numbers without iostreams
#endif

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace anyprec {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Arrays read by the 4-wide scans are padded: readable (and finite) this many entries past their end.
constexpr int kPad = 8;

// Time per stage, per thread: lap(stage) charges the time since the last lap to `stage`. Summed over
// the threads this is each stage's thread-seconds (a steady clock: ~25 ns a lap, cheap per row).
enum Stage { kPrepare, kSeed, kSplit, kJoint, kFinish, kStages };
const char* const kStageNames[kStages] = {"prepare", "seed", "split", "joint", "finish"};

struct StageClock {
  double seconds[kStages] = {0, 0, 0, 0, 0};
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Stage stage) {
    const auto now = std::chrono::steady_clock::now();
    seconds[stage] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// Outputs of quantize_rows (allocated by the caller): codes [R, n], luts[b - s] [R, 2^b], sse [R, levels],
// obj [R, 2] (zeroed by the caller); the stage thread-seconds and the wall time are filled in.
struct Outputs {
  uint8_t* codes;
  std::vector<double*> luts;
  double* sse;
  double* obj;
  double stage_seconds[kStages] = {0, 0, 0, 0, 0};
  double wall = 0;
};

// joint keeps every prepared row of a matrix for its second pass. That buffer is kept between calls (up to
// this size), so consecutive matrices reuse memory that is already mapped instead of faulting fresh pages
// in (which cost ~10 % of the joint rule's time on SmolLM2). A second caller at the same time allocates its own.
constexpr size_t kArenaMaxBytes = size_t(256) << 20;
struct Arena {
  std::mutex mu;
  std::vector<unsigned char> buf;
};
inline Arena& arena() {
  static Arena a;
  return a;
}

}  // namespace anyprec

#define ANYPREC_ISA_PASS 1
namespace anyprec {
namespace generic {
#include __FILE__
}  // namespace generic
}  // namespace anyprec
#undef ANYPREC_ISA_PASS

#define ANYPREC_ISA_PASS 2
#pragma GCC push_options
#pragma GCC target("avx2")
namespace anyprec {
namespace avx2 {
#include __FILE__
}  // namespace avx2
}  // namespace anyprec
#pragma GCC pop_options
#undef ANYPREC_ISA_PASS

namespace anyprec {

// isa: "auto" (AVX2 where the CPU has it), "generic" or "avx2"; returns the one used, or "" when the
// request cannot be met.
inline std::string pick_isa(const std::string& isa) {
  __builtin_cpu_init();
  const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (isa == "generic") return "generic";
  if (isa == "avx2") return has_avx2 ? "avx2" : "";
  if (isa == "auto") return has_avx2 ? "avx2" : "generic";
  return "";
}

inline int64_t quantize_rows(const std::string& isa, const float* w, const double* sv, int64_t sens_stride, int64_t R,
                             int64_t n, int s, int p, bool joint, const std::vector<double>& level_weights,
                             int64_t window, double seed_tolerance, int nthreads, Outputs& out) {
  if (isa == "avx2")
    return avx2::quantize_rows(w, sv, sens_stride, R, n, s, p, joint, level_weights, window, seed_tolerance, nthreads,
                               out);
  return generic::quantize_rows(w, sv, sens_stride, R, n, s, p, joint, level_weights, window, seed_tolerance, nthreads,
                                out);
}

inline int64_t kmeans_exact_rows(const std::string& isa, const float* w, const double* sv, int64_t sens_stride,
                                 int64_t R, int64_t n, int K, int nthreads, int32_t* cuts, double* inertia) {
  if (isa == "avx2") return avx2::kmeans_exact_rows(w, sv, sens_stride, R, n, K, nthreads, cuts, inertia);
  return generic::kmeans_exact_rows(w, sv, sens_stride, R, n, K, nthreads, cuts, inertia);
}

}  // namespace anyprec

#ifndef ANYPREC_CPU_CORE_ONLY
// The two entry points' inputs: W fp32 [R, n] and its sensitivity fp64 [n] or [R, n], contiguous, on the CPU.
void check_rows(const at::Tensor& W, const at::Tensor& sens, const char* fn) {
  QK_CHECK(W.device().is_cpu() && W.scalar_type() == at::kFloat && W.dim() == 2 && W.is_contiguous(), fn,
           ": W must be a contiguous fp32 CPU matrix, got ", W.scalar_type(), " ", W.sizes(), " on ", W.device());
  QK_CHECK(sens.device().is_cpu() && sens.scalar_type() == at::kDouble && sens.is_contiguous(), fn,
           ": sensitivity must be contiguous fp64 on the CPU, got ", sens.scalar_type(), " on ", sens.device());
  const int64_t R = W.size(0), n = W.size(1);
  QK_CHECK((sens.dim() == 1 && sens.size(0) == n) || (sens.dim() == 2 && sens.size(0) == R && sens.size(1) == n), fn,
           ": sensitivity must be [", n, "] or [", R, ", ", n, "], got ", sens.sizes());
  QK_CHECK(n >= 1 && n < (int64_t(1) << 31), fn, ": row length ", n, " out of range");
}

std::string available_isa(const std::string& isa, const char* fn) {
  const std::string used = anyprec::pick_isa(isa);
  QK_CHECK(!used.empty(), fn, ": instruction set ", isa, " is not available (auto, generic, avx2)");
  return used;
}

// W fp32 [R, n]; sens fp64 [n] (one weight per column, all rows) or [R, n]; 1 <= s <= p <= 8;
// joint: level_weights [p-s+1], window, seed_tolerance (< 0: no limit on the seed width's SSE);
// isa: "auto", "generic" or "avx2" (the same results; for tests and measurements).
// Returns (codes uint8 [R, n] of the p-bit parent, [lut_b fp64 [R, 2^b] for b = s..p], sse fp64 [R, p-s+1],
// objective fp64 [R, 2] = (J of split, J of the result) (zeros unless joint), seconds: "wall" of the call
// and the thread-seconds of every stage, summed over threads).
std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, std::map<std::string, double>> quantize(
    const at::Tensor& W, const at::Tensor& sens, int64_t seed_bits, int64_t parent_bits, bool joint,
    const std::vector<double>& level_weights, int64_t window, double seed_tolerance, int64_t threads,
    const std::string& isa) {
  check_rows(W, sens, "anyprec_cpu");
  const int64_t R = W.size(0), n = W.size(1);
  QK_CHECK(1 <= seed_bits && seed_bits <= parent_bits && parent_bits <= 8,
              "anyprec_cpu: need 1 <= seed_bits <= parent_bits <= 8, got ", seed_bits, " and ", parent_bits);
  const int s = static_cast<int>(seed_bits), p = static_cast<int>(parent_bits);
  const int levels = p - s + 1;
  QK_CHECK(!joint || static_cast<int>(level_weights.size()) == levels, "anyprec_cpu: ", levels,
              " level weights needed for bits ", s, "..", p, ", got ", level_weights.size());
  for (double v : level_weights) QK_CHECK(v > 0 && std::isfinite(v), "anyprec_cpu: level weights must be > 0");
  QK_CHECK(window >= 0 && window <= 4096, "anyprec_cpu: window must be in 0..4096, got ", window);
  const std::string used = available_isa(isa, "anyprec_cpu");
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();

  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor codes = at::empty({R, n}, at::TensorOptions().dtype(at::kByte));
  at::Tensor sse = at::empty({R, levels}, opts);
  at::Tensor obj = at::zeros({R, 2}, opts);
  std::vector<at::Tensor> luts;
  for (int b = s; b <= p; ++b) luts.push_back(at::empty({R, int64_t(1) << b}, opts));
  anyprec::Outputs out;
  out.codes = codes.data_ptr<uint8_t>();
  for (auto& t : luts) out.luts.push_back(t.data_ptr<double>());
  out.sse = sse.data_ptr<double>();
  out.obj = obj.data_ptr<double>();
  int64_t bad;
  {
    pybind11::gil_scoped_release no_gil;
    bad = anyprec::quantize_rows(used, W.data_ptr<float>(), sens.data_ptr<double>(), sens.dim() == 2 ? n : 0, R, n,
                                 s, p, joint, level_weights, window, seed_tolerance, nthreads, out);
  }
  QK_CHECK(bad < 0, "anyprec_cpu: row ", bad, " has a weight that is not finite or a sensitivity that is "
              "negative or not finite");
  std::map<std::string, double> secs;
  secs["wall"] = out.wall;
  for (int k = 0; k < anyprec::kStages; ++k) secs[anyprec::kStageNames[k]] = out.stage_seconds[k];
  return {codes, luts, sse, obj, secs};
}

// Exact weighted k-means with K runs for every row (the seed stage alone): cuts int32 [R, K+1] over the
// sorted distinct values, and the inertia fp64 [R]. For tests and measurements.
std::tuple<at::Tensor, at::Tensor> kmeans_exact(const at::Tensor& W, const at::Tensor& sens, int64_t K,
                                                int64_t threads, const std::string& isa) {
  check_rows(W, sens, "kmeans_exact");
  QK_CHECK(K >= 1 && K <= 65536, "kmeans_exact: K out of range");
  const std::string used = available_isa(isa, "kmeans_exact");
  const int64_t R = W.size(0), n = W.size(1);
  at::Tensor cuts = at::empty({R, K + 1}, at::TensorOptions().dtype(at::kInt));
  at::Tensor inertia = at::empty({R}, at::TensorOptions().dtype(at::kDouble));
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  int64_t bad;
  {
    pybind11::gil_scoped_release no_gil;
    bad = anyprec::kmeans_exact_rows(used, W.data_ptr<float>(), sens.data_ptr<double>(), sens.dim() == 2 ? n : 0, R,
                                     n, static_cast<int>(K), nthreads, cuts.data_ptr<int32_t>(),
                                     inertia.data_ptr<double>());
  }
  QK_CHECK(bad < 0, "kmeans_exact: row ", bad, " has a weight that is not finite or a sensitivity that "
              "is negative or not finite");
  return {cuts, inertia};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Any-precision seed (exact weighted 1-D k-means) and nested upscaling on the CPU (anyprec_cpu.cpp)";
  m.def("quantize", &quantize,
        "Seed at seed_bits, upscale to parent_bits (split, or joint with level_weights, window and "
        "seed_tolerance); returns "
        "(codes uint8 [R, n], [lut_b fp64 [R, 2^b]], sse fp64 [R, levels], objective fp64 [R, 2], stage seconds).",
        py::arg("W"), py::arg("sens"), py::arg("seed_bits"), py::arg("parent_bits"), py::arg("joint"),
        py::arg("level_weights"), py::arg("window"), py::arg("seed_tolerance"), py::arg("threads"),
        py::arg("isa") = "auto");
  m.def("kmeans_exact", &kmeans_exact, "Exact weighted k-means of every row: (cuts int32 [R, K+1], inertia fp64 [R]).",
        py::arg("W"), py::arg("sens"), py::arg("K"), py::arg("threads"), py::arg("isa") = "auto");
  m.def("isa", &anyprec::pick_isa, "The instruction set a request (auto, generic, avx2) runs on ('' if unavailable).",
        py::arg("isa") = "auto");
}
#endif  // ANYPREC_CPU_CORE_ONLY

#else  // ANYPREC_ISA_PASS
// ============================================================================ per instruction set (twice)
#define AP_AVX2 (ANYPREC_ISA_PASS == 2)
#define AP_INLINE inline __attribute__((always_inline))

namespace {

// One prepared row: m sorted distinct values and fp64 prefix sums over them; P0..P2 are padded (kPad
// entries past m, equal to the last one, so that a scan reading past its run computes finite values).
struct Row {
  int m;
  const double* x;   // [m] ascending
  const double* P0;  // [m+1] Σ w
  const double* P1;  // [m+1] Σ w x
  const double* P2;  // [m+1] Σ w x²

  // weighted SSE of run [i, j) around its weighted mean. Weights are >= 0, so a run without weight has
  // ΔP1 = ΔP2 = 0 exactly and dividing by 1 instead of ΔP0 = 0 gives its SSE, 0, without a branch.
  AP_INLINE double S(int i, int j) const {
    const double sw = P0[j] - P0[i], s1 = P1[j] - P1[i];
    return (P2[j] - P2[i]) - s1 * s1 / (sw > 0 ? sw : 1.0);
  }
  AP_INLINE bool has_weight(int i, int j) const { return P0[j] - P0[i] > 0; }
  AP_INLINE double mean(int i, int j) const { return (P1[j] - P1[i]) / (P0[j] - P0[i]); }
};

// ---------------------------------------------------------------- scans: first argmin over a run of candidates

#if AP_AVX2
// Row::S lane by lane, from the differences of the three prefix sums (weight, first and second moment)
AP_INLINE __m256d S4_of(__m256d sw, __m256d s1, __m256d d2) {
  const __m256d den = _mm256_blendv_pd(_mm256_set1_pd(1.0), sw, _mm256_cmp_pd(sw, _mm256_setzero_pd(), _CMP_GT_OQ));
  return _mm256_sub_pd(d2, _mm256_div_pd(_mm256_mul_pd(s1, s1), den));
}
// S(i, j) for the four i = i0..i0+3 and one j (whose prefix sums are broadcast in pj0..pj2)
AP_INLINE __m256d S4_to(const Row& row, int i0, __m256d pj0, __m256d pj1, __m256d pj2) {
  return S4_of(_mm256_sub_pd(pj0, _mm256_loadu_pd(row.P0 + i0)), _mm256_sub_pd(pj1, _mm256_loadu_pd(row.P1 + i0)),
               _mm256_sub_pd(pj2, _mm256_loadu_pd(row.P2 + i0)));
}
// S(i, j) for one i (broadcast in pi0..pi2) and the four j = j0..j0+3
AP_INLINE __m256d S4_from(const Row& row, __m256d pi0, __m256d pi1, __m256d pi2, int j0) {
  return S4_of(_mm256_sub_pd(_mm256_loadu_pd(row.P0 + j0), pi0), _mm256_sub_pd(_mm256_loadu_pd(row.P1 + j0), pi1),
               _mm256_sub_pd(_mm256_loadu_pd(row.P2 + j0), pi2));
}
AP_INLINE __m256d bcast(const double* p) { return _mm256_broadcast_sd(p); }
AP_INLINE __m256d hmin(__m256d v) {
  const __m256d t = _mm256_min_pd(v, _mm256_permute_pd(v, 5));
  return _mm256_min_pd(t, _mm256_permute2f128_pd(t, t, 1));
}
#endif

// The first c in [a, b] (b >= a) minimising cost(c), and *val = that minimum; one(c) is the cost, vec(c)
// the costs of c..c+3 (lanes past b are ignored; they must read only padded memory). Lowest index on ties.
#if AP_AVX2
// kTail[k]: lanes k+1..3 set (all bits), for masking a step of 4 whose last valid lane is k
alignas(32) constexpr uint64_t kTail[4][4] = {
    {0, ~0ull, ~0ull, ~0ull}, {0, 0, ~0ull, ~0ull}, {0, 0, 0, ~0ull}, {0, 0, 0, 0}};
inline __m256d tail_mask(int last) { return _mm256_load_pd(reinterpret_cast<const double*>(kTail[last])); }
#endif

template <class One, class Vec>
AP_INLINE int argmin_range(int a, int b, const One& one, const Vec& vec, double* val) {
#if AP_AVX2
  const __m256d inf = _mm256_set1_pd(kInf);
  if (b - a < 4) {  // most scans: one step, no loop
    const __m256d v = _mm256_blendv_pd(vec(a), inf, tail_mask(b - a));
    const __m256d t = hmin(v);
    const int hit = _mm256_movemask_pd(_mm256_cmp_pd(v, t, _CMP_EQ_OQ));
    if (hit != 0) {
      // the minimum (equal entries differ at most in the sign of a zero, which no later step tells apart)
      *val = _mm256_cvtsd_f64(t);
      return a + __builtin_ctz(static_cast<unsigned>(hit));
    }  // (only with NaN costs) fall through to the scalar scan
  } else {
    __m256d best = inf, bidx = _mm256_set1_pd(a);
    __m256d idx = _mm256_add_pd(_mm256_set1_pd(a), _mm256_set_pd(3, 2, 1, 0));
    const __m256d four = _mm256_set1_pd(4.0);
    int c = a;
    for (; c + 3 <= b; c += 4) {
      const __m256d v = vec(c);
      bidx = _mm256_blendv_pd(bidx, idx, _mm256_cmp_pd(v, best, _CMP_LT_OQ));
      best = _mm256_min_pd(v, best);  // v where v < best, else best: the first minimum of each lane stays
      idx = _mm256_add_pd(idx, four);
    }
    if (c <= b) {
      const __m256d v = _mm256_blendv_pd(vec(c), inf, tail_mask(b - c));
      bidx = _mm256_blendv_pd(bidx, idx, _mm256_cmp_pd(v, best, _CMP_LT_OQ));
      best = _mm256_min_pd(v, best);
    }
    const __m256d t = hmin(best);
    const __m256d cand = _mm256_blendv_pd(inf, bidx, _mm256_cmp_pd(best, t, _CMP_EQ_OQ));
    const double k = _mm256_cvtsd_f64(hmin(cand));
    if (k < kInf) {
      *val = _mm256_cvtsd_f64(t);
      return static_cast<int>(k);
    }
  }
#else
  (void)vec;
#endif
  double best = kInf;
  int bc = a;
  for (int c = a; c <= b; ++c) {
    const double v = one(c);
    const bool lt = v < best;  // branch-free: where the minimum lies is unpredictable
    best = lt ? v : best;
    bc = lt ? c : bc;
  }
  *val = best;
  return bc;
}

// first argmin over i in [a, b] of F[i] + S(i, j)
AP_INLINE int argmin_F_plus_S(const Row& row, const double* F, int a, int b, int j, double* val) {
#if AP_AVX2
  const __m256d pj0 = bcast(row.P0 + j), pj1 = bcast(row.P1 + j), pj2 = bcast(row.P2 + j);
  auto vec = [&](int i) { return _mm256_add_pd(_mm256_loadu_pd(F + i), S4_to(row, i, pj0, pj1, pj2)); };
#else
  auto vec = [](int) { return 0; };
#endif
  return argmin_range(a, b, [&](int i) { return F[i] + row.S(i, j); }, vec, val);
}

#if !AP_AVX2  // (used by run_B only)
// first argmin over c in [a, b] of S(x, c) + G[c]
AP_INLINE int argmin_S_plus_G(const Row& row, const double* G, int a, int b, int x, double* val) {
  auto vec = [](int) { return 0; };
  return argmin_range(a, b, [&](int c) { return row.S(x, c) + G[c]; }, vec, val);
}
#endif

// Exact weighted 2-means cut of run [lo, hi): the first x in [lo, hi] minimising S(lo, x) + S(x, hi).
AP_INLINE int best_cut(const Row& row, int lo, int hi) {
#if AP_AVX2
  const __m256d pl0 = bcast(row.P0 + lo), pl1 = bcast(row.P1 + lo), pl2 = bcast(row.P2 + lo);
  const __m256d ph0 = bcast(row.P0 + hi), ph1 = bcast(row.P1 + hi), ph2 = bcast(row.P2 + hi);
  auto vec = [&](int c) { return _mm256_add_pd(S4_from(row, pl0, pl1, pl2, c), S4_to(row, c, ph0, ph1, ph2)); };
#else
  auto vec = [](int) { return 0; };
#endif
  double value;
  return argmin_range(lo, hi, [&](int c) { return row.S(lo, c) + row.S(c, hi); }, vec, &value);
}

// first argmin over c in [a, b] of u[c] + v[c] (arrays readable 3 entries past b)
AP_INLINE int argmin_sum(const double* u, const double* v, int a, int b, double* val) {
#if AP_AVX2
  auto vec = [&](int c) { return _mm256_add_pd(_mm256_loadu_pd(u + c), _mm256_loadu_pd(v + c)); };
#else
  auto vec = [](int) { return 0; };
#endif
  return argmin_range(a, b, [&](int c) { return u[c] + v[c]; }, vec, val);
}

// For k = 0..hi-lo: outL[k] = S(lo, lo + k) and outR[k] = S(lo + k, hi) (either may be null; the arrays
// must have 3 entries of room past hi - lo)
inline void S_span(const Row& row, int lo, int hi, double* outL, double* outR) {
  int k = 0;
#if AP_AVX2
  const __m256d pl0 = bcast(row.P0 + lo), pl1 = bcast(row.P1 + lo), pl2 = bcast(row.P2 + lo);
  const __m256d ph0 = bcast(row.P0 + hi), ph1 = bcast(row.P1 + hi), ph2 = bcast(row.P2 + hi);
  for (; lo + k <= hi; k += 4) {
    if (outL) _mm256_storeu_pd(outL + k, S4_from(row, pl0, pl1, pl2, lo + k));
    if (outR) _mm256_storeu_pd(outR + k, S4_to(row, lo + k, ph0, ph1, ph2));
  }
#else
  for (; lo + k <= hi; ++k) {
    if (outL) outL[k] = row.S(lo, lo + k);
    if (outR) outR[k] = row.S(lo + k, hi);
  }
#endif
}

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<uint64_t> keys, keys2;
  std::vector<double> x, P0, P1, P2, wsum;  // the prepared row (padded)
  std::vector<int32_t> rank;
  std::vector<double> fa, fb, fc, buf2;
  std::vector<int> ia, ib, ic, id;
  std::vector<int> cuts_a, cuts_b, cuts_c, cuts_d;
  double *dp_F = nullptr, *dp_G = nullptr;  // kmeans_dp's last layer, for kmeans_dp_more
  std::vector<double> sa, sb;  // refine_seed: S rows of one transition's window pairs
  std::vector<double> la[2];  // look-ahead arrays of two consecutive levels
  std::vector<int> lai[2];
};

// ---------------------------------------------------------------- prepare

// Sort (value, column) keys by value with an LSD radix sort over the 32 value bits, 8 at a time;
// a pass whose digit is the same for every key is skipped.
void radix_sort(std::vector<uint64_t>& keys, std::vector<uint64_t>& tmp, int n) {
  uint32_t hist[4][256];
  std::memset(hist, 0, sizeof(hist));
  for (int i = 0; i < n; ++i) {
    const uint32_t v = static_cast<uint32_t>(keys[i] >> 32);
    ++hist[0][v & 255];
    ++hist[1][(v >> 8) & 255];
    ++hist[2][(v >> 16) & 255];
    ++hist[3][v >> 24];
  }
  uint64_t* src = keys.data();
  uint64_t* dst = tmp.data();
  for (int pass = 0; pass < 4; ++pass) {
    uint32_t* h = hist[pass];
    const int shift = 32 + 8 * pass;
    if (h[(src[0] >> shift) & 255] == static_cast<uint32_t>(n)) continue;
    uint32_t sum = 0;
    for (int d = 0; d < 256; ++d) {
      const uint32_t c = h[d];
      h[d] = sum;
      sum += c;
    }
    for (int i = 0; i < n; ++i) dst[h[(src[i] >> shift) & 255]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::memcpy(keys.data(), src, sizeof(uint64_t) * n);
}

// Prefix sums of m distinct values x with weights wsum into P0..P2 [m+1], padded with the last entry.
inline void prefix_sums(int m, const double* x, const double* wsum, double* P0, double* P1, double* P2) {
  P0[0] = P1[0] = P2[0] = 0;
  for (int u = 0; u < m; ++u) {
    P0[u + 1] = P0[u] + wsum[u];
    P1[u + 1] = P1[u] + wsum[u] * x[u];
    P2[u + 1] = P2[u] + wsum[u] * x[u] * x[u];
  }
  for (int u = m + 1; u <= m + kPad; ++u) {
    P0[u] = P0[m];
    P1[u] = P1[m];
    P2[u] = P2[m];
  }
}

// Row r into sc: distinct sorted values sc.x, their summed weights sc.wsum, prefix sums, and
// sc.rank[c] = index of column c's value in x. The weights of equal values are summed in column order.
// Returns m, or -1 when a weight is not finite or a sensitivity is negative or not finite.
int prepare_row(const float* w, const double* sens, int n, Scratch& sc) {
  sc.keys.resize(n);
  sc.keys2.resize(n);
  sc.x.resize(n + kPad);
  sc.wsum.resize(n + kPad);
  sc.P0.resize(n + 1 + kPad);
  sc.P1.resize(n + 1 + kPad);
  sc.P2.resize(n + 1 + kPad);
  sc.rank.resize(n);
  // keys and input checks in one branch-free (vectorisable) pass: a weight is finite when its exponent is
  // not all ones; a sensitivity must satisfy 0 <= s < inf (false for NaN)
  unsigned bad = 0;
  uint64_t* keys = sc.keys.data();
  for (int c = 0; c < n; ++c) {
    uint32_t u;
    std::memcpy(&u, w + c, 4);
    bad |= static_cast<unsigned>((u & 0x7f800000u) == 0x7f800000u) | static_cast<unsigned>(!(sens[c] >= 0)) |
           static_cast<unsigned>(!(sens[c] < kInf));
    u = (u & 0x7fffffffu) ? u : 0u;  // -0 and +0 are one value
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // float order as unsigned order: negatives flipped
    keys[c] = (static_cast<uint64_t>(u) << 32) | static_cast<uint32_t>(c);
  }
  if (bad) return -1;
  radix_sort(sc.keys, sc.keys2, n);
  double* x = sc.x.data();
  double* wsum = sc.wsum.data();
  int32_t* rank = sc.rank.data();
  // branch-free merge: u = index of the current distinct value, acc = its weight so far
  int u = -1;
  uint32_t prev = ~static_cast<uint32_t>(sc.keys[0] >> 32);
  double acc = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(sc.keys[i] >> 32);
    const int c = static_cast<int>(sc.keys[i] & 0xffffffffu);
    const bool fresh = bits != prev;
    u += fresh;
    acc = fresh ? sens[c] : acc + sens[c];
    x[u] = static_cast<double>(w[c]) + 0.0;  // + 0.0: -0 is stored as 0
    wsum[u] = acc;
    rank[c] = u;
    prev = bits;
  }
  const int m = u + 1;
  prefix_sums(m, x, wsum, sc.P0.data(), sc.P1.data(), sc.P2.data());
  return m;
}

inline Row row_of(const Scratch& sc, int m) { return Row{m, sc.x.data(), sc.P0.data(), sc.P1.data(), sc.P2.data()}; }

// ---------------------------------------------------------------- seed: exact k-means by DP

// One DP layer on rows j = L..M: G[j] = min_{lo(j) <= i <= j} F[i] + S(i, j) and its first argmin, where
// lo(j) = max(prev[j], Lf) (F is read from Lf on). The argmin is non-decreasing in j (S is Monge), so rows
// are solved coarse to fine: row j (position q = j-L+1 = h·odd) searches only between the argmins of rows
// j-h and j+h, which a coarser pass already found: O(n log n) costs for n = M-L+1 rows, no recursion.
// Pruning: G is non-decreasing in j, so once a row's value exceeds U (an upper bound on the whole problem's
// optimum) every later row does too; those rows are set to G = +inf, arg = -1 (no bound for other rows). An
// optimal path only passes rows whose value is at most the optimum, and such a row's argmin has a value at
// most its own, so every row at most U is computed exactly from rows at most U.
void dp_layer(const Row& row, const double* F, int Lf, const int* prev, int L, int M, double* G, int* arg,
              double U) {
  const int n = M - L + 1;
  int top = 1;
  while (top * 2 <= n) top *= 2;
  int jmax = M + 1;  // rows from here on are pruned
  for (int h = top; h >= 1; h /= 2) {
    for (int q = h; q <= n; q += 2 * h) {
      const int j = L + q - 1;
      if (j >= jmax) {
        G[j] = kInf;
        arg[j] = -1;
        continue;
      }
      int a = q - h >= 1 ? arg[j - h] : Lf;
      if (prev) a = std::max(a, prev[j]);  // (-1 where the previous layer was pruned: no bound)
      const int up = q + h <= n ? arg[j + h] : -1;
      const int b = up >= 0 ? std::min(up, j) : j;
      if (a > b) a = b;  // only through rounding ties between the bounds; never search an empty range
      arg[j] = argmin_F_plus_S(row, F, a, b, j, G + j);
      if (!(G[j] <= U)) {  // (its argmin is not reliable either: its candidates may have been pruned)
        jmax = std::min(jmax, j);
        G[j] = kInf;
        arg[j] = -1;
      }
    }
  }
}

// An upper bound on the weighted K-means optimum of the row (with a little slack for rounding): the best
// of a few Lloyd steps from the weighted quantiles. It only prunes the exact DP, so any bound is correct.
double kmeans_upper(const Row& row, int K, Scratch& sc) {
  const int m = row.m;
  if (m <= K) return kInf;  // (tiny rows: nothing to prune)
  std::vector<int>& c = sc.cuts_d;
  std::vector<double>& mu = sc.buf2;
  c.resize(K + 1);
  mu.resize(K);
  const double W = row.P0[m];
  int u = 0;
  c[0] = 0;
  for (int k = 1; k < K; ++k) {  // cut before the first value whose prefix weight reaches k/K of the total
    const double target = W * k / K;
    while (u < m && row.P0[u + 1] < target) ++u;
    c[k] = std::max(c[k - 1], u);
  }
  c[K] = m;
  auto cost = [&]() {
    double e = 0;
    for (int k = 0; k < K; ++k) e += std::max(0.0, row.S(c[k], c[k + 1]));
    return e;
  };
  double best = cost();
  for (int it = 0; it < 8; ++it) {
    int nk = 0;
    for (int k = 0; k < K; ++k)
      if (row.has_weight(c[k], c[k + 1])) mu[nk++] = row.mean(c[k], c[k + 1]);
    // every value to its nearest mean (means ascending: a merge along the sorted values)
    u = 0;
    bool same = true;
    for (int k = 1; k < K; ++k) {
      int nc = m;
      if (k < nk) {
        const double mid = 0.5 * (mu[k - 1] + mu[k]);
        while (u < m && row.x[u] < mid) ++u;
        nc = u;
      }
      same &= nc == c[k];
      c[k] = nc;
    }
    if (same) break;
    best = std::min(best, cost());
  }
  return best * (1 + 1e-9) + 1e-12 * std::fabs(row.P2[m]) + 1e-300;
}

// cuts[0..K] of the K-run optimum from layer K-1's F (searched from `lo`; the last layer needs only
// j = m) and the argmins dp_layer kept per layer in sc.ia.
void backtrack(const Row& row, const double* F, int lo, const int* prev, const Scratch& sc, int K, int* cuts) {
  const int m = row.m;
  cuts[0] = 0;
  cuts[K] = m;
  double value;
  cuts[K - 1] = argmin_F_plus_S(row, F, std::max(prev ? prev[m] : 0, lo), m, m, &value);
  for (int k = K - 1; k >= 2; --k) cuts[k - 1] = sc.ia[static_cast<size_t>(k) * (m + 1) + cuts[k]];
}

// Optimal K runs of the row: cuts[0..K]. F_1(j) = S(0, j); F_k(j) = min_{i<=j} F_{k-1}(i) + S(i, j).
// With one cluster more the last cluster of [0, j) starts no earlier, opt_k(j) >= opt_{k-1}(j)
// (Knuth-type bound), which narrows every row's search further. Layers are pruned by an upper bound on the
// optimum (dp_layer): the K-run layers by kmeans_upper, which leaves ~70 % of their rows on SmolLM2.
// kmeans_dp_more then goes on to the 2K-run optimum (the joint rule's start) from the same layers, with
// the caller's bound U2 (the split result's (s+1)-bit SSE); layer k > K is computed only on j >= c_{k-K},
// c = the K-run optimum: every row that a later layer can search is there, since
// opt_k(c_{k-K+1}) >= opt_{k-K+1}(c_{k-K+1}) = c_{k-K} (Knuth's bound and the optimum's own backtracking).
void kmeans_dp(const Row& row, int K, Scratch& sc, int* cuts, bool keep = false) {
  const int m = row.m;
  const int layers = keep ? 2 * K : K;
  sc.fa.resize(m + 1 + kPad);
  sc.fb.resize(m + 1 + kPad);
  sc.ia.resize(static_cast<size_t>(layers) * (m + 1));
  double* F = sc.fa.data();
  double* G = sc.fb.data();
  S_span(row, 0, m, F, nullptr);
  for (int j = m + 1; j <= m + kPad; ++j) F[j] = G[j] = 0;
  const double U = kmeans_upper(row, K, sc);
  const int* prev = nullptr;
  for (int k = 2; k < K; ++k) {
    int* arg = sc.ia.data() + static_cast<size_t>(k) * (m + 1);
    dp_layer(row, F, 0, prev, 0, m, G, arg, U);
    prev = arg;
    std::swap(F, G);
  }
  if (K > 1) {
    backtrack(row, F, 0, prev, sc, K, cuts);
  } else {
    cuts[0] = 0;
    cuts[K] = m;
  }
  sc.dp_F = F;  // layer K-1, for kmeans_dp_more
  sc.dp_G = G;
}

void kmeans_dp_more(const Row& row, int K, const int* cuts, double U2, Scratch& sc, int* cuts2) {
  const int m = row.m, K2 = 2 * K;
  double* F = sc.dp_F;
  double* G = sc.dp_G;
  const int* prev = K > 2 ? sc.ia.data() + static_cast<size_t>(K - 1) * (m + 1) : nullptr;
  const double U = U2 * (1 + 1e-9) + 1e-12 * std::fabs(row.P2[m]) + 1e-300;
  int Lf = 0;
  for (int k = K; k < K2; ++k) {
    int* arg = sc.ia.data() + static_cast<size_t>(k) * (m + 1);
    const int L = k > K ? cuts[k - K] : 0;
    for (int j = 0; j < L; ++j) G[j] = kInf;
    dp_layer(row, F, Lf, prev, L, m, G, arg, U);
    prev = arg;
    Lf = L;
    std::swap(F, G);
  }
  backtrack(row, F, Lf, prev, sc, K2, cuts2);
}

// ---------------------------------------------------------------- split

// Σ_b λ_b SSE_b of leaf cuts, and the per-level SSE (from the prefix sums)
double objective(const Row& row, const int* leaf, int s, int p, const double* lam, double* per_level) {
  double J = 0;
  for (int b = s; b <= p; ++b) {
    const int step = 1 << (p - b);
    double e = 0;
    for (int j = 0; j < (1 << p); j += step) e += std::max(0.0, row.S(leaf[j], leaf[j + step]));
    if (per_level) per_level[b - s] = e;
    if (lam) J += lam[b - s] * e;
  }
  return J;
}

// Leaf cuts [2^p + 1] from the level-b cuts `coarse` [2^b + 1]: every run of every finer level cut in two
// by the exact 2-means cut. (Sharing S(lo, ·) and S(·, hi) with the children, as grow_lookahead does, was
// slower here: most runs below the seed level are a few values long, one step of best_cut's scan.)
void grow(const Row& row, const int* coarse, int b, int p, int* leaf) {
  const int L = 1 << p;
  const int step0 = 1 << (p - b);
  for (int j = 0; j <= (1 << b); ++j) leaf[j * step0] = coarse[j];
  for (int level = b + 1; level <= p; ++level) {
    const int step = 1 << (p - level);  // distance between level-`level` cuts in leaf indices
    for (int j = 0; j < L; j += 2 * step) leaf[j + step] = best_cut(row, leaf[j], leaf[j + 2 * step]);
  }
}

// ---------------------------------------------------------------- joint

// B(a, b) = min_c S(a, c) + S(c, b): the SSE of the best 2-split of run [a, b).
// Seed refinement with two levels: minimise Σ_k l0·S(t_{k-1}, t_k) + l1·B(t_{k-1}, t_k) over the seed
// cuts t, each kept within ±window of its current position (a chain DP over k), re-centred until stable.
// The B values of one window pair come from Knuth's bounds c*(a, b-1) <= c*(a, b) <= c*(a+1, b); a
// pair of windows that did not move since the last round keeps its values. Returns the objective.
double refine_seed(const Row& row, int K, double l0, double l1, int window, int max_rounds, Scratch& sc, int* t) {
  const int m = row.m;
  const int W = 2 * window + 1, WW = W * W;
  std::vector<double>& V = sc.fa;     // [K+1][W] cost to reach cut k at each candidate position
  std::vector<int>& back = sc.ia;     // [K+1][W]
  std::vector<int>& copt = sc.ib;     // [K+1][W][W] split argmin of each window pair
  std::vector<double>& cval = sc.fc;  // [K+1][W][W] l0·S + l1·B of each window pair
  std::vector<int>& lo_k = sc.ic;     // [K+1] first candidate of each cut, then [K+1] the cuts of the last round
  V.resize(static_cast<size_t>(K + 1) * W);
  back.resize(static_cast<size_t>(K + 1) * W);
  copt.resize(static_cast<size_t>(K + 1) * WW);
  cval.resize(static_cast<size_t>(K + 1) * WW);
  lo_k.assign(2 * (K + 1), -1);
  int* t_prev = lo_k.data() + K + 1;
  auto count = [&](int k) { return (k == 0 || k == K) ? 1 : std::min(m, t[k] + window) - lo_k[k] + 1; };
  double total = kInf;
  for (int round = 0; round < max_rounds; ++round) {
    for (int k = 0; k <= K; ++k) lo_k[k] = (k == 0 || k == K) ? t[k] : std::max(0, t[k] - window);
    V[0] = 0;
    for (int k = 1; k <= K; ++k) {
      const int la = lo_k[k - 1], na = count(k - 1), lb = lo_k[k], nb = count(k);
      int* cp = copt.data() + static_cast<size_t>(k) * WW;
      double* cv = cval.data() + static_cast<size_t>(k) * WW;
      // the windows are functions of t[k-1] and t[k]: unchanged cuts keep their pair values
      if (round == 0 || t_prev[k - 1] != t[k - 1] || t_prev[k] != t[k]) {
        // the S values every pair of this transition needs, once: SA[ia][c] = S(a, c), SB[ib][c] = S(c, b)
        // for c in [la, lb + nb - 1] (stored from index c - la), so a pair's split scan only adds
        const int span = std::max(0, lb + nb - la), stride = span + kPad;
        std::vector<double>& SA = sc.sa;
        std::vector<double>& SB = sc.sb;
        if (SA.size() < static_cast<size_t>(W) * stride) SA.resize(static_cast<size_t>(W) * stride);
        if (SB.size() < static_cast<size_t>(W) * stride) SB.resize(static_cast<size_t>(W) * stride);
        for (int ia = 0; ia < na; ++ia) {
          const int a = la + ia;
          if (a <= lb + nb - 1) S_span(row, a, lb + nb - 1, SA.data() + ia * stride + (a - la), nullptr);
        }
        for (int ib = 0; ib < nb; ++ib) {
          const int b = lb + ib;
          if (b >= la) S_span(row, la, b, nullptr, SB.data() + ib * stride);
        }
        for (int ia = na - 1; ia >= 0; --ia) {  // a descending, b ascending: Knuth bounds are known
          const int a = la + ia;
          const double* sa = SA.data() + ia * stride - la;  // sa[c] = S(a, c)
          for (int ib = 0; ib < nb; ++ib) {
            const int b = lb + ib;
            if (b < a) {
              cp[ia * W + ib] = a;
              cv[ia * W + ib] = kInf;
              continue;
            }
            const double* sb = SB.data() + ib * stride - la;  // sb[c] = S(c, b)
            int clo = a, chi = b;
            if (ib > 0 && b - 1 >= a) clo = std::max(clo, cp[ia * W + ib - 1]);
            if (ia + 1 < na && a + 1 <= b) chi = std::min(chi, cp[(ia + 1) * W + ib]);
            if (clo > chi) clo = chi;  // only possible through ties; keep the bounds consistent
            double best;
            cp[ia * W + ib] = argmin_sum(sa, sb, clo, chi, &best);  // the same sums as best_cut
            cv[ia * W + ib] = l0 * sa[b] + l1 * best;
          }
        }
      }
      for (int ib = 0; ib < nb; ++ib) {
        double best = kInf;
        int bi = 0;
        for (int ia = 0; ia < na; ++ia) {
          const double v = V[(k - 1) * W + ia] + cv[ia * W + ib];
          if (v < best) {
            best = v;
            bi = ia;
          }
        }
        V[k * W + ib] = best;
        back[k * W + ib] = bi;
      }
    }
    std::copy(t, t + K + 1, t_prev);
    total = V[K * W];
    bool changed = false;
    int ib = 0;
    for (int k = K; k >= 1; --k) {
      const int ia = back[k * W + ib];
      const int pos = lo_k[k - 1] + ia;
      if (k - 1 > 0 && pos != t[k - 1]) {
        t[k - 1] = pos;
        changed = true;
      }
      ib = ia;
    }
    if (!changed) break;
  }
  return total;
}

#if !AP_AVX2
// B over one run [lo, hi] for every end: BL[x - lo] = B(lo, x) with its first split argmin AL[x - lo], from
// SL[x - lo] = S(lo, x); BR[x - lo] = B(x, hi), AR[x - lo], from SR[x - lo] = S(x, hi). Both argmins are
// non-decreasing in x, so x is solved coarse to fine as in dp_layer: O(len log len) costs.
void run_B(const Row& row, int lo, int hi, const double* SL, const double* SR, double* BL, int* AL, double* BR,
           int* AR) {
  const int n = hi - lo + 1;
  int top = 1;
  while (top * 2 <= n) top *= 2;
  const double* Fl = SL - lo;  // indexed by the absolute position (never read below lo)
  const double* Fr = SR - lo;
  for (int h = top; h >= 1; h /= 2) {
    for (int q = h; q <= n; q += 2 * h) {
      const int x = lo + q - 1;
      if (BL) {
        int a = q - h >= 1 ? AL[x - h - lo] : lo;
        const int b = q + h <= n ? std::min(AL[x + h - lo], x) : x;
        if (a > b) a = b;
        AL[x - lo] = argmin_F_plus_S(row, Fl, a, b, x, BL + (x - lo));
      }
      if (BR) {
        int a = q - h >= 1 ? std::max(AR[x - h - lo], x) : x;
        const int b = q + h <= n ? AR[x + h - lo] : hi;
        if (a > b) a = b;
        AR[x - lo] = argmin_S_plus_G(row, Fr, a, b, x, BR + (x - lo));
      }
    }
  }
}

#endif

#if AP_AVX2
// run_B with four ends per step: BL over x = lo..hi in blocks of four (lanes), each block scanning the split
// points from the previous end's argmin on (a lower bound for all four, as the argmin is non-decreasing in
// x): every lane's candidates contain its first argmin, so the result is run_B's. No reductions across lanes.
void run_BL4(const Row& row, int lo, int hi, const double* SL, double* BL, int* AL) {
  const __m256d inf = _mm256_set1_pd(kInf);
  int cL = lo;
  for (int x0 = lo; x0 <= hi; x0 += 4) {
    const __m256d xv = _mm256_add_pd(_mm256_set1_pd(x0), _mm256_set_pd(3, 2, 1, 0));
    __m256d best = inf, bidx = _mm256_set1_pd(cL);
    const int cH = std::min(x0 + 3, hi);
    for (int c = cL; c <= cH; ++c) {
      const __m256d cv = _mm256_set1_pd(c);
      const __m256d S = S4_from(row, bcast(row.P0 + c), bcast(row.P1 + c), bcast(row.P2 + c), x0);
      __m256d v = _mm256_add_pd(bcast(SL + (c - lo)), S);
      v = _mm256_blendv_pd(v, inf, _mm256_cmp_pd(cv, xv, _CMP_GT_OQ));  // split point past the end
      bidx = _mm256_blendv_pd(bidx, cv, _mm256_cmp_pd(v, best, _CMP_LT_OQ));
      best = _mm256_min_pd(v, best);
    }
    _mm256_storeu_pd(BL + (x0 - lo), best);  // (lanes past hi land in the padding / the next run's segment)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(AL + (x0 - lo)), _mm256_cvttpd_epi32(bidx));
    cL = AL[std::min(x0 + 3, hi) - lo];
  }
}

// BR over x = hi..lo in blocks of four from the right, each block scanning up to the argmin of the end just
// right of it (an upper bound for all four)
void run_BR4(const Row& row, int lo, int hi, const double* SR, double* BR, int* AR) {
  const __m256d inf = _mm256_set1_pd(kInf);
  int cU = hi, xe = hi + 1;
  while (xe > lo) {
    const int xs = std::max(lo, xe - 4);
    const __m256d xv = _mm256_add_pd(_mm256_set1_pd(xs), _mm256_set_pd(3, 2, 1, 0));
    __m256d best = inf, bidx = _mm256_set1_pd(cU);
    for (int c = xs; c <= cU; ++c) {
      const __m256d cv = _mm256_set1_pd(c);
      const __m256d S = S4_to(row, xs, bcast(row.P0 + c), bcast(row.P1 + c), bcast(row.P2 + c));
      __m256d v = _mm256_add_pd(S, bcast(SR + (c - lo)));
      v = _mm256_blendv_pd(v, inf, _mm256_cmp_pd(cv, xv, _CMP_LT_OQ));  // split point before the start
      bidx = _mm256_blendv_pd(bidx, cv, _mm256_cmp_pd(v, best, _CMP_LT_OQ));
      best = _mm256_min_pd(v, best);
    }
    alignas(32) double bv[4];
    alignas(16) int ai[4];
    _mm256_store_pd(bv, best);
    _mm_store_si128(reinterpret_cast<__m128i*>(ai), _mm256_cvttpd_epi32(bidx));
    for (int x = xs; x < xe; ++x) {
      BR[x - lo] = bv[x - xs];
      AR[x - lo] = ai[x - xs];
    }
    cU = ai[0];
    xe = xs;
  }
}
#endif

// BL/AL and BR/AR of one run (either pair may be left out)
inline void run_B_any(const Row& row, int lo, int hi, const double* SL, const double* SR, double* BL, int* AL,
                      double* BR, int* AR) {
#if AP_AVX2
  if (BL) run_BL4(row, lo, hi, SL, BL, AL);
  if (BR) run_BR4(row, lo, hi, SR, BR, AR);
#else
  run_B(row, lo, hi, SL, SR, BL, AL, BR, AR);
#endif
}

// Leaf cuts [2^p + 1] for the joint rule from seed cuts [2^s + 1]: level s+1 by exact splits, levels
// s+2..p-1 by look-ahead splits, level p by exact splits. A look-ahead split of run [lo, hi) at level ℓ is the
// first x minimising l0·(S(lo,x) + S(x,hi)) + l1·(B(lo,x) + B(x,hi)), l0 = λ_ℓ, l1 = λ_ℓ+1: the cut chosen for
// its own level and for the best split of both children one level further.
// The arrays of a run are shared with its children: the left child [lo, x*) has the parent's S(lo, ·) and
// B(lo, ·) for its ends, the right child [x*, hi) the parent's S(·, hi) and B(·, hi), so each look-ahead
// level after the first computes only the other half; and the exact cuts of level p are the split argmins
// of B already found at level p-1.
void grow_lookahead(const Row& row, const int* seed, int s, int p, const double* lam, Scratch& sc, int* leaf) {
  const int L = 1 << p, m = row.m;
  const int step_s = 1 << (p - s);
  for (int j = 0; j <= (1 << s); ++j) leaf[j * step_s] = seed[j];
  if (p == s) return;
  // per level: 6 arrays (SL, SR, BL, BR as doubles; AL, AR as ints) of one segment per run, run j at
  // offset lo_j + j (both ends included); sized for the finest look-ahead level
  const size_t cap = static_cast<size_t>(m) + 1 + (L >> 1) + kPad;
  for (int t = 0; t < 2; ++t) {
    if (sc.la[t].size() < 4 * cap) sc.la[t].assign(4 * cap, 0.0);
    if (sc.lai[t].size() < 2 * cap) sc.lai[t].assign(2 * cap, 0);
  }
  int cur = 0;
  auto arrays = [&](int t, double*& SL, double*& SR, double*& BL, double*& BR, int*& AL, int*& AR) {
    SL = sc.la[t].data();
    SR = SL + cap;
    BL = SR + cap;
    BR = BL + cap;
    AL = sc.lai[t].data();
    AR = AL + cap;
  };
  // level s+1: exact splits of the seed runs, keeping S(lo, ·) and S(·, hi) of every seed run
  {
    double *SL, *SR, *BL, *BR;
    int *AL, *AR;
    arrays(cur, SL, SR, BL, BR, AL, AR);
    const int step = 1 << (p - s - 1);
    for (int j = 0; j < (1 << s); ++j) {
      const int lo = leaf[2 * j * step], hi = leaf[(2 * j + 2) * step], off = lo + j;
      S_span(row, lo, hi, SL + off, SR + off);
      double best;  // the same sums as best_cut: S(lo, c) + S(c, hi)
      leaf[(2 * j + 1) * step] = lo + argmin_sum(SL + off, SR + off, 0, hi - lo, &best);
    }
  }
  bool have_B = false;  // whether the current arrays hold B(lo, ·) and B(·, hi) of their runs
  for (int level = s + 2; level < p; ++level) {
    const int pl = level - 1;               // the runs cut at this level are those of level pl
    const int step = 1 << (p - level);      // distance between this level's cuts in leaf indices
    const int runs = 1 << pl;
    double *pSL, *pSR, *pBL, *pBR, *SL, *SR, *BL, *BR;
    int *pAL, *pAR, *AL, *AR;
    arrays(cur, pSL, pSR, pBL, pBR, pAL, pAR);  // of the parents (level pl-1 runs)
    arrays(1 - cur, SL, SR, BL, BR, AL, AR);
    const double l0 = lam[level - s], l1 = lam[level + 1 - s];
    for (int r = 0; r < runs; ++r) {
      const int lo = leaf[2 * r * step], hi = leaf[(2 * r + 2) * step], len = hi - lo + 1;
      const int off = lo + r;
      const int P = r >> 1;  // the parent run [LO, HI), cut at y
      const int LO = leaf[2 * P * 2 * step], poff = LO + P;
      if ((r & 1) == 0) {  // left child [LO, y): its left ends are the parent's
        std::copy(pSL + poff, pSL + poff + len, SL + off);
        S_span(row, lo, hi, nullptr, SR + off);
        if (have_B) {
          std::copy(pBL + poff, pBL + poff + len, BL + off);
          std::copy(pAL + poff, pAL + poff + len, AL + off);
          run_B_any(row, lo, hi, nullptr, SR + off, nullptr, nullptr, BR + off, AR + off);
        } else {
          run_B_any(row, lo, hi, SL + off, SR + off, BL + off, AL + off, BR + off, AR + off);
        }
      } else {  // right child [y, HI): its right ends are the parent's
        const int y = lo;
        std::copy(pSR + poff + (y - LO), pSR + poff + (y - LO) + len, SR + off);
        S_span(row, lo, hi, SL + off, nullptr);
        if (have_B) {
          std::copy(pBR + poff + (y - LO), pBR + poff + (y - LO) + len, BR + off);
          std::copy(pAR + poff + (y - LO), pAR + poff + (y - LO) + len, AR + off);
          run_B_any(row, lo, hi, SL + off, nullptr, BL + off, AL + off, nullptr, nullptr);
        } else {
          run_B_any(row, lo, hi, SL + off, SR + off, BL + off, AL + off, BR + off, AR + off);
        }
      }
      const double *sl = SL + off, *sr = SR + off, *bl = BL + off, *br = BR + off;
#if AP_AVX2
      const __m256d l0v = _mm256_set1_pd(l0), l1v = _mm256_set1_pd(l1);
      auto vec = [&](int k) {
        return _mm256_add_pd(_mm256_mul_pd(l0v, _mm256_add_pd(_mm256_loadu_pd(sl + k), _mm256_loadu_pd(sr + k))),
                             _mm256_mul_pd(l1v, _mm256_add_pd(_mm256_loadu_pd(bl + k), _mm256_loadu_pd(br + k))));
      };
#else
      auto vec = [](int) { return 0; };
#endif
      double best;
      leaf[(2 * r + 1) * step] =
          lo + argmin_range(0, len - 1, [&](int k) { return l0 * (sl[k] + sr[k]) + l1 * (bl[k] + br[k]); }, vec, &best);
    }
    cur = 1 - cur;
    have_B = true;
  }
  // level p: exact splits; after a look-ahead level they are the split argmins found there
  const int runs = 1 << (p - 1);
  if (have_B) {
    double *SL, *SR, *BL, *BR;
    int *AL, *AR;
    arrays(cur, SL, SR, BL, BR, AL, AR);
    for (int r = 0; r < runs; ++r) {
      const int P = r >> 1;  // the level p-2 run [LO, HI) cut at y
      const int LO = leaf[4 * P], y = leaf[4 * P + 2], poff = LO + P;
      leaf[2 * r + 1] = (r & 1) == 0 ? AL[poff + (y - LO)] : AR[poff + (y - LO)];
    }
  } else if (p >= s + 2) {
    for (int r = 0; r < runs; ++r) leaf[2 * r + 1] = best_cut(row, leaf[2 * r], leaf[2 * r + 2]);
  }
}

// Lloyd-type alternation for the blended objective with all levels at once: with every level's table
// fixed, each value goes to the leaf minimising Σ_b λ_b (x − c_b(ancestor_b(leaf)))² = Λx² − 2xM_l + A_l,
// the lower envelope of the lines A_l − 2xM_l; with tables ordered by index so are the M_l, so the best leaf
// is non-decreasing in x and leaves stay runs. The envelope is built once (a stack over the lines in slope
// order) and swept along the sorted values: O(m + 2^p) per step. Then every table is refit as weighted
// means of its runs. Neither step raises J; leaves without weight are left out (their centroid is free,
// and leaving them out keeps the M_l ordered). Stops when the cuts repeat. J: the objective of `leaf`.
double envelope_polish(const Row& row, int s, int p, const double* lam, int max_iters, Scratch& sc, int* leaf,
                       double J) {
  const int L = 1 << p, m = row.m;
  std::vector<double>& M = sc.fa;
  std::vector<double>& A = sc.fb;
  std::vector<int>& live = sc.ia;
  std::vector<int>& hull = sc.ib;
  std::vector<int>& owner = sc.ic;
  std::vector<int>& next = sc.cuts_d;
  M.resize(L);
  A.resize(L);
  live.resize(L);
  hull.resize(L);
  owner.resize(m);
  next.resize(L + 1);
  std::vector<double>& cm = sc.buf2;  // level means, level b at offset 2^b - 2^s
  cm.resize((size_t(2) << p) - (size_t(1) << s));
  for (int it = 0; it < max_iters && m > 0; ++it) {
    for (int b = s; b <= p; ++b) {
      const int step = 1 << (p - b);
      double* c = cm.data() + ((1 << b) - (1 << s));
      for (int j = 0; j < (1 << b); ++j) {
        const int lo = leaf[j * step], hi = leaf[(j + 1) * step];
        c[j] = row.has_weight(lo, hi) ? row.mean(lo, hi) : 0.0;  // 0: only read for leaves left out
      }
    }
    int nl = 0;
    for (int l = 0; l < L; ++l) {
      if (!row.has_weight(leaf[l], leaf[l + 1])) continue;
      double mm = 0, aa = 0;
      for (int b = s; b <= p; ++b) {
        const double c = cm[((1 << b) - (1 << s)) + (l >> (p - b))];
        mm += lam[b - s] * c;
        aa += lam[b - s] * c * c;
      }
      M[nl] = mm;
      A[nl] = aa;
      live[nl] = l;
      ++nl;
    }
    if (nl == 0) break;
    auto cost = [&](int q, double x) { return A[q] - 2.0 * x * M[q]; };
    // lower envelope: lines in order of increasing M (the leaf order); line b leaves the stack when the
    // next line c meets the one below it, a, no later than b does: (A_c − A_b)(M_b − M_a) <= (A_b − A_a)(M_c − M_b)
    bool ordered = true;
    int H = 0;
    for (int q = 0; q < nl; ++q) {
      if (q > 0 && !(M[q] > M[q - 1])) {
        ordered = false;
        break;
      }
      while (H >= 2) {
        const int a = hull[H - 2], b = hull[H - 1];
        if ((A[q] - A[b]) * (M[b] - M[a]) <= (A[b] - A[a]) * (M[q] - M[b]))
          --H;
        else
          break;
      }
      hull[H++] = q;
    }
    if (ordered) {
      int t = 0;
      for (int u = 0; u < m; ++u) {
        const double x = row.x[u];
        while (t + 1 < H && cost(hull[t + 1], x) < cost(hull[t], x)) ++t;
        owner[u] = live[hull[t]];
      }
    } else {  // tables out of order (rounding only): every line for every value
      for (int u = 0; u < m; ++u) {
        double best = kInf;
        int bq = 0;
        for (int q = 0; q < nl; ++q) {
          const double v = cost(q, row.x[u]);
          if (v < best) {
            best = v;
            bq = q;
          }
        }
        owner[u] = live[bq];
      }
      for (int u = 1; u < m; ++u)
        if (owner[u] < owner[u - 1]) owner[u] = owner[u - 1];  // keep runs
    }
    // leaf l's run starts at the first value owned by a leaf >= l
    int u = 0;
    for (int l = 0; l <= L; ++l) {
      while (u < m && owner[u] < l) ++u;
      next[l] = u;
    }
    next[L] = m;
    if (std::equal(next.begin(), next.end(), leaf)) break;
    const double Jn = objective(row, next.data(), s, p, lam, nullptr);
    if (!(Jn < J)) break;  // rounding only: exact arithmetic never rises
    J = Jn;
    std::copy(next.begin(), next.end(), leaf);
  }
  return J;
}

// Joint nested partition of one row, starting from the split result in `leaf` (replaced only by a
// result with a lower J, so joint is never worse than split on J):
//   1. seed: the exact K-run optimum (the split seed) and the even cuts of the exact 2K-run optimum
//      (`pairs`: pairs of good (s+1)-bit clusters, so the nested (s+1)-bit level can come close to the
//      independent (s+1)-bit k-means), each refined by refine_seed; the lower two-level value wins;
//   2. the levels below: (s+1) by exact splits, s+2..p-1 by look-ahead splits, p by exact splits
//      (plain exact splits below the refined seed were measured: they never won on SmolLM2);
//   3. envelope_polish; if that is no better than split, the polished split result is tried instead.
// J_split: the objective of `leaf` (Σ_b λ_b SSE_b summed in level order, as objective() does).
double joint_row(const Row& row, int s, int p, const double* lam, int window, const int* seed, const int* pairs,
                 double J_split, Scratch& sc, int* leaf) {
  const int K = 1 << s, L = 1 << p;
  std::vector<int>& cand = sc.cuts_a;
  cand.resize(L + 1);
  double J = kInf;
  if (p > s) {
    std::vector<int>& t0 = sc.cuts_b;
    std::vector<int>& t1 = sc.cuts_c;
    t0.assign(seed, seed + K + 1);
    t1.assign(pairs, pairs + K + 1);
    const double v0 = refine_seed(row, K, lam[0], lam[1], window, 20, sc, t0.data());
    const double v1 = refine_seed(row, K, lam[0], lam[1], window, 20, sc, t1.data());
    grow_lookahead(row, (v1 < v0 ? t1 : t0).data(), s, p, lam, sc, cand.data());
    J = envelope_polish(row, s, p, lam, 100, sc, cand.data(), objective(row, cand.data(), s, p, lam, nullptr));
  }
  if (!(J < J_split)) {
    cand.assign(leaf, leaf + L + 1);
    J = envelope_polish(row, s, p, lam, 100, sc, cand.data(), J_split);
  }
  if (J < J_split) {
    std::copy(cand.begin(), cand.end(), leaf);
    return J;
  }
  return J_split;
}

// ---------------------------------------------------------------- finish

// Tables, per-level SSE and codes of one finished row: the b-bit table holds the weighted means of the
// b-bit runs; a run without weight takes its parent's value (at the seed level the previous run's, else
// the next one's): a value no code refers to. SSE_b = Σ w (x − lut_b)² over the values, from the tables.
void finish_row(const Row& row, const int* lf, const int32_t* rank, int64_t n, int s, int p, int64_t r,
                const std::vector<double*>& lut_ptr, double* sse, uint8_t* codes, Scratch& sc) {
  const int L = 1 << p;
  for (int b = s; b <= p; ++b) {
    const int step = 1 << (p - b), nb = 1 << b;
    double* lut = lut_ptr[b - s] + r * nb;
    for (int j = 0; j < nb; ++j) {
      const int lo = lf[j * step], hi = lf[(j + 1) * step];
      if (row.has_weight(lo, hi))
        lut[j] = row.mean(lo, hi);
      else
        lut[j] = b > s ? lut_ptr[b - s - 1][r * (nb / 2) + j / 2] : std::numeric_limits<double>::quiet_NaN();
    }
    if (b == s) {
      double last = std::numeric_limits<double>::quiet_NaN();
      for (int j = 0; j < nb; ++j) lut[j] = std::isnan(lut[j]) ? last : (last = lut[j]);
      for (int j = nb - 1; j >= 0; --j) lut[j] = std::isnan(lut[j]) ? last : (last = lut[j]);
      for (int j = 0; j < nb; ++j) lut[j] = std::isnan(lut[j]) ? 0.0 : lut[j];
    }
  }
  std::vector<int>& leaf_of = sc.id;
  leaf_of.resize(row.m);
  for (int l = 0; l < L; ++l)
    for (int u = lf[l]; u < lf[l + 1]; ++u) leaf_of[u] = l;
  // one pass over the values with a running sum per level (each still summed in value order)
  const int levels = p - s + 1;
  const double* lut_r[9];
  double e[9];
  for (int b = s; b <= p; ++b) {
    lut_r[b - s] = lut_ptr[b - s] + r * (int64_t(1) << b);
    e[b - s] = 0;
  }
  for (int u = 0; u < row.m; ++u) {
    const double wu = row.P0[u + 1] - row.P0[u], xu = row.x[u];
    const int l = leaf_of[u];
    for (int i = 0; i < levels; ++i) {
      const double d = xu - lut_r[i][l >> (levels - 1 - i)];
      e[i] += wu * d * d;
    }
  }
  for (int i = 0; i < levels; ++i) sse[i] = e[i];
  for (int64_t c = 0; c < n; ++c) codes[c] = static_cast<uint8_t>(leaf_of[rank[c]]);
}

}  // namespace

// ---------------------------------------------------------------- driver

// The whole matrix (see the torch entry point quantize for the arguments). Returns -1, or the first row
// with a weight that is not finite or a sensitivity that is negative or not finite.
int64_t quantize_rows(const float* w, const double* sv, int64_t sens_stride, int64_t R, int64_t n, int s, int p,
                      bool joint, const std::vector<double>& level_weights, int64_t window, double seed_tolerance,
                      int nthreads, Outputs& out) {
  const int levels = p - s + 1, K = 1 << s, L = 1 << p;
  const std::vector<double*>& lut_ptr = out.luts;
  uint8_t* code_ptr = out.codes;
  double* sse_ptr = out.sse;
  double* obj_ptr = out.obj;
  double* stage_seconds = out.stage_seconds;
  const auto start = std::chrono::steady_clock::now();

  // Each row goes through prepare, seed, split and (without joint) finish in one go, while its arrays
  // are in cache. joint needs every row's split SSE first (for λ), so then the prepared rows are kept for a
  // second pass, compactly: the distinct values (fp32, which they are), their weights and the column ranks
  // (16 bytes per weight); the prefix sums are recomputed from them with the same operations.
  const int64_t kept = joint ? R : 0;
  const size_t kept_bytes = static_cast<size_t>(kept) * static_cast<size_t>(n) * 16;
  std::unique_lock<std::mutex> arena_lock(arena().mu, std::defer_lock);
  std::unique_ptr<unsigned char[]> own;
  unsigned char* store = nullptr;
  if (kept_bytes > 0) {
    if (kept_bytes <= kArenaMaxBytes && arena_lock.try_lock()) {
      if (arena().buf.size() < kept_bytes) arena().buf.resize(kept_bytes);
      store = arena().buf.data();
    } else {
      own.reset(new unsigned char[kept_bytes]);
      store = own.get();
    }
  }
  double* kw = reinterpret_cast<double*>(store);                            // [R, n] weights of the values
  float* kx = reinterpret_cast<float*>(store + static_cast<size_t>(kept) * n * 8);   // [R, n] values
  int32_t* krank = reinterpret_cast<int32_t*>(store + static_cast<size_t>(kept) * n * 12);  // [R, n] ranks
  std::vector<int32_t> msize(R);
  std::vector<int> seed(R * (K + 1)), leaf(R * (L + 1));
  std::vector<int> pairs(joint && p > s ? R * (K + 1) : 0);  // even cuts of the exact 2K-run optimum
  std::vector<double> split_sse(joint ? R * levels : 0);
  // the kept row r into sc (prefix sums recomputed), as after prepare_row
  auto restore = [&](int64_t r, Scratch& sc) {
    const int m = msize[r];
    sc.x.resize(n + kPad);
    sc.wsum.resize(n + kPad);
    sc.P0.resize(n + 1 + kPad);
    sc.P1.resize(n + 1 + kPad);
    sc.P2.resize(n + 1 + kPad);
    const float* xr = kx + r * n;
    for (int u = 0; u < m; ++u) sc.x[u] = xr[u];
    std::copy(kw + r * n, kw + r * n + m, sc.wsum.data());
    prefix_sums(m, sc.x.data(), sc.wsum.data(), sc.P0.data(), sc.P1.data(), sc.P2.data());
    return row_of(sc, m);
  };

#pragma omp parallel num_threads(nthreads)
  {
    Scratch sc;
    StageClock clock;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < R; ++r) {
      clock.lap(kFinish);  // (the loop's own overhead)
      msize[r] = prepare_row(w + r * n, sv + r * sens_stride, static_cast<int>(n), sc);
      if (msize[r] >= 0 && kept) {
        const int m = msize[r];
        float* xr = kx + r * n;
        for (int u = 0; u < m; ++u) xr[u] = static_cast<float>(sc.x[u]);
        std::copy(sc.wsum.data(), sc.wsum.data() + m, kw + r * n);
        std::copy(sc.rank.data(), sc.rank.data() + n, krank + r * n);
      }
      clock.lap(kPrepare);
      if (msize[r] < 0) continue;  // reported after the parallel region
      const Row row = row_of(sc, msize[r]);
      kmeans_dp(row, K, sc, seed.data() + r * (K + 1), !pairs.empty());
      clock.lap(kSeed);
      int* lf = leaf.data() + r * (L + 1);
      grow(row, seed.data() + r * (K + 1), s, p, lf);
      if (joint) objective(row, lf, s, p, nullptr, split_sse.data() + r * levels);
      clock.lap(kSplit);
      if (!pairs.empty()) {  // the 2K-run optimum, bounded by the split result's (s+1)-bit SSE
        std::vector<int>& c2 = sc.cuts_a;
        c2.resize(2 * K + 1);
        kmeans_dp_more(row, K, seed.data() + r * (K + 1), split_sse[r * levels + 1], sc, c2.data());
        for (int k = 0; k <= K; ++k) pairs[r * (K + 1) + k] = c2[2 * k];
        clock.lap(kSeed);
      }
      if (!joint) {
        finish_row(row, lf, sc.rank.data(), n, s, p, r, lut_ptr, sse_ptr + r * levels, code_ptr + r * n, sc);
        clock.lap(kFinish);
      }
    }
#pragma omp critical
    for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
  }
  for (int64_t r = 0; r < R; ++r)
    if (msize[r] < 0) return r;

  if (joint) {
    // λ_b = weight_b / (matrix SSE_b of the split result): every level counts by its relative change.
    // Summed serially in row order so the result does not depend on the thread count.
    std::vector<double> lam(levels);
    for (int b = 0; b < levels; ++b) {
      double tot = 0;
      for (int64_t r = 0; r < R; ++r) tot += split_sse[r * levels + b];
      lam[b] = level_weights[b] / std::max(tot, 1e-300);
    }
    const std::vector<int> split_leaf = seed_tolerance >= 0 ? leaf : std::vector<int>();  // for rows sent back
    std::vector<double> seed_sse(R);
    // joint and finish of every row; rows that the seed tolerance sends back to split are finished again below
#pragma omp parallel num_threads(nthreads)
    {
      Scratch sc;
      StageClock clock;
#pragma omp for schedule(dynamic, 4)
      for (int64_t r = 0; r < R; ++r) {
        clock.lap(kFinish);
        const Row row = restore(r, sc);
        clock.lap(kPrepare);
        int* lf = leaf.data() + r * (L + 1);
        double Js = 0;
        for (int b = 0; b < levels; ++b) Js += lam[b] * split_sse[r * levels + b];
        obj_ptr[r * 2] = Js;
        obj_ptr[r * 2 + 1] = joint_row(row, s, p, lam.data(), static_cast<int>(window), seed.data() + r * (K + 1),
                                       pairs.empty() ? nullptr : pairs.data() + r * (K + 1), Js, sc, lf);
        double e = 0;
        for (int k = 0; k < K; ++k) e += std::max(0.0, row.S(lf[k << (p - s)], lf[(k + 1) << (p - s)]));
        seed_sse[r] = e;
        clock.lap(kJoint);
        finish_row(row, lf, krank + r * n, n, s, p, r, lut_ptr, sse_ptr + r * levels, code_ptr + r * n, sc);
        clock.lap(kFinish);
      }
#pragma omp critical
      for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
    }
    // Seed tolerance: if the matrix's seed-width SSE rose by more than the tolerance, rows go back to
    // their split result, least J gained per seed SSE added first, until it is within the tolerance.
    std::vector<int64_t> back;
    if (seed_tolerance >= 0) {
      double split_total = 0, joint_total = 0;
      for (int64_t r = 0; r < R; ++r) {
        split_total += split_sse[r * levels];
        joint_total += seed_sse[r];
      }
      const double limit = (1 + seed_tolerance) * split_total;
      if (joint_total > limit) {
        std::vector<std::pair<double, int64_t>> order;
        for (int64_t r = 0; r < R; ++r) {
          const double added = seed_sse[r] - split_sse[r * levels];
          if (added > 0) order.emplace_back((obj_ptr[r * 2] - obj_ptr[r * 2 + 1]) / added, r);
        }
        std::sort(order.begin(), order.end());
        for (const auto& item : order) {
          if (joint_total <= limit) break;
          const int64_t r = item.second;
          std::copy(split_leaf.begin() + r * (L + 1), split_leaf.begin() + (r + 1) * (L + 1),
                    leaf.begin() + r * (L + 1));
          joint_total -= seed_sse[r] - split_sse[r * levels];
          obj_ptr[r * 2 + 1] = obj_ptr[r * 2];
          back.push_back(r);
        }
      }
    }
    const int64_t nback = static_cast<int64_t>(back.size());
#pragma omp parallel num_threads(nthreads)
    {
      Scratch sc;
      StageClock clock;
#pragma omp for schedule(dynamic, 8)
      for (int64_t i = 0; i < nback; ++i) {
        const int64_t r = back[i];
        finish_row(restore(r, sc), leaf.data() + r * (L + 1), krank + r * n, n, s, p, r, lut_ptr,
                   sse_ptr + r * levels, code_ptr + r * n, sc);
        clock.lap(kFinish);
      }
#pragma omp critical
      for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
    }
  }
  out.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return -1;
}

// Exact weighted k-means with K runs for every row: cuts [R, K+1], inertia [R]. Returns -1 or the first bad row.
int64_t kmeans_exact_rows(const float* w, const double* sv, int64_t sens_stride, int64_t R, int64_t n, int K,
                          int nthreads, int32_t* cp, double* ip) {
#pragma omp parallel num_threads(nthreads)
  {
    Scratch sc;
    std::vector<int> c(K + 1);
#pragma omp for schedule(dynamic, 8)
    for (int64_t r = 0; r < R; ++r) {
      const int m = prepare_row(w + r * n, sv + r * sens_stride, static_cast<int>(n), sc);
      if (m < 0) {  // reported after the parallel region
        ip[r] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      const Row row = row_of(sc, m);
      kmeans_dp(row, K, sc, c.data());
      double e = 0;
      for (int k = 0; k < K; ++k) e += std::max(0.0, row.S(c[k], c[k + 1]));
      ip[r] = e;
      std::copy(c.begin(), c.end(), cp + r * (K + 1));
    }
  }
  for (int64_t r = 0; r < R; ++r)
    if (std::isnan(ip[r])) return r;
  return -1;
}

#undef AP_AVX2
#undef AP_INLINE
#endif  // ANYPREC_ISA_PASS
