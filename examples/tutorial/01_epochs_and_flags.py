"""01 - Epochs and flags: one GPU hands data to another, call after call, with no reset.

What you will learn
  * Symmetric memory: ``comm.alloc_symmetric`` / ``comm.alloc_flags`` give every rank of the
    node the same (zeroed) buffer; a kernel reaches a peer's copy with ``primitives.peer_view``.
  * Data, then flag: ``roles.blocks.publish`` makes the block's stores visible, then
    release-stores the flag; the reader's ``roles.blocks.wait`` polls it with acquire loads,
    bounded by a deadline (a timeout fills an error record that ``comm.check`` raises).
  * Epochs, not resets: call ``c`` publishes ``epoch_of_host(c)`` (1, 2, ...; after 2**32 - 1
    it wraps to 1, never 0, which fresh flags hold) and a reader waits for "flag reached this
    call's epoch". A flag is never cleared. Clearing would need its own synchronisation (the
    reader that zeroes a flag can erase the next call's store; a writer that zeroes it first
    can erase what the reader has not seen yet) and a memset per call; with epochs the old
    values are simply "earlier", and back-to-back calls need nothing in between.

What the code does
  Rank 0's kernel stores this call's payload into rank 1's buffer and publishes
  ``ready = epoch`` in rank 1's flags. Rank 1's kernel waits for ``ready``, copies the payload
  out, and publishes ``done = epoch`` back in rank 0's flags: rank 0 waits for ``done`` of the
  previous call before it overwrites the buffer (a credit). Four calls run back to back without
  a host synchronisation; then rank 1 checks every payload it received.

Run it:  mpiexec -n 2 python examples/tutorial/01_epochs_and_flags.py
"""
import numpy as np

import mknumba as mk                              # before numba.cuda: it picks the simulator
from mknumba import primitives as prim
from mknumba.errors import ROLE_RECV, ROLE_SEND
from mknumba.roles.blocks import copy_tile, publish, wait
from numba import cuda

N, CALLS, THREADS = 64, 4, 32
READY, DONE = 0, 1                                # our two flags: rank 1 reads READY, rank 0 DONE


@cuda.jit
def handoff(x, box, box_ptrs, flags, flag_ptrs, me, epoch, prev, timeout_ns, err, rank, out):
    """x: this call's payload (rank 0); box: the symmetric buffer; out: where rank 1 puts it."""
    deadline = prim.globaltimer() + timeout_ns
    if me == 0:                                   # ---- writer
        # the credit: rank 1 has read the previous payload (call 1 waits for epoch 0: no wait)
        if not wait(flags, DONE, prev, deadline, err, rank, ROLE_SEND):
            return
        copy_tile(x, 0, prim.peer_view(box_ptrs, 1, box), 0, x.size)      # NVLink stores
        publish(prim.peer_view(flag_ptrs, 1, flags), READY, epoch)       # then the flag
    else:                                         # ---- reader
        if not wait(flags, READY, epoch, deadline, err, rank, ROLE_RECV):
            return
        copy_tile(box, 0, out, 0, box.size)
        publish(prim.peer_view(flag_ptrs, 0, flags), DONE, epoch)        # "you may overwrite"


def main():
    with mk.init() as comm:
        if comm.local_size != 2:
            raise SystemExit("run on 2 ranks of one node: mpiexec -n 2 python ...")
        me = comm.local_rank
        box = comm.alloc_symmetric((N,), np.int64)          # collective: both ranks allocate
        flags = comm.alloc_flags(2)
        err = comm.new_error_record()
        sent = 1000 * np.arange(1, CALLS + 1)[:, None] + np.arange(N)   # call c sends row c-1
        xs = cuda.to_device(sent)
        got = cuda.to_device(np.zeros_like(sent))
        for call in range(1, CALLS + 1):          # back to back: no reset, no host sync
            epoch, prev = prim.epoch_of_host(call), prim.epoch_of_host(call - 1)
            handoff[1, THREADS](xs[call - 1], box.local, box.ptrs, flags.local, flags.ptrs,
                                me, epoch, prev, comm.timeout_ns, err, comm.rank, got[call - 1])
        comm.synchronize()
        comm.check(err, "handoff")                # raises MkTimeoutError if a wait expired
        if me == 1:
            if not np.array_equal(got.copy_to_host(), sent):
                raise SystemExit("rank 1 received wrong payloads")
            final = int(flags.local.copy_to_host()[READY])
            print(f"01 epochs and flags: {CALLS} calls handed over, ready flag at epoch "
                  f"{final} (never reset): OK")


if __name__ == "__main__":
    main()
