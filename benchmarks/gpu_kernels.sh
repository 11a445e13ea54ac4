#!/usr/bin/env bash
# Build the CUDA kernels once (in parallel), then run their GPU tests and/or benchmarks.
#   OUT=$OUT benchmarks/gpu_kernels.sh build|test|bench [kernel ...]     kernels: gptq lutgemm anyprec
# A GPU machine without network gets its inputs staged in $QUANTKIT_STAGE (default stage/, relative to the
# repository root): the model, the evaluation texts and wheels (ninja, gguf); wheels in its whl/ are
# installed when present.
set -u
stage=${QUANTKIT_STAGE:-stage}
out=${OUT:?set OUT}
step=${1:?build|test|bench}; shift
kernels=${*:-gptq lutgemm anyprec}
mkdir -p "$out"
if ls "$stage"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$stage"/whl/*.whl 2>/dev/null
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 QUANTKIT_KERNEL_CACHE=${QUANTKIT_KERNEL_CACHE:-$HOME/.cache/quantkit/kernels}
for k in $kernels; do  # builds are cached by source hash, so this is quick when already built
  ( python3 -c "import time,sys; from quantkit.kernels import build; t=time.time(); m=build.load('$k', verbose=False); print('$k', 'built' if m else 'FAILED: %s' % build.unavailable_reason('$k'), round(time.time()-t,1), 's')" \
      > "$out/build_$k.log" 2>&1 ) &
done
wait
cat "$out"/build_*.log
[[ $step == build ]] && exit 0
declare -A tests=([gptq]=tests/test_kernel_gptq.py [lutgemm]=tests/test_kernel_lutgemm.py [anyprec]=tests/test_kernel_anyprec.py)
declare -A benches=([gptq]=benchmarks/bench_gptq_kernel.py [lutgemm]=benchmarks/bench_lutgemm.py [anyprec]=benchmarks/bench_anyprec_kernel.py)
if [[ $step == test ]]; then  # correctness only: the test files run side by side
  for k in $kernels; do
    ( timeout "${TEST_LIMIT:-300}" python3 -m pytest -q -ra "${tests[$k]}" ${PYTEST_ARGS:-} > "$out/test_$k.log" 2>&1;
      echo "rc=$?" >> "$out/test_$k.log" ) &
  done
  wait
  for k in $kernels; do echo "== test $k"; tail -n 25 "$out/test_$k.log"; done
  exit 0
fi
for k in $kernels; do  # timings: one benchmark at a time
  if true; then
    timeout "${BENCH_LIMIT:-240}" python3 "${benches[$k]}" ${BENCH_ARGS:-} --json "$out/bench_$k.json" > "$out/bench_$k.log" 2>&1
    echo "== bench $k rc=$?"; tail -n 40 "$out/bench_$k.log"
  fi
done
