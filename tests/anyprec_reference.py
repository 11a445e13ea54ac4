"""Brute-force oracle of the any-precision C++ extension (quantkit.methods.kmeans_native), for the tests.

The same algorithms as kernels/anyprec_cpu.cpp in plain Python, brute force (no divide and conquer, no
Knuth bounds, no pruning), with the same formulas and tie-breaking (lowest index wins), one row at a time.
For small inputs only: the tests hold the extension to these results exactly.
"""

import torch

from quantkit.methods.kmeans_native import NativeResult

INF = float("inf")


class RefRow:
    """Distinct sorted values of one row with prefix sums P0 = Σw, P1 = Σwx, P2 = Σwx² (Python floats)."""

    def __init__(self, x, w):
        # ascending value, columns ascending among equal values (+ 0.0: -0 is 0); equal values merged
        pairs = sorted(((float(v) + 0.0, c, float(wc)) for c, (v, wc) in enumerate(zip(x, w))))
        self.x, weights = [], []
        for value, _, weight in pairs:
            if self.x and self.x[-1] == value:
                weights[-1] += weight
            else:
                self.x.append(value)
                weights.append(weight)
        self.m = len(self.x)
        self.P0, self.P1, self.P2 = [0.0], [0.0], [0.0]
        for value, weight in zip(self.x, weights):
            self.P0.append(self.P0[-1] + weight)
            self.P1.append(self.P1[-1] + weight * value)
            self.P2.append(self.P2[-1] + weight * value * value)

    def S(self, i, j):
        """Weighted SSE of run [i, j); a run without weight has ΔP1 = ΔP2 = 0 exactly, hence 0."""
        sw = self.P0[j] - self.P0[i]
        s1 = self.P1[j] - self.P1[i]
        return (self.P2[j] - self.P2[i]) - s1 * s1 / (sw if sw > 0 else 1.0)

    def has_weight(self, i, j):
        return self.P0[j] - self.P0[i] > 0

    def mean(self, i, j):
        return (self.P1[j] - self.P1[i]) / (self.P0[j] - self.P0[i])


def _argmin(values):
    best, arg = INF, 0
    for k, v in enumerate(values):
        if v < best:
            best, arg = v, k
    return arg


def ref_kmeans_dp(row, K):
    """Cuts [K+1] of the exact K-run optimum."""
    m = row.m
    F = [row.S(0, j) for j in range(m + 1)]
    args = {}
    for k in range(2, K):
        G, arg = [], []
        for j in range(m + 1):
            i = _argmin([F[i] + row.S(i, j) for i in range(j + 1)])
            G.append(F[i] + row.S(i, j))
            arg.append(i)
        F, args[k] = G, arg
    cuts = [0] * (K + 1)
    cuts[K] = m
    if K > 1:
        cuts[K - 1] = _argmin([F[i] + row.S(i, m) for i in range(m + 1)])
        for k in range(K - 1, 1, -1):
            cuts[k - 1] = args[k][cuts[k]]
    return cuts


def ref_best_cut(row, lo, hi):
    """The exact weighted 2-means cut of run [lo, hi)."""
    return lo + _argmin([row.S(lo, x) + row.S(x, hi) for x in range(lo, hi + 1)])


def ref_grow(row, coarse, b, p):
    """Leaf cuts [2^p + 1] from level-b cuts: every run of every finer level cut by its exact 2-means cut."""
    L = 1 << p
    leaf = [0] * (L + 1)
    for j, c in enumerate(coarse):
        leaf[j << (p - b)] = c
    for level in range(b + 1, p + 1):
        step = 1 << (p - level)
        for j in range(0, L, 2 * step):
            leaf[j + step] = ref_best_cut(row, leaf[j], leaf[j + 2 * step])
    return leaf


def reference_anyprec(weight, sens, seed_bits, parent_bits):
    """What native_anyprec computes (split upscaling), in plain Python (slow: small matrices only). Returns a
    NativeResult on the CPU (no timings)."""
    s, p = seed_bits, parent_bits
    weight = weight.detach().to("cpu", torch.float32)
    sens = torch.as_tensor(sens, dtype=torch.float64).expand_as(weight)
    R, n = weight.shape
    rows = [RefRow(weight[r].tolist(), sens[r].tolist()) for r in range(R)]
    leaves = [ref_grow(row, ref_kmeans_dp(row, 1 << s), s, p) for row in rows]
    codes = torch.empty(R, n, dtype=torch.uint8)
    luts = {b: torch.empty(R, 1 << b, dtype=torch.float64) for b in range(s, p + 1)}
    sse = {b: torch.empty(R, dtype=torch.float64) for b in range(s, p + 1)}
    for r, (row, leaf) in enumerate(zip(rows, leaves)):
        for b in range(s, p + 1):
            step = 1 << (p - b)
            for j in range(1 << b):
                lo, hi = leaf[j * step], leaf[(j + 1) * step]
                if row.has_weight(lo, hi):
                    luts[b][r, j] = row.mean(lo, hi)
                else:  # the parent's value; at the seed width filled in below
                    luts[b][r, j] = luts[b - 1][r, j // 2] if b > s else float("nan")
            if b == s:  # runs without weight at the seed level: the previous run's value, else the next one's
                vals = luts[b][r].tolist()
                for j in range(1, len(vals)):
                    vals[j] = vals[j - 1] if vals[j] != vals[j] else vals[j]
                for j in range(len(vals) - 2, -1, -1):
                    vals[j] = vals[j + 1] if vals[j] != vals[j] else vals[j]
                luts[b][r] = torch.tensor([0.0 if v != v else v for v in vals], dtype=torch.float64)
        leaf_of = [next(lf for lf in range(1 << p) if leaf[lf] <= u < leaf[lf + 1]) for u in range(row.m)]
        index = {value: u for u, value in enumerate(row.x)}
        for c, value in enumerate(weight[r].tolist()):
            codes[r, c] = leaf_of[index[value + 0.0]]
        for b in range(s, p + 1):
            e = 0.0
            for u in range(row.m):
                d = row.x[u] - float(luts[b][r, leaf_of[u] >> (p - b)])
                e += (row.P0[u + 1] - row.P0[u]) * d * d
            sse[b][r] = e
    return NativeResult(codes=codes, luts=luts, sse=sse)
