"""Push >= 10,000 commands of random sizes through a small ring; check every byte and flag.

Run: mpiexec -n N python proxy_stress.py TRANSPORT TOTAL_COMMANDS   (simulator, N in 2..4)
Each rank is its own (emulated) node. Two rounds reuse the same flags with epochs 1 and 2:
round 1 is produced by a simulated kernel through roles.send.enqueue and consumed by a kernel
through primitives.wait_flag; round 2 by a host producer through the same encoder.
Environment set by the test: MKNUMBA_GPUS_PER_NODE=1, MKNUMBA_PROXY_SLOTS=16 (backpressure).
"""
import os
import sys
import time

import numpy as np

import mknumba
from mknumba.errors import ROLE_RECV
from mknumba.primitives import globaltimer, wait_flag
from mknumba.proxy.ring import host_enqueue
from mknumba.roles.send import enqueue
from numba import cuda

MAXC = 192          # largest chunk, bytes
SRC_BYTES = 4096    # source window per rank


def plan(rnd, sender, dest, m):
    """The commands ``sender`` sends to ``dest`` in round ``rnd``: sizes, src/dst offsets, slots."""
    rng = np.random.default_rng([rnd, sender, dest])
    nbytes = rng.integers(1, MAXC + 1, m)
    src = rng.integers(0, SRC_BYTES - nbytes + 1)
    dst = (sender * m + np.arange(m)) * MAXC          # a region per (sender, j) on dest
    slot = sender * m + np.arange(m)
    return nbytes, src, dst, slot


def source(rnd, rank):
    return np.random.default_rng([99, rnd, rank]).integers(0, 256, SRC_BYTES, dtype=np.uint8)


@cuda.jit
def send_kernel(ring, head, tail, peers, src_off, dst_off, nbytes, slots, epoch, src_win,
                dst_win, flag_win, timeout_ns, err, rank):
    deadline = globaltimer() + timeout_ns
    for j in range(cuda.threadIdx.x, peers.shape[0], cuda.blockDim.x):
        if not enqueue(ring, head, tail, peers[j], src_win, src_off[j], dst_win, dst_off[j],
                       nbytes[j], j, flag_win, slots[j], epoch, deadline, err, rank):
            return


@cuda.jit
def recv_kernel(flags, slots, epoch, timeout_ns, err, rank, ok):
    deadline = globaltimer() + timeout_ns
    for j in range(cuda.threadIdx.x, slots.shape[0], cuda.blockDim.x):
        if wait_flag(flags, slots[j], epoch, deadline, err, rank, ROLE_RECV):
            cuda.atomic.add(ok, 0, 1)


def start(spec):
    """mknumba.init with the proxy on ``spec``; 'dma-host:MODE[:batch]' runs the dma transport's
    compiled path over a host-memory stand-in for libcuda (no GPU needed)."""
    if not spec.startswith("dma-host"):
        comm = mknumba.init(transport=spec)
        return comm, comm.proxy
    from proxy_hostdriver import host_driver
    from mknumba.proxy.transports.dma import DmaTransport
    _, mode, *copy = spec.split(":")
    comm = mknumba.init(gpus_per_node=1, transport="sim")
    comm.proxy.stop()   # replace the simulator's transport by dma over host memory
    comm.proxy = mknumba.proxy.start(comm, DmaTransport(comm, mode, copy=(copy or ["each"])[0],
                                                        driver=host_driver()))
    return comm, comm.proxy


def event_records(proxy):
    """Events the dma transport recorded (completions moved to its write stream), or None."""
    t = proxy.transport
    calls = getattr(getattr(getattr(t, "drv", None), "lib", None), "calls", None)
    return None if calls is None else calls.get("event_record", 0)


def main():
    spec, total = sys.argv[1], int(sys.argv[2])
    t_start = time.time()
    comm, proxy = start(spec)
    assert proxy is not None and comm.nodes == comm.size, comm
    me, size = comm.rank, comm.size
    per_peer = -(-total // (2 * size * (size - 1)))     # commands per (round, sender, dest)
    src_buf = comm.alloc_symmetric((SRC_BYTES,), np.uint8, scope="world")
    dst_buf = comm.alloc_symmetric((size * per_peer * MAXC,), np.uint8, scope="world")
    flags = comm.alloc_flags(size * per_peer, scope="world")
    wins = [proxy.register(b) for b in (src_buf, dst_buf, flags)]
    ring, head, tail = proxy.device_args()
    err = comm.new_error_record()
    peers = [p for p in range(size) if p != me]
    for rnd in (1, 2):
        # Every rank has checked last round's arrivals, so no proxy still holds a command that
        # reads this source (a rank that has received everything may still be sending).
        comm.barrier()
        src_buf.local.copy_to_device(source(rnd, me))
        cmds = []
        for p in peers:
            nb, so, do, sl = plan(rnd, me, p, per_peer)
            cmds += [(p, *c) for c in zip(nb, so, do, sl)]
        order = np.random.default_rng([7, rnd, me]).permutation(len(cmds))
        cmds = np.array(cmds, np.int64)[order]           # interleave connections
        if rnd == 1 or not comm.simulator:   # a (simulated) kernel produces: 1 block x 4 threads
            dev = [cuda.to_device(np.ascontiguousarray(cmds[:, i])) for i in range(5)]
            send_kernel[1, 4](ring, head, tail, dev[0], dev[2], dev[3], dev[1], dev[4], rnd,
                              wins[0], wins[1], wins[2], comm.timeout_ns, err, me)
            # Wait without holding the GIL: the kernel needs our proxy thread to progress.
            comm.synchronize()
        else:          # a host producer, same encoder and commit protocol
            r, h, t = np.asarray(ring), np.asarray(head), np.asarray(tail)
            deadline = time.monotonic() + 60
            full = 0
            for p, nb, so, do, sl in cmds:
                while not host_enqueue(r, h, t, peer=p, src_win=wins[0], src_off=so,
                                       dst_win=wins[1], dst_off=do, nbytes=nb, chunk=0,
                                       flag_win=wins[2], flag_slot=sl, epoch=rnd):
                    full += 1
                    proxy.check()
                    assert time.monotonic() < deadline, "host producer: no credit for 60 s"
                    time.sleep(1e-5)
            assert full > 0, "the ring never filled: no backpressure was exercised"
        comm.check(err, f"round {rnd} send")
        proxy.check()
        # receive: every chunk from every peer
        slots = np.concatenate([plan(rnd, s, me, per_peer)[3] for s in peers])
        if rnd == 1 or not comm.simulator:
            ok, dslots = cuda.to_device(np.zeros(1, np.int64)), cuda.to_device(slots)
            recv_kernel[1, 2](flags.local, dslots, rnd, comm.timeout_ns, err, me, ok)
            comm.synchronize()
            comm.check(err, "round 1 receive")
            assert ok.copy_to_host()[0] == len(slots)
        else:
            deadline = time.monotonic() + 60
            while not (flags.local.copy_to_host()[slots] == rnd).all():
                proxy.check()
                f = flags.local.copy_to_host()[slots]
                assert time.monotonic() < deadline, ("round 2: flags did not arrive", slots[f != rnd][:10], (f != rnd).sum(), proxy.stats, proxy.alive)
                time.sleep(1e-3)
        got = dst_buf.local.copy_to_host()
        for s in peers:
            nb, so, do, sl = plan(rnd, s, me, per_peer)
            src = source(rnd, s)
            for n, a, b in zip(nb, so, do):
                assert (got[b:b + n] == src[a:a + n]).all(), (
                    rnd, s, n, a, b, np.flatnonzero(got[b:b + n] != src[a:a + n])[:8],
                    got[b:b + 8], src[a:a + 8], source(3 - rnd, s)[a:a + 8])
        assert (flags.local.copy_to_host()[slots] == rnd).all()
    # Hold no GIL-keeping call (MPI object collectives) while our proxy still has commands.
    proxy.wait_submitted(2 * len(cmds))
    if not comm.simulator:
        full = -1   # the GPU rounds have no host producer to count full-ring refusals
    stats = dict(proxy.stats)
    events = event_records(proxy)
    if events is not None and os.environ.get("MKNUMBA_DMA_EVENT_BYTES") == "0":
        assert events == stats["batches"], (events, stats["batches"])   # every batch took it
    sent = comm.mpi.allreduce(stats["commands"])
    slots_n = proxy.slots
    comm.finalize()
    if me == 0:
        print(f"proxy_stress {spec}: {sent} commands through {slots_n}-slot rings on {size} "
              f"ranks, every byte and flag checked, {time.time() - t_start:.1f} s; rank 0 "
              f"batches {stats['batches']} (avg {stats['commands'] / stats['batches']:.2f}), "
              f"ring full {full} times in the host round")
    assert sent >= total, (sent, total)


if __name__ == "__main__":
    main()
