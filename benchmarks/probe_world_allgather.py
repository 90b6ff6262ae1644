"""AllGather across emulated nodes (scope="world", the dma proxy), calls back to back, with or
without a host sync after each; per rank: the error if any, wrong results, the proxy's stats
(``max_issue_ns`` near the timeout means one of its driver calls was held up).

    MKNUMBA_GPUS_PER_NODE=1 MKNUMBA_ALLOW_SHARED_GPU=1 MKNUMBA_TIMEOUT_S=10 \
        mpirun --bind-to none -n 2 python benchmarks/probe_world_allgather.py async|sync CALLS [out]

``out``: every other call also gets a poisoned ``out=`` made by ``cuda.to_device`` (a blocking
host copy while the previous call is in flight: the pattern that still stalls, NOTES.md).
"""
import sys
import time

import numpy as np
from numba import cuda

import mknumba as mk

comm = mk.init()
mode, calls = sys.argv[1], int(sys.argv[2])
poison = len(sys.argv) > 3 and sys.argv[3] == "out"
rng = np.random.default_rng(comm.rank)
for shape, dtype in [((1 << 20,), np.float32), ((3, 100003), np.float64)]:
    op = mk.AllGather(comm, shape, dtype, scope="world")
    sent, outs, err, t0 = [], [], None, time.time()
    try:
        for it in range(calls):
            x = (rng.standard_normal(shape) * 1000).astype(dtype)
            sent.append(x)
            out = (cuda.to_device(np.full((comm.size,) + shape, np.nan, dtype))
                   if poison and it % 2 else None)
            outs.append(op(cuda.to_device(x), out=out))
            if mode == "sync":
                op.synchronize()
        op.synchronize()
    except mk.MkError as e:
        err = f"{type(e).__name__}: {e}"
    bad = 0
    if err is None:
        for x, out in zip(sent, outs):
            bad += int(not np.array_equal(out.copy_to_host(), np.stack(comm.mpi.allgather(x))))
    print(f"rank {comm.rank} {mode} {shape} {np.dtype(dtype).name}: err={err} wrong={bad} "
          f"t={time.time() - t0:.1f}s proxy={comm.proxy.stats}", flush=True)
    if err:
        comm.mpi.Abort(1)
    op.free()
comm.finalize()
