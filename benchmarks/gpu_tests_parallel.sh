#!/usr/bin/env bash
# Run groups of GPU tests side by side (each group a pytest -k expression), one log per group
# under $OUT, then print each group's summary line. Compiling dominates a multi-rank GPU test,
# and the machine's CPU cores compile the groups in parallel.
#   OUT=/some/dir bash benchmarks/gpu_tests_parallel.sh "expr one" "expr two" ...
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
i=0
for expr in "$@"; do
  i=$((i + 1))
  timeout "${GROUP_TIMEOUT_S:-450}" ${PYTHON:-python3} -m pytest -v -m gpu -rs --durations=5 \
    -k "$expr" tests > "$OUT/group$i.log" 2>&1 &
done
wait
i=0
for expr in "$@"; do
  i=$((i + 1)); echo "== group $i ($expr): $(grep -E 'passed|failed|error' "$OUT/group$i.log" | tail -1)"
  grep -E "FAILED|ERROR" "$OUT/group$i.log" | head -5
done
