#!/usr/bin/env bash
# One GPU run for the any-precision matvec variants, under 8 minutes: build the extension, run the kernel's
# correctness tests (every width, batch and variant, the row-per-lane kernel at every split; poisoned outputs;
# awkward shapes), then time today's kernel against each variant (FLAG_PAIR / FLAG_OCC, FLAG_ROWS) and cuBLAS
# fp16 in one process (bench_anyprec_variants.py), and print the dispatch table that run would give
# (anyprec_dispatch_table.py, without --write).
#   OUT=DIR benchmarks/anyprec_variants_gpu.sh        writes DIR/{build,test,bench,table}.log, DIR/anyprec_variants.json
set -u
out=${OUT:?set OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s)
timeout "${BUILD_LIMIT:-150}" python3 -c "import time; from quantkit.kernels import build; t=time.time(); \
m=build.load('anyprec'); print('anyprec', 'built' if m else 'FAILED: %s' % build.unavailable_reason('anyprec'), \
round(time.time()-t, 1), 's')" > "$out/build.log" 2>&1
echo "== build rc=$? ($(( $(date +%s) - start )) s)"; tail -n 3 "$out/build.log"
timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -ra -p no:cacheprovider tests/test_kernel_anyprec.py > "$out/test.log" 2>&1
echo "== test rc=$? ($(( $(date +%s) - start )) s)"; tail -n 15 "$out/test.log"
timeout "${BENCH_LIMIT:-170}" python3 benchmarks/bench_anyprec_variants.py --passes 3 --json "$out/anyprec_variants.json" \
  > "$out/bench.log" 2>&1
echo "== bench rc=$? ($(( $(date +%s) - start )) s)"
python3 benchmarks/anyprec_dispatch_table.py "$out/anyprec_variants.json" > "$out/table.log" 2>&1
grep -E "^[A-Z]|^  (bits|today)" "$out/table.log" | head -n 60
tail -n 90 "$out/bench.log"
