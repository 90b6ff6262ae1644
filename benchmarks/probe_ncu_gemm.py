"""mk.Gemm and torch.matmul (cuBLAS) under Nsight Compute: one launch of each per shape.

    ncu --clock-control none --profile-from-start off --csv --page raw --metrics \\
        gpu__time_duration.sum,lts__t_bytes.sum.per_second,lts__t_sectors_op_read.sum,\\
lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,\\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__grid_size \\
        python benchmarks/probe_ncu_gemm.py 512x1024x8192,512x4096x8192 > ncu.csv
    python benchmarks/probe_ncu_gemm.py --summarize ncu.csv --out summary.json

Each shape's operands are made and both GEMMs warmed up (compiled, planned) before the
profiled range (``torch.cuda.profiler.start``), so ncu sees exactly ours then cuBLAS's kernel
per shape, in that order; B is [n, k] (``w.T``), or [k, n] with ``--b-layout kn``. ncu
flushes the caches before each kernel (its default), so both start from cold L2; with
``--cache-control none`` both find what the warm-up left there, as in ``bench_gemm.py``.
Leave the clocks alone (``--clock-control none``: the device notes). ``--summarize`` turns
ncu's raw CSV into records ``kernel: "gemm_ncu"``, the shape taken from the launch order.
"""
import argparse
import csv
import json
import os
import sys


TENSOR_PIPE = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed"


def run(shapes, layout):
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mknumba.kernels.gemm import Gemm
    op, runs = Gemm(), []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = b.T if layout == "nk" else b.T.contiguous()     # [k, n]: a view of [n, k] or not
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            op(a, b, out=c)
            torch.matmul(a, b, out=c)
        runs.append((a, b, c))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for a, b, c in runs:
        op(a, b, out=c)
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _value(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def summarize(path, shapes, command, layout):
    rows = list(csv.reader(open(path)))
    hdr = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, records = rows[hdr], []
    for i, row in enumerate(rows[hdr + 2:]):          # after the header, a row of units
        d = dict(zip(names, row))
        metrics = {c: _value(d[c]) for c in names
                   if c.startswith(("gpu__", "lts__", "dram__", "sm__", "launch__")) and d[c]}
        m, n, k = shapes[i // 2]
        records.append(dict(kernel="gemm_ncu", shape=dict(m=m, n=n, k=k), b_layout=layout,
                            who="ours" if i % 2 == 0 else "cublas",
                            name=d["Kernel Name"][:60], gpu=d.get("Device", ""),
                            command=command, metrics=metrics))
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shapes", help="MxNxK,... (the same list for --summarize)")
    p.add_argument("--summarize", default=None, help="ncu's raw CSV of a run")
    p.add_argument("--command", default="", help="--summarize: the ncu command, for the records")
    p.add_argument("--b-layout", default="nk", choices=("nk", "kn"),
                   help="B as [n, k] (a w.T view, as torch.nn.Linear holds it) or [k, n]")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.summarize is None:
        run(shapes, args.b_layout)
        return
    records = summarize(args.summarize, shapes, args.command, args.b_layout)
    for r in records:
        mt = r["metrics"]
        print(f"{r['shape']['m']}x{r['shape']['n']}x{r['shape']['k']} {r['who']:6s} "
              f"{mt.get('gpu__time_duration.sum', 0) / 1e3:8.1f} us  L2 "
              f"{mt.get('lts__t_bytes.sum.per_second', 0) / 1e12:5.2f} TB/s "
              f"({mt.get('lts__throughput.avg.pct_of_peak_sustained_elapsed', 0):4.1f}%)  "
              f"tensor pipe {mt.get(TENSOR_PIPE, 0):4.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
