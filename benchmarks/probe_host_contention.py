"""Host time of a launch with and without another process launching on the same GPU.

    python benchmarks/probe_host_contention.py TAG                      # alone
    python benchmarks/probe_host_contention.py A & python benchmarks/probe_host_contention.py B
    taskset -c 2 python benchmarks/probe_host_contention.py c2 & taskset -c 9 ... c9

torch.matmul, mk.Gemm and torch.add at 2048 x 2048 x 512 (bf16), each as the best of ten bursts
of 100 calls queued behind a ~30 ms kernel (``bench_host_cost.burst``): wall and the
calling thread's CPU time per call, printed with TAG. Ranks sharing one GPU (the two-rank runs
of ``bench_host_cost.py`` on a one-GPU machine) are two such processes.
"""
import sys

import torch

import mknumba as mk
from bench_host_cost import burst

M, N, K = 2048, 2048, 512
CALLS = 100


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "alone"
    torch.cuda.set_device(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    g = mk.Gemm()
    for name, fn in (("torch.matmul", lambda: torch.matmul(a, w.T, out=c)),
                     ("mk.Gemm w.T", lambda: g(a, w.T, out=c)),
                     ("torch.add", lambda: torch.add(a, a, out=a))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        bursts = [burst(fn, CALLS) for _ in range(10)]      # (wall, CPU) seconds
        print(f"{tag} {name:<14} wall {min(b[0] for b in bursts) / CALLS * 1e6:6.2f} "
              f"cpu {min(b[1] for b in bursts) / CALLS * 1e6:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
