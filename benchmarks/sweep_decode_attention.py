"""Work split of runtime.decode_attention: positions per program (chunk) x warps per program, batch 1,
Llama-2-7B attention (32 heads of 128).

  python benchmarks/sweep_decode_attention.py --json $OUT/decode_attention_sweep.json     # ~40 s on an H100

Each configuration runs 32 times in one CUDA graph, each call on its own cache (as the 32 layers of a
decode step: the caches do not stay in L2 between calls), timed as in bench_decode_pieces (median of 5
replays of 10 graphs); µs per call, with the relative error against the fp32 reference.
"""

import argparse
import itertools
import json
from pathlib import Path

import torch
from bench_decode_pieces import HEAD_DIM, HEADS, graph_us

from quantkit.runtime import decode_attention as da

LAYERS = 32


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="256:128,256:256,1152:576,1152:1152,4096:4096",
                    help="comma list of CACHE_LENGTH:ATTENDED_POSITIONS [%(default)s]")
    ap.add_argument("--chunks", default="32,64,128,256")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and da.available()):
        raise SystemExit("needs a CUDA device and Triton")
    torch.manual_seed(0)
    rows = []
    for case in args.cases.split(","):
        length, attended = (int(v) for v in case.split(":"))
        q = torch.randn(1, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.float16)
        keys = [torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
        values = [torch.randn_like(keys[0]) for _ in range(LAYERS)]
        position = torch.tensor([[attended - 1]], device="cuda")
        counters = da.counters(1, HEADS, "cuda")
        want = da.reference(q, keys[0], values[0], position, HEAD_DIM**-0.5)
        for chunk, warps in itertools.product(map(int, args.chunks.split(",")), map(int, args.warps.split(","))):
            layer = iter(range(10**9))

            def call():  # captured 32 times in a row: the next layer's cache each time
                i = next(layer) % LAYERS
                return da.decode(q, keys[i], values[i], position, HEAD_DIM**-0.5, counters, chunk=chunk,
                                 num_warps=warps)

            out = da.decode(q, keys[0], values[0], position, HEAD_DIM**-0.5, counters, chunk=chunk, num_warps=warps)
            err = ((out.float() - want).norm() / want.norm()).item()
            us = graph_us(call)
            rows.append({"cache_length": length, "attended": attended, "chunk": chunk, "warps": warps, "us": us,
                         "rel_err": err})
            print(f"L={length:5d} attended={attended:5d} chunk={chunk:4d} warps={warps}  {us:7.2f} us  "
                  f"rel err {err:.1e}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "defaults": {"chunk": da.CHUNK, "warps": da.NUM_WARPS},
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
