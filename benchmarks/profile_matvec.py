"""One launch each of the LUT-GEMM and any-precision matvec kernels (and cuBLAS fp16 on the same
shapes) for Nsight Compute to profile: the goal shapes of the two kernels at batch 1.

  ncu --clock-control none --set full -k regex:'lut_gemm|matvec|gemv' python3 benchmarks/profile_matvec.py
  ncu --clock-control none --set full -k regex:bcq_mma python3 benchmarks/profile_matvec.py --bcq-only --batch 8

--bcq-only --batch B --bits q: only the LUT-GEMM call, at B columns of x (5..8 run the tensor-core
kernel) and q sign planes. --ap-shape OUTxIN --ap-bits k --ap-batch B: the any-precision call's shape,
width and columns of x (default 28672x8192, k = 3, batch 1).
"""

import argparse

import torch

from quantkit.kernels import anyprec_gemm as ag
from quantkit.kernels import build, lutgemm


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bcq-only", action="store_true", help="profile only the LUT-GEMM call")
    parser.add_argument("--batch", type=int, default=1, help="columns of x for the LUT-GEMM call (1..8)")
    parser.add_argument("--bits", type=int, default=3, help="sign planes q of the LUT-GEMM weight")
    parser.add_argument("--ap-shape", default="28672x8192", help="OUTxIN of the any-precision call")
    parser.add_argument("--ap-bits", type=int, default=3, help="width k the any-precision call serves")
    parser.add_argument("--ap-batch", type=int, default=1, help="columns of x for the any-precision call")
    args = parser.parse_args()
    torch.manual_seed(0)
    lut_ext, ap_ext = build.load("lutgemm"), build.load("anyprec")
    rows, cols, q = 49152, 12288, args.bits
    t = lutgemm.BCQTensors(
        qweight=torch.randint(-(2**31), 2**31 - 1, (q, cols // 32, rows), dtype=torch.int32, device="cuda"),
        alpha=((torch.rand(cols // 128, q, rows, device="cuda") + 0.5) * 0.02).half(),
        offset=None, group_size=128, in_features=cols)
    x = torch.randn(args.batch, cols, device="cuda").half()
    w = torch.randn(rows, cols, device="cuda").half()
    for _ in range(2):  # the second round is the one to read (warm clocks, loaded modules)
        lutgemm.lut_matmul(x, t, ops=lut_ext)
        torch.mm(x, w.t())
    if args.bcq_only:
        torch.cuda.synchronize()
        print("profile_matvec done")
        return
    rows, cols = map(int, args.ap_shape.split("x"))
    nat = torch.randint(-2**31, 2**31, (8, rows, cols // 32), device="cuda", dtype=torch.int64).to(torch.int32)
    planes = ag.kernel_layout(nat)
    lut = (torch.randn(rows, 2**args.ap_bits, device="cuda").sort(1).values * 0.02).half()
    x = torch.randn(args.ap_batch, cols, device="cuda").half()
    w = torch.randn(rows, cols, device="cuda").half()
    for _ in range(2):
        ag.matvec(x, planes, lut, args.ap_bits, cols // 32, ext=ap_ext)
        torch.mm(x, w.t())
    torch.cuda.synchronize()
    print("profile_matvec done")


if __name__ == "__main__":
    main()
