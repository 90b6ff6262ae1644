"""Host time of a launch with and without another process launching on the same GPU.

    python benchmarks/probe_host_contention.py TAG                      # alone
    python benchmarks/probe_host_contention.py A & python benchmarks/probe_host_contention.py B
    taskset -c 2 python benchmarks/probe_host_contention.py c2 & taskset -c 9 ... c9

torch.matmul, mk.Gemm and torch.add at 2048 x 2048 x 512 (bf16), each as the best of ten bursts
of 100 calls queued behind a ~30 ms kernel (as ``bench_host_cost.py`` times): wall and the
calling thread's CPU time per call, printed with TAG. Ranks sharing one GPU (the two-rank runs
of ``bench_host_cost.py`` on a one-GPU machine) are two such processes.
"""
import sys
import time

import torch

import mknumba as mk

M, N, K = 2048, 2048, 512


def burst(fn, calls=100):
    """(wall, CPU) microseconds per call of ``calls`` calls queued behind a sleeping kernel."""
    torch.cuda._sleep(60_000_000)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    per_call = ((time.perf_counter() - t0) / calls * 1e6, (time.thread_time() - c0) / calls * 1e6)
    torch.cuda.synchronize()
    return per_call


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
        bursts = [burst(fn) for _ in range(10)]
        print(f"{tag} {name:<14} wall {min(b[0] for b in bursts):6.2f} "
              f"cpu {min(b[1] for b in bursts):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
