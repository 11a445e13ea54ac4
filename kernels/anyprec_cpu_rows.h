// The per-row stages of the any-precision CPU clustering (anyprec_cpu.cpp documents the algorithm):
// prepare, seed (exact k-means by DP), split (exact 2-means cuts), finish, and the drivers over a
// matrix's rows. Included twice by anyprec_cpu.cpp, inside namespace anyprec::generic and anyprec::avx2
// (see anyprec_cpu_scan.h, which it includes first), so it has no include guard.
#include "anyprec_cpu_scan.h"

namespace {

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<uint64_t> keys, keys2;
  std::vector<double> x, P0, P1, P2, wsum;  // the prepared row (padded)
  std::vector<int32_t> rank;
  std::vector<double> fa, fb;  // kmeans_dp: two layers of F
  std::vector<int> ia;         // kmeans_dp: every layer's argmins
  std::vector<int> cuts;       // kmeans_upper: the Lloyd steps' cuts
  std::vector<double> means;   // kmeans_upper: the Lloyd steps' means
  std::vector<int> leaf_of;    // finish_row: the leaf of every distinct value
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

// One DP layer on rows j = 0..M: G[j] = min_{lo(j) <= i <= j} F[i] + S(i, j) and its first argmin, where
// lo(j) = max(prev[j], 0) (0 without prev). The argmin is non-decreasing in j (S is Monge), so rows are solved
// coarse to fine: row j (position q = j+1 = h·odd) searches only between the argmins of rows j-h and j+h,
// which a coarser pass already found: O(n log n) costs for n = M+1 rows, no recursion.
// Pruning: G is non-decreasing in j, so once a row's value exceeds U (an upper bound on the whole problem's
// optimum) every later row does too; those rows are set to G = +inf, arg = -1 (no bound for other rows). An
// optimal path only passes rows whose value is at most the optimum, and such a row's argmin has a value at
// most its own, so every row at most U is computed exactly from rows at most U.
void dp_layer(const Row& row, const double* F, const int* prev, int M, double* G, int* arg, double U) {
  const int n = M + 1;
  int top = 1;
  while (top * 2 <= n) top *= 2;
  int jmax = M + 1;  // rows from here on are pruned
  for (int h = top; h >= 1; h /= 2) {
    for (int q = h; q <= n; q += 2 * h) {
      const int j = q - 1;
      if (j >= jmax) {
        G[j] = kInf;
        arg[j] = -1;
        continue;
      }
      int a = q - h >= 1 ? arg[j - h] : 0;
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
  std::vector<int>& c = sc.cuts;
  std::vector<double>& mu = sc.means;
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

// cuts[0..K] of the K-run optimum from layer K-1's F (the last layer needs only j = m) and the argmins
// dp_layer kept per layer in sc.ia.
void backtrack(const Row& row, const double* F, const int* prev, const Scratch& sc, int K, int* cuts) {
  const int m = row.m;
  cuts[0] = 0;
  cuts[K] = m;
  double value;
  cuts[K - 1] = argmin_F_plus_S(row, F, std::max(prev ? prev[m] : 0, 0), m, m, &value);
  for (int k = K - 1; k >= 2; --k) cuts[k - 1] = sc.ia[static_cast<size_t>(k) * (m + 1) + cuts[k]];
}

// Optimal K runs of the row: cuts[0..K]. F_1(j) = S(0, j); F_k(j) = min_{i<=j} F_{k-1}(i) + S(i, j).
// With one cluster more the last cluster of [0, j) starts no earlier, opt_k(j) >= opt_{k-1}(j)
// (Knuth-type bound), which narrows every row's search further. Layers are pruned by an upper bound on the
// optimum (dp_layer) from kmeans_upper, which leaves ~70 % of their rows on SmolLM2.
void kmeans_dp(const Row& row, int K, Scratch& sc, int* cuts) {
  const int m = row.m;
  sc.fa.resize(m + 1 + kPad);
  sc.fb.resize(m + 1 + kPad);
  sc.ia.resize(static_cast<size_t>(K) * (m + 1));
  double* F = sc.fa.data();
  double* G = sc.fb.data();
  S_span(row, 0, m, F);
  for (int j = m + 1; j <= m + kPad; ++j) F[j] = G[j] = 0;
  const double U = kmeans_upper(row, K, sc);
  const int* prev = nullptr;
  for (int k = 2; k < K; ++k) {
    int* arg = sc.ia.data() + static_cast<size_t>(k) * (m + 1);
    dp_layer(row, F, prev, m, G, arg, U);
    prev = arg;
    std::swap(F, G);
  }
  if (K > 1) {
    backtrack(row, F, prev, sc, K, cuts);
  } else {
    cuts[0] = 0;
    cuts[K] = m;
  }
}

// ---------------------------------------------------------------- split

// Leaf cuts [2^p + 1] from the level-b cuts `coarse` [2^b + 1]: every run of every finer level cut in two
// by the exact 2-means cut. Each cut is a fresh scan (best_cut): most runs below the seed level are a few
// values long, one step of the scan.
void grow(const Row& row, const int* coarse, int b, int p, int* leaf) {
  const int L = 1 << p;
  const int step0 = 1 << (p - b);
  for (int j = 0; j <= (1 << b); ++j) leaf[j * step0] = coarse[j];
  for (int level = b + 1; level <= p; ++level) {
    const int step = 1 << (p - level);  // distance between level-`level` cuts in leaf indices
    for (int j = 0; j < L; j += 2 * step) leaf[j + step] = best_cut(row, leaf[j], leaf[j + 2 * step]);
  }
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
  std::vector<int>& leaf_of = sc.leaf_of;
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

// ---------------------------------------------------------------- drivers

// The whole matrix (see the torch entry point quantize in anyprec_cpu.cpp for the arguments): every row
// goes through prepare, seed, split and finish in one go, while its arrays are in cache. Returns -1, or
// the first row with a weight that is not finite or a sensitivity that is negative or not finite.
int64_t quantize_rows(const float* w, const double* sv, int64_t sens_stride, int64_t R, int64_t n, int s, int p,
                      int nthreads, Outputs& out) {
  const int levels = p - s + 1, K = 1 << s, L = 1 << p;
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> msize(R);
#pragma omp parallel num_threads(nthreads)
  {
    Scratch sc;
    StageClock clock;
    std::vector<int> seed(K + 1), leaf(L + 1);
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < R; ++r) {
      clock.lap(kFinish);  // (the loop's own overhead)
      msize[r] = prepare_row(w + r * n, sv + r * sens_stride, static_cast<int>(n), sc);
      clock.lap(kPrepare);
      if (msize[r] < 0) continue;  // reported after the parallel region
      const Row row = row_of(sc, msize[r]);
      kmeans_dp(row, K, sc, seed.data());
      clock.lap(kSeed);
      grow(row, seed.data(), s, p, leaf.data());
      clock.lap(kSplit);
      finish_row(row, leaf.data(), sc.rank.data(), n, s, p, r, out.luts, out.sse + r * levels, out.codes + r * n, sc);
      clock.lap(kFinish);
    }
#pragma omp critical
    for (int k = 0; k < kStages; ++k) out.stage_seconds[k] += clock.seconds[k];
  }
  for (int64_t r = 0; r < R; ++r)
    if (msize[r] < 0) return r;
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
