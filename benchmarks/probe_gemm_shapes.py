"""mk.Gemm, with B in both layouts, beside torch.matmul at a few shapes, one process
(diagnostic; bench_gemm.py records).

    python benchmarks/probe_gemm_shapes.py [m,n,k ...]

B [n, k] (the weight w, passed as ``w.T``: the tile's K-major B) and B [k, n] row-major (``wt =
w.T.contiguous()``, read as it is by the tile's ":kn" build: TMA boxes of 64 N-columns, a
transposed wgmma B). Prints ms per call (mean of back-to-back calls after a warm-up), the ratio
torch / ours for each layout (torch.matmul on the same operands), and each layout's error
against an fp32 reference.
"""
import sys

import torch

import mknumba as mk

shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[1:]] or [
    (2048, 2048, 512), (6144, 5120, 1536), (8192, 8192, 8192)]
op = mk.Gemm()


def time_ms(fn, m, n, k):
    for _ in range(5):
        fn()
    iters = max(10, int(2e10 / (2 * m * n * k)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


for m, n, k in shapes:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wt = w.T.contiguous()                                   # [k, n] row-major
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ w.float().T
    line = [f"gemm {m}x{n}x{k}:"]
    for layout, b in (("b[n,k]", w.T), ("b[k,n]", wt)):
        c.fill_(float("nan"))
        op(a, b, out=c)
        torch.cuda.synchronize()
        err = ((c.float() - ref).norm() / ref.norm()).item()
        ours = time_ms(lambda: op(a, b, out=c), m, n, k)
        theirs = time_ms(lambda: torch.matmul(a, b, out=c), m, n, k)
        line.append(f"{layout} ours {ours:.4f} ms ({2 * m * n * k / ours / 1e9:.0f} TF/s), "
                    f"torch.matmul {theirs:.4f} ms, torch/ours {theirs / ours:.3f}, "
                    f"err {err:.1e};")
    print(" ".join(line), flush=True)
