#!/usr/bin/env bash
# The any-precision and OOC perplexity tables (RESULTS.md) on one GPU, full protocol.
# A SmolLM2 quantize+eval process is bound by kernel launches, not by the GPU, so the configs run
# as parallel processes (16 host cores) and their JSON files are merged at the end. On a GPU machine
# without network the model and the evaluation texts are staged in $QUANTKIT_STAGE (default stage/):
#   QUANTKIT_DATA=stage/data MODEL=stage/model.gguf OUT=$OUT benchmarks/quality_tables.sh [ooc|anyprec|rest|all]
set -u
stage=${QUANTKIT_STAGE:-stage}
model=${MODEL:?set MODEL to the SmolLM2 gguf (e.g. $stage/model.gguf) or a model dir}
out=${OUT:?set OUT to the result directory}
which=${1:-all}
limit=${LIMIT:-540}
mkdir -p "$out"
pids=()
run() {
  local name=$1; shift
  timeout "$limit" python3 scripts/bench_quality.py --model "$model" --device cuda --val-windows 16 --batch-size ${EVAL_BATCH:-2} \
    --workdir "/tmp/bq-$name" --json "$out/q_$name.json" "$@" > "$out/q_$name.log" 2>&1 &
  pids+=($!)
}
G2="gptq:2:128:act_order=false,static_groups=false,clip_search=false"
if [[ $which == ooc || $which == all ]]; then
  run ooc1 --config "$G2" --config ooc:-:128:scan=0.1
  run ooc2 --config ooc:-:128:scan=0.2 --config ooc:-:128:scan=0.1,per_row=true
  run ooc3 --config ooc:-:128:scan=0.5
  run ooc4 --config ooc:-:128:scan=1.0
  run ooc5 --config ooc:-:128:scan=0.2,per_row=true --config ooc:-:128:scan=0.5,per_row=true
  run ooc6 --config ooc:-:128:scan=1.0,per_row=true
  run ooc7 --config ooc:-:128:high_bits=3,scan=0.2 --config ooc:-:128:high_bits=3,scan=0.2,per_row=true
fi
if [[ $which == anyprec || $which == all ]]; then
  run sq1 --config squeezellm:3:-:sensitivity=fisher --config squeezellm:4:-:sensitivity=fisher \
    --config squeezellm:5:-:sensitivity=fisher
  run sq2 --config squeezellm:6:-:sensitivity=fisher --config squeezellm:7:-:sensitivity=fisher \
    --config squeezellm:8:-:sensitivity=fisher
  run ap1 --config "anyprec:-:-:sensitivity=fisher,eval_bits=3/4/5/6/7/8"
  run ap2 --config "anyprec:-:-:sensitivity=activation,eval_bits=3/4/5/6/7/8" \
    --config squeezellm:3:-:sensitivity=activation --config squeezellm:4:-:sensitivity=activation
fi
if [[ $which == rest ]]; then  # one config per process
  for c in "$G2" ooc:-:128:scan=0.2,per_row=true ooc:-:128:scan=0.5,per_row=true ooc:-:128:high_bits=3,scan=0.2 \
           ooc:-:128:high_bits=3,scan=0.2,per_row=true squeezellm:3:-:sensitivity=fisher \
           squeezellm:4:-:sensitivity=fisher squeezellm:5:-:sensitivity=fisher squeezellm:8:-:sensitivity=fisher \
           anyprec:-:-:sensitivity=activation,eval_bits=3/4/5/6/7/8 squeezellm:3:-:sensitivity=activation \
           squeezellm:4:-:sensitivity=activation; do
    run "r$(echo "$c" | md5sum | cut -c1-6)" --config "$c"
  done
fi
for p in "${pids[@]}"; do wait "$p"; done
python3 scripts/bench_quality.py --merge "$out"/q_*.json --json "$out/quality_merged.json" | tee "$out/quality_table.txt"
