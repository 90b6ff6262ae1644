#!/usr/bin/env bash
# Host cost of this tree beside an earlier one's, in one device call: bench_host_cost.py from
# each tree in turn (the earlier first), ROUNDS rounds (default 2), on RANKS ranks (default 2:
# the fused ops' hot paths; the ranks share one GPU, only host time is timed). Every record goes
# to $OUT/host_cost_ab.json with "tree" (BASE_DIR's name or "this tree") and "round"; a table of
# us per call and of the ratio to torch.matmul's in the same run (steadier on a noisy host), each
# the median over the rounds, is printed last.
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
mpi=($MPIRUN -n "${RANKS:-2}")
for r in $(seq 1 "$rounds"); do
  for tree in "$base" "$here"; do
    tag=$([ "$tree" = "$here" ] && echo this || echo base)
    (cd "$tree" && PYTHONPATH="$tree" timeout 300 "${mpi[@]}" python3 \
       benchmarks/bench_host_cost.py --out "$OUT/host_${tag}_$r.json" \
       > "$OUT/host_${tag}_$r.log" 2>&1)
  done
done
python3 - "$OUT" "$rounds" "$(basename "$base")" <<'EOF'
import collections, json, statistics, sys
out, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records, us, ratio = [], collections.defaultdict(list), collections.defaultdict(list)
for r in range(1, rounds + 1):
    for tag, tree in (("base", base), ("this", "this tree")):
        run = json.load(open(f"{out}/host_{tag}_{r}.json"))
        mm = {(x["graph"], x["fresh_out"]): x["host_us"] for x in run if x["op"] == "torch.matmul"}
        for rec in run:
            rec.update(tree=tree, round=r)
            records.append(rec)
            key = (rec["op"], rec["graph"], rec["fresh_out"], rec["graph_launch"])
            us[key, tree].append(rec["host_us"])
            mm_us = mm.get((rec["graph"], rec["fresh_out"])) or mm.get((rec["graph"], False))
            if mm_us:
                ratio[key, tree].append(rec["host_us"] / mm_us)
json.dump(records, open(f"{out}/host_cost_ab.json", "w"), indent=1)
# a noisy host moves whole runs: an op's ratio to torch.matmul of the same run is steadier
med = lambda v: statistics.median(v) if v else float("nan")      # noqa: E731
print(f"{'op':<34} {'graph':>5} {'fresh':>5} {'mode':<6} {base:>9} {'this tree':>9} "
      f"{'/mm ' + base:>12} {'/mm this':>9}")
for key in dict.fromkeys(k for k, _ in us):
    cells = [med(us.get((key, t))) for t in (base, "this tree")]
    cells += [med(ratio.get((key, t))) for t in (base, "this tree")]
    print(f"{key[0]:<34} {int(key[1]):>5} {int(key[2]):>5} {key[3]:<6} "
          f"{cells[0]:>9.2f} {cells[1]:>9.2f} {cells[2]:>12.2f} {cells[3]:>9.2f}")
EOF
