"""Host time per call: every op beside torch.matmul and an NCCL all-reduce, in one run.

    mpirun -n 2 python benchmarks/bench_host_cost.py --out benchmarks/results/host_cost.json

Host cost is the wall time the calling thread spends in one call (the work is queued on the
stream, not waited for): the mean over ``--calls`` back-to-back calls after warm-up, queued
behind a kernel that holds the stream (``torch.cuda._sleep``) until the burst is in, so that
nothing of the calls runs meanwhile: the host's time alone, not the GPU's (two ranks sharing
one GPU slice it between their contexts) nor a full launch queue. A graph
record (``graph: true``) is the host time of one ``CUDAGraph.replay()`` of a captured call.
Ranks may share a GPU (``MKNUMBA_ALLOW_SHARED_GPU=1``): only the host side is timed. Records:
``kernel: "host_cost"`` with ``op``, ``host_us`` and ``graph`` (docs/design.md §8); the slowest
rank counts.
"""
import os
import time

os.environ.setdefault("MKNUMBA_ALLOW_SHARED_GPU", "1")   # host timing only

import common  # noqa: E402
import numpy as np  # noqa: E402

import mknumba as mk  # noqa: E402

M, N, K = 2048, 2048, 512      # the decode-sized GEMM the issue names (0.42x cuBLAS there)
GATE_CYCLES = 60_000_000       # ~30 ms of GPU clock: longer than a burst of calls takes to queue


def host_us(fn, calls, mpi):
    """Mean host microseconds per call of ``fn`` (slowest rank), after warm-up."""
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    mpi.Barrier()
    best = None
    for _ in range(5):                       # best of five bursts: a burst can hit a GC pause
        torch.cuda._sleep(GATE_CYCLES)       # holds the stream until the burst is queued
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        mpi.Barrier()
        best = us if best is None else min(best, us)
    return mpi.allreduce(best, op=common._max())


def graph_us(fn, calls, mpi):
    """Host microseconds per replay of a CUDA graph holding one call of ``fn``."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return host_us(g.replay, calls, mpi)


def main():
    args = common.parse_args(ranks="2 shared", extra=[
        (("--calls",), dict(type=int, default=100))])
    import torch
    comm = mk.init()
    torch.cuda.set_device(comm.device_id)
    if torch.cuda.device_count() >= comm.size:
        dist = common.init_nccl(29547, device=comm.device_id)
    else:       # NCCL refuses two ranks on one GPU: time a one-rank all-reduce on each
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29547 + comm.rank))
        dist.init_process_group("nccl", rank=0, world_size=1,
                                device_id=torch.device("cuda", comm.device_id))
    mpi, W = comm.mpi, comm.size
    topo = f"{comm.nodes}x{comm.local_size}"
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)     # nn.Linear's [out, in]
    b_kn = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1 << 18, device="cuda", dtype=torch.float32)    # 1 MiB
    g = mk.Gemm()
    rs = mk.GemmReduceScatter(comm, M, N, K)
    ar = mk.GemmAllReduce(comm, M, N, K)
    ag = mk.AllGather(comm, x.shape, np.float32)
    agg = mk.AllGatherGemm(comm, M, N, K)
    a_shard = a[:M // W]                                            # this rank's rows
    ring = mk.RingAttention(comm, 1, 1024, 8, 8, 128)
    q, kk, v = (torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(3))
    q_out = torch.empty_like(q)
    lse = torch.empty(1, 8, 1024, device="cuda", dtype=torch.float32)
    moe = mk.MoeDispatchGemm(comm, 1024, 512, 8, 2, 512)
    x_tok = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    topk = torch.randint(0, 8, (512, 2), device="cuda", dtype=torch.int32)
    w_moe = torch.randn(8 // W, 1024, 512, device="cuda", dtype=torch.bfloat16)
    moe_out, moe_layout = moe(x_tok, topk, w_moe)
    rs_out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
    ag_out = torch.empty((ag.members,) + tuple(x.shape), device="cuda", dtype=torch.float32)
    cases = [
        ("torch.matmul", lambda: torch.matmul(a, w.T, out=c), True),
        ("nccl", lambda: dist.all_reduce(x), False),
        ("mk.Gemm w.T", lambda: g(a, w.T, out=c), True),
        ("mk.Gemm b [k,n]", lambda: g(a, b_kn, out=c), True),
        ("mk.GemmReduceScatter", lambda: rs(a, w.T, out=rs_out), False),
        ("mk.GemmAllReduce", lambda: ar(a, w.T, out=c), False),
        ("mk.AllGather", lambda: ag(x, out=ag_out), False),
        ("mk.AllGatherGemm", lambda: agg(a_shard, w.T, out=c), False),
        ("mk.RingAttention", lambda: ring(q, kk, v, out=q_out, lse=lse), False),
        ("mk.MoeDispatchGemm", lambda: moe(x_tok, topk, w_moe, out=moe_out, layout=moe_layout),
         False),
    ]
    records = []
    for name, fn, graph in cases:
        for in_graph in ((False, True) if graph else (False,)):
            us = (graph_us if in_graph else host_us)(fn, args.calls, mpi)
            records.append(common.record(
                "host_cost", {"m": M, "n": N, "k": K}, dtype="bfloat16", world=W,
                topology=topo, transport=None, ours_ms=None, baseline=None, baseline_ms=None,
                floor_ms=None, op=name, host_us=us, graph=in_graph))
    for op in (rs, ar, ag, agg, ring, moe):
        op.synchronize()
        op.free()
    if comm.rank == 0:
        common.write(records, args.out)
        for r in records:
            print(f"host_cost {r['op']:<22} graph={int(r['graph'])}  {r['host_us']:7.2f} us")
    dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
