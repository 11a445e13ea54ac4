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
//            and each layer costs O(m log m) evaluations of S (dp_layer). joint also needs the 2K optimum:
//            the same layers, continued.
//   split    per extra bit, every run is cut in two at the exact weighted 2-means optimum of its own
//            members (scan of all cuts), children 2j, 2j+1 refine run j: codes nest, code_b = code_p >> (p-b).
//   joint    (optional) nested partitions chosen for J = Σ_b λ_b SSE_b over b = s..p (joint_row), then the
//            seed tolerance: rows go back to split until the matrix's seed-width SSE is within it.
//   finish   b-bit tables = weighted means of the b-bit runs, per-level SSE, parent codes per column.
//
// A clustering of a row is stored as its leaf cuts: cuts[0] = 0 <= cuts[1] <= ... <= cuts[2^p] = m,
// leaf l = sorted distinct values [cuts[l], cuts[l+1]); the b-bit run j is [cuts[j·2^(p-b)], cuts[(j+1)·2^(p-b)]).
// Ties go to the lowest index everywhere and sums over rows are serial, so results do not depend on the
// thread count. Memory: per thread O(n); with joint ~36 bytes per weight while a matrix is processed.

#ifndef ANYPREC_CPU_CORE_ONLY  // defined only to build the algorithms without torch, for profiling
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#endif

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One prepared row: m sorted distinct values and fp64 prefix sums over them.
struct Row {
  int m;
  const double* x;   // [m] ascending
  const double* P0;  // [m+1] Σ w
  const double* P1;  // [m+1] Σ w x
  const double* P2;  // [m+1] Σ w x²

  // weighted SSE of run [i, j) around its weighted mean. Weights are >= 0, so a run without weight has
  // ΔP1 = ΔP2 = 0 exactly and dividing by 1 instead of ΔP0 = 0 gives its SSE, 0, without a branch.
  inline double S(int i, int j) const {
    const double sw = P0[j] - P0[i], s1 = P1[j] - P1[i];
    return (P2[j] - P2[i]) - s1 * s1 / (sw > 0 ? sw : 1.0);
  }
  inline bool has_weight(int i, int j) const { return P0[j] - P0[i] > 0; }
  inline double mean(int i, int j) const { return (P1[j] - P1[i]) / (P0[j] - P0[i]); }

  // The first c in [a, b] minimising S(lo, c) + S(c, hi): the best cut of run [lo, hi) within [a, b].
  // Branch-free minimum: where the minimum lies is unpredictable, a branch there mispredicts often.
  inline int best_cut_in(int lo, int hi, int a, int b, double* value) const {
    double best = kInf;
    int bc = a;
    for (int c = a; c <= b; ++c) {
      const double v = S(lo, c) + S(c, hi);
      const bool lt = v < best;
      best = lt ? v : best;
      bc = lt ? c : bc;
    }
    *value = best;
    return bc;
  }
};

// Row minima of a matrix whose leftmost argmin is non-decreasing in the row index (true for the
// Monge-structured costs used here): rows j in [jlo, jhi], candidates i in [max(ilo, lo(j)), min(ihi, hi(j))].
// cost(i, j) is evaluated about (rows + candidates)·log(rows) times; val/arg are indexed by j - base.
// The candidate ranges are short (a few values per row on average), so a plain scalar loop is used.
template <class Cost, class Lo, class Hi>
void monotone_argmin(int jlo, int jhi, int ilo, int ihi, const Cost& cost, const Lo& lo, const Hi& hi, int base,
                     double* val, int* arg) {
  while (jlo <= jhi) {
    const int j = jlo + (jhi - jlo) / 2;
    const int a = std::max(ilo, lo(j)), b = std::min(ihi, hi(j));
    double best = kInf;
    int bi = a;
    for (int i = a; i <= b; ++i) {
      const double c = cost(i, j);
      if (c < best) {
        best = c;
        bi = i;
      }
    }
    val[j - base] = best;
    arg[j - base] = bi;
    // recurse on the smaller half, loop on the other (bounded stack depth)
    if (j - jlo < jhi - j) {
      monotone_argmin(jlo, j - 1, ilo, bi, cost, lo, hi, base, val, arg);
      jlo = j + 1;
      ilo = bi;
    } else {
      monotone_argmin(j + 1, jhi, bi, ihi, cost, lo, hi, base, val, arg);
      jhi = j - 1;
      ihi = bi;
    }
  }
}

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<uint64_t> keys, keys2;
  std::vector<double> fa, fb, fc, buf2;
  std::vector<int> ia, ib, ic, id;
  std::vector<int> cuts_a, cuts_b, cuts_c, cuts_d;
};

// ---------------------------------------------------------------- prepare

inline uint32_t order_bits(float v) {
  if (v == 0.0f) v = 0.0f;  // -0 and +0 are one value
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

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

// Row r: distinct sorted values x, prefix sums, and rank[c] = index of column c's value in x.
// The weights of equal values are summed first (columns ascending), then added to the prefix sums.
// Returns m, or -1 when a weight is not finite or a sensitivity is negative or not finite.
int prepare_row(const float* w, const double* sens, int n, Scratch& sc, double* x, double* P0, double* P1, double* P2,
                int32_t* rank) {
  sc.keys.resize(n);
  sc.keys2.resize(n);
  bool ok = true;
  for (int c = 0; c < n; ++c) {
    ok &= std::isfinite(w[c]) && std::isfinite(sens[c]) && sens[c] >= 0;
    sc.keys[c] = (static_cast<uint64_t>(order_bits(w[c])) << 32) | static_cast<uint32_t>(c);
  }
  if (!ok) return -1;
  radix_sort(sc.keys, sc.keys2, n);
  P0[0] = P1[0] = P2[0] = 0;
  int m = 0;
  double wsum = 0;
  uint32_t prev = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(sc.keys[i] >> 32);
    const int c = static_cast<int>(sc.keys[i] & 0xffffffffu);
    if (i > 0 && bits != prev) {  // close value m
      P0[m + 1] = P0[m] + wsum;
      P1[m + 1] = P1[m] + wsum * x[m];
      P2[m + 1] = P2[m] + wsum * x[m] * x[m];
      ++m;
      wsum = 0;
    }
    if (i == 0 || bits != prev) x[m] = static_cast<double>(w[c]) + 0.0;  // + 0.0: -0 is stored as 0
    wsum += sens[c];
    rank[c] = m;
    prev = bits;
  }
  P0[m + 1] = P0[m] + wsum;
  P1[m + 1] = P1[m] + wsum * x[m];
  P2[m + 1] = P2[m] + wsum * x[m] * x[m];
  return m + 1;
}

// ---------------------------------------------------------------- seed: exact k-means by DP

// One DP layer: G[j] = min_{lo(j) <= i <= j} F[i] + S(i, j) and its first argmin, for j = 0..m, where
// lo(j) = prev[j] (or 0). The argmin is non-decreasing in j (S is Monge), so rows are solved coarse to
// fine: row j (counting from 1, j+1 = h·odd) searches only between the argmins of rows j-h and j+h, which
// a coarser pass already found: O(m log m) costs, no recursion, and a branch-free inner minimum (the
// position of the minimum is unpredictable, so a branch there mispredicts often).
void dp_layer(const Row& row, const double* F, const int* prev, double* G, int* arg) {
  const int m = row.m;
  int top = 1;
  while (top * 2 <= m + 1) top *= 2;
  for (int h = top; h >= 1; h /= 2) {
    for (int j1 = h; j1 <= m + 1; j1 += 2 * h) {  // j1 = j + 1 = h · odd
      const int j = j1 - 1;
      int a = j - h >= 0 ? arg[j - h] : 0;
      if (prev) a = std::max(a, prev[j]);
      const int b = j + h <= m ? std::min(arg[j + h], j) : j;
      if (a > b) a = b;  // only through rounding ties between the bounds; never search an empty range
      const double p0 = row.P0[j], p1 = row.P1[j], p2 = row.P2[j];
      double best = kInf;
      int bi = a;
      for (int i = a; i <= b; ++i) {
        const double sw = p0 - row.P0[i], s1 = p1 - row.P1[i];
        const double c = F[i] + ((p2 - row.P2[i]) - s1 * s1 / (sw > 0 ? sw : 1.0));
        const bool lt = c < best;
        best = lt ? c : best;
        bi = lt ? i : bi;
      }
      G[j] = best;
      arg[j] = bi;
    }
  }
}

// Optimal K runs of the row: cuts[0..K]. F_1(j) = S(0, j); F_k(j) = min_{i<=j} F_{k-1}(i) + S(i, j).
// With one cluster more the last cluster of [0, j) starts no earlier, opt_k(j) >= opt_{k-1}(j)
// (Knuth-type bound), which narrows every row's search further. With K2 > K the same layers go on to
// K2 runs and cuts2[0..K2] gets that optimum too (the joint rule's start), for the cost of the extra layers.
void kmeans_dp(const Row& row, int K, Scratch& sc, int* cuts, int K2 = 0, int* cuts2 = nullptr) {
  const int m = row.m;
  const int Kmax = std::max(K, K2);
  sc.fa.resize(m + 1);
  sc.fb.resize(m + 1);
  sc.ia.resize(static_cast<size_t>(Kmax) * (m + 1));
  double* F = sc.fa.data();
  double* G = sc.fb.data();
  for (int j = 0; j <= m; ++j) F[j] = row.S(0, j);
  const int* prev = nullptr;
  for (int k = 2; k < Kmax; ++k) {
    int* arg = sc.ia.data() + static_cast<size_t>(k) * (m + 1);
    dp_layer(row, F, prev, G, arg);
    prev = arg;
    std::swap(F, G);
  }
  // last layer: only j = m is needed
  int last = 0;
  if (Kmax > 1) {
    double best = kInf;
    for (int i = prev ? prev[m] : 0; i <= m; ++i) {
      const double c = F[i] + row.S(i, m);
      if (c < best) {
        best = c;
        last = i;
      }
    }
  }
  auto backtrack = [&](int Kc, int* c) {
    c[0] = 0;
    c[Kc] = m;
    if (Kc == 1) return;
    c[Kc - 1] = Kc == Kmax ? last : sc.ia[static_cast<size_t>(Kc) * (m + 1) + m];
    for (int k = Kc - 1; k >= 2; --k) c[k - 1] = sc.ia[static_cast<size_t>(k) * (m + 1) + c[k]];
  };
  backtrack(K, cuts);
  if (cuts2) backtrack(K2, cuts2);
}

// ---------------------------------------------------------------- split

// Exact weighted 2-means cut of run [lo, hi): the first x in [lo, hi] minimising S(lo, x) + S(x, hi).
inline int best_cut(const Row& row, int lo, int hi) {
  double value;
  return row.best_cut_in(lo, hi, lo, hi, &value);
}

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
        for (int ia = na - 1; ia >= 0; --ia) {  // a descending, b ascending: Knuth bounds are known
          const int a = la + ia;
          for (int ib = 0; ib < nb; ++ib) {
            const int b = lb + ib;
            if (b < a) {
              cp[ia * W + ib] = a;
              cv[ia * W + ib] = kInf;
              continue;
            }
            int clo = a, chi = b;
            if (ib > 0 && b - 1 >= a) clo = std::max(clo, cp[ia * W + ib - 1]);
            if (ia + 1 < na && a + 1 <= b) chi = std::min(chi, cp[(ia + 1) * W + ib]);
            if (clo > chi) clo = chi;  // only possible through ties; keep the bounds consistent
            double best;
            cp[ia * W + ib] = row.best_cut_in(a, b, clo, chi, &best);
            cv[ia * W + ib] = l0 * row.S(a, b) + l1 * best;
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

// Look-ahead split of run [lo, hi): the first x minimising l0·(S(lo,x) + S(x,hi)) + l1·(B(lo,x) + B(x,hi)),
// i.e. the cut chosen for its own level and for the best split of both children one level further.
// B(lo, x) for all x: its leftmost split argmin is non-decreasing in x, so the scan for x starts at the
// argmin for x-1; B(x, hi) likewise from the argmin for x+1 downwards. The values are exact minima.
int lookahead_cut(const Row& row, int lo, int hi, double l0, double l1, Scratch& sc) {
  const int len = hi - lo + 1;
  sc.fb.resize(2 * len);
  sc.fc.resize(2 * len);
  double* SL = sc.fb.data();        // S(lo, lo + k)
  double* SR = SL + len;            // S(lo + k, hi)
  double* BL = sc.fc.data();        // B(lo, lo + k)
  double* BR = BL + len;            // B(lo + k, hi)
  for (int k = 0; k < len; ++k) {
    SL[k] = row.S(lo, lo + k);
    SR[k] = row.S(lo + k, hi);
  }
  for (int x = lo, c0 = lo; x <= hi; ++x) {
    double best = kInf;
    int bc = c0;
    for (int c = c0; c <= x; ++c) {
      const double v = SL[c - lo] + row.S(c, x);
      const bool lt = v < best;
      best = lt ? v : best;
      bc = lt ? c : bc;
    }
    BL[x - lo] = best;
    c0 = bc;
  }
  for (int x = hi, c1 = hi; x >= lo; --x) {
    double best = kInf;
    int bc = x;
    for (int c = x; c <= c1; ++c) {
      const double v = row.S(x, c) + SR[c - lo];
      const bool lt = v < best;
      best = lt ? v : best;
      bc = lt ? c : bc;
    }
    BR[x - lo] = best;
    c1 = bc;
  }
  double best = kInf;
  int bx = lo;
  for (int k = 0; k < len; ++k) {
    const double v = l0 * (SL[k] + SR[k]) + l1 * (BL[k] + BR[k]);
    if (v < best) {
      best = v;
      bx = lo + k;
    }
  }
  return bx;
}

// Leaf cuts [2^p + 1] from the level-b cuts `coarse` [2^b + 1]: every run of every finer level cut in two,
// by the exact 2-means cut, or (lam != nullptr) by lookahead_cut for levels s+2..p-1 (weights λ_level, λ_level+1).
void grow(const Row& row, const int* coarse, int b, int p, int* leaf, int s, const double* lam, Scratch& sc) {
  const int L = 1 << p;
  const int step0 = 1 << (p - b);
  for (int j = 0; j <= (1 << b); ++j) leaf[j * step0] = coarse[j];
  for (int level = b + 1; level <= p; ++level) {
    const int step = 1 << (p - level);  // distance between level-`level` cuts in leaf indices
    const bool look = lam != nullptr && level >= s + 2 && level < p;
    for (int j = 0; j < L; j += 2 * step) {
      const int lo = leaf[j], hi = leaf[j + 2 * step];
      leaf[j + step] =
          look ? lookahead_cut(row, lo, hi, lam[level - s], lam[level + 1 - s], sc) : best_cut(row, lo, hi);
    }
  }
}

// Lloyd-type alternation for the blended objective with all levels at once: with every level's table
// fixed, each value goes to the leaf minimising Σ_b λ_b (x − c_b(ancestor_b(leaf)))² = Λx² − 2xM_l + A_l,
// a lower envelope of lines in x; with tables ordered by index so are the M_l, so the best leaf is
// non-decreasing in x and leaves stay runs (monotone_argmin over values × leaves). Then every table is
// refit as weighted means of its runs. Neither step raises J; leaves without weight are left out (their
// centroid is free, and leaving them out keeps the M_l ordered). Stops when the cuts repeat.
double envelope_polish(const Row& row, int s, int p, const double* lam, int max_iters, Scratch& sc, int* leaf) {
  const int L = 1 << p, m = row.m;
  std::vector<double>& M = sc.fa;
  std::vector<double>& A = sc.fb;
  std::vector<int>& live = sc.ia;
  std::vector<int>& owner = sc.ib;
  std::vector<double>& dummy = sc.fc;
  std::vector<int>& next = sc.cuts_d;
  M.resize(L);
  A.resize(L);
  live.resize(L);
  owner.resize(m);
  dummy.resize(m);
  next.resize(L + 1);
  std::vector<double>& cm = sc.buf2;  // level means, level b at offset 2^b - 2^s
  cm.resize((size_t(2) << p) - (size_t(1) << s));
  double J = objective(row, leaf, s, p, lam, nullptr);
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
    auto cost = [&](int q, int u) { return A[q] - 2.0 * row.x[u] * M[q]; };
    monotone_argmin(0, m - 1, 0, nl - 1, cost, [](int) { return 0; }, [nl](int) { return nl - 1; }, 0, dummy.data(),
                    owner.data());
    // leaf l's run starts at the first value owned by a leaf >= l
    int u = 0;
    for (int l = 0; l <= L; ++l) {
      while (u < m && live[owner[u]] < l) ++u;
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
double joint_row(const Row& row, int s, int p, const double* lam, int window, const int* seed, const int* pairs,
                 Scratch& sc, int* leaf) {
  const int K = 1 << s, L = 1 << p;
  const double J_split = objective(row, leaf, s, p, lam, nullptr);
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
    grow(row, (v1 < v0 ? t1 : t0).data(), s, p, cand.data(), s, lam, sc);
    J = envelope_polish(row, s, p, lam, 100, sc, cand.data());
  }
  if (!(J < J_split)) {
    cand.assign(leaf, leaf + L + 1);
    J = envelope_polish(row, s, p, lam, 100, sc, cand.data());
  }
  if (J < J_split) {
    std::copy(cand.begin(), cand.end(), leaf);
    return J;
  }
  return J_split;
}

// ---------------------------------------------------------------- driver

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
  std::vector<int>& leaf_of = sc.ia;
  leaf_of.resize(row.m);
  for (int l = 0; l < L; ++l)
    for (int u = lf[l]; u < lf[l + 1]; ++u) leaf_of[u] = l;
  for (int b = s; b <= p; ++b) {
    const double* lut = lut_ptr[b - s] + r * (int64_t(1) << b);
    double e = 0;
    for (int u = 0; u < row.m; ++u) {
      const double d = row.x[u] - lut[leaf_of[u] >> (p - b)];
      e += (row.P0[u + 1] - row.P0[u]) * d * d;
    }
    sse[b - s] = e;
  }
  for (int64_t c = 0; c < n; ++c) codes[c] = static_cast<uint8_t>(leaf_of[rank[c]]);
}

}  // namespace

#ifndef ANYPREC_CPU_CORE_ONLY
// W fp32 [R, n]; sens fp64 [n] (one weight per column, all rows) or [R, n]; 1 <= s <= p <= 8;
// joint: level_weights [p-s+1], window, seed_tolerance (< 0: no limit on the seed width's SSE).
// Returns (codes uint8 [R, n] of the p-bit parent, [lut_b fp64 [R, 2^b] for b = s..p], sse fp64 [R, p-s+1],
// objective fp64 [R, 2] = (J of split, J of the result) (zeros unless joint), seconds: "wall" of the call
// and the thread-seconds of every stage, summed over threads).
std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, std::map<std::string, double>> quantize(
    const at::Tensor& W, const at::Tensor& sens, int64_t seed_bits, int64_t parent_bits, bool joint,
    const std::vector<double>& level_weights, int64_t window, double seed_tolerance, int64_t threads) {
  TORCH_CHECK(W.device().is_cpu() && W.scalar_type() == at::kFloat && W.dim() == 2 && W.is_contiguous(),
              "anyprec_cpu: W must be a contiguous fp32 CPU matrix, got ", W.scalar_type(), " ", W.sizes());
  TORCH_CHECK(sens.device().is_cpu() && sens.scalar_type() == at::kDouble && sens.is_contiguous(),
              "anyprec_cpu: sensitivity must be contiguous fp64 on the CPU, got ", sens.scalar_type());
  const int64_t R = W.size(0), n = W.size(1);
  TORCH_CHECK((sens.dim() == 1 && sens.size(0) == n) || (sens.dim() == 2 && sens.size(0) == R && sens.size(1) == n),
              "anyprec_cpu: sensitivity must be [", n, "] or [", R, ", ", n, "], got ", sens.sizes());
  TORCH_CHECK(1 <= seed_bits && seed_bits <= parent_bits && parent_bits <= 8,
              "anyprec_cpu: need 1 <= seed_bits <= parent_bits <= 8, got ", seed_bits, " and ", parent_bits);
  TORCH_CHECK(n >= 1 && n < (int64_t(1) << 31), "anyprec_cpu: row length ", n, " out of range");
  const int s = static_cast<int>(seed_bits), p = static_cast<int>(parent_bits);
  const int levels = p - s + 1, K = 1 << s, L = 1 << p;
  TORCH_CHECK(!joint || static_cast<int>(level_weights.size()) == levels, "anyprec_cpu: ", levels,
              " level weights needed for bits ", s, "..", p, ", got ", level_weights.size());
  for (double v : level_weights) TORCH_CHECK(v > 0 && std::isfinite(v), "anyprec_cpu: level weights must be > 0");
  TORCH_CHECK(window >= 0 && window <= 4096, "anyprec_cpu: window must be in 0..4096, got ", window);
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();

  const float* w = W.data_ptr<float>();
  const double* sv = sens.data_ptr<double>();
  const int64_t sens_stride = sens.dim() == 2 ? n : 0;

  // Each row goes through prepare, seed, split and (without joint) finish in one go, while its arrays
  // are in cache. joint needs every row's split SSE first (for λ), so then the prepared rows are kept
  // (~36 bytes per weight, left uninitialised: every entry read is written first) for a second pass.
  const int64_t kept = joint ? R : 0;
  std::unique_ptr<double[]> xs(new double[kept * n]), P0(new double[kept * (n + 1)]),
      P1(new double[kept * (n + 1)]), P2(new double[kept * (n + 1)]);
  std::unique_ptr<int32_t[]> rank(new int32_t[kept * n]);
  std::vector<int32_t> msize(R);
  std::vector<int> seed(R * (K + 1)), leaf(R * (L + 1));
  std::vector<int> pairs(joint && p > s ? R * (K + 1) : 0);  // even cuts of the exact 2K-run optimum
  std::vector<double> split_sse(joint ? R * levels : 0);
  auto kept_row = [&](int64_t r) {
    return Row{msize[r], xs.get() + r * n, P0.get() + r * (n + 1), P1.get() + r * (n + 1), P2.get() + r * (n + 1)};
  };
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor codes = at::empty({R, n}, at::TensorOptions().dtype(at::kByte));
  at::Tensor sse = at::empty({R, levels}, opts);
  at::Tensor obj = at::zeros({R, 2}, opts);
  std::vector<at::Tensor> luts;
  for (int b = s; b <= p; ++b) luts.push_back(at::empty({R, int64_t(1) << b}, opts));
  std::vector<double*> lut_ptr;
  for (auto& t : luts) lut_ptr.push_back(t.data_ptr<double>());
  uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  double* sse_ptr = sse.data_ptr<double>();
  double* obj_ptr = obj.data_ptr<double>();
  double stage_seconds[kStages] = {0, 0, 0, 0, 0};
  const auto start = std::chrono::steady_clock::now();

  {
    pybind11::gil_scoped_release no_gil;
#pragma omp parallel num_threads(nthreads)
    {
      Scratch sc;
      StageClock clock;
      std::vector<double> x(kept ? 0 : n), q0(kept ? 0 : n + 1), q1(kept ? 0 : n + 1), q2(kept ? 0 : n + 1);
      std::vector<int32_t> rk(kept ? 0 : n);
#pragma omp for schedule(dynamic, 4)
      for (int64_t r = 0; r < R; ++r) {
        double* xr = kept ? xs.get() + r * n : x.data();
        double* p0 = kept ? P0.get() + r * (n + 1) : q0.data();
        double* p1 = kept ? P1.get() + r * (n + 1) : q1.data();
        double* p2 = kept ? P2.get() + r * (n + 1) : q2.data();
        int32_t* rr = kept ? rank.get() + r * n : rk.data();
        clock.lap(kFinish);  // (the loop's own overhead)
        msize[r] = prepare_row(w + r * n, sv + r * sens_stride, static_cast<int>(n), sc, xr, p0, p1, p2, rr);
        clock.lap(kPrepare);
        if (msize[r] < 0) continue;  // reported after the parallel region
        const Row row{msize[r], xr, p0, p1, p2};
        if (pairs.empty()) {
          kmeans_dp(row, K, sc, seed.data() + r * (K + 1));
        } else {
          std::vector<int>& c2 = sc.cuts_a;
          c2.resize(2 * K + 1);
          kmeans_dp(row, K, sc, seed.data() + r * (K + 1), 2 * K, c2.data());
          for (int k = 0; k <= K; ++k) pairs[r * (K + 1) + k] = c2[2 * k];
        }
        clock.lap(kSeed);
        int* lf = leaf.data() + r * (L + 1);
        grow(row, seed.data() + r * (K + 1), s, p, lf, s, nullptr, sc);
        if (joint) objective(row, lf, s, p, nullptr, split_sse.data() + r * levels);
        clock.lap(kSplit);
        if (!joint) {
          finish_row(row, lf, rr, n, s, p, r, lut_ptr, sse_ptr + r * levels, code_ptr + r * n, sc);
          clock.lap(kFinish);
        }
      }
#pragma omp critical
      for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
    }
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(msize[r] >= 0, "anyprec_cpu: row ", r, " has a weight that is not finite or a sensitivity that is "
                  "negative or not finite");

    if (joint) {
      // λ_b = weight_b / (matrix SSE_b of the split result): every level counts by its relative change.
      // Summed serially in row order so the result does not depend on the thread count.
      std::vector<double> lam(levels);
      for (int b = 0; b < levels; ++b) {
        double tot = 0;
        for (int64_t r = 0; r < R; ++r) tot += split_sse[r * levels + b];
        lam[b] = level_weights[b] / std::max(tot, 1e-300);
      }
      const std::vector<int> split_leaf(leaf);
      std::vector<double> seed_sse(R);
#pragma omp parallel num_threads(nthreads)
      {
        Scratch sc;
        StageClock clock;
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < R; ++r) {
          const Row row = kept_row(r);
          int* lf = leaf.data() + r * (L + 1);
          double Js = 0;
          for (int b = 0; b < levels; ++b) Js += lam[b] * split_sse[r * levels + b];
          obj_ptr[r * 2] = Js;
          obj_ptr[r * 2 + 1] = joint_row(row, s, p, lam.data(), static_cast<int>(window), seed.data() + r * (K + 1),
                                         pairs.empty() ? nullptr : pairs.data() + r * (K + 1), sc, lf);
          double e = 0;
          for (int k = 0; k < K; ++k) e += std::max(0.0, row.S(lf[k << (p - s)], lf[(k + 1) << (p - s)]));
          seed_sse[r] = e;
          clock.lap(kJoint);
        }
#pragma omp critical
        for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
      }
      // Seed tolerance: if the matrix's seed-width SSE rose by more than the tolerance, rows go back to
      // their split result, least J gained per seed SSE added first, until it is within the tolerance.
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
          }
        }
      }
#pragma omp parallel num_threads(nthreads)
      {
        Scratch sc;
        StageClock clock;
#pragma omp for schedule(dynamic, 8)
        for (int64_t r = 0; r < R; ++r) {
          finish_row(kept_row(r), leaf.data() + r * (L + 1), rank.get() + r * n, n, s, p, r, lut_ptr,
                     sse_ptr + r * levels, code_ptr + r * n, sc);
          clock.lap(kFinish);
        }
#pragma omp critical
        for (int k = 0; k < kStages; ++k) stage_seconds[k] += clock.seconds[k];
      }
    }
  }
  std::map<std::string, double> secs;
  secs["wall"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int k = 0; k < kStages; ++k) secs[kStageNames[k]] = stage_seconds[k];
  return {codes, luts, sse, obj, secs};
}

// Exact weighted k-means with K runs for every row (the seed stage alone): cuts int32 [R, K+1] over the
// sorted distinct values, and the inertia fp64 [R]. For tests and measurements.
std::tuple<at::Tensor, at::Tensor> kmeans_exact(const at::Tensor& W, const at::Tensor& sens, int64_t K,
                                                int64_t threads) {
  TORCH_CHECK(W.scalar_type() == at::kFloat && W.dim() == 2 && W.is_contiguous(), "kmeans_exact: fp32 [R, n] W");
  TORCH_CHECK(sens.scalar_type() == at::kDouble && sens.is_contiguous() && sens.numel() % W.size(1) == 0,
              "kmeans_exact: fp64 sensitivity [n] or [R, n]");
  TORCH_CHECK(K >= 1 && K <= 65536, "kmeans_exact: K out of range");
  const int64_t R = W.size(0), n = W.size(1);
  const int64_t sens_stride = sens.dim() == 2 ? n : 0;
  at::Tensor cuts = at::empty({R, K + 1}, at::TensorOptions().dtype(at::kInt));
  at::Tensor inertia = at::empty({R}, at::TensorOptions().dtype(at::kDouble));
  const float* w = W.data_ptr<float>();
  const double* sv = sens.data_ptr<double>();
  int32_t* cp = cuts.data_ptr<int32_t>();
  double* ip = inertia.data_ptr<double>();
  const int nthreads = threads > 0 ? static_cast<int>(threads) : at::get_num_threads();
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel num_threads(nthreads)
  {
    Scratch sc;
    std::vector<double> x(n), P0(n + 1), P1(n + 1), P2(n + 1);
    std::vector<int32_t> rank(n);
    std::vector<int> c(K + 1);
#pragma omp for schedule(dynamic, 8)
    for (int64_t r = 0; r < R; ++r) {
      const int m = prepare_row(w + r * n, sv + r * sens_stride, static_cast<int>(n), sc, x.data(), P0.data(),
                                P1.data(), P2.data(), rank.data());
      if (m < 0) {  // reported after the parallel region
        ip[r] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      const Row row{m, x.data(), P0.data(), P1.data(), P2.data()};
      kmeans_dp(row, static_cast<int>(K), sc, c.data());
      double e = 0;
      for (int k = 0; k < K; ++k) e += std::max(0.0, row.S(c[k], c[k + 1]));
      ip[r] = e;
      std::copy(c.begin(), c.end(), cp + r * (K + 1));
    }
  }
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(!std::isnan(ip[r]), "kmeans_exact: row ", r, " has a weight that is not finite or a sensitivity that "
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
        py::arg("level_weights"), py::arg("window"), py::arg("seed_tolerance"), py::arg("threads"));
  m.def("kmeans_exact", &kmeans_exact, "Exact weighted k-means of every row: (cuts int32 [R, K+1], inertia fp64 [R]).",
        py::arg("W"), py::arg("sens"), py::arg("K"), py::arg("threads"));
}
#endif  // ANYPREC_CPU_CORE_ONLY
