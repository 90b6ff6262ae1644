#!/usr/bin/env bash
# The whole GPU suite in one call: GPU tests, then every benchmark, then a short table.
#   OUT=/some/dir bash benchmarks/run_gpu.sh [pytest -k expression]
# Writes under $OUT: env.txt, tests.log, bench.log and one JSON per benchmark
# (DESIGN.md §8 records); copy the JSON into benchmarks/results/ to commit it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mknumba-gpu}
mkdir -p "$OUT"
# Never NVLink multicast on the shared hosts (DESIGN.md §3).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
NGPU=$(nvidia-smi -L | wc -l)
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv; nvidia-smi topo -m
  $PY -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"; } > "$OUT/env.txt" 2>&1

$PY -m pytest -q -m gpu -rs ${1:+-k "$1"} tests 2>&1 | tee "$OUT/tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}

MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x PYTHONPATH"
: > "$OUT/bench.log"
for b in benchmarks/bench_*.py; do
  name=$(basename "$b" .py); name=${name#bench_}
  echo "== $name" | tee -a "$OUT/bench.log"
  ranks=$($PY "$b" --ranks 2>/dev/null || echo 1)
  [ "$ranks" -gt "$NGPU" ] && { echo "skip $name: needs $ranks GPUs" | tee -a "$OUT/bench.log"; continue; }
  if [ "$ranks" -gt 1 ]; then
    # the records' "command" names the launcher (benchmarks/common.py: command_line)
    MKNUMBA_LAUNCHER="mpirun --bind-to none -n $ranks" timeout 400 $MPIRUN -x MKNUMBA_LAUNCHER \
      -n "$ranks" $PY "$b" --out "$OUT/$name.json" >> "$OUT/bench.log" 2>&1
  else
    timeout 400 $PY "$b" --out "$OUT/$name.json" >> "$OUT/bench.log" 2>&1
  fi || echo "FAILED $name (exit $?)" | tee -a "$OUT/bench.log"
done
$PY benchmarks/report.py "$OUT"/*.json
echo "tests exit code: $tests_rc"
exit $tests_rc
