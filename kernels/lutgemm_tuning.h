// Tuning switches of the LUT-GEMM kernels (lutgemm_lut_kernel.cuh, lutgemm_mma_kernel.cuh), in one place.
// Each holds the value the benchmark named beside it chose; every one is guarded by #ifndef, so an A/B
// build overrides it with -DNAME=value (QUANTKIT_KERNEL_DEFINES, benchmarks/ab_defines.sh lutgemm ...),
// and an override is part of the kernel build cache's key.
#pragma once

// ---- the LUT kernel (1..8 columns of x, LUT in shared memory) ------------------------------------

// Ring stages of the LUT kernel's pipeline: each lane has LUT_STAGES - 1 steps of sign words and scales in
// flight (cp.async into shared memory) while it computes one. 2 stages (80 KB with the LUT at 1..4
// columns, 2 resident blocks per SM) stream a single large matvec as fast as 3 did, and decode BCQ up to 3 %
// faster (docs/lutgemm-kernel.md); at 4 stages shared memory allows only one block per SM.
#ifndef LUT_STAGES
#define LUT_STAGES 2  // chosen by benchmarks/bench_e2e_decode.py, BCQ q3 / q4 batch 1, H100
#endif
static_assert(LUT_STAGES >= 2 && LUT_STAGES <= 8, "LUT_STAGES must be 2..8");

// Words of a row a lane handles per pipeline step (a ring stage holds one step).
#ifndef LUT_STEP_WORDS
#define LUT_STEP_WORDS 4  // chosen by benchmarks/bench_lutgemm.py, 49152x12288 q3 batch 1, H100
#endif
static_assert(LUT_STEP_WORDS == 1 || LUT_STEP_WORDS == 2 || LUT_STEP_WORDS == 4, "LUT_STEP_WORDS must be 1, 2 or 4");

// Resident blocks per SM the LUT kernel's register allocation must allow (shared memory allows 2 at 2 or 3
// stages of 4 words).
#ifndef LUT_MIN_BLOCKS
#define LUT_MIN_BLOCKS 2  // chosen by benchmarks/bench_lutgemm.py, 49152x12288 q3 batch 1, H100
#endif

// The same for the lean instances (1-4 columns) that cards named by lut_lean_registers() in lutgemm.cu run.
// 3 does not add a LUT block (shared memory holds 2); it caps registers at 80 (no spills; 128 at 2), which
// leaves room on every SM for the small kernels that follow a matvec in the decode (norms, attention,
// SiLU·mul) to become resident and start early: the H100's decode is 0.4-1.4 % faster, the H200's 0.5-2.5 %
// slower (on the H100 a lone matvec is 0-2 % slower at 80 registers; not measured alone on the H200).
#ifndef LUT_MIN_BLOCKS_LEAN
#define LUT_MIN_BLOCKS_LEAN 3  // chosen by benchmarks/bench_e2e_decode.py, BCQ q3 / q4 batch 1, H100 and H200
#endif

// The offset plane (z·Σx per word) in one pipeline step per chunk instead of one per LUT_STEP_WORDS words, where
// the chunk's z (8 bytes a word) fit in a stage's sign-word slots (16 bytes a word), which that step does not use
// otherwise: where a plane is two steps (1-2 columns at 4 words a step). GPTQ-4 decode 2.035 -> 1.987 ms/token
// (H100, docs/lutgemm-kernel.md).
#ifndef LUT_OFFSET_ONE_STEP
#define LUT_OFFSET_ONE_STEP 1  // chosen by benchmarks/bench_e2e_decode.py, GPTQ-4 g128 batch 1, H100
#endif

// ---- the tensor-core kernel (5..8 columns of x) --------------------------------------------------

// Ring stages of the tensor-core kernel: MMA_STAGES - 1 chunks in flight per lane. 2 stages are as fast as
// 3 and leave room for 2 blocks per SM up to q = 4; 3 stages would not fit one SM at q = 8.
#ifndef MMA_STAGES
#define MMA_STAGES 2  // chosen by benchmarks/bench_lutgemm.py, 49152x12288 q2-q4 batch 8, H100
#endif
static_assert(MMA_STAGES >= 2 && MMA_STAGES <= 8, "MMA_STAGES must be 2..8");

// Resident blocks per SM the tensor-core kernel's register allocation must allow (the ring allows 2 up to
// q = 4; 3 costs spills and was slower on every shape measured).
#ifndef MMA_MIN_BLOCKS
#define MMA_MIN_BLOCKS 2  // chosen by benchmarks/bench_lutgemm.py, 49152x12288 and 12288x49152 q2-q4, H100
#endif

// q = 1..MMA_STATIC_Q_MAX get a tensor-core kernel instance each (Q = q: the plane and copy loops unrolled,
// their strides constants); wider q share one instance that reads q at run time (Q = 0). 0 builds only
// the shared instance.
#ifndef MMA_STATIC_Q_MAX
#define MMA_STATIC_Q_MAX 4  // chosen by benchmarks/bench_lutgemm.py, 49152x12288 q2-q4 batch 8, H100
#endif
static_assert(MMA_STATIC_Q_MAX >= 0 && MMA_STATIC_Q_MAX <= 4, "the launchers dispatch q = 1..4");
