"""One launch each of the LUT-GEMM and any-precision matvec kernels (and cuBLAS fp16 on the same
shapes) for Nsight Compute to profile: the goal shapes of issues 8 and 9 at batch 1.

  ncu --clock-control none --set full -k regex:'lut_gemm|matvec|gemv' python3 benchmarks/profile_matvec.py
"""

import torch

from quantkit.kernels import anyprec_gemm as ag
from quantkit.kernels import build, lutgemm


def main():
    torch.manual_seed(0)
    lut_ext, ap_ext = build.load("lutgemm"), build.load("anyprec")
    rows, cols = 49152, 12288
    t = lutgemm.BCQTensors(
        qweight=torch.randint(-(2**31), 2**31 - 1, (3, cols // 32, rows), dtype=torch.int32, device="cuda"),
        alpha=((torch.rand(cols // 128, 3, rows, device="cuda") + 0.5) * 0.02).half(),
        offset=None, group_size=128, in_features=cols)
    x = torch.randn(1, cols, device="cuda").half()
    w = torch.randn(rows, cols, device="cuda").half()
    for _ in range(2):  # the second round is the one to read (warm clocks, loaded modules)
        lutgemm.lut_matmul(x, t, ops=lut_ext)
        torch.mm(x, w.t())
    rows, cols = 28672, 8192
    nat = torch.randint(-2**31, 2**31, (8, rows, cols // 32), device="cuda", dtype=torch.int64).to(torch.int32)
    planes = ag.kernel_layout(nat)
    lut = (torch.randn(rows, 8, device="cuda").sort(1).values * 0.02).half()
    x = torch.randn(1, cols, device="cuda").half()
    w = torch.randn(rows, cols, device="cuda").half()
    for _ in range(2):
        ag.matvec(x, planes, lut, 3, cols // 32, ext=ap_ext)
        torch.mm(x, w.t())
    torch.cuda.synchronize()
    print("profile_matvec done")


if __name__ == "__main__":
    main()
