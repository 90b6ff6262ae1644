"""GEMM + AllReduce (paper §3.1, §4): ``out = sum over ranks of A_r @ B_r`` on every rank.

    op = mk.GemmAllReduce(comm, m, n, k_local)
    out = op(a, b)          # a: [m, k_local], b: [k_local, n] (bf16) -> out: [m, n]

Hierarchical: tile row ``tm`` belongs to local GPU ``tm % G``. The owner pulls the node's G
partial tiles over NVLink and sums them; with several nodes it sends that node sum to its rail
peers (1/G of the output per GPU crosses the network, in chunks published by a per-chunk
counter) and adds theirs; then it stores the finished tile into every other local GPU's
symmetric buffer, from which that GPU copies it into its output. Roles and waits:
:mod:`mknumba.kernels.gemm_reduce`.

    op = mk.GemmAllReduce(comm, m, n, k_local, shared_out=True)
    out = op(a, b)          # op.output(torch=True): valid until the next call, which may
                            # not read it (it writes it): feed a copy to the next layer

With ``shared_out`` the op owns a symmetric output and the owner writes each finished tile
straight into every local GPU's copy of it: no copy at the end (1.23x instead of 1.15x over
cuBLAS + NCCL at m = n = 16384, k_local = 4096 on 2xH200, benchmarks/NOTES.md).
"""
from .gemm_reduce import GemmReduce


class GemmAllReduce(GemmReduce):
    """See the module docstring and :class:`~mknumba.kernels.gemm_reduce.GemmReduce`."""
    allreduce = True
    name = "GemmAllReduce"
    kernel_name = "gemm_allreduce"

    def out_shape(self):
        return (self.m, self.n)


__all__ = ["GemmAllReduce"]
