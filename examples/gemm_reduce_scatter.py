"""A row-parallel linear layer: GEMM + ReduceScatter and GEMM + AllReduce, each one kernel.

    mpiexec -n 2 python examples/gemm_reduce_scatter.py        # 2 GPUs of a node, or the simulator
    MKNUMBA_GPUS_PER_NODE=1 mpiexec -n 2 python examples/gemm_reduce_scatter.py   # 2 emulated nodes

The setting. In a tensor-parallel MLP the second weight matrix is split along K over the ranks:
rank r holds activations ``A_r [m, k_local]`` and weights ``B_r [k_local, n]``, and the layer's
output is ``Y = sum over r of A_r @ B_r``. Unfused, each rank runs a GEMM for its partial product,
then a collective sums the partials: reduce_scatter when the next layer is sequence-parallel
(rank r keeps rows ``[r m / W, (r + 1) m / W)``), all_reduce when every rank needs all of Y. The
collective starts only when the whole GEMM is done, and the GEMM's SMs wait while it runs.

The fused ops run one persistent kernel whose blocks take roles
(``mknumba/kernels/gemm_reduce/kernel.py`` reads like this list):

  compute   the GEMM, tile by tile, in an order that finishes what others need first; after each
            tile, publish its flag (the call's epoch)
  reduce    for each tile this GPU owns: wait for that tile's flag on every GPU of the node, then
            sum the partial tiles over NVLink
  send      (several nodes) reduced tiles fill network chunks; the last tile of a chunk publishes
            it, and the chunk goes to the host proxy's command ring for the rail peer
  receive   (several nodes) wait for a chunk's arrival flag, add the remote partial sums
  pull      (AllReduce, several GPUs a node) copy out the finished tiles that the other GPUs own
            and pushed here (with ``shared_out=True`` the owners write them straight into this
            GPU's output, and pull only waits for them)

so the reduction of the first tiles overlaps the GEMM of the last ones.

Knobs worth trying: ``comm_sms`` (SMs held back from the GEMM for the other roles) and
``deliver`` (on one node, the GEMM writes each tile straight into its owner's memory; both
default to the sweep recorded in ``mknumba/sched/split.py``), ``shared_out`` (AllReduce into
an output the op owns, see ``op.output()``: valid until the next call), ``chunk_bytes``
(network chunk size) and ``trace=True``, which stamps every role's steps with the GPU clock
(``op.trace_events()``; ``benchmarks/trace_fused.py`` prints them as a timeline).

Without a GPU this runs in numba's CUDA simulator at a small size. Either way it checks both ops
against a float64 NumPy reference of the same bf16 inputs, and exits non-zero if they differ.
"""
import numpy as np

import mknumba as mk          # before numba.cuda: without a GPU it picks the simulator
from mknumba._compat import SIMULATOR
from numba import cuda


def to_bf16(x):
    """float -> bf16 bits (uint16), rounding to nearest even: what the kernels take."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def main():
    with mk.init() as comm:
        W = comm.size
        m, n, k = (32 * W, 64, 32) if SIMULATOR else (4096, 4096, 1024)   # k = k_local
        rng = np.random.default_rng(comm.rank)
        for Op in (mk.GemmReduceScatter, mk.GemmAllReduce):
            op = Op(comm, m, n, k)           # plans buffers, flags, SM split and chunks once
            sent, on_gpu, outs = [], [], []
            for call in range(2):            # back to back, no host synchronisation
                a = to_bf16(rng.standard_normal((m, k)))
                b = to_bf16(rng.standard_normal((k, n)) / np.sqrt(k))
                sent.append((a, b))
                on_gpu.append((cuda.to_device(a), cuda.to_device(b)))  # alive until the sync
                outs.append(op(*on_gpu[-1]))                           # bf16 bits in and out
            op.synchronize()                 # waits; raises MkTimeoutError if a wait expired
            rows = op.out_shape()[0]
            for call, ((a, b), out) in enumerate(zip(sent, outs)):
                parts = comm.mpi.allgather((a, b))          # every rank's inputs, for the check
                want = sum(from_bf16(x) @ from_bf16(y) for x, y in parts)
                if rows < m:                                # ReduceScatter: my row block
                    want = want[comm.rank * rows:(comm.rank + 1) * rows]
                got = from_bf16(out.copy_to_host())
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
                if not err <= 1e-2:
                    raise SystemExit(f"rank {comm.rank}: {op.name} call {call}: relative error "
                                     f"{err:.3g}")
            if comm.rank == 0:
                where = "numba CUDA simulator" if SIMULATOR else "GPUs"
                print(f"{op.name}: [{m}, {k}] @ [{k}, {n}] summed over {W} ranks "
                      f"({comm.nodes} node(s) x {comm.local_size}, {where}) -> out {rows} x {n}"
                      f" per rank: 2 calls match NumPy")
            op.free()


if __name__ == "__main__":
    main()
