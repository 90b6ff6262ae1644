"""02 - Roles by block index, and a work queue.

What you will learn
  * One persistent kernel, several jobs: each block reads ``cuda.blockIdx.x`` and takes a
    role. Here blocks [0, P) produce items and blocks [P, P+C) consume them. Producers come
    first: a block may wait only on lower-numbered blocks (or on other GPUs), because blocks
    are not guaranteed to run at once (the simulator runs them one after another).
  * Flags between blocks of one GPU: ``publish(..., system=False)`` / ``wait(..., False)``,
    cheaper than the system scope that peer GPUs need.
  * A work queue: ``roles.blocks.take`` hands out items 0, 1, 2, ... to whichever consumer
    asks first, so no consumer idles while another has work. Its ticket counter only grows,
    like the flags of lesson 01: call ``c`` knows where its tickets start, nothing is reset.
  * The launch frame (``kernels.launch``): parameters declared once by annotations
    (``array_type``), compiled once (``compile_kernel``), arguments converted once
    (``Launch``); a call binds one address (``bind``) and launches. The call counter lives on
    the GPU (``Frame``, ``kernels.lifetime``): every block calls ``begin(frame)`` first and
    gets this call's epoch.

What the code does
  Producers compute ``items = 2 * src`` item by item and publish one flag per item; consumers
  take items from the queue, wait for each item's flag, write ``out = items + 1`` and count
  the item in ``hits``. Three calls back to back; every item must be done exactly once a call.

Run it:  mpiexec -n 2 python examples/tutorial/02_roles_and_queues.py   (each rank on its own)
"""
import numpy as np

import mknumba as mk
from mknumba import primitives as prim
from mknumba.errors import ROLE_COMPUTE
from mknumba.kernels.launch import Launch, Slot, array_type, compile_kernel, param
from mknumba.kernels.lifetime import Frame
from mknumba.roles.blocks import begin, publish, take, wait
from numba import cuda, types

ITEMS, WIDTH, PRODUCERS, CONSUMERS, THREADS, CALLS = 12, 32, 2, 3, 32, 3
Vals, Counts = array_type(np.float32, 1), array_type(np.int32, 1)
Flags, Words64, Record = array_type(np.uint32, 1), array_type(np.uint64, 1), array_type(np.int64, 1)


@cuda.jit
def pipeline(src: Vals, items: Vals, out: Vals, hits: Counts, ready: Flags, queue: Flags,
             frame: Words64, producers: types.int64, timeout_ns: types.uint64, err: Record,
             rank: types.int64):
    epoch, call = begin(frame)                    # every block, first: this call's epoch
    deadline = prim.globaltimer() + timeout_ns
    n = ready.size
    t = cuda.threadIdx.x
    if cuda.blockIdx.x < producers:               # ---- producer role: items b, b + P, ...
        i = cuda.blockIdx.x
        while i < n:
            for e in range(i * WIDTH + t, (i + 1) * WIDTH, THREADS):
                items[e] = 2 * src[e]
            publish(ready, i, epoch, False)       # only blocks of this GPU read it
            i += producers
    else:                                         # ---- consumer role: whatever comes next
        consumers = cuda.gridDim.x - producers
        while True:
            i = take(queue, 0, call, n, consumers)
            if i >= n:
                return                            # the call's items are all taken
            if not wait(ready, i, epoch, deadline, err, rank, ROLE_COMPUTE, False):
                return
            for e in range(i * WIDTH + t, (i + 1) * WIDTH, THREADS):
                out[e] = items[e] + 1
            if t == 0:
                cuda.atomic.add(hits, i, 1)


def main():
    with mk.init() as comm:
        grid = PRODUCERS + CONSUMERS
        frame = Frame(grid)                       # the call counter, on the GPU
        err = comm.new_error_record()
        hits = cuda.to_device(np.zeros(ITEMS, np.int32))
        out = cuda.device_array(ITEMS * WIDTH, np.float32)
        compiled, _ = compile_kernel(pipeline, THREADS, 0)
        launch = Launch(pipeline, compiled, dict(
            src=Slot((ITEMS * WIDTH,)), items=cuda.device_array(ITEMS * WIDTH, np.float32),
            out=out, hits=hits, ready=cuda.to_device(np.zeros(ITEMS, np.uint32)),
            queue=cuda.to_device(np.zeros(1, np.uint32)), frame=frame.words,
            producers=PRODUCERS, timeout_ns=comm.timeout_ns, err=err, rank=comm.rank),
            grid, THREADS, 0)
        rng = np.random.default_rng(comm.rank)
        srcs = [cuda.to_device(rng.standard_normal(ITEMS * WIDTH).astype(np.float32))
                for _ in range(CALLS)]
        for src in srcs:                          # back to back: bind one address, launch
            launch.bind("src", param(src))
            launch()
        comm.synchronize()
        comm.check(err, "pipeline")
        want = 2 * srcs[-1].copy_to_host() + 1
        ok = np.array_equal(out.copy_to_host(), want) and np.all(hits.copy_to_host() == CALLS)
        if comm.mpi.allreduce(int(not ok)):       # every rank checked its own kernel
            raise SystemExit(f"rank {comm.rank}: {'items lost or done twice' if not ok else ''}")
        if comm.rank == 0:
            print(f"02 roles and queues: {CALLS} calls of {ITEMS} items on each rank, each done "
                  f"once a call by {CONSUMERS} consumers, epoch {frame.read()[1]}: OK")


if __name__ == "__main__":
    main()
