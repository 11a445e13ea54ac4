// The scans of the any-precision CPU clustering (anyprec_cpu.cpp): one prepared row and "first argmin of a
// cost over a run of candidates", plain or four candidates per AVX2 step. Included twice by
// anyprec_cpu.cpp, inside namespace anyprec::generic (ANYPREC_ISA_PASS 1) and anyprec::avx2
// (ANYPREC_ISA_PASS 2, compiled with the avx2 target), so it has no include guard and includes nothing
// itself. Both passes compute every cost with the same IEEE operations in the same order (no FMA
// contraction: neither target enables FMA), so they return the same bits.
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

// out[k] = S(lo, lo + k) for k = 0..hi-lo (out must have 3 entries of room past hi - lo)
inline void S_span(const Row& row, int lo, int hi, double* out) {
  int k = 0;
#if AP_AVX2
  const __m256d pl0 = bcast(row.P0 + lo), pl1 = bcast(row.P1 + lo), pl2 = bcast(row.P2 + lo);
  for (; lo + k <= hi; k += 4) _mm256_storeu_pd(out + k, S4_from(row, pl0, pl1, pl2, lo + k));
#else
  for (; lo + k <= hi; ++k) out[k] = row.S(lo, lo + k);
#endif
}

}  // namespace
