#!/usr/bin/env bash
# A/B of kernel build variants in one device call: each variant is a set of nvcc defines
# (QUANTKIT_KERNEL_DEFINES, part of the build cache key), all are built in parallel, then the kernel's
# benchmark runs once per variant per round, variants alternating, each in its own process. Results
# land in $OUT/ab.tgz as ab_r<round>_v<variant>.json / .log ("" = the source as committed).
#   OUT=$OUT benchmarks/ab_defines.sh lutgemm 3 "--shapes 49152x12288 --batches 1,8 --no-crossover" "" "-DMMA_MIN_BLOCKS=3"
#   OUT=$OUT benchmarks/ab_defines.sh anyprec 2 "--bits 3 --no-switch --no-ablation" "-DAP_COPY_ALL_LANES=0" ""
set -u
out=${OUT:?set OUT}
kernel=${1:?kernel: lutgemm or anyprec}
rounds=${2:?rounds}
args=${3?benchmark arguments}
shift 3
variants=("$@")
export PYTHONPATH=$PWD QUANTKIT_KERNEL_CACHE=${QUANTKIT_KERNEL_CACHE:-/root/qk-kernels} PYTHONUNBUFFERED=1
for v in "${variants[@]}"; do
  ( QUANTKIT_KERNEL_DEFINES="$v" python3 -c "import time; from quantkit.kernels import build; t=time.time(); m=build.load('$kernel', verbose=False); print('[$v]', 'built' if m else 'FAILED ' + str(build.unavailable_reason('$kernel')), round(time.time() - t, 1), 's')" ) &
done
wait
declare -A benches=([lutgemm]=benchmarks/bench_lutgemm.py [anyprec]=benchmarks/bench_anyprec_kernel.py)
for r in $(seq 1 "$rounds"); do
  i=0
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086  # args is a list of benchmark options
    QUANTKIT_KERNEL_DEFINES="$v" timeout 200 python3 "${benches[$kernel]}" $args --json "$out/ab_r${r}_v${i}.json" > "$out/ab_r${r}_v${i}.log" 2>&1
    echo "round $r variant $i [$v] rc=$?"
    i=$((i + 1))
  done
done
cd "$out" && tar czf ab.tgz ab_*.json ab_*.log && rm -f ab_*.json ab_*.log
