"""GPTQ's U (the upper Cholesky factor of the damped H⁻¹) two ways, on one GPU, in fp32:

  three factorisations  the GPTQ reference's: L = chol(H + λI), H⁻¹ = cholesky_inverse(L), U = chol(H⁻¹, upper)
  reversed Cholesky      with J the reversal of the indices, chol(J (H + λI) J) = L' gives U = J L'⁻¹ J: one
                         factorisation and one triangular inverse (about half the flops)

Both against U computed in fp64 by the first way: time (median of 5, synchronised) and the largest error
relative to U's largest entry. H from correlated random tokens as in bench_gptq_kernel.py.

  python3 benchmarks/bench_gptq_inverse.py --json $OUT/gptq_inverse.json
"""

import argparse
import json
import statistics
import time

import torch
from bench_gptq_kernel import make_layer  # benchmarks/, next to this script

from quantkit.methods.gptq import reversed_cholesky_factor, three_factorisations_factor


def damped(h, damp=0.01):
    return h + (damp * torch.diagonal(h).mean()) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def timed(fn, repeats=5):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for d in (4096, 11008):
        h, _, _ = make_layer(256, d)
        reference = three_factorisations_factor(damped(h.double()))
        scale = reference.abs().max().item()
        row = {"d": d}
        for name, fn in (("three_factorisations", lambda: three_factorisations_factor(damped(h))),
                         ("reversed_cholesky", lambda: reversed_cholesky_factor(damped(h)))):
            fn()
            seconds, u = timed(fn)
            row[name] = {"ms": round(seconds * 1e3, 2),
                         "max_error_rel": (u.double() - reference).abs().max().item() / scale}
        rows.append(row)
        print(f"d={d}: " + "; ".join(f"{k} {v['ms']} ms, error {v['max_error_rel']:.2e}"
                                     for k, v in row.items() if k != "d"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
