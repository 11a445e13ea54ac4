"""Any-precision seed + incremental upscaling through the C++ extension kernels/csrc/anyprec_cpu.cpp,
and a plain-Python reference of the same algorithms for the tests.

`native_anyprec(weight, sens, seed_bits, parent_bits, upscale)` clusters every row of W [R, n] (OpenMP
over rows) and returns None when the extension cannot be built (the caller then uses the torch path of
kmeans.py). Per row, over the m distinct values sorted, with fp64 prefix sums so that the weighted SSE
S(i, j) of any run [i, j) costs O(1):

  seed   the exact weighted k-means optimum with 2^s clusters (DP over runs, divide and conquer, rows of
         a layer above an upper bound on the optimum pruned); the torch path's inits + Lloyd + swap
         moves land 1-3 % above it on SmolLM2's rows.
  split  per extra bit, every cluster cut in two at the exact weighted 2-means optimum of its members
         (Any-Precision LLM §4.2): the b-bit code of every weight is the top b bits of its parent code.
  joint  nested partitions chosen for J = Σ_b λ_b·SSE_b, b = s..p, λ_b = level_weights[b]/SSE_b(split),
         SSE summed over the matrix, so every level counts by its relative change. Given the s-bit
         partition, split IS the best next level (SSE adds over clusters), so a gain has to come from
         choosing the coarse cuts with the finer levels in view:
         (1) seed cuts re-chosen for λ_s·SSE_s + λ_{s+1}·SSE_{s+1} (chain DP over the cuts, each within
             ±window of its place, the (s+1)-bit split of every candidate run exact), started from the
             exact seed and from the even cuts of the exact 2^(s+1)-means (pairs of good (s+1)-bit
             clusters: this start is where most of the 4-bit gain comes from); the lower value wins;
         (2) level s+1 by exact splits, levels s+2..p-1 by look-ahead splits (each cut chosen for its
             own level plus the best split of both children), level p by exact splits;
         (3) the Lloyd-type polish of all levels at once (ref_envelope_polish): with the tables fixed,
             each value takes the leaf minimising Σ_b λ_b (x − c_b(ancestor_b(leaf)))², a lower envelope
             of lines in x, so leaves stay runs when the tables are ordered; then every table is refit
             as the means of its runs. Neither step raises J.
         A row keeps its split result unless the candidate (or, failing that, the polished split) has
         a lower J: joint is never worse than split on J. Last, the seed tolerance: while the matrix's
         seed-width SSE exceeds (1 + seed_tolerance) × split's, rows go back to split, those with the
         least J gained per seed SSE added first.

The b-bit table is always the weighted means of the b-bit clusters. Results do not depend on the
thread count (ties go to the lowest index, sums over rows are serial) nor on the instruction set: the
extension carries a plain and an AVX2 build of its scans (`isa`: "auto" picks AVX2 where the CPU has
it), which evaluate every cost with the same operations, so they return the same bits. The speed-ups
of the C++ path (pruned and narrowed DP layers, four candidates per step, shared look-ahead arrays)
change no result: the tests hold it to the brute-force reference below.
"""

from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError

UPSCALE_RULES = ("split", "joint")
ISAS = ("auto", "generic", "avx2")
# joint may raise the matrix's seed-width SSE by at most this fraction (rows with the least J gained
# per seed SSE added go back to split first)
DEFAULT_SEED_TOLERANCE = 0.01
# ±2 positions per seed cut: windows up to ±16 gained < 0.5 % at 4 bits on SmolLM2 for up to 16x the
# refinement time
DEFAULT_WINDOW = 2


def default_level_weights(seed_bits, parent_bits):
    """λ multipliers for bits seed..parent: each extra bit counts half as much as the one below it, since
    every bit cuts the error ~4x and the served quality at 6-8 bits is already close to the float model.
    On SmolLM2 this keeps the seed within ~1 % of its optimum while 4..8 bits all gain
    (scripts/bench_anyprec_cpu.py)."""
    return [0.5 ** (b - seed_bits) for b in range(seed_bits, parent_bits + 1)]


@dataclass
class NativeResult:
    codes: torch.Tensor  # uint8 [R, n]: parent codes, code_b = code >> (parent - b)
    luts: dict  # {b: fp64 [R, 2^b]} weighted cluster means, b = seed..parent
    sse: dict  # {b: fp64 [R]} weighted SSE Σ w (x − lut_b[code_b])² of every row
    objective: torch.Tensor  # fp64 [R, 2]: J of split and of the result (zeros for split)
    # "wall" of the call, and per stage (prepare, seed, split, joint, finish) its thread-seconds
    seconds: dict = field(default_factory=dict)


def extension():
    """The compiled module, or None (warned once by the loader) when it cannot be built."""
    from quantkit.kernels.build import load_cpu

    return load_cpu("anyprec_cpu")


def check_upscale(rule):
    if rule not in UPSCALE_RULES:
        raise QuantkitError(f"--upscale must be one of {', '.join(UPSCALE_RULES)}, got {rule!r}")


def _column_or_matrix(sens, weight):
    """fp64 [n] when the sensitivity is one weight per column (a broadcast view), else fp64 [R, n]."""
    sens = torch.as_tensor(sens)
    if sens.dim() == 2 and sens.shape[0] > 0 and (sens.stride(0) == 0 or sens.shape[0] == 1):
        sens = sens[0]
    if sens.dim() == 1:
        if sens.shape[0] != weight.shape[1]:
            raise QuantkitError(f"sensitivity has {sens.shape[0]} columns, weight has {weight.shape[1]}")
    elif sens.shape != weight.shape:
        sens = sens.expand_as(weight)
    return sens.detach().to(device="cpu", dtype=torch.float64).contiguous()  # checked (finite, >= 0) natively


def check_isa(isa):
    if isa not in ISAS:
        raise QuantkitError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")


def native_isa(isa="auto"):
    """The instruction set the extension runs `isa` on ("generic" or "avx2"), "" if this CPU lacks it,
    None without the extension."""
    check_isa(isa)
    ext = extension()
    return None if ext is None else ext.isa(isa)


def native_anyprec(weight, sens, seed_bits, parent_bits, upscale="split", level_weights=None, window=DEFAULT_WINDOW,
                   seed_tolerance=DEFAULT_SEED_TOLERANCE, threads=None, isa="auto"):
    """Seed + upscaling of every row of weight [R, n] with sensitivity sens ([n], [R, n] or a broadcast
    view); NativeResult on weight's device, or None when the extension is unavailable.
    joint: level_weights (λ multipliers, bits seed..parent), window, seed_tolerance (None: no limit).
    threads: OpenMP threads (default torch.get_num_threads()); isa: "auto", "generic" or "avx2" (the
    same results; for tests and measurements)."""
    check_upscale(upscale)
    check_isa(isa)
    ext = extension()
    if ext is None:
        return None
    if level_weights is None:
        level_weights = default_level_weights(seed_bits, parent_bits)
    level_weights = [float(v) for v in level_weights]
    if len(level_weights) != parent_bits - seed_bits + 1 or min(level_weights) <= 0:
        raise QuantkitError(f"level_weights needs {parent_bits - seed_bits + 1} positive values (bits "
                            f"{seed_bits}..{parent_bits}), got {level_weights}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    s = _column_or_matrix(sens, w)
    threads = int(threads or torch.get_num_threads())
    try:
        codes, luts, sse, objective, seconds = ext.quantize(
            w, s, seed_bits, parent_bits, upscale == "joint", level_weights, int(window),
            -1.0 if seed_tolerance is None else float(seed_tolerance), threads, isa)
    except RuntimeError as exc:  # the extension's input checks (TORCH_CHECK) name the row and the problem
        raise QuantkitError(str(exc).splitlines()[0]) from exc
    dev = weight.device
    bits = range(seed_bits, parent_bits + 1)
    return NativeResult(codes=codes.to(dev), luts={b: t.to(dev) for b, t in zip(bits, luts)},
                        sse={b: sse[:, i].to(dev) for i, b in enumerate(bits)}, objective=objective.to(dev),
                        seconds=dict(seconds))


def native_kmeans_exact(weight, sens, k, threads=None, isa="auto", cuts=False):
    """Exact weighted k-means inertia of every row (fp64 [R]), or None without the extension; with
    cuts=True (cuts int32 [R, k+1] over the sorted distinct values, inertia)."""
    check_isa(isa)
    ext = extension()
    if ext is None:
        return None
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    try:
        found, inertia = ext.kmeans_exact(w, _column_or_matrix(sens, w), int(k), int(threads or torch.get_num_threads()),
                                          isa)
    except RuntimeError as exc:
        raise QuantkitError(str(exc).splitlines()[0]) from exc
    return (found, inertia) if cuts else inertia


# ---------------------------------------------------------------------------------------------
# Plain-Python reference: the same algorithms brute force (no divide and conquer, no Knuth bounds),
# the same formulas and tie-breaking (lowest index wins), one row at a time. For small inputs only.

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

    def B(self, a, b):
        """SSE of the best 2-split of run [a, b)."""
        return min(self.S(a, c) + self.S(c, b) for c in range(a, b + 1))


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
    return lo + _argmin([row.S(lo, x) + row.S(x, hi) for x in range(lo, hi + 1)])


def ref_lookahead_cut(row, lo, hi, l0, l1):
    return lo + _argmin([l0 * (row.S(lo, x) + row.S(x, hi)) + l1 * (row.B(lo, x) + row.B(x, hi))
                         for x in range(lo, hi + 1)])


def ref_grow(row, coarse, b, p, s=None, lam=None):
    """Leaf cuts [2^p + 1] from level-b cuts: exact splits, or look-ahead splits at levels s+2..p-1."""
    L = 1 << p
    leaf = [0] * (L + 1)
    for j, c in enumerate(coarse):
        leaf[j << (p - b)] = c
    for level in range(b + 1, p + 1):
        step = 1 << (p - level)
        look = lam is not None and s + 2 <= level < p
        for j in range(0, L, 2 * step):
            lo, hi = leaf[j], leaf[j + 2 * step]
            leaf[j + step] = (ref_lookahead_cut(row, lo, hi, lam[level - s], lam[level + 1 - s]) if look
                              else ref_best_cut(row, lo, hi))
    return leaf


def ref_level_sse(row, leaf, s, p):
    """SSE of every level b = s..p of leaf cuts (from the prefix sums)."""
    out = []
    for b in range(s, p + 1):
        step = 1 << (p - b)
        out.append(sum(max(0.0, row.S(leaf[j], leaf[j + step])) for j in range(0, 1 << p, step)))
    return out


def ref_objective(row, leaf, s, p, lam):
    return sum(lv * e for lv, e in zip(lam, ref_level_sse(row, leaf, s, p)))


def ref_refine_seed(row, t, l0, l1, window, rounds=20):
    """Seed cuts re-chosen for l0·S + l1·B over runs, each cut within ±window of its place; (cuts, value)."""
    K, m = len(t) - 1, row.m
    t = list(t)
    total = INF
    for _ in range(rounds):
        doms = ([[t[0]]] + [list(range(max(0, t[k] - window), min(m, t[k] + window) + 1)) for k in range(1, K)]
                + [[t[K]]])
        V = [0.0]
        back = []
        for k in range(1, K + 1):
            cost = [[(l0 * row.S(a, b) + l1 * row.B(a, b)) if b >= a else INF for b in doms[k]] for a in doms[k - 1]]
            newV, arg = [], []
            for ib in range(len(doms[k])):
                ia = _argmin([V[ia] + cost[ia][ib] for ia in range(len(doms[k - 1]))])
                newV.append(V[ia] + cost[ia][ib])
                arg.append(ia)
            V = newV
            back.append(arg)
        total = V[0]
        changed, ib = False, 0
        for k in range(K, 0, -1):
            ia = back[k - 1][ib]
            pos = doms[k - 1][ia]
            if k - 1 > 0 and pos != t[k - 1]:
                t[k - 1] = pos
                changed = True
            ib = ia
        if not changed:
            break
    return t, total


def ref_envelope_polish(row, leaf, s, p, lam, max_iters=100):
    """Lloyd-type alternation on J; returns (leaf cuts, [J after every accepted step])."""
    L, m = 1 << p, row.m
    leaf = list(leaf)
    history = [ref_objective(row, leaf, s, p, lam)]
    for _ in range(max_iters):
        if m == 0:
            break
        lines = []  # (leaf, M, A) of the leaves with weight
        for lf in range(L):
            if not row.has_weight(leaf[lf], leaf[lf + 1]):
                continue
            M = A = 0.0
            for b in range(s, p + 1):
                step = 1 << (p - b)
                j0 = (lf // step) * step
                c = row.mean(leaf[j0], leaf[j0 + step])
                M += lam[b - s] * c
                A += lam[b - s] * c * c
            lines.append((lf, M, A))
        if not lines:
            break
        owner = [lines[_argmin([A - 2.0 * row.x[u] * M for _, M, A in lines])][0] for u in range(m)]
        new = [sum(1 for o in owner if o < lf) for lf in range(L + 1)]
        if new == leaf:
            break
        J = ref_objective(row, new, s, p, lam)
        if not J < history[-1]:
            break
        leaf = new
        history.append(J)
    return leaf, history


def ref_joint_row(row, seed, leaf, s, p, lam, window=DEFAULT_WINDOW):
    """The joint rule for one row from its split result `leaf`: (leaf cuts, J)."""
    J_split = ref_objective(row, leaf, s, p, lam)
    J = INF
    if p > s:
        t0, v0 = ref_refine_seed(row, seed, lam[0], lam[1], window)
        t1, v1 = ref_refine_seed(row, ref_kmeans_dp(row, 2 << s)[::2], lam[0], lam[1], window)
        cand, history = ref_envelope_polish(row, ref_grow(row, t1 if v1 < v0 else t0, s, p, s, lam), s, p, lam)
        J = history[-1]
    if not J < J_split:
        cand, history = ref_envelope_polish(row, leaf, s, p, lam)
        J = history[-1]
    return (cand, J) if J < J_split else (list(leaf), J_split)


def reference_anyprec(weight, sens, seed_bits, parent_bits, upscale="split", level_weights=None,
                      window=DEFAULT_WINDOW, seed_tolerance=DEFAULT_SEED_TOLERANCE):
    """What native_anyprec computes, in plain Python (slow: small matrices only). Returns a NativeResult
    on the CPU (objective as native's; no timings)."""
    check_upscale(upscale)
    s, p = seed_bits, parent_bits
    levels = p - s + 1
    weight = weight.detach().to("cpu", torch.float32)
    sens = torch.as_tensor(sens, dtype=torch.float64).expand_as(weight)
    R, n = weight.shape
    rows = [RefRow(weight[r].tolist(), sens[r].tolist()) for r in range(R)]
    seeds = [ref_kmeans_dp(row, 1 << s) for row in rows]
    leaves = [ref_grow(row, seed, s, p) for row, seed in zip(rows, seeds)]
    objective = torch.zeros(R, 2, dtype=torch.float64)
    if upscale == "joint":
        weights = level_weights or default_level_weights(s, p)
        split = [ref_level_sse(row, leaf, s, p) for row, leaf in zip(rows, leaves)]
        lam = []
        for b in range(levels):
            total = 0.0
            for r in range(R):
                total += split[r][b]
            lam.append(weights[b] / max(total, 1e-300))
        split_leaves = [list(leaf) for leaf in leaves]
        for r in range(R):
            objective[r, 0] = sum(lv * e for lv, e in zip(lam, split[r]))
            leaves[r], objective[r, 1] = ref_joint_row(rows[r], seeds[r], leaves[r], s, p, lam, window)
        if seed_tolerance is not None:  # rows back to split, least J gained per seed SSE added first
            seed_sse = [sum(max(0.0, row.S(leaf[k << (p - s)], leaf[(k + 1) << (p - s)])) for k in range(1 << s))
                        for row, leaf in zip(rows, leaves)]
            split_total = joint_total = 0.0
            for r in range(R):
                split_total += split[r][0]
                joint_total += seed_sse[r]
            limit = (1 + seed_tolerance) * split_total
            if joint_total > limit:
                order = sorted(((float(objective[r, 0] - objective[r, 1]) / (seed_sse[r] - split[r][0]), r)
                                for r in range(R) if seed_sse[r] - split[r][0] > 0))
                for _, r in order:
                    if joint_total <= limit:
                        break
                    leaves[r] = split_leaves[r]
                    joint_total -= seed_sse[r] - split[r][0]
                    objective[r, 1] = objective[r, 0]
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
    return NativeResult(codes=codes, luts=luts, sse=sse, objective=objective)
