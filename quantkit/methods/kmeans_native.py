"""Any-precision seed + incremental upscaling through the C++ extension (kernels/anyprec_cpu.cpp).

`native_anyprec(weight, sens, seed_bits, parent_bits)` clusters every row of W [R, n] (OpenMP over rows)
and returns None when the extension cannot be built (the caller then uses the torch path of kmeans.py).
Per row, over the m distinct values sorted, with fp64 prefix sums so that the weighted SSE S(i, j) of any
run [i, j) costs O(1):

  seed   the exact weighted k-means optimum with 2^s clusters (DP over runs, divide and conquer, rows of
         a layer above an upper bound on the optimum pruned); the torch path's inits + Lloyd + swap
         moves land 1-3 % above it on SmolLM2's rows.
  split  per extra bit, every cluster cut in two at the exact weighted 2-means optimum of its members
         (Any-Precision LLM §4.2): the b-bit code of every weight is the top b bits of its parent code.

The b-bit table is always the weighted means of the b-bit clusters. Results do not depend on the thread
count (ties go to the lowest index, rows are independent) nor on the instruction set: the extension
carries a plain and an AVX2 build of its scans (`isa`: "auto" picks AVX2 where the CPU has it), which
evaluate every cost with the same operations, so they return the same bits. The speed-ups of the C++ path
(pruned and narrowed DP layers, four candidates per step) change no result: the tests hold it to a
brute-force reference (tests/anyprec_reference.py).
"""

from dataclasses import dataclass, field

import torch

from quantkit.errors import QuantkitError

UPSCALE = "split"  # the upscaling rule: exact 2-means splits of every cluster, bit by bit
ISAS = ("auto", "generic", "avx2")


@dataclass
class NativeResult:
    codes: torch.Tensor  # uint8 [R, n]: parent codes, code_b = code >> (parent - b)
    luts: dict  # {b: fp64 [R, 2^b]} weighted cluster means, b = seed..parent
    sse: dict  # {b: fp64 [R]} weighted SSE Σ w (x − lut_b[code_b])² of every row
    # "wall" of the call, and per stage (prepare, seed, split, finish) its thread-seconds
    seconds: dict = field(default_factory=dict)


def extension():
    """The compiled module, or None (warned once by the loader) when it cannot be built."""
    from quantkit.kernels.build import load_cpu

    return load_cpu("anyprec_cpu")


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


def native_anyprec(weight, sens, seed_bits, parent_bits, *, threads=None, isa="auto"):
    """Seed + upscaling (UPSCALE: exact 2-means splits) of every row of weight [R, n] with sensitivity sens
    ([n], [R, n] or a broadcast view); NativeResult on weight's device, or None when the extension is
    unavailable. threads: OpenMP threads (default torch.get_num_threads()); isa: "auto", "generic" or
    "avx2" (the same results; for tests and measurements)."""
    check_isa(isa)
    ext = extension()
    if ext is None:
        return None
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    s = _column_or_matrix(sens, w)
    threads = int(threads or torch.get_num_threads())
    try:
        codes, luts, sse, seconds = ext.quantize(w, s, seed_bits, parent_bits, threads, isa)
    except RuntimeError as exc:  # the extension's input checks (TORCH_CHECK) name the row and the problem
        raise QuantkitError(str(exc).splitlines()[0]) from exc
    dev = weight.device
    bits = range(seed_bits, parent_bits + 1)
    return NativeResult(codes=codes.to(dev), luts={b: t.to(dev) for b, t in zip(bits, luts)},
                        sse={b: sse[:, i].to(dev) for i, b in enumerate(bits)}, seconds=dict(seconds))


def native_kmeans_exact(weight, sens, k, threads=None, isa="auto", cuts=False):
    """Exact weighted k-means inertia of every row (fp64 [R]), or None without the extension; with
    cuts=True (cuts int32 [R, k+1] over the sorted distinct values, inertia)."""
    check_isa(isa)
    ext = extension()
    if ext is None:
        return None
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    threads = int(threads or torch.get_num_threads())
    try:
        found, inertia = ext.kmeans_exact(w, _column_or_matrix(sens, w), int(k), threads, isa)
    except RuntimeError as exc:
        raise QuantkitError(str(exc).splitlines()[0]) from exc
    return (found, inertia) if cuts else inertia
