#!/usr/bin/env bash
# compute-sanitizer on two-rank runs of the five fused kernels (issue 17, item 7): each tool in
# turn (default: memcheck, then racecheck), the kernels' runs side by side, every rank under
# the tool, small shapes (every tile ragged) and a few calls each with their results checked
# by the run itself. One log per tool and kernel under $OUT (sanitizer_<tool>_<kernel>.log);
# a line each in $OUT/sanitizer.log: the exit code and how many ranks the tool called clean.
# Exits 1 if any run failed or a rank was not clean.
#   OUT=/some/dir bash benchmarks/sanitize.sh [tool ...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
PY=${PYTHON:-python3}
# the tool slows every kernel many times: the ranks' waits get a bound to match
export MKNUMBA_TIMEOUT_S=${MKNUMBA_TIMEOUT_S:-300}
declare -A runs=(
  [gemm_rs_ar]="tests/mpi/fused_checks.py both 1024 512 256 3 torch"
  [allgather_gemm]="tests/mpi/allgather_gemm_checks.py calls m=2000 n=776 k=264 calls=3
                    arrays=torch"
  [moe_dispatch]="tests/mpi/moe_dispatch_checks.py calls hidden=264 ffn=776 experts=8 top_k=2
                  max_tokens=300 calls=1 arrays=torch"
  [ring_attention]="tests/mpi/ring_checks.py 1 200 4 2 64 2 torch"
)
: > "$OUT/sanitizer.log"
codes=$(mktemp -d)          # each run's exit code (kept out of $OUT: fewer files come back)
rc=0
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck)
for tool in "${tools[@]}"; do
  for name in "${!runs[@]}"; do
    log="$OUT/sanitizer_${tool}_$name.log"
    ( timeout "${SANITIZE_TIMEOUT_S:-500}" $MPIRUN -x MKNUMBA_TIMEOUT_S -n 2 \
        compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 9 \
        $PY -m mpi4py ${runs[$name]} > "$log" 2>&1
      echo $? > "$codes/${tool}_$name" ) &
  done
  wait
  for name in "${!runs[@]}"; do
    log="$OUT/sanitizer_${tool}_$name.log"
    # occurrences, not lines: the two ranks' output can share a line
    clean=$(grep -oE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazard' "$log" | wc -l)
    passed=$(grep -oE 'PASS [a-z]' "$log" | wc -l)
    code=$(cat "$codes/${tool}_$name")
    echo "compute-sanitizer $tool $name: exit $code, $clean/2 ranks clean, $passed PASS reports" \
      | tee -a "$OUT/sanitizer.log"
    # a clean summary and at least one PASS from each rank
    [ "$code" = 0 ] && [ "$clean" -eq 2 ] && [ "$passed" -ge 2 ] || rc=1
  done
done
rm -rf "$codes"
exit $rc
