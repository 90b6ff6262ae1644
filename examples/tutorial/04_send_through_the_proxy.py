"""04 - Between nodes: a kernel hands the host proxy a command, the proxy moves the data.

What you will learn
  * No GPU stores reach another node. A send block writes a 48-byte command into a ring in
    mapped host memory (``roles.send.enqueue``): "copy these bytes of window W here to that
    window on rank P, then set flag F there to this epoch". A proxy thread on the host issues
    it (``MKNUMBA_TRANSPORT``: a copy engine between GPUs posing as nodes, RDMA, or ``sim``).
  * Windows: ``comm.proxy.register(buf)`` (collective) names a symmetric buffer, so commands
    can say where; ``comm.proxy.device_args()`` is the ring the kernel writes into.
  * The receiver waits on its flag exactly as in lesson 01: the proxy writes the flag after
    the data has landed. ``comm.rail_peers``: the ranks with my local rank on the other nodes.
  * Reuse without resets: each call writes slot ``call & 1``. A rank cannot finish call e+1
    before its peer has sent e+1, which comes after the peer finished reading call e, so the
    slot it writes in call e+2 is one the peer is done with (as ``kernels/allgather.py``).

What the code does
  Two emulated nodes of one GPU each (``MKNUMBA_GPUS_PER_NODE=1``, set here when unset). Each
  rank's send block copies its payload into its own box, hands the proxy one command that
  moves it into the rail peer's box and sets the peer's flag; its receive block waits for the
  peer's flag and copies what arrived out. Three calls back to back, then the check.

Run it:  mpiexec -n 2 python examples/tutorial/04_send_through_the_proxy.py
"""
import os

import numpy as np

import mknumba as mk
from mknumba import primitives as prim
from mknumba.errors import ROLE_RECV
from mknumba.kernels.launch import Launch, Slot, array_type, compile_kernel, param
from mknumba.kernels.lifetime import Frame
from mknumba.roles.blocks import begin, copy_tile, wait
from mknumba.roles.send import enqueue
from numba import cuda, types

N, CALLS, THREADS = 64, 3, 32
Words, Flags, Record = array_type(np.uint64, 1), array_type(np.uint32, 1), array_type(np.int64, 1)
i64 = types.int64


@cuda.jit
def exchange(x: Words, out: Words, box: Words, flags: Flags, ring: Flags, head: Flags,
             tail: Flags, frame: Words, me: i64, peer: i64, win_box: i64, win_flags: i64,
             timeout_ns: types.uint64, err: Record, rank: i64):
    """box: symmetric [2 slots, 2 nodes, N] words; flags: symmetric [2 nodes]; me: my node."""
    epoch, call = begin(frame)
    deadline = prim.globaltimer() + timeout_ns
    mine = ((call & 1) * 2 + me) * N              # my payload's place, in every rank's box
    if cuda.blockIdx.x == 0:                      # ---- send role
        copy_tile(x, 0, box, mine, N)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            prim.fence_sys()                      # the box, before the proxy reads it
            # bytes [mine*8, +N*8) of my box -> the same bytes of the peer's box; then the
            # peer's flags[me] = epoch. False: no ring credit before the deadline (recorded).
            enqueue(ring, head, tail, peer, win_box, mine * 8, win_box, mine * 8, N * 8, 0,
                    win_flags, me, epoch, deadline, err, rank)
    else:                                         # ---- receive role
        src = 1 - me
        if wait(flags, src, epoch, deadline, err, rank, ROLE_RECV):
            copy_tile(box, ((call & 1) * 2 + src) * N, out, 0, N)


def main():
    os.environ.setdefault("MKNUMBA_GPUS_PER_NODE", "1")   # read by mk.init(): 2 ranks, 2 nodes
    with mk.init() as comm:
        if comm.nodes != 2 or comm.size != 2:
            raise SystemExit("run on 2 ranks: mpiexec -n 2 python ...")
        box = comm.alloc_symmetric((2 * 2 * N,), np.uint64)   # node scope: one GPU here
        flags = comm.alloc_flags(2)
        win_box, win_flags = comm.proxy.register(box), comm.proxy.register(flags)
        ring, head, tail = comm.proxy.device_args()
        frame, err = Frame(2), comm.new_error_record()
        got = cuda.device_array((CALLS, N), np.uint64)
        compiled, _ = compile_kernel(exchange, THREADS, 0)
        launch = Launch(exchange, compiled, dict(
            x=Slot((N,)), out=Slot((N,)), box=box.local, flags=flags.local, ring=ring,
            head=head, tail=tail, frame=frame.words, me=comm.node, peer=comm.rail_peers[0],
            win_box=win_box, win_flags=win_flags, timeout_ns=comm.timeout_ns, err=err,
            rank=comm.rank), 2, THREADS, 0)
        sent = [np.arange(N, dtype=np.uint64) + 1000 * call + 100 * comm.rank
                for call in range(CALLS)]
        xs = [cuda.to_device(s) for s in sent]
        for call in range(CALLS):                 # back to back
            launch.bind("x", param(xs[call]))
            launch.bind("out", param(got[call]))
            launch()
        comm.synchronize()                        # (a GIL-free wait: the proxy needs the GIL)
        comm.check(err, "exchange")
        theirs = comm.mpi.sendrecv(sent, dest=comm.rail_peers[0], source=comm.rail_peers[0])
        ok = np.array_equal(got.copy_to_host(), np.stack(theirs))
        if comm.mpi.allreduce(int(not ok)):
            raise SystemExit(f"rank {comm.rank}: {'wrong data from the peer' if not ok else ''}")
        if comm.rank == 0:
            print(f"04 send through the proxy: {CALLS} calls exchanged {N} words between "
                  f"{comm.nodes} nodes ({comm.proxy.transport.name} transport): OK")


if __name__ == "__main__":
    main()
