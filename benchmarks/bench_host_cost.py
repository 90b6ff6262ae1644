"""Host time per call: every op beside torch.matmul and an NCCL all-reduce, in one run.

    mpirun -n 2 python benchmarks/bench_host_cost.py --out benchmarks/results/host_cost.json

Host cost is the wall time the calling thread spends in one call (the work is queued on the
stream, not waited for): the mean over a burst of ``--calls`` back-to-back calls after a
short warm-up, queued behind a kernel that holds the stream (``torch.cuda._sleep``) until the
burst is in, so that nothing of the calls runs meanwhile: the host's time alone, not the GPU's
(two ranks sharing one GPU slice it between their contexts) nor a full launch queue. Every
op's variants take turns, one burst each per round, for ``--rounds`` rounds; ``host_us`` is
the best burst, ``host_us_median`` the median (the host's speed drifts over a run). A graph
record (``graph: true``) is the host time of one ``CUDAGraph.replay()`` of a captured call; a
``fresh_out: true`` record, of calls whose output alternates between two arrays, for each op of
ours in each graph launch mode (``kernels.launch.set_graph_launch``; the record's
``graph_launch``): the default first, then "always" (its launches through the op's one-node
graph) and "stable" (``cuLaunchKernel`` for every call whose addresses changed).
Ranks may share a GPU (``MKNUMBA_ALLOW_SHARED_GPU=1``): only the host side is timed. Records:
``kernel: "host_cost"`` with ``op``, ``host_us`` and ``graph`` (docs/design.md §8), and
``host_cpu_us``, the calling thread's CPU time per call, best burst (equal to ``host_us`` while
the thread keeps its core; below it, the thread waited); the slowest rank counts. The share of the
machine's CPU time stolen by its host while timing is printed last.

``--profile DIR``: instead, where each op's host time goes: rank 0 runs ``--calls`` calls of
each op with fresh outputs under cProfile (after warm-up, the default graph launch mode) and
writes ``DIR/host_profile.txt``, each op's functions by their own time, and how many of its
calls took the checked path (``arrays.operand`` calls per call: 0 on the hot path). cProfile
adds its own cost to every Python call, so the shares, not the microseconds, are the finding.
"""
import os
import statistics
import time

os.environ.setdefault("MKNUMBA_ALLOW_SHARED_GPU", "1")   # host timing only

import common  # noqa: E402
import numpy as np  # noqa: E402

import mknumba as mk  # noqa: E402
from mknumba.kernels.launch import graph_launch, set_graph_launch  # noqa: E402

M, N, K = 2048, 2048, 512      # the decode-sized GEMM the issue names (0.42x cuBLAS there)
GATE_CYCLES = 60_000_000       # ~30 ms of GPU clock: longer than a burst of calls takes to queue


def warm_up(fn, mpi):
    """A few calls of ``fn``, finished on every rank."""
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    mpi.Barrier()


def burst(fn, calls, mpi=None, prof=None):
    """Host seconds of ``calls`` back-to-back calls of ``fn``, queued behind a kernel that holds
    the stream until the burst is in; then finished (on every rank of ``mpi``, if given):
    (wall, this thread's CPU time). ``prof``: a cProfile profiler, enabled for the calls
    alone."""
    import torch
    torch.cuda._sleep(GATE_CYCLES)
    t0, c0 = time.perf_counter(), time.thread_time()
    if prof is not None:
        prof.enable()
    for _ in range(calls):
        fn()
    if prof is not None:
        prof.disable()
    s, cpu = time.perf_counter() - t0, time.thread_time() - c0
    torch.cuda.synchronize()
    if mpi is not None:
        mpi.Barrier()
    return s, cpu


def captured(fn):
    """``replay`` of a CUDA graph holding one call of ``fn`` (warmed up on a side stream)."""
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
    return g.replay


def interleaved_us(variants, rounds, calls, mpi):
    """Per variant (``fn``, graph launch mode), host microseconds per call, the slowest rank's:
    (best wall, best CPU, median wall) over ``rounds`` bursts, one burst of each variant per
    round, each after a short warm-up. The host's speed drifts over hundreds of milliseconds
    (benchmarks/NOTES.md, fortieth session), longer than consecutive bursts of one variant
    take; taken in turn, every variant meets the same fast and slow stretches."""
    bursts = [[] for _ in variants]
    for _ in range(rounds):
        for i, (fn, mode) in enumerate(variants):
            set_graph_launch(mode)
            warm_up(fn, mpi)
            bursts[i].append(burst(fn, calls, mpi))
    out = []
    for b in bursts:
        mine = (min(w for w, _ in b), min(c for _, c in b), statistics.median(w for w, _ in b))
        out.append(tuple(mpi.allreduce(v / calls * 1e6, op=common._max()) for v in mine))
    return out


def _cpu_stat():
    """The machine's (steal, total) CPU jiffies so far (/proc/stat; zeros where it is not):
    a virtual machine's host running something else on our cores shows as steal."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _alternating(call, outs):
    """``call`` with its output taking each of ``outs`` in turn."""
    state = [0]

    def fn():
        state[0] ^= 1
        return call(outs[state[0]])
    return fn


def profile(cases, calls, path, mpi):
    """Rank 0 (``--profile``): ``calls`` calls of each op of ours with fresh outputs under
    cProfile, each op's top functions by own time into ``path``."""
    import cProfile
    import io
    import pstats
    if mpi.Get_rank() == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") if mpi.Get_rank() == 0 else io.StringIO() as f:
        for name, call, outs, _ in cases:
            if not name.startswith("mk."):
                continue
            fn = _alternating(call, outs)
            warm_up(fn, mpi)
            prof = cProfile.Profile()
            burst(fn, calls, mpi, prof)
            stats = pstats.Stats(prof, stream=f)
            checked = sum(v[0] for k, v in stats.stats.items() if k[2] == "operand")
            f.write(f"==== {name}: {calls} calls, arrays.operand called {checked} times\n")
            stats.sort_stats("tottime").print_stats(18)


def main():
    args = common.parse_args(ranks="2 shared", extra=[
        (("--calls",), dict(type=int, default=100)),
        (("--profile",), dict(default=None, help="a directory: profile, do not time")),
        (("--rounds",), dict(type=int, default=12, help="bursts of each variant, in turn"))])
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
    topk_w = torch.rand(512, 2, device="cuda", dtype=torch.float32)
    moe_out, moe_layout = moe(x_tok, topk, w_moe)
    rs_out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
    ag_out = torch.empty((ag.members,) + tuple(x.shape), device="cuda", dtype=torch.float32)
    # each op's call with the same arrays every time, and (fresh_out) with its output
    # alternating between two arrays, as a caller's activations come from an allocator: the
    # launch's parameters then change from call to call (kernels.launch: set_graph_launch)
    c2, rs_out2, ag_out2, q_out2 = (torch.empty_like(t) for t in (c, rs_out, ag_out, q_out))
    moe_out2 = torch.empty_like(moe_out)
    cases = [
        ("torch.matmul", lambda o: torch.matmul(a, w.T, out=o), (c, c2), True),
        ("nccl", lambda o: dist.all_reduce(x), None, False),
        ("mk.Gemm w.T", lambda o: g(a, w.T, out=o), (c, c2), True),
        ("mk.Gemm b [k,n]", lambda o: g(a, b_kn, out=o), (c, c2), True),
        ("mk.GemmReduceScatter", lambda o: rs(a, w.T, out=o), (rs_out, rs_out2), False),
        ("mk.GemmAllReduce", lambda o: ar(a, w.T, out=o), (c, c2), False),
        ("mk.AllGather", lambda o: ag(x, out=o), (ag_out, ag_out2), False),
        ("mk.AllGatherGemm", lambda o: agg(a_shard, w.T, out=o), (c, c2), False),
        ("mk.RingAttention", lambda o: ring(q, kk, v, out=o, lse=lse), (q_out, q_out2), False),
        ("mk.MoeDispatchGemm", lambda o: moe(x_tok, topk, w_moe, out=o, layout=moe_layout),
         (moe_out, moe_out2), False),
        ("mk.MoeDispatchGemm topk_weights",
         lambda o: moe(x_tok, topk, w_moe, topk_w, out=o, layout=moe_layout),
         (moe_out, moe_out2), False),
        # the first op of ours timed read up to 2x slower than b [k, n] with fresh outputs
        # (benchmarks/NOTES.md): timed again last, whether that follows the op or its place
        ("mk.Gemm w.T, again last", lambda o: g(a, w.T, out=o), (c, c2), False),
    ]
    if args.profile:
        profile(cases, args.calls, os.path.join(args.profile, "host_profile.txt"), mpi)
        cases = []
    stat0 = _cpu_stat()
    default = graph_launch()
    modes = [default] + [m for m in ("always", "stable") if m != default]
    variants = []                  # (name, in_graph, fresh_out, mode, fn)
    for name, call, outs, graph in cases:
        same = (lambda call=call, o=outs and outs[0]: call(o))
        variants.append((name, False, False, default, same))
        if graph:
            set_graph_launch(default)
            variants.append((name, True, False, default, captured(same)))
        ours = name.startswith("mk.")
        variants += [(name, False, True, m, _alternating(call, outs))
                     for m in (modes if ours else modes[:1]) if outs]
    timed = interleaved_us([(v[4], v[3]) for v in variants], args.rounds, args.calls, mpi)
    set_graph_launch(default)
    records = [common.record(
        "host_cost", {"m": M, "n": N, "k": K}, dtype="bfloat16", world=W, topology=topo,
        transport=None, ours_ms=None, baseline=None, baseline_ms=None, floor_ms=None, op=name,
        host_us=us, host_cpu_us=cpu_us, host_us_median=median_us, graph=in_graph,
        fresh_out=fresh, graph_launch=mode)
        for (name, in_graph, fresh, mode, _), (us, cpu_us, median_us) in zip(variants, timed)]
    for op in (rs, ar, ag, agg, ring, moe):
        op.synchronize()
        op.free()
    if comm.rank == 0 and records:
        common.write(records, args.out)
        for r in records:
            print(f"host_cost {r['op']:<32} graph={int(r['graph'])} fresh_out="
                  f"{int(r['fresh_out'])} {r['graph_launch']:<6} {r['host_us']:7.2f} us "
                  f"(CPU {r['host_cpu_us']:6.2f}, median {r['host_us_median']:6.2f})")
        steal = [b - a for a, b in zip(stat0, _cpu_stat())]
        print(f"steal: {100 * steal[0] / max(steal[1], 1):.1f}% of the machine's CPU time "
              "while timing (/proc/stat)")
    dist.destroy_process_group()
    comm.finalize()


if __name__ == "__main__":
    main()
