"""Where one call's host time goes (diagnostic, not part of run_gpu.sh; one process, one GPU).

    python benchmarks/probe_call_cost.py

Times, per call in microseconds, each step of an ``mk.Gemm`` call with PyTorch tensors (the
operand checks, the stream lookup, a bind, the tensor-map lookup, the raw driver launch) beside
the whole call and ``torch.matmul``, so a change to the launch path can be checked piece by
piece. ``benchmarks/bench_host_cost.py`` records the whole calls of every op.
"""
import time

import torch
import mknumba as mk
from mknumba.arrays import operand
from mknumba.kernels.streams import stream_handle
from mknumba.kernels.gemm import op as G
M, N, K = 2048, 2048, 512
a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
op = mk.Gemm()
op(a, w.T, out=c); torch.cuda.synchronize()
plan = next(iter(op._plans.values()))
L = plan.launch
s = stream_handle(None, 0)
A = operand(a, "x", "a", ndim=2)
def t(name, fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:<28} {dt:7.2f} us", flush=True)
t("empty lambda", lambda: None)
t("operand(torch a)", lambda: operand(a, "x", "a", ndim=2))
t("operand(w.T col)", lambda: operand(w.T, "x", "b", ndim=2, layouts=("row", "col")))
t("w.T alone", lambda: w.T)
t("stream_handle", lambda: stream_handle(None, 0))
t("current_device", G.current_device)
t("bind a", lambda: L.bind("a", A.ptr))
t("tmaps lookup", lambda: plan.tmaps(A.ptr, A.ptr + 0, s))
t("raw launch", lambda: L(s), 500)
t("streams.enter", lambda: op.streams.enter(s))
t("full op(a, w.T)", lambda: op(a, w.T, out=c), 500)
wt = w.T
t("full op(a, wt)", lambda: op(a, wt, out=c), 500)
t("torch.matmul", lambda: torch.matmul(a, wt, out=c), 500)
from cuda.bindings import driver as drv
t("cuCtxGetDevice", drv.cuCtxGetDevice)
t("torch get_device", lambda: a.get_device())
t("data_ptr", lambda: a.data_ptr())
t("tuple(shape)", lambda: tuple(a.shape))
t("stride()", lambda: a.stride())
t("is_contiguous", lambda: a.is_contiguous())
from cuda.bindings import driver as drv
fn = drv.CUfunction(L._fn); cs = drv.CUstream(s)
t("bindings launch", lambda: drv.cuLaunchKernel(fn, L.grid, 1, 1, L.threads, 1, 1, L.smem, cs, None, L._extra_addr), 500)
t("operand(out c)", lambda: operand(c, "x", "out", shape=(M, N), device_id=0))
