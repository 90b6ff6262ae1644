"""Where a fused op's host time goes (diagnostic; two ranks, one GPU shared is enough).

    mpirun -n 2 python benchmarks/probe_fused_call_cost.py

Times each step of the tensor hot path of ``mk.GemmReduceScatter.__call__`` (the operand checks,
the error word, the stream lookup, the launch lookup, the binds, the tensor-map lookup, the
raw driver launch) beside the whole call, then profiles 2000 whole calls of each fused op with
cProfile (the functions by own time). Rank 0 prints; ``bench_host_cost.py`` records the calls.
"""
import cProfile
import io
import os
import pstats
import time

os.environ.setdefault("MKNUMBA_ALLOW_SHARED_GPU", "1")   # host timing only

import torch  # noqa: E402

import mknumba as mk  # noqa: E402
from mknumba.arrays import torch_ptr  # noqa: E402
from mknumba.errors import ERR_SET  # noqa: E402
from mknumba.kernels.streams import stream_handle  # noqa: E402

M, N, K = 2048, 2048, 512


def main():
    comm = mk.init()
    torch.cuda.set_device(comm.device_id)
    W, dev = comm.size, comm.device_id
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    rs_out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
    rs = mk.GemmReduceScatter(comm, M, N, K)
    ar = mk.GemmAllReduce(comm, M, N, K)
    agg = mk.AllGatherGemm(comm, M, N, K)
    a_shard = a[:M // W]
    wt = w.T
    for _ in range(3):
        rs(a, wt, out=rs_out)
        ar(a, wt, out=c)
        agg(a_shard, wt, out=c)
    torch.cuda.synchronize()
    comm.mpi.Barrier()

    def t(name, fn, n=2000, gate=True):
        """Best of five bursts of n calls; a burst that launches queues behind a kernel that
        holds the stream (``gate``), so that the GPU runs none of it meanwhile."""
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        comm.mpi.Barrier()
        best = None
        for _ in range(5):
            if gate:
                torch.cuda._sleep(60_000_000)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            us = (time.perf_counter() - t0) / n * 1e6
            best = us if best is None else min(best, us)
            torch.cuda.synchronize()
            comm.mpi.Barrier()
        if comm.rank == 0:
            print(f"{name:<32} {best:7.2f} us", flush=True)

    L = rs.launches(False, stream_handle(None, dev))
    s = stream_handle(None, dev)
    pa, pb, pc = a.data_ptr(), wt.data_ptr(), rs_out.data_ptr()
    t("empty lambda", lambda: None)
    t("torch_ptr(a)", lambda: torch_ptr(a, (M, K), dev))
    t("torch_ptr(w.T) strided", lambda: torch_ptr(wt, (K, N), dev, (1, K)))
    t("torch_ptr(out)", lambda: torch_ptr(rs_out, (M // W, N), dev))
    t("err[ERR_SET]", lambda: rs.err[ERR_SET])
    t("stream_handle", lambda: stream_handle(None, dev))
    t("launches(kn, s)", lambda: rs.launches(False, s))
    t("streams.enter", lambda: rs.streams.enter(s))
    t("bind x1", lambda: L.bind("a", pa))
    t("tmaps lookup", lambda: rs.tmaps(pa, pb, s, False))
    t("raw launch", lambda: L(s), 100)
    go, tm, cfg = L.binder("a", "b", "tmaps", "out", "out_c", "cfg"), rs.tmaps(pa, pb, s), \
        rs._cfg_ptr[False]
    t("binder: 6 binds + launch", lambda: go(s, pa, pb, tm, pc, pc, cfg), 100)
    t("_run", lambda: rs._run(pa, pb, "view", pc, pc, False, s), 100)
    t("full rs(a, w.T, out=)", lambda: rs(a, wt, out=rs_out), 100)
    t("full rs, not gated", lambda: rs(a, wt, out=rs_out), 100, gate=False)
    t("full ar(a, w.T, out=)", lambda: ar(a, wt, out=c), 100)
    t("full ar, not gated", lambda: ar(a, wt, out=c), 100, gate=False)
    t("full agg(a_shard, w.T, out=)", lambda: agg(a_shard, wt, out=c), 100)
    t("torch.matmul", lambda: torch.matmul(a, wt, out=c), 100)

    for name, fn in (("GemmReduceScatter", lambda: rs(a, wt, out=rs_out)),
                     ("AllGatherGemm", lambda: agg(a_shard, wt, out=c))):
        prof = cProfile.Profile()
        comm.mpi.Barrier()
        prof.enable()
        for _ in range(20):
            torch.cuda._sleep(60_000_000)
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
        prof.disable()
        torch.cuda.synchronize()
        comm.mpi.Barrier()
        if comm.rank == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
            print(f"---- cProfile, 2000 calls (gated bursts of 100) of {name}\n"
                  + buf.getvalue(), flush=True)
    for op in (rs, ar, agg):
        op.synchronize()
        op.free()
    comm.finalize()


if __name__ == "__main__":
    main()
