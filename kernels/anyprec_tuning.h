// Tuning switches of the any-precision matvec kernel (anyprec_decode.cuh Config, anyprec_matvec_kernel.cuh),
// in one place. Each holds the value the benchmark named beside it chose; every one is guarded by
// #ifndef, so an A/B build overrides it with -DNAME=value (QUANTKIT_KERNEL_DEFINES,
// benchmarks/ab_defines.sh anyprec ...), and an override is part of the kernel build cache's key.
#pragma once

// Resident blocks per SM that registers and shared memory are sized for, in blocks of 8 warps:
// AP_MIN_BLOCKS_SMALL for k <= 7, AP_MIN_BLOCKS at k = 8 (whose shared-memory tables are 4x those of k = 7).
#ifndef AP_MIN_BLOCKS_SMALL
#define AP_MIN_BLOCKS_SMALL 3  // chosen by benchmarks/bench_anyprec_kernel.py, 4096x4096..28672x8192 k3-k8, H100
#endif
#ifndef AP_MIN_BLOCKS
#define AP_MIN_BLOCKS 2  // chosen by benchmarks/bench_anyprec_kernel.py, 4096x4096..28672x8192 k8, H100
#endif

// Two-tile blocks (batch 4-8 on the taller shapes, anyprec_gemm.choose_tiles) up to this width run 4
// warps instead of 8, each with twice the column steps of its tile; one-tile blocks always run 8 warps
// (at batch 1, 4 warps are slower).
#ifndef AP_FOUR_WARPS_MAX_K
#define AP_FOUR_WARPS_MAX_K 4  // chosen by benchmarks/bench_anyprec_kernel.py, 11008x4096..28672x8192 k3-k5 b4-b8, H100
#endif
// Resident blocks per SM of those 4-warp blocks: AP_FOUR_WARPS_MIN_BLOCKS_SMALL at k <= 3 (register tables),
// AP_FOUR_WARPS_MIN_BLOCKS above (6 blocks at k = 3 are slower on 28672x8192).
#ifndef AP_FOUR_WARPS_MIN_BLOCKS_SMALL
#define AP_FOUR_WARPS_MIN_BLOCKS_SMALL 5  // chosen by benchmarks/bench_anyprec_kernel.py, 28672x8192 k3 b4-b8, H100
#endif
#ifndef AP_FOUR_WARPS_MIN_BLOCKS
#define AP_FOUR_WARPS_MIN_BLOCKS 6  // chosen by benchmarks/bench_anyprec_kernel.py, 11008x4096..28672x8192 k4 b4-b8, H100
#endif

// Widths k up to which, in one-tile blocks, every lane copies ring pieces: the warp splits into 4 / PIECES
// lane groups, group h copying the items of row slot h (half as many copy instructions at 2 pieces).
// Two-tile blocks and wider k keep one group, with 32 - 8·PIECES lanes idle during the copies.
#ifndef AP_COPY_ALL_LANES
#define AP_COPY_ALL_LANES 3  // chosen by benchmarks/bench_anyprec_kernel.py, 4096x4096..28672x8192 k3-k4 b1-b2, H100/H200
#endif

// The ring's shape (Config::PIECES, Config::STAGES) follows from the shared memory left per block; an A/B
// build may force it with -DAP_PIECES=1|2|4 and -DAP_STAGES=n (no default here: unset = derived).

// Ring steps per warp of the row-per-lane kernel (anyprec_rows.cuh), at most: fewer where the shared memory of
// its resident blocks leaves less room.
#ifndef AP_ROWS_STAGES
#define AP_ROWS_STAGES 4  // code pairs at 8 warps: 6 steps no faster (anyprec_pairs_warps_ab_h200.json)
#endif

// Widths up to which the row-per-lane kernel aligns its table to the table's size so that a lookup's address is one
// LOP3 (anyprec_rows.cuh RowsConfig::TABLE_OR); wider tables add their address instead.
#ifndef AP_ROWS_TABLE_OR_MAX_K
#define AP_ROWS_TABLE_OR_MAX_K 6  // the slack it costs: k = 6 8 KB, k = 7 16 KB (a ring stage at 2 blocks per SM)
#endif

// Warps per block of the row-per-lane kernel with code-pair tables (FLAG_CODE_PAIRS) at batch <= 4: its 64 KB table
// per block allows 2 resident blocks, so more warps per block keep more loads in flight.
#ifndef AP_ROWS_PAIRS_WARPS
#define AP_ROWS_PAIRS_WARPS 16  // chosen by bench_anyprec_variants.py, 8 / 12 / 16, the 7 shapes k4 b1-b8, H200
#endif
