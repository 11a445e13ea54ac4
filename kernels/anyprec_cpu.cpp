// Any-precision seed + incremental upscaling on the CPU (Any-Precision LLM §4; SqueezeLLM seed): the
// entry points of the anyprec_cpu extension, their instruction-set dispatch and the Python bindings.
// Python caller: quantkit/methods/kmeans_native.py; tests/anyprec_reference.py computes the same results
// brute force, and the tests hold this extension to it exactly.
//
// Every output row r of W [R, n] is an independent weighted 1-D clustering problem, so rows are spread
// over OpenMP threads; a row runs all its stages in one go while its arrays are in cache, and the
// thread-seconds of every stage are returned (anyprec_cpu_rows.h):
//
//   prepare  sort the row (LSD radix sort of 64-bit keys: order-preserving float bits << 32 | column),
//            merge equal values (their weights add: an optimal 1-D partition never separates equal
//            values), and take fp64 prefix sums P0 = Σw, P1 = Σwx, P2 = Σwx² over the m distinct values.
//            Any run [i, j) of sorted values then has weighted SSE S(i, j) = ΔP2 − ΔP1²/ΔP0 in O(1).
//   seed     the exact weighted k-means optimum with K = 2^s clusters: in 1-D optimal clusters are runs,
//            F_k(j) = min_i F_{k-1}(i) + S(i, j), and S is Monge, so the argmin i is non-decreasing in j
//            and each layer costs O(m log m) evaluations of S (dp_layer). Rows j of a layer whose value
//            exceeds an upper bound on the optimum are pruned (a few Lloyd steps give the bound), which skips
//            ~30 % of them.
//   split    per extra bit, every run is cut in two at the exact weighted 2-means optimum of its own
//            members (scan of all cuts), children 2j, 2j+1 refine run j: codes nest, code_b = code_p >> (p-b).
//   finish   b-bit tables = weighted means of the b-bit runs, per-level SSE, parent codes per column.
//
// A clustering of a row is stored as its leaf cuts: cuts[0] = 0 <= cuts[1] <= ... <= cuts[2^p] = m,
// leaf l = sorted distinct values [cuts[l], cuts[l+1]); the b-bit run j is [cuts[j·2^(p-b)], cuts[(j+1)·2^(p-b)]).
// Ties go to the lowest index everywhere and rows are independent, so results do not depend on the thread
// count. Every pruning and search bound keeps the first argmin of each scan (in exact arithmetic), so the
// results are those of the brute-force reference.
//
// Instruction sets: the algorithms (anyprec_cpu_scan.h, anyprec_cpu_rows.h) are compiled twice, by
// including them below: plain (namespace generic) and with AVX2 enabled (namespace avx2), where the scans
// "first argmin of a cost over a run of candidates" evaluate four candidates per step. Both compute every
// cost with the same IEEE operations in the same order, so they return the same bits; AVX2 is used where
// the CPU has it (the build itself stays portable: no -march flags). Memory: O(n) per thread.

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
#include <string>
#include <utility>
#include <vector>

namespace anyprec {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Arrays read by the 4-wide scans are padded: readable (and finite) this many entries past their end.
constexpr int kPad = 8;

// Time per stage, per thread: lap(stage) charges the time since the last lap to `stage`. Summed over
// the threads this is each stage's thread-seconds (a steady clock: ~25 ns a lap, cheap per row).
enum Stage { kPrepare, kSeed, kSplit, kFinish, kStages };
const char* const kStageNames[kStages] = {"prepare", "seed", "split", "finish"};

struct StageClock {
  double seconds[kStages] = {0, 0, 0, 0};
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Stage stage) {
    const auto now = std::chrono::steady_clock::now();
    seconds[stage] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// Outputs of quantize_rows (allocated by the caller): codes [R, n], luts[b - s] [R, 2^b], sse [R, levels];
// the stage thread-seconds and the wall time are filled in.
struct Outputs {
  uint8_t* codes;
  std::vector<double*> luts;
  double* sse;
  double stage_seconds[kStages] = {0, 0, 0, 0};
  double wall = 0;
};

}  // namespace anyprec

#define ANYPREC_ISA_PASS 1
namespace anyprec {
namespace generic {
#include "anyprec_cpu_rows.h"
}  // namespace generic
}  // namespace anyprec
#undef ANYPREC_ISA_PASS

#define ANYPREC_ISA_PASS 2
#pragma GCC push_options
#pragma GCC target("avx2")
namespace anyprec {
namespace avx2 {
#include "anyprec_cpu_rows.h"
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
                             int64_t n, int s, int p, int nthreads, Outputs& out) {
  if (isa == "avx2") return avx2::quantize_rows(w, sv, sens_stride, R, n, s, p, nthreads, out);
  return generic::quantize_rows(w, sv, sens_stride, R, n, s, p, nthreads, out);
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
// isa: "auto", "generic" or "avx2" (the same results; for tests and measurements).
// Returns (codes uint8 [R, n] of the p-bit parent, [lut_b fp64 [R, 2^b] for b = s..p], sse fp64 [R, p-s+1],
// seconds: "wall" of the call and the thread-seconds of every stage, summed over threads).
std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor, std::map<std::string, double>> quantize(
    const at::Tensor& W, const at::Tensor& sens, int64_t seed_bits, int64_t parent_bits, int64_t threads,
    const std::string& isa) {
  check_rows(W, sens, "anyprec_cpu");
  const int64_t R = W.size(0), n = W.size(1);
  QK_CHECK(1 <= seed_bits && seed_bits <= parent_bits && parent_bits <= 8,
              "anyprec_cpu: need 1 <= seed_bits <= parent_bits <= 8, got ", seed_bits, " and ", parent_bits);
  const int s = static_cast<int>(seed_bits), p = static_cast<int>(parent_bits);
  const int levels = p - s + 1;
  const std::string used = available_isa(isa, "anyprec_cpu");
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();

  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor codes = at::empty({R, n}, at::TensorOptions().dtype(at::kByte));
  at::Tensor sse = at::empty({R, levels}, opts);
  std::vector<at::Tensor> luts;
  for (int b = s; b <= p; ++b) luts.push_back(at::empty({R, int64_t(1) << b}, opts));
  anyprec::Outputs out;
  out.codes = codes.data_ptr<uint8_t>();
  for (auto& t : luts) out.luts.push_back(t.data_ptr<double>());
  out.sse = sse.data_ptr<double>();
  int64_t bad;
  {
    pybind11::gil_scoped_release no_gil;
    bad = anyprec::quantize_rows(used, W.data_ptr<float>(), sens.data_ptr<double>(), sens.dim() == 2 ? n : 0, R, n,
                                 s, p, nthreads, out);
  }
  QK_CHECK(bad < 0, "anyprec_cpu: row ", bad, " has a weight that is not finite or a sensitivity that is "
              "negative or not finite");
  std::map<std::string, double> secs;
  secs["wall"] = out.wall;
  for (int k = 0; k < anyprec::kStages; ++k) secs[anyprec::kStageNames[k]] = out.stage_seconds[k];
  return {codes, luts, sse, secs};
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
        "Seed at seed_bits, split every cluster up to parent_bits; returns "
        "(codes uint8 [R, n], [lut_b fp64 [R, 2^b]], sse fp64 [R, levels], stage seconds).",
        py::arg("W"), py::arg("sens"), py::arg("seed_bits"), py::arg("parent_bits"), py::arg("threads"),
        py::arg("isa") = "auto");
  m.def("kmeans_exact", &kmeans_exact, "Exact weighted k-means of every row: (cuts int32 [R, K+1], inertia fp64 [R]).",
        py::arg("W"), py::arg("sens"), py::arg("K"), py::arg("threads"), py::arg("isa") = "auto");
  m.def("isa", &anyprec::pick_isa, "The instruction set a request (auto, generic, avx2) runs on ('' if unavailable).",
        py::arg("isa") = "auto");
}
#endif  // ANYPREC_CPU_CORE_ONLY
