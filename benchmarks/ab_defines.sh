#!/usr/bin/env bash
# A/B of kernel build variants in one run on a GPU machine: each variant is a set of nvcc defines overriding the
# switches of the kernel family's tuning header (kernels/<family>_tuning.h; QUANTKIT_KERNEL_DEFINES, part of
# the build cache key). All variants are built in parallel, then the family's benchmark runs once per
# variant per round, variants alternating, each in its own process. Results land in $OUT/ab.tgz as
# ab_r<round>_v<variant>.json / .log ("" = the values the tuning header holds).
#   OUT=$OUT benchmarks/ab_defines.sh lutgemm 3 "--shapes 49152x12288 --batches 1,8 --no-crossover" "" "-DMMA_MIN_BLOCKS=3"
#   OUT=$OUT benchmarks/ab_defines.sh anyprec 2 "--bits 3 --no-switch --no-ablation" "-DAP_COPY_ALL_LANES=0" ""
#   benchmarks/ab_defines.sh --knobs anyprec     # list the switches a variant may set, with their values
# BENCH=<script> runs another benchmark per variant instead, e.g. the whole decode (its --json is set here):
#   OUT=$OUT BENCH=benchmarks/bench_e2e_decode.py benchmarks/ab_defines.sh lutgemm 2 \
#       "--formats fp16,bcq-q3-g128 --batches 1 --gen 128 --no-share" "" "-DLUT_STAGES=3"
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
declare -A benches=([lutgemm]=benchmarks/bench_lutgemm.py [anyprec]=benchmarks/bench_anyprec_kernel.py
                    [gptq]=benchmarks/bench_gptq_kernel.py)

# the switches of a family: the macros its tuning header guards with #ifndef (AP_PIECES / AP_STAGES, which
# have no default, are named in a comment of anyprec_tuning.h and added here)
knobs() {
  local header="$repo/kernels/$1_tuning.h"
  [ -f "$header" ] || { echo "no tuning header $header" >&2; return 1; }
  sed -n 's/^#ifndef \([A-Z0-9_]*\).*/\1/p' "$header"
  [ "$1" = anyprec ] && printf '%s\n' AP_PIECES AP_STAGES
  return 0
}

if [ "${1:-}" = --knobs ]; then
  family=${2:?family: lutgemm, anyprec or gptq}
  for k in $(knobs "$family"); do
    value=$(sed -n "s/^#define $k \([^ ]*\).*/\1/p" "$repo/kernels/${family}_tuning.h")
    printf '%-32s %s\n' "$k" "${value:-(derived from the shared memory left)}"
  done
  exit 0
fi

out=${OUT:?set OUT}
kernel=${1:?kernel: lutgemm, anyprec or gptq}
rounds=${2:?rounds}
args=${3?benchmark arguments}
shift 3
variants=("$@")
[ -n "${benches[$kernel]:-}" ] || { echo "unknown kernel family $kernel" >&2; exit 2; }
bench=${BENCH:-${benches[$kernel]}}
[ -f "$repo/$bench" ] || [ -f "$bench" ] || { echo "no benchmark script $bench" >&2; exit 2; }

# every -DNAME of a variant must be a switch of the family's tuning header (a typo would A/B nothing)
allowed=" $(knobs "$kernel" | tr '\n' ' ') "
for v in "${variants[@]}"; do
  for d in $v; do
    name=${d#-D}
    name=${name%%=*}
    case "$allowed" in
      *" $name "*) ;;
      *) echo "variant [$v]: $name is not a switch of kernels/${kernel}_tuning.h (see --knobs $kernel)" >&2; exit 2 ;;
    esac
  done
done

export PYTHONPATH=$PWD QUANTKIT_KERNEL_CACHE=${QUANTKIT_KERNEL_CACHE:-${TMPDIR:-/tmp}/qk-kernels} PYTHONUNBUFFERED=1
for v in "${variants[@]}"; do
  ( QUANTKIT_KERNEL_DEFINES="$v" python3 -c "import time; from quantkit.kernels import build; t=time.time(); m=build.load('$kernel', verbose=False); print('[$v]', 'built' if m else 'FAILED ' + str(build.unavailable_reason('$kernel')), round(time.time() - t, 1), 's')" ) &
done
wait
for r in $(seq 1 "$rounds"); do
  i=0
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086  # args is a list of benchmark options
    QUANTKIT_KERNEL_DEFINES="$v" timeout 200 python3 "$bench" $args --json "$out/ab_r${r}_v${i}.json" > "$out/ab_r${r}_v${i}.log" 2>&1
    echo "round $r variant $i [$v] rc=$?"
    i=$((i + 1))
  done
done
cd "$out" && tar czf ab.tgz ab_*.json ab_*.log && rm -f ab_*.json ab_*.log
