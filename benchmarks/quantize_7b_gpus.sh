#!/usr/bin/env bash
# Whole-model GPTQ of the 7B-shaped checkpoint on 1, 2, ... GPUs of one machine in one command, under 10 minutes
# on H100/H200s: build the checkpoint and the GPTQ kernel (in parallel), time one run per GPU count, then one run
# with the engine's phase timings on the most GPUs (synchronised: its wall time is not the one to quote), and check
# that every artifact is byte-identical to the one-GPU run. Everything lands in $OUT:
#   quantize_7b_<n>gpu.json, q<n>.log     the timed runs (bench_quantize_7b.py --json)
#   quantize_7b_<n>gpu_phases.json        the run with QUANTKIT_ENGINE_TIMINGS=1 (each rank's engine phases)
#   summary.log                           what this script printed
#   OUT=$OUT bash benchmarks/quantize_7b_gpus.sh [GPU counts, default: 1 2 4 8 up to the GPUs present]
# WORKDIR (default build/q7b) keeps the 12.6 GiB checkpoint for runs that follow on the same machine; RUN_LIMIT
# (seconds, default 200) bounds each run.
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
work=${WORKDIR:-build/q7b}
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
counts=${*:-$(for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && echo -n "$n "; done)}
exec > >(tee "$out/summary.log") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
python3 -c "from quantkit.kernels import build; print('gptq kernel', 'built' if build.load('gptq') else 'FAILED')" &
kernel=$!
python3 benchmarks/bench_quantize_7b.py --build-only --workdir "$work" | tail -n 1
wait "$kernel"  # not a bare wait: it would also wait for the tee below, which never ends
echo "== ready after $(( $(date +%s) - start )) s; GPU counts: $counts"
last=1
for n in $counts; do
  timeout "${RUN_LIMIT:-200}" python3 benchmarks/bench_quantize_7b.py --workdir "$work" --nproc "$n" \
    --json "$out/quantize_7b_${n}gpu.json" > "$out/q$n.log" 2>&1
  echo "== $n GPU(s): rc=$? at $(( $(date +%s) - start )) s"
  grep -E "^(wall|load|forwards|solver|write|other) |peak" "$out/q$n.log"
  if [ "$n" -gt 1 ]; then
    same=1
    for f in "$work/artifact-1gpu"/*; do
      b=$(basename "$f"); [ "$b" = quant_log.json ] && continue
      cmp -s "$f" "$work/artifact-${n}gpu/$b" || { echo "DIFFERS: $b"; same=0; }
    done
    echo "byte-identical to one GPU (all files but quant_log.json): $same"
  fi
  last=$n
done
timeout "${RUN_LIMIT:-200}" python3 benchmarks/bench_quantize_7b.py --workdir "$work" --nproc "$last" --phases \
  --json "$out/quantize_7b_${last}gpu_phases.json" > "$out/q${last}_phases.log" 2>&1
echo "== phases on $last GPU(s): rc=$?"
grep "engine phases" "$out/q${last}_phases.log"
echo "== total $(( $(date +%s) - start )) s"
