"""The adaptive SM split against static splits: for each fused kernel, shape and topology, a
sweep of static splits, the best of them, the recorded table's choice and the controller.

    mpirun --bind-to none -n 2 python benchmarks/bench_controller.py \
        --out benchmarks/results/controller.json [--save-trace /tmp/ctl]

Two ranks, one per GPU; ``1x2`` (NVLink) and ``2x1`` (two emulated nodes through the host
proxy, paced to ``--pace-gbps``) in one run. Kernels: GEMM + ReduceScatter and GEMM +
AllReduce (``--kernels rs,ar``). Shapes (m = n, k_local): every row of the recorded table
(``sched/split.py``, ``held_out: false``) and shapes that are not in it (``--held-out``,
``held_out: true``). Per point, each configuration is checked once against an fp32 reference
(into a poisoned output), then timed over back-to-back calls (mean, slowest rank):

- ``static``: ``comm_sms`` = each of ``--sweep`` (default 1, 2, 4, ..., 64; splits the op
  refuses for the topology are skipped), with the table's deliver/fold for the shape;
- ``table``: the op's default (``comm_sms=None``: the recorded table's split);
- ``adaptive``: ``comm_sms="adaptive"`` (``roles.controller``; it starts from the table's
  split, never folds).

Records (docs/design.md §8) carry ``sm_split`` ("compute+comm", or "adaptive"), ``controller``
(true for the adaptive runs), ``held_out``, ``config`` (static | table | adaptive), and
compare with the best static split of the point: ``baseline`` "best_static_split",
``baseline_ms`` its time, ``speedup`` best / ours (1.0 for the best itself, < 1 slower). The
floor is as in bench_fused.py. At the end rank 0 prints per kernel and topology the
controller's geometric mean and worst ratio to the best static split, and against the table
on the held-out shapes (the goals: <= 1.05x, no point worse than 1.15x, better than
the table where held out). ``--save-trace PREFIX``: one traced controller call per point as a
Chrome / Perfetto trace (``PREFIX-<kernel>-<topology>-<m>-<k>.json``, see
benchmarks/plot_timeline.py).
"""
import math
import os
import sys

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.errors import MkValueError  # noqa: E402
from mknumba.kernels.gemm_ar import GemmAllReduce  # noqa: E402
from mknumba.kernels.gemm_rs import GemmReduceScatter  # noqa: E402
from mknumba.sched import split as sm_split  # noqa: E402

NVLINK_GBPS = 380.0                  # measured copy rate (docs/design.md §6), as bench_fused.py
OPS = {"rs": GemmReduceScatter, "ar": GemmAllReduce}
SWEEP = (1, 2, 4, 8, 16, 32, 64)
#: (m, k_local) pairs in none of the recorded table's rows
HELD_OUT = ((3072, 1536), (6144, 384), (12288, 3072), (8192, 128))


def iters_for(ms_est):
    return int(min(50, max(5, 150.0 / max(ms_est, 1e-3))))


def shapes(kernel, topology, held_out):
    """[(m, k, held_out)]: the table's rows for (kernel, topology), then ``held_out``."""
    rows = sorted({(m, k) for m, k, *_ in sm_split.RECORDED.get((kernel, topology), [])})
    return [(m, k, False) for m, k in rows] + [(m, k, True) for m, k in held_out
                                               if (m, k) not in rows]


def bench_point(comm, dist, args, Op, m, k, held, records, log):
    import torch
    topo = f"{comm.nodes}x{comm.local_size}"
    _, paced, transport = common.transport_of(comm, args)
    W, n = comm.size, m
    rows = m // W if Op is GemmReduceScatter else m
    torch.manual_seed(31 + comm.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    b = w.T
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    t_gemm = common.time_ms(lambda: torch.matmul(a, b, out=c), 20, mpi=comm.mpi)
    G = comm.local_size
    link_bytes = (1 if Op is GemmReduceScatter else 2) * (G - 1) / G * m * n * 2
    net_bytes = (m * n * 2 / W if Op is GemmReduceScatter else m * n * 2 / G) * (comm.nodes - 1)
    t_net = net_bytes / ((args.pace_gbps if paced else NVLINK_GBPS) * 1e9) * 1e3
    floor = max(t_gemm, link_bytes / (NVLINK_GBPS * 1e9) * 1e3,
                t_net if comm.nodes > 1 else 0.0)
    ref = a.float() @ w.float().T
    dist.all_reduce(ref)
    want = ref[comm.rank * rows:(comm.rank + 1) * rows] if rows < m else ref
    out = torch.empty((rows, n), device="cuda", dtype=torch.bfloat16)
    configs = [("static", s) for s in args.sweep] + [("table", None), ("adaptive", "adaptive")]
    measured = []
    for config, sms in configs:
        try:
            op = Op(comm, m, n, k, comm_sms=sms)
        except MkValueError as e:             # a split this topology cannot run
            log(f"  skip {config} comm_sms={sms}: {e}")
            continue
        out.fill_(float("nan"))
        op(a, b, out=out)
        op.synchronize()
        err = ((out.float() - want).norm() / want.norm()).item()
        ok = bool(torch.isfinite(out).all().item()) and err <= 1e-2
        err = comm.mpi.allreduce(err if ok else 1.0, op=_max())
        ms = common.time_ms(lambda: op(a, b, out=out), iters_for(floor * 2), mpi=comm.mpi)
        op.synchronize()
        split = "adaptive" if op.adaptive else f"{op.sms - op.comm_sms}+{op.comm_sms}"
        measured.append(dict(config=config, ms=ms, err=err, split=split,
                             comm_sms=op.comm_sms, deliver=op.deliver, fold=op.fold,
                             sms=op.sms))
        if err > 1e-2:
            log(f"  WRONG {Op.kernel_name} {topo} m={m} k={k} {config} {split}: rel err {err}")
        op.free()
    if args.save_trace:
        op = Op(comm, m, n, k, comm_sms="adaptive", trace=True)
        for _ in range(3):
            op(a, b, out=out)
        op.synchronize()
        op.save_trace(f"{args.save_trace}-{Op.kernel_name}-{topo}-{m}-{k}.json")
        op.free()
    static = [x for x in measured if x["config"] == "static" and x["err"] <= 1e-2]
    best = min(static, key=lambda x: x["ms"]) if static else None
    for x in measured:
        rec = common.record(
            Op.kernel_name, {"m": m, "n": n, "k": k}, dtype="bfloat16", world=W, topology=topo,
            transport=transport, ours_ms=x["ms"], baseline="best_static_split",
            baseline_ms=best["ms"] if best else None, floor_ms=floor, sm_split=x["split"],
            controller=x["config"] == "adaptive", held_out=held, config=x["config"],
            best_static=x is best, best_static_split=best["split"] if best else None,
            sms_reserved=None if x["config"] == "adaptive" else x["comm_sms"],
            comm_sms_start=x["comm_sms"], deliver=x["deliver"], fold=x["fold"],
            rel_err=x["err"], cublas_ms=t_gemm, of_floor=floor / x["ms"])
        records.append(rec)
        log(f"{Op.kernel_name:19s} {topo} m={m:5d} k={k:5d} {'held' if held else 'table'} "
            f"{x['config']:8s} {x['split']:>9s} {x['ms']:8.3f} ms"
            + (f"  x{x['ms'] / best['ms']:5.2f} of best ({best['split']})" if best else ""))
    del ref
    torch.cuda.empty_cache()


def summary(records, log):
    """Per kernel and topology: the controller against the best static split and the table."""
    groups = {}
    for r in records:
        groups.setdefault((r["kernel"], r["topology"]), []).append(r)
    for (kern, topo), recs in sorted(groups.items()):
        ctl = [r for r in recs if r["controller"] and r["baseline_ms"]]
        if not ctl:
            continue
        ratios = [r["ours_ms"] / r["baseline_ms"] for r in ctl]
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        held = {(r["shape"]["m"], r["shape"]["k"]): r["ours_ms"] for r in ctl if r["held_out"]}
        table = {(r["shape"]["m"], r["shape"]["k"]): r["ours_ms"] for r in recs
                 if r["config"] == "table" and r["held_out"]}
        better = sum(held[s] < table[s] for s in held if s in table)
        log(f"{kern} {topo}: controller / best static: geomean {gm:.3f}, worst "
            f"{max(ratios):.3f} over {len(ratios)} points; held out: faster than the table at "
            f"{better} of {len(held)}")


def _max():
    from mpi4py import MPI
    return MPI.MAX


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--topologies",), dict(default="1x2,2x1")),
        (("--kernels",), dict(default="rs,ar", help="rs, ar or both (comma-separated)")),
        *common.NETWORK_ARGS,
        (("--sweep",), dict(default=",".join(map(str, SWEEP)),
                            help="static comm SMs to time at every point")),
        (("--held-out",), dict(default=",".join(f"{m}:{k}" for m, k in HELD_OUT),
                               help="m:k_local shapes not in the table ('' for none)")),
        (("--table-shapes",), dict(default="1", choices=("0", "1"),
                                   help="also the table's own shapes")),
        (("--save-trace",), dict(default=None, metavar="PREFIX",
                                 help="write one traced controller call per point"))])
    args.sweep = [int(s) for s in args.sweep.split(",") if s]
    held_out = [tuple(int(x) for x in s.split(":")) for s in args.held_out.split(",") if s]
    kernels = [OPS[x] for x in args.kernels.split(",")]

    kept = []                  # the list run_topologies fills and writes after each topology

    def bench_topology(comm, dist, args, records, log):
        kept[:] = [records]
        topo = f"{comm.nodes}x{comm.local_size}"
        for Op in kernels:
            for m, k, held in shapes(Op.kernel_name, topo, held_out):
                if held or args.table_shapes == "1":
                    bench_point(comm, dist, args, Op, m, k, held, records, log)
    common.run_topologies(args, bench_topology, args.topologies.split(","), 29547)
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0 and kept:
        summary(kept[0], print)


if __name__ == "__main__":
    main()
