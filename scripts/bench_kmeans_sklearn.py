"""Weighted 1-D k-means of every row at once (kmeans.weighted_kmeans_1d, torch) against a loop of
scikit-learn KMeans fits, one per row: time and Σ inertia, for a few row counts and cluster counts.

  python scripts/bench_kmeans_sklearn.py --json out/kmeans_sklearn.json

Rows are Gaussian with a few large outliers (as in LLM weights) and a random squared-uniform
sensitivity per weight. Each side is timed best-of --repeats after one warm-up call (both pay a
one-time setup on their first call). The CPU may be shared with other jobs, so read the ratio of
two runs taken back to back, not the absolute times.
"""

import argparse
import json
import os
import platform
import time

import torch


def make_rows(rows, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 0.05
    x[:, :4] *= 8
    w = torch.rand(rows, n, generator=g) ** 2 + 1e-3
    return x, w


def best_time(run, repeats):
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return out, min(times)


def measure(rows, n, k, repeats):
    from sklearn.cluster import KMeans

    from quantkit.methods.kmeans import weighted_kmeans_1d

    x, w = make_rows(rows, n)
    (_, _, inertia), ours_s = best_time(lambda: weighted_kmeans_1d(x, w, k), repeats)

    def sklearn_loop():
        return [KMeans(k, n_init="auto", random_state=r).fit(
            x[r].double().numpy()[:, None], sample_weight=w[r].double().numpy()).inertia_ for r in range(rows)]

    ref, sk_s = best_time(sklearn_loop, repeats)
    return {"rows": rows, "n": n, "k": k, "ours_s": ours_s, "sklearn_s": sk_s, "speedup": sk_s / ours_s,
            "inertia_ratio": float(inertia.sum()) / sum(ref)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[24, 96, 384])
    parser.add_argument("--n", type=int, default=576, help="weights per row (SmolLM2's hidden size)")
    parser.add_argument("--k", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    results = [measure(rows, args.n, k, args.repeats) for k in args.k for rows in args.rows]
    print(f"{'k':>3} {'rows':>5} {'ours s':>8} {'sklearn s':>10} {'speedup':>8} {'Σ inertia ours/sk':>18}")
    for r in results:
        print(f"{r['k']:>3} {r['rows']:>5} {r['ours_s']:>8.3f} {r['sklearn_s']:>10.3f} {r['speedup']:>7.2f}x "
              f"{r['inertia_ratio']:>18.4f}")
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor()
                or platform.machine(), "load_avg": [round(v, 2) for v in os.getloadavg()]}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
