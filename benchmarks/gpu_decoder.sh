#!/usr/bin/env bash
# The fast decoder on a GPU machine in one command: build the CUDA kernels (in parallel), run the GPU tests of
# the decoder and its kernels, then the end-to-end decode benchmark. Everything lands in $OUT:
#   build_lutgemm.log, build_anyprec.log
#   gpu_tests.log, gpu_tests.json   (one entry per test: outcome, seconds, message)
#   e2e_decode.json                 (rewritten after every format: a run cut short keeps what it measured)
#   e2e_decode.log, e2e_decode.stderr.log
#   OUT=$OUT benchmarks/gpu_decoder.sh [bench_e2e_decode.py arguments...]     # ~6-7 min on an H100
# TEST_LIMIT and BENCH_LIMIT (seconds) bound the two steps [180, 270]: with the builds, 8 minutes at most.
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for k in lutgemm anyprec; do  # builds are cached by source hash: quick when already built
  ( python3 -c "import time; from quantkit.kernels import build; t = time.time(); m = build.load('$k'); \
print('$k', 'built' if m else 'FAILED: %s' % build.unavailable_reason('$k'), round(time.time() - t, 1), 's')" \
      > "$out/build_$k.log" 2>&1 ) &
done
wait
cat "$out"/build_*.log
timeout "${TEST_LIMIT:-180}" python3 -m pytest -v -rs -m gpu -p no:cacheprovider --junitxml="$out/gpu_tests.xml" \
  tests/test_fast_model.py tests/test_decode_attention.py tests/test_add_norm.py tests/test_silu_mul.py \
  tests/test_runtime_cuda.py tests/test_transformers_loading.py > "$out/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$out/gpu_tests.log"
python3 - "$out/gpu_tests.xml" "$out/gpu_tests.json" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    json.dump({"error": f"no test report: {exc}"}, open(sys.argv[2], "w"))
    raise SystemExit
tests = []
for case in root.iter("testcase"):
    outcome, message = "passed", ""
    for child in case:
        if child.tag in ("failure", "error", "skipped"):
            outcome, message = child.tag, (child.get("message") or "")[:400]
    tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "message": message})
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
json.dump({"counts": counts, "tests": tests}, open(sys.argv[2], "w"), indent=1)
print("tests:", counts)
EOF
rm -f "$out/gpu_tests.xml"
tail -n 5 "$out/gpu_tests.log"
timeout "${BENCH_LIMIT:-270}" python3 benchmarks/bench_e2e_decode.py --json "$out/e2e_decode.json" "$@" \
  > "$out/e2e_decode.log" 2> "$out/e2e_decode.stderr.log"
echo "bench rc=$?"
cat "$out/e2e_decode.log"
