"""mk.Gemm beside torch.matmul at a few shapes, one process (diagnostic; bench_gemm.py records).

    python benchmarks/probe_gemm_shapes.py [m,n,k ...]

Prints ms per call (mean of back-to-back calls after a warm-up) and the ratio torch / ours.
"""
import sys

import torch

import mknumba as mk

shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[1:]] or [
    (2048, 2048, 512), (6144, 5120, 1536), (8192, 8192, 8192)]
op = mk.Gemm()
for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ w.float().T
    op(a, w.T, out=c)
    torch.cuda.synchronize()
    err = ((c.float() - ref).norm() / ref.norm()).item()
    times = {}
    for name, fn in (("ours", lambda: op(a, w.T, out=c)),
                     ("torch", lambda: torch.matmul(a, w.T, out=c))):
        for _ in range(5):
            fn()
        iters = max(10, int(2e10 / (2 * m * n * k)))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / iters
    tf = 2 * m * n * k / times["ours"] / 1e9
    print(f"gemm {m}x{n}x{k}: ours {times['ours']:.4f} ms ({tf:.0f} TF/s), torch.matmul "
          f"{times['torch']:.4f} ms, torch/ours {times['torch'] / times['ours']:.3f}, "
          f"err {err:.1e}", flush=True)
