"""GEMM + ReduceScatter (paper §4, Table 3): ``out = (sum over ranks of A_r @ B_r)[my row block]``.

    op = mk.GemmReduceScatter(comm, m, n, k_local)   # plans buffers, flags, SM split, chunks
    out = op(a, b)          # a: [m, k_local], b: [k_local, n] (bf16) -> out: [m / world, n]

World rank ``r`` receives rows ``[r * m/world, (r + 1) * m/world)``. Inside a node the owner of
a row block pulls the local GPUs' partial tiles over NVLink and sums them; across nodes each GPU
sends the node's partial sums of its rail peers' row blocks (1/G of the output per GPU, in
chunks of several tiles as soon as they are reduced) and adds the sums it receives. The schedule
and roles are in :mod:`mknumba.kernels.gemm_reduce`.
"""
from .gemm_reduce import GemmReduce


class GemmReduceScatter(GemmReduce):
    """See the module docstring and :class:`~mknumba.kernels.gemm_reduce.GemmReduce`.

    m must split into ``world`` row blocks of whole tiles (m % (world * 128) == 0 on Hopper).
    """
    allreduce = False
    name = "GemmReduceScatter"
    kernel_name = "gemm_reducescatter"


__all__ = ["GemmReduceScatter"]
