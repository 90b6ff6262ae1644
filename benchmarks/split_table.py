"""The SM-split table of ``mknumba/sched/split.py`` from a fused benchmark's sweep.

    python benchmarks/split_table.py [benchmarks/results/fused.json]

Prints ``RECORDED = {...}``: per (kernel, topology), rows ``(m, k_local, comm_sms, deliver, fold)``
of the fastest entry of each point's sweep, wrapped at 100 columns. Paste it into split.py;
``tests/test_fused.py`` checks that the two agree.
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
        head = f"    {key!r}: ["
        line, lines = head, []
        for i, row in enumerate(rows):
            item = f"{row!r}" + ("]," if i == len(rows) - 1 else ",")
            if len(line) + len(item) + 1 > 100:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += item + " "
        print("\n".join(lines + [line.rstrip()]))
    print("}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "fused.json"))
