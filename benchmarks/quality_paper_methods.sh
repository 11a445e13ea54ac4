#!/usr/bin/env bash
# Bits per weight against perplexity for every method on SmolLM2, full protocol, in one GPU command (~7 min):
# RTN, GPTQ (defaults), BCQ (output-aware and weight-error solvers, with and without offset), OOC over the
# default GPTQ (with the two-flow ensemble rows), independent SqueezeLLM and upscaled any-precision, each
# with its quantize time. The configs run as parallel processes on the one GPU (a SmolLM2 run is bound by
# kernel launches, not by the GPU; the host has 16 cores), every process under its own time limit; each
# writes its JSON after every config, so a process cut short keeps what it measured. Then the JSON files
# are merged (one table, ensemble rows added) and plotted when matplotlib is importable.
#   QUANTKIT_DATA=stage/data MODEL=stage/model.gguf OUT=$OUT benchmarks/quality_paper_methods.sh
# Quantize times are measured while the other processes share the GPU and the host: compare them within
# this run only. The CUDA extensions are not built (QUANTKIT_NO_KERNELS=cuda, unless KERNELS=1): on a fresh
# machine seventeen processes would wait for their first build. Every method then runs its PyTorch path on
# the GPU (the GPTQ column loop included, so GPTQ and the BCQ sweep are timed alike) and evaluation runs the
# reference dequantize + matmul, which the kernels are held to. The CPU extension (exact k-means of
# SqueezeLLM and any-precision) is built once, before the processes start.
# SET=core runs only the GPTQ, output-aware BCQ and OOC rows (nine processes), SET=anyprec the upscaled family
# and independent SqueezeLLM at 4..8 bits (six processes), for a machine with less time; SET=anyprec-rules the
# upscaling rules side by side (split, gptq with bands 0.25 / 0.5 / 1 and two sweeps) with SqueezeLLM 3 and 4.
# Each process gets QUANTKIT_THREADS host threads (default 1): seventeen processes with torch's default pool
# on 16 cores spend their time waiting for each other.
set -u
[[ ${KERNELS:-0} == 1 ]] || export QUANTKIT_NO_KERNELS=cuda
export QUANTKIT_THREADS=${QUANTKIT_THREADS:-1}
python3 -c "from quantkit.methods import kmeans_native as k; print('CPU extension:', k.extension() is not None)"
if [[ ${KERNELS:-0} == 1 ]]; then  # built once here, so that no process waits for another's build
  for k in gptq lutgemm anyprec; do
    python3 -c "from quantkit.kernels import build; print('$k extension:', build.load('$k') is not None)" &
  done
  wait
fi
model=${MODEL:?set MODEL to the SmolLM2 gguf (e.g. stage/model.gguf) or a model dir}
out=${OUT:?set OUT to the result directory}
limit=${LIMIT:-420}
mkdir -p "$out"
pids=()
first=1
run() {
  local name=$1; shift
  local float=--no-float
  if [[ $first == 1 ]]; then float=""; first=0; fi  # one process evaluates the float model
  timeout "$limit" python3 scripts/bench_quality.py --model "$model" --device cuda --val-windows 16 \
    --batch-size ${EVAL_BATCH:-2} $float --workdir "/tmp/qpm-$name" --json "$out/q_$name.json" "$@" \
    > "$out/q_$name.log" 2>&1 &
  pids+=($!)
}
# quick ones first in each process, so a process cut short still has them
if [[ ${SET:-all} == anyprec ]]; then  # the upscaled family against independent SqueezeLLM, one width a process
  run ap --config "anyprec:-:-:sensitivity=fisher,eval_bits=3/4/5/6/7/8"
  for q in 4 5 6 7 8; do run "sq$q" --config "squeezellm:$q:-:sensitivity=fisher"; done
elif [[ ${SET:-all} == anyprec-rules ]]; then  # every width of each rule against independent SqueezeLLM
  run sq34 --config "squeezellm:3:-:sensitivity=fisher" --config "squeezellm:4:-:sensitivity=fisher"
  run ap-split --config "anyprec:-:-:sensitivity=fisher,upscale=split,eval_bits=3/4/5/6/7/8"
  run ap-gptq --config "anyprec:-:-:sensitivity=fisher,eval_bits=4/5/6/7/8"
  run ap-gptq-b25 --config "anyprec:-:-:sensitivity=fisher,band=0.25,eval_bits=4/5/6/7/8"
  run ap-gptq-b100 --config "anyprec:-:-:sensitivity=fisher,band=1.0,eval_bits=4/5/6/7/8"
  run ap-gptq-s2 --config "anyprec:-:-:sensitivity=fisher,sweeps=2,eval_bits=4/5/6/7/8"
elif [[ ${SET:-all} == core ]]; then
  for q in 2 3 4; do
    run "gptq$q" --config "gptq:$q:128"
    run "bcq$q" --config "bcq:$q:128"
  done
  run bcq3-offset --config bcq:3:128:offset=true
  run ooc2 --config ooc:-:128:low_bits=2,high_bits=2,clear_fraction=0.1,scan=0.1
  run ooc3 --config ooc:-:128:low_bits=3,high_bits=3,clear_fraction=0.1,scan=0.1
else
run rtn --config rtn:3:128 --config rtn:4:128
run gptq-a --config gptq:2:128 --config gptq:3:128 --config gptq:4:128
run gptq-b --config gptq:2:64 --config gptq:3:64
run bcq-w --config bcq:2:128:solver=weight --config bcq:3:128:solver=weight --config bcq:4:128:solver=weight \
  --config bcq:2:128:solver=weight,offset=true --config bcq:3:128:solver=weight,offset=true \
  --config bcq:4:128:solver=weight,offset=true
for q in 2 3 4; do
  run "bcq$q-offset" --config "bcq:$q:128:offset=true"
  run "bcq$q" --config "bcq:$q:128"
done
run ooc2 --config ooc:-:128:low_bits=2,high_bits=2,clear_fraction=0.1,scan=0.1
run ooc3 --config ooc:-:128:low_bits=3,high_bits=3,clear_fraction=0.1,scan=0.1
run sq-a --config squeezellm:3:-:sensitivity=fisher --config squeezellm:4:-:sensitivity=fisher \
  --config squeezellm:5:-:sensitivity=fisher
run sq-b --config squeezellm:6:-:sensitivity=fisher --config squeezellm:7:-:sensitivity=fisher \
  --config squeezellm:8:-:sensitivity=fisher
run sq-refit --config squeezellm:3:-:sensitivity=fisher,table_refit=output \
  --config squeezellm:4:-:sensitivity=fisher,table_refit=output
run ap --config "anyprec:-:-:sensitivity=fisher,eval_bits=3/4/5/6/7/8"
run ap-norefit --config "anyprec:-:-:sensitivity=fisher,table_refit=none,eval_bits=3/4/5/6/7/8"
fi
for p in "${pids[@]}"; do wait "$p"; done
python3 scripts/bench_quality.py --merge "$out"/q_*.json --json "$out/quality_merged.json" | tee "$out/quality_table.txt"
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 scripts/plot_quality.py "$out/quality_merged.json" --out "$out/quality_bits_wikitext2.png"
else
  echo "matplotlib is not installed: plot later with scripts/plot_quality.py $out/quality_merged.json"
fi
