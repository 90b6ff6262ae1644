"""Launching through a one-node CUDA graph (``kernels.launch._OneKernelGraph``) against
``cuLaunchKernel`` (diagnostic, one GPU):

    python benchmarks/probe_graph_launch.py

1. host microseconds per launch of mk.Gemm's kernel (2048 x 2048 x 512; best of 7 bursts of
   200, each burst queued behind a stream-holding kernel): ``cuLaunchKernel``, the graph
   launched as it is, the graph after refreshing its node's parameters;
2. whether refreshing the node's parameters (``cuGraphExecKernelNodeSetParams``), or a second
   launch of the graph, waits on the host for a launch of the graph still queued on the GPU
   (the stream held ~50 ms: a wait shows as ~50 ms of host time);
3. GPU microseconds per call, back to back, both ways, at three shapes.
"""
import ctypes
import time

import torch

import mknumba as mk
from mknumba.kernels.streams import stream_handle

cu = ctypes.CDLL("libcuda.so.1")
vp = ctypes.c_void_p
cu.cuGraphLaunch.argtypes = [vp, vp]
cu.cuGraphExecKernelNodeSetParams.argtypes = [vp, vp, vp]
cu.cuLaunchKernel.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp]
HOLD = 100_000_000          # GPU clock cycles: ~50 ms


def plan_of(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    op = mk.Gemm()
    op(a, w.T, out=c)
    torch.cuda.synchronize()
    return next(iter(op._plans.values())).launch


def fns(L, s):
    g = L._graph
    # the node holds the buffer as it was at plan time: bring it in step once
    assert cu.cuGraphExecKernelNodeSetParams(g.exec, g.node, g.params) == 0
    direct = lambda: cu.cuLaunchKernel(L._fn, L.grid, 1, 1, L.threads, 1, 1, L.smem, s, None,  # noqa: E731
                                       L._extra_addr)
    graph = lambda: cu.cuGraphLaunch(g.exec, s)   # noqa: E731

    def refreshed():
        cu.cuGraphExecKernelNodeSetParams(g.exec, g.node, g.params)
        cu.cuGraphLaunch(g.exec, s)
    return direct, graph, refreshed


def host_us(fn, n=200):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(7):
        torch.cuda._sleep(60_000_000)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def gpu_us(fn, iters=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(60_000_000)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / iters * 1e3)
    return sorted(ts)[2]


def main():
    s = stream_handle(None, 0)
    L = plan_of(2048, 2048, 512)
    assert L._graph.exec, "the driver refused the one-node graph"
    direct, graph, refreshed = fns(L, s)
    for name, fn in (("cuLaunchKernel", direct), ("graph", graph),
                     ("SetParams + graph", refreshed), ("Launch (binder)", lambda: L(s))):
        print(f"host  {name:<22} {host_us(fn):7.2f} us", flush=True)
    for name, fn in (("SetParams", lambda: cu.cuGraphExecKernelNodeSetParams(
            L._graph.exec, L._graph.node, L._graph.params)), ("graph launch", graph)):
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD)
        graph()                          # queued behind the hold
        t0 = time.perf_counter()
        fn()
        print(f"while a launch is queued: {name} took {(time.perf_counter() - t0) * 1e3:.3f} ms "
              "of host time", flush=True)
        torch.cuda.synchronize()
    for shape in ((512, 1024, 512), (2048, 1024, 512), (4096, 4096, 1024)):
        L = plan_of(*shape)
        direct, graph, refreshed = fns(L, s)
        print("gpu   {}x{}x{}: ".format(*shape) + "  ".join(
            f"{name} {gpu_us(fn):.2f} us" for name, fn in
            (("cuLaunchKernel", direct), ("graph", graph), ("SetParams + graph", refreshed))),
            flush=True)


if __name__ == "__main__":
    main()
