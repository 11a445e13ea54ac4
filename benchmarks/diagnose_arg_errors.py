"""Find where a failing argument check in the lutgemm / anyprec extensions kills the process
(issue 8/9 defect): each bad call runs in its own child process with faulthandler on."""
import subprocess
import sys

CASES = {
    "gptq_bad_bits": "from quantkit.kernels import build; import torch; e=build.load('gptq'); "
                     "w=torch.zeros(4,8,device='cuda'); e.tile(w,w,w,w,w,w,w,w,w,None,None,None,0,4,1,0,8,8,1,False,False,0.0,0,0,0.0,4)",
    "lut_dtype": "from quantkit.kernels import build, lutgemm; import torch; e=build.load('lutgemm'); "
                 "q=torch.zeros(2,4,64,dtype=torch.int32,device='cuda'); a=torch.ones(4,2,64,device='cuda').half(); "
                 "x=torch.randn(1,128,device='cuda'); o=torch.empty(1,64,device='cuda').half(); "
                 "e.lut_gemm(x,q,a,None,None,32,o,9)",
    "ap_batch": "from quantkit.kernels import build; import torch; e=build.load('anyprec'); "
                "p=torch.zeros(3,32,4,dtype=torch.int32,device='cuda'); l=torch.zeros(32,8,device='cuda').half(); "
                "x=torch.randn(9,128,device='cuda').half(); o=torch.empty(9,32,device='cuda').half(); "
                "e.matvec(x,p,l,3,4,None,o,7,1)",
    "plain_torch_check": "import torch; torch.empty(2,device='cuda').view(3)",
}
for name, code in CASES.items():
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
    print(f"== {name}: rc={r.returncode}")
    print("\n".join((r.stdout + r.stderr).strip().splitlines()[-12:]))
