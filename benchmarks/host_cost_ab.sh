#!/usr/bin/env bash
# Host cost of this tree beside an earlier one's, in one device call: bench_host_cost.py from
# each tree in turn (the earlier first), ROUNDS rounds (default 2), on RANKS ranks (default 2:
# the fused ops' hot paths; the ranks share one GPU, only host time is timed). Every record goes
# to $OUT/host_cost_ab.json with "tree" (BASE_DIR's name or "this tree") and "round"; a table of
# us per call, each op's mean over the rounds, is printed last.
#
# BASE_DIR is the earlier tree, made on the machine that has the git history and carried as an
# untracked folder (delete it before committing):
#   mkdir _base && git archive 16ed3d4 | tar -x -C _base
#   OUT=/some/dir bash benchmarks/host_cost_ab.sh _base
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
base=$(cd "$1" && pwd)
here=$PWD
rounds=${ROUNDS:-2}
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE
     -x PYTHONUNBUFFERED -x MKNUMBA_ALLOW_SHARED_GPU -n "${RANKS:-2}")
for r in $(seq 1 "$rounds"); do
  for tree in "$base" "$here"; do
    tag=$([ "$tree" = "$here" ] && echo this || echo base)
    (cd "$tree" && timeout 300 "${mpi[@]}" -x PYTHONPATH="$tree" python3 \
       benchmarks/bench_host_cost.py --out "$OUT/host_${tag}_$r.json" > "$OUT/host_${tag}_$r.log" 2>&1)
  done
done
python3 - "$OUT" "$rounds" "$(basename "$base")" <<'EOF'
import collections, json, sys
out, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records, mean = [], collections.defaultdict(list)
for r in range(1, rounds + 1):
    for tag, tree in (("base", base), ("this", "this tree")):
        for rec in json.load(open(f"{out}/host_{tag}_{r}.json")):
            rec.update(tree=tree, round=r)
            records.append(rec)
            key = (rec["op"], rec["graph"], rec["fresh_out"], rec["graph_launch"])
            mean[key, tree].append(rec["host_us"])
json.dump(records, open(f"{out}/host_cost_ab.json", "w"), indent=1)
print(f"{'op':<34} {'graph':>5} {'fresh':>5} {'mode':<6} {base:>9} {'this tree':>9}")
for key in dict.fromkeys(k for k, _ in mean):
    cells = [sum(v) / len(v) if (v := mean.get((key, t))) else float("nan")
             for t in (base, "this tree")]
    print(f"{key[0]:<34} {int(key[1]):>5} {int(key[2]):>5} {key[3]:<6} "
          f"{cells[0]:>9.2f} {cells[1]:>9.2f}")
EOF
