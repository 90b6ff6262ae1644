"""mk.Gemm's tile orders (group_m 1, 2, 4, 16) beside cuBLAS at four few-tile shapes, each
timed two ways: a CUDA graph of 20 calls replayed (launches back to back, as the standalone
probes time) and 20 plain calls between two events (the host's launch rate can show).

    source benchmarks/gpu_env.sh; python3 benchmarks/probe_graph_order.py

Prints one line per shape: us a call, graph / plain calls, the median of 9 rounds. Asks
whether the row order's gain in ``cuda/gemm_multicast64.cu`` (graph timing) shows in the
library's tiles (benchmarks/NOTES.md, twenty-ninth session).
"""
import torch

from mknumba.kernels.gemm import Gemm

torch.manual_seed(0)
for (m, n, k) in [(512, 1024, 8192), (512, 1024, 2048), (1024, 1024, 8192), (2048, 1024, 4096)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).T
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fns = {"cublas": lambda: torch.matmul(a, b, out=c)}
    for g in (1, 2, 4, 16):
        op = Gemm(group_m=g)
        op(a, b, out=c); torch.cuda.synchronize()
        fns[f"g{g}"] = (lambda op=op: op(a, b, out=c))
    graphs = {}
    s = torch.cuda.Stream()
    for name, fn in fns.items():
        fn(); torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=s):
            for _ in range(20):
                fn()
        graphs[name] = gr
    times = {nm: [] for nm in fns}
    for r in range(9):
        for nm, gr in graphs.items():
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record(); gr.replay(); e1.record(); e1.synchronize()
            times[nm].append(e0.elapsed_time(e1) * 1000 / 20)
        for nm, fn in fns.items():   # plain calls, the benchmark's way
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            for _ in range(20):
                fn()
            e1.record(); e1.synchronize()
            times[nm + "_calls"] = times.get(nm + "_calls", []) + [e0.elapsed_time(e1) * 1000 / 20]
    med = {nm: sorted(v)[len(v) // 2] for nm, v in times.items()}
    print(f"{m}x{n}x{k} us (graph / calls): " + "  ".join(
        f"{nm} {med[nm]:.2f}/{med[nm + '_calls']:.2f}" for nm in fns), flush=True)
