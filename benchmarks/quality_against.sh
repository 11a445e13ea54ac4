#!/usr/bin/env bash
# WikiText-2 perplexity ± its standard error, the KL divergence from the float model (mean, 99th
# percentile) and the top-1 agreement with it, for the default model quantized with each preset.
#
#   benchmarks/quality_against.sh MODEL OUTDIR [PRESET.yaml ...]
#
# MODEL is the float checkpoint (a .gguf, an HF directory, or smollm2); every artifact is written to
# OUTDIR/<preset>/ and the table to OUTDIR/against.json (quantkit eval ppl --json). Without presets,
# one of each method. Calibration is each preset's (128 x 2048 C4 windows unless it says otherwise).
set -euo pipefail
model=${1:?usage: quality_against.sh MODEL OUTDIR [PRESET.yaml ...]}
out=${2:?usage: quality_against.sh MODEL OUTDIR [PRESET.yaml ...]}
shift 2
presets=("$@")
if [ ${#presets[@]} -eq 0 ]; then
  presets=(configs/rtn-w4g128.yaml configs/rtn-w3g128.yaml configs/gptq-w4g128.yaml configs/gptq-w3g128.yaml
           configs/bcq-q4g128.yaml configs/bcq-q3g128.yaml configs/anyprec-3to8.yaml configs/ooc-w2g128.yaml)
fi
device=${DEVICE:-cuda}
mkdir -p "$out"
models=(--model "$model")
for preset in "${presets[@]}"; do
  name=$(basename "$preset" .yaml)
  python3 -m quantkit quantize --model "$model" --preset "$preset" --device "$device" --out "$out/$name" \
    --overwrite --json "$out/$name.quantize.json"
  models+=(--model "$out/$name")
done
python3 -m quantkit eval ppl "${models[@]}" --against "$model" --dataset wikitext2 --device "$device" \
  --json "$out/against.json"
