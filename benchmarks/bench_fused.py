"""GEMM + ReduceScatter and GEMM + AllReduce (fused, one persistent kernel) against cuBLAS + NCCL.

    mpirun --bind-to none -n 2 python benchmarks/bench_fused.py --out benchmarks/results/fused.json

Two ranks, one per GPU; both topologies in one run: ``1x2`` (one node, NVLink) and ``2x1`` (two
emulated nodes: the dma transport through the host proxy, paced to ``--pace-gbps`` per GPU).
Shapes: M in {2048, 4096, 8192, 16384}, N = M, K_local in {M/16, M/4}; B is the row-major
[N, K_local] weight handed over as its [K_local, N] view ``w.T`` (cuBLAS gets the same).

Baselines in the same process: cuBLAS (torch.matmul) then NCCL reduce_scatter / all_reduce. In
2x1 NCCL still runs over NVLink (it cannot be paced), so the baseline there is the model
``T_cuBLAS + max(T_NCCL, network bytes / pace)``; the measured NCCL time is kept beside it.
With ``--pace-gbps 0`` the 2x1 transfers run unpaced over NVLink through the copy engines
(two "nodes" on one NVLink pair), and the baseline is the measured cuBLAS + NCCL. Ours: the
mean over back-to-back calls (the ratio uses it); ``ours_median_ms`` is the median of
the calls' own times on the stream, without the occasional multi-ms host-side stall (see
benchmarks/NOTES.md). Floor: ``max(T_cuBLAS, bytes on the slowest link / its rate)`` with NVLink at 380 GB/s (measured
copy rate, docs/design.md §6) and the network at the pace. Every point: the fastest of a small sweep
of comm SMs (all kept under "sweep"), on one node of several GPUs each with and without
delivered partials (keys "24" and "24:deliver"; ReduceScatter also with the delivered partials
folded into the owner's epilogue, "2:fold"), a correctness check against an fp32 reference
first. AllReduce writes into the op's shared output (``--shared-out 1``, the default: every
owner writes the finished tile into each local GPU's output, as NCCL's in-place all_reduce
leaves its result in the GEMM's output) or, with ``--shared-out 0``, into a tensor of ours,
which costs each GPU a local copy of the tiles others own.
"""
import os
import sys

import common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mknumba.kernels.gemm_ar import GemmAllReduce  # noqa: E402
from mknumba.kernels.gemm_rs import GemmReduceScatter  # noqa: E402
from mknumba.sched import split as sm_split  # noqa: E402

NVLINK_GBPS = 380.0
SWEEP = {("gemm_reducescatter", "1x2"): (8, 16, 24, 32, 48, 64, 80),
         ("gemm_allreduce", "1x2"): (8, 16, 24, 32, 48, 64, 96),
         ("gemm_reducescatter", "2x1"): (32, 48, 64), ("gemm_allreduce", "2x1"): (32, 48, 64)}
#: with fold the reduce role has nothing to do: the fewest comm SMs the op accepts, and a few more
FOLD_SWEEP = (1, 2, 4)


def iters_for(ms_est):
    return int(min(50, max(5, 150.0 / max(ms_est, 1e-3))))


def bench_topology(comm, dist, args, records, log):
    import torch
    topo = f"{comm.nodes}x{comm.local_size}"
    transport = "nvlink" if comm.nodes == 1 else (
        f"dma:{args.mode}@{args.pace_gbps:g}GB/s" if args.pace_gbps > 0 else f"dma:{args.mode}")
    W = comm.size
    for m in args.sizes:
        n = m
        for k in (m // 16, m // 4):
            torch.manual_seed(17 + comm.rank)
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            b = w.T                                            # [k, n] view, no copy
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            t_gemm = common.time_ms(lambda: torch.matmul(a, b, out=c), 20, mpi=comm.mpi)
            ref = None
            for Op in (GemmReduceScatter, GemmAllReduce):
                kern = Op.kernel_name
                rows = m // W if Op is GemmReduceScatter else m
                nccl_out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                if Op is GemmReduceScatter:
                    coll = lambda: dist.reduce_scatter_tensor(nccl_out, c)  # noqa: E731
                    link_bytes = (comm.local_size - 1) / comm.local_size * m * n * 2
                    net_bytes = m * n * 2 / W * (comm.nodes - 1)
                else:
                    coll = lambda: dist.all_reduce(c)  # noqa: E731
                    link_bytes = 2 * (comm.local_size - 1) / comm.local_size * m * n * 2
                    net_bytes = m * n * 2 / comm.local_size * (comm.nodes - 1)
                t_nccl = common.time_ms(coll, 20, mpi=comm.mpi)

                def unfused():
                    torch.matmul(a, b, out=c)
                    coll()
                t_unfused, t_unfused_med = common.time_ms(unfused, 20, mpi=comm.mpi, median=True)
                paced = comm.nodes > 1 and args.pace_gbps > 0
                # unpaced 2x1: the "network" is NVLink through the copy engines
                t_net = net_bytes / ((args.pace_gbps if paced else NVLINK_GBPS) * 1e9) * 1e3
                t_link = link_bytes / (NVLINK_GBPS * 1e9) * 1e3
                if paced:
                    baseline_ms = t_gemm + max(t_nccl, t_net)
                    baseline = f"cublas+nccl_{'reduce_scatter' if rows < m else 'all_reduce'}" \
                               f"(network modelled at {args.pace_gbps:g} GB/s)"
                else:
                    baseline_ms = t_unfused
                    baseline = f"cublas+nccl_{'reduce_scatter' if rows < m else 'all_reduce'}"
                floor = max(t_gemm, t_link, t_net if comm.nodes > 1 else 0.0)
                comm_share = (baseline_ms - t_gemm) / baseline_ms
                # correctness once per point and delivery mode (fp32 reference of the summed
                # bf16 products), into a poisoned output
                out = torch.empty((rows, n), device="cuda", dtype=torch.bfloat16)
                sweep, steady, errs = {}, {}, {}
                sms_total = 132
                opts = {} if comm.nodes > 1 or args.join is None else {"join": args.join == "1"}
                delivers = [None] if comm.nodes > 1 or comm.local_size < 2 else (
                    [False, True] if args.deliver == "both" else [args.deliver == "1"])
                modes = [(d, False) for d in delivers]       # (deliver, fold)
                if Op is GemmReduceScatter and True in delivers and args.fold != "0":
                    modes = [x for x in modes if args.fold == "both"] + [(True, True)]
                tries = [(s, d, f) for d, f in modes
                         for s in (args.sweep or (FOLD_SWEEP if f else SWEEP[(kern, topo)]))]
                for sms, deliver, fold in tries:
                    shared = args.shared_out == "1" and Op is GemmAllReduce
                    op = Op(comm, m, n, k, comm_sms=sms, tile=args.tile,
                            deliver=deliver, shared_out=shared,
                            fold=fold if Op is GemmReduceScatter else None, **opts)
                    dst = None if shared else out    # None: into the op's shared output
                    mode = (op.deliver, op.fold)
                    key = sm_split.sweep_key(sms, *mode)
                    sms_total = op.sms
                    if mode not in errs:
                        if ref is None:
                            ref = a.float() @ w.float().T
                            dist.all_reduce(ref)
                        want = ref[comm.rank * rows:(comm.rank + 1) * rows] if rows < m else ref
                        got = op.output(torch=True) if shared else out
                        got.fill_(float("nan"))
                        op(a, b, out=dst)
                        op.synchronize()
                        e = ((got.float() - want).norm() / want.norm()).item()
                        ok = bool(torch.isfinite(got).all().item()) and e <= 1e-2
                        errs[mode] = e = comm.mpi.allreduce(e if ok else 1.0, op=_max())
                        if e > 1e-2:
                            log(f"WRONG {kern} {topo} m={m} k={k} deliver={op.deliver} "
                                f"fold={op.fold}: rel err {e}")
                    est = min(sweep.values()) if sweep else baseline_ms
                    sweep[key], steady[key] = common.time_ms(
                        lambda: op(a, b, out=dst), iters_for(est), mpi=comm.mpi, median=True)
                    op.synchronize()
                    op.free()
                best_key = min(sweep, key=sweep.get)
                ours = sweep[best_key]
                chosen = sm_split.parse_sweep_key(best_key)
                best = chosen.comm_sms
                err = max(errs.values())
                rec = common.record(
                    kern, {"m": m, "n": n, "k": k}, dtype="bfloat16", world=W, topology=topo,
                    transport=transport, ours_ms=ours, baseline=baseline,
                    baseline_ms=baseline_ms, floor_ms=floor, sm_split=f"{sms_total - best}+{best}",
                    ours_median_ms=steady[best_key], unfused_median_ms=t_unfused_med,
                    sms_reserved=best, sweep=sweep,
                    cublas_ms=t_gemm, nccl_ms=t_nccl, unfused_measured_ms=t_unfused,
                    network_ms=t_net if comm.nodes > 1 else None, nvlink_ms=t_link,
                    comm_share=comm_share, rel_err=err, of_floor=floor / ours,
                    join=op.join, shared_out=op.shared_out,
                    direct=op.shared_out and comm.local_size > 1 and (chosen.deliver
                                                                      or comm.nodes > 1),
                    deliver=chosen.deliver, fold=chosen.fold,
                    **({} if args.tile == "auto" else {"tile": args.tile}))
                records.append(rec)
                if comm.rank == 0:
                    common.write(records, args.out)   # keep every point, even if cut short
                log(f"{kern:19s} {topo} m={m:5d} k={k:5d} ours {ours:8.3f} ms (median "
                    f"{steady[best_key]:7.3f}, comm_sms {best_key:>10s})"
                    f"  base {baseline_ms:8.3f}  x{baseline_ms / ours:5.2f}  floor {floor:8.3f}"
                    f" ({floor / ours:4.0%})  comm {comm_share:4.0%}  err {err:.1e}")
            del ref
            torch.cuda.empty_cache()


def _max():
    from mpi4py import MPI
    return MPI.MAX


def main():
    args = common.parse_args(ranks=2, extra=[
        (("--sizes",), dict(default="2048,4096,8192,16384")),
        (("--topologies",), dict(default="1x2,2x1")),
        *common.NETWORK_ARGS,
        (("--sweep",), dict(default="", help="comm SMs to try at every point (default: the "
                                              "built-in lists per kernel and topology)")),
        (("--tile",), dict(default="auto", help="GEMM tile build (roles.compute.tile_build), "
                                                "e.g. sm90:e2p1")),
        (("--join",), dict(default=None, choices=("0", "1"),
                           help="idle compute blocks join the reduce and pull queues (1 node "
                                "only); default: the op's")),
        (("--shared-out",), dict(default="1", choices=("0", "1"),
                                 help="AllReduce into the op's shared output (shared_out=True, "
                                      "out=None; NCCL's all_reduce is in place too), else into "
                                      "a tensor of ours (a copy per tile)")),
        (("--fold",), dict(default="both", choices=("0", "1", "both"),
                           help="ReduceScatter with delivery: the owner adds the delivered "
                                "partials in its GEMM epilogue (1 node of several GPUs only); "
                                "default: time it beside delivery without it")),
        (("--deliver",), dict(default="both", choices=("0", "1", "both"),
                              help="compute blocks write tiles other GPUs own into their "
                                   "memory (1 node of several GPUs only); default: time both"))])
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.sweep = [int(s) for s in args.sweep.split(",") if s]
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    dist = common.init_nccl()
    records = []

    def log(msg):
        if rank == 0:
            print(msg, flush=True)
    for topo in args.topologies.split(","):
        comm, _ = common.init_topology(topo, args)
        try:
            bench_topology(comm, dist, args, records, log)
        finally:
            comm.finalize()
        if rank == 0:
            common.write(records, args.out)           # keep what we have after each topology
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
