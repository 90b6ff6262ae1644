"""The SM-split table of ``mknumba/sched/split.py`` from a fused benchmark's sweep.

    python benchmarks/split_table.py [benchmarks/results/fused.json]

Prints ``RECORDED = {...}``: per (kernel, topology), rows ``(m, k_local, comm_sms)`` with the
fastest comm_sms of each point's sweep. Paste it into split.py; ``tests/test_fused.py`` checks
that the two agree.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from mknumba.sched.split import from_sweep  # noqa: E402


def main(path):
    with open(path) as f:
        t = from_sweep(json.load(f))
    print("RECORDED = {")
    for key, rows in t.items():
        print(f"    {key!r}: {rows!r},")
    print("}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "fused.json"))
