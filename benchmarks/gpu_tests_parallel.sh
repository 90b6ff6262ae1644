#!/usr/bin/env bash
# Run groups of GPU tests side by side, one log per group under $OUT, then print each group's
# summary line; exits 1 if a group failed. Compiling dominates a multi-rank GPU test, and the
# machine's CPU cores compile the groups in parallel. A group is test files ("tests/a.py
# tests/b.py") or a pytest -k expression. At most MAX_GROUPS run at once (default 2 on one GPU,
# 6 on more): with more on one GPU, the first call of each multi-rank test spends minutes in
# the driver's LTO link and the groups' ranks time-slice the GPU, so groups run past
# GROUP_TIMEOUT_S unfinished (three groups on one H100 did, where two ended in 43-83 s).
#   OUT=/some/dir bash benchmarks/gpu_tests_parallel.sh "tests/test_fused.py" "moe and 1x2" ...
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# a run that would outlast its group fails first, with what its ranks printed so far
group_s=${GROUP_TIMEOUT_S:-450}
export MKNUMBA_TEST_TIMEOUT_S=${MKNUMBA_TEST_TIMEOUT_S:-$((group_s > 60 ? group_s - 30 : group_s))}
i=0
for group in "$@"; do
  i=$((i + 1))
  while [ "$(jobs -rp | wc -l)" -ge "${MAX_GROUPS:-$((NGPU < 2 ? 2 : 6))}" ]; do wait -n; done
  if [[ $group == tests/* ]]; then args=($group); else args=(-k "$group" tests); fi
  timeout "$group_s" ${PYTHON:-python3} -m pytest -v -m gpu -rs --durations=5 \
    "${args[@]}" > "$OUT/group$i.log" 2>&1 &
done
wait
i=0
rc=0
bad='[0-9]+ (failed|errors?)([^a-z]|$)'
for group in "$@"; do
  i=$((i + 1))
  summary=$(grep -E '(passed|failed|error|skipped|no tests ran).* in ' "$OUT/group$i.log" | tail -1)
  echo "== group $i ($group): ${summary:-no summary (timed out?)}"
  grep -E "^(FAILED|ERROR)" "$OUT/group$i.log" | head -5
  # a count of failed tests or errors ("1 xfailed" is an expected failure: not one)
  [[ $summary =~ $bad || -z $summary ]] && rc=1
done
exit $rc
