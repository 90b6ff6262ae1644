"""Gather every rank's shard onto every GPU with mknumba's persistent AllGather kernel.

    mpiexec -n 4 python examples/allgather.py              # GPUs, or the simulator without one
    MKNUMBA_GPUS_PER_NODE=2 mpiexec -n 4 python examples/allgather.py   # 2 emulated nodes x 2

Without a GPU it runs in numba's CUDA simulator at a small size. Either way it checks the
result against the shards gathered with MPI and NumPy, and exits non-zero if they differ.
"""
import numpy as np

import mknumba as mk
from mknumba._compat import SIMULATOR


def main():
    with mk.init() as comm:
        n = 1000 if SIMULATOR else 1 << 24
        op = mk.AllGather(comm, (n,), np.float32, scope="node")   # plans buffers and flags once
        rng = np.random.default_rng(comm.rank)
        for call in range(3):                                    # back to back, no host sync
            shard = rng.standard_normal(n).astype(np.float32)
            x = shard if SIMULATOR else mk.arrays.cuda.to_device(shard)
            out = op(x)                                          # [local ranks, n] on this GPU
            op.synchronize()
            got = np.asarray(out) if SIMULATOR else out.copy_to_host()
            want = np.stack(comm.node_comm.allgather(shard))
            if not np.array_equal(got, want):
                raise SystemExit(f"rank {comm.rank}: call {call} gathered wrong data")
        if comm.rank == 0:
            where = "numba CUDA simulator" if SIMULATOR else f"{comm.size} GPUs"
            print(f"AllGather of {n} float32 per rank on {comm.nodes} node(s) x "
                  f"{comm.local_size} ({where}): 3 calls match NumPy")


if __name__ == "__main__":
    main()
