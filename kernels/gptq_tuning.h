// Tuning switches of the fused GPTQ / k-OOC tile kernel (gptq.cu), in one place. Each notes what chose
// its value; every one is guarded by #ifndef, so an A/B build overrides it with
// -DNAME=value (QUANTKIT_KERNEL_DEFINES, benchmarks/ab_defines.sh gptq ...), and an override is part of the
// kernel build cache's key. (The tile width, gptq.cu TILE, is not one: quantkit/kernels/gptq_cuda.py must
// agree with it.)
#pragma once

// Threads per block: GPTQ_BLOCK / TPR rows per block (TPR = threads per row, 4..32, chosen by gptq_cuda.py).
#ifndef GPTQ_BLOCK
#define GPTQ_BLOCK 256  // 8 warps; timed by benchmarks/bench_gptq_kernel.py (all shapes, H100), no other size A/B-tested
#endif
static_assert(GPTQ_BLOCK % 32 == 0 && GPTQ_BLOCK >= 32 && GPTQ_BLOCK <= 1024, "GPTQ_BLOCK must be whole warps");

// Resident blocks per SM the register allocation must allow for fp32 rows of 8+ threads (they fit in 128
// registers without spilling, ptxas -v); fp32 at 4 threads per row, and fp64, always get 1 (they would spill).
#ifndef GPTQ_MIN_BLOCKS_FP32
#define GPTQ_MIN_BLOCKS_FP32 2  // chosen by ptxas -v register counts (no spills); timed by benchmarks/bench_gptq_kernel.py, H100
#endif
