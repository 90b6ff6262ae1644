#!/usr/bin/env bash
# The whole GPU suite in one call: GPU tests, compute-sanitizer, every benchmark, a short table.
#   OUT=/some/dir bash benchmarks/run_gpu.sh [pytest -k expression] [benchmark name pattern]
# SANITIZE=0 leaves out compute-sanitizer; a pytest expression "none" runs no tests, none runs
# every GPU test, in groups side by side (gpu_tests_parallel.sh: a log per group).
# Writes under $OUT: env.txt, tests.log, bench.log and one JSON per benchmark
# (docs/design.md §8 records); copy the JSON into benchmarks/results/ to commit it.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PY=${PYTHON:-python3}
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv; nvidia-smi topo -m
  $PY -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"; } > "$OUT/env.txt" 2>&1

tests_rc=0
if [ -n "${1:-}" ] && [ "$1" != none ]; then
  $PY -m pytest -q -m gpu -rs -k "$1" tests 2>&1 | tee "$OUT/tests.log" | tail -25
  tests_rc=${PIPESTATUS[0]}
elif [ "${1:-}" != none ]; then
  # the whole suite as groups side by side (one after another it outlasts a 10-minute call)
  bash benchmarks/gpu_tests_parallel.sh \
    "tests/test_gemm.py tests/test_reduce_roles.py tests/test_proxy_gpu.py" \
    "tests/test_frame.py" "tests/test_fused.py" \
    "tests/test_allgather_gemm.py tests/test_moe_dispatch.py" \
    "tests/test_ring_attention.py tests/test_examples.py" \
    "tests/test_runtime.py tests/test_tutorials.py" 2>&1 | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
fi

# compute-sanitizer memcheck and racecheck of two-rank runs of the five fused kernels
: > "$OUT/sanitizer.log"
sanitize_rc=0
[ "${SANITIZE:-1}" = 0 ] || bash benchmarks/sanitize.sh > /dev/null || sanitize_rc=$?

: > "$OUT/bench.log"
for b in benchmarks/bench_${2:-*}.py; do
  name=$(basename "$b" .py); name=${name#bench_}
  echo "== $name" | tee -a "$OUT/bench.log"
  # "--ranks" prints the ranks a benchmark needs, and "shared" when they may share GPUs
  read -r ranks shared <<< "$($PY "$b" --ranks 2>/dev/null || echo 1)"
  if [ "$ranks" -gt "$NGPU" ] && [ "$shared" != shared ]; then
    echo "skip $name: needs $ranks GPUs" | tee -a "$OUT/bench.log"; continue
  fi
  if [ "$ranks" -gt 1 ]; then
    # the records' "command" names the launcher (benchmarks/common.py: command_line)
    MKNUMBA_LAUNCHER="mpirun --bind-to none -n $ranks" timeout 400 $MPIRUN -x MKNUMBA_LAUNCHER \
      -n "$ranks" $PY "$b" --out "$OUT/$name.json" >> "$OUT/bench.log" 2>&1
  else
    timeout 400 $PY "$b" --out "$OUT/$name.json" >> "$OUT/bench.log" 2>&1
  fi || echo "FAILED $name (exit $?)" | tee -a "$OUT/bench.log"
done
$PY benchmarks/report.py "$OUT"/*.json
cat "$OUT/sanitizer.log"
echo "tests exit code: $tests_rc, compute-sanitizer exit code: $sanitize_rc"
[ "$tests_rc" = 0 ] && exit $sanitize_rc
exit $tests_rc
