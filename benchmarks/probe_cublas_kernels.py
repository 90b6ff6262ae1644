"""Which kernels cuBLAS runs for torch.matmul at given shapes (diagnostic, one GPU).

    python benchmarks/probe_cublas_kernels.py 512x1024x512,8192x8192x512 $OUT/cublas_kernels.json

For each M x N x K and layout of B ([n, k] read as ``w.T``, and row-major [k, n]) prints and
records the names of the kernels the PyTorch profiler sees in five calls. cuBLAS's Hopper
kernel names carry their tile, pipeline depth and cluster (``nvjet_sm90_tst_<BM>x<BN>_
64x<stages>_<cluster>...``) and whether K is split (``splitK`` plus a reduction kernel).
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def kernels(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for layout, b in (("nk", w.T), ("kn", w.T.contiguous())):
        for _ in range(3):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
        for e in p.key_averages():
            if getattr(e, "device_time", 0) > 0:
                yield dict(m=m, n=n, k=k, layout=layout, name=e.key)


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
    records = []
    for shape in shapes:
        for r in kernels(*shape):
            print(f"{r['m']}x{r['n']}x{r['k']} {r['layout']}  {r['name'][:160]}", flush=True)
            records.append(r)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
