"""Register and free proxy windows over and over: ids are reused, nothing stale is delivered.

Run: mpiexec -n 2 python proxy_windows.py TRANSPORT ROUNDS   (simulator; each rank a node)
Every round allocates fresh source, destination and flag buffers, registers them, has a host
producer send one chunk to every peer, checks bytes and flags, then frees the buffers (which
unregisters their windows). Completion mode names flag windows with 4 bits, so more than 16
rounds only pass if ids come back; a command naming a freed window must be refused.
"""
import sys
import time

import numpy as np

from mknumba.errors import MkValueError
from mknumba.proxy.ring import host_enqueue
from proxy_stress import start

NBYTES = 96


def send_all(comm, proxy, wins, epoch):
    r, h, t = (np.asarray(x) for x in proxy.device_args())
    for p in range(comm.size):
        if p == comm.rank:
            continue
        deadline = time.monotonic() + 60
        while not host_enqueue(r, h, t, peer=p, src_win=wins[0], src_off=0, dst_win=wins[1],
                               dst_off=comm.rank * NBYTES, nbytes=NBYTES, chunk=0,
                               flag_win=wins[2], flag_slot=comm.rank, epoch=epoch):
            proxy.check()
            assert time.monotonic() < deadline, "no credit for 60 s"
            time.sleep(1e-5)


def main():
    spec, rounds = sys.argv[1], int(sys.argv[2])
    comm, proxy = start(spec)
    me, size = comm.rank, comm.size
    seen = set()
    for rnd in range(rounds):
        src = comm.alloc_symmetric((NBYTES,), np.uint8, scope="world")
        dst = comm.alloc_symmetric((size * NBYTES,), np.uint8, scope="world")
        flags = comm.alloc_flags(size, scope="world")
        wins = [proxy.register(b) for b in (src, dst, flags)]
        seen.update(wins)
        payload = np.random.default_rng([rnd, me]).integers(0, 256, NBYTES, np.uint8)
        src.local.copy_to_device(payload)
        dst.local.copy_to_device(np.full(size * NBYTES, 0xEE, np.uint8))   # poisoned
        comm.barrier()
        send_all(comm, proxy, wins, rnd + 1)
        deadline = time.monotonic() + 60
        peers = [p for p in range(size) if p != me]
        while not (flags.local.copy_to_host()[peers] == rnd + 1).all():
            proxy.check()
            assert time.monotonic() < deadline, ("flags did not arrive", rnd)
            time.sleep(1e-4)
        got = dst.local.copy_to_host()
        for p in peers:
            want = np.random.default_rng([rnd, p]).integers(0, 256, NBYTES, np.uint8)
            assert (got[p * NBYTES:(p + 1) * NBYTES] == want).all(), (rnd, p)
        assert (got[me * NBYTES:(me + 1) * NBYTES] == 0xEE).all()
        comm.barrier()   # every peer has checked: nothing in flight names these windows
        for b in (src, dst, flags):
            comm.free(b)
    assert len(seen) == 3, f"window ids were not reused: {sorted(seen)}"
    # A command naming a window that is gone is refused, not delivered somewhere stale, while
    # the windows around it stay usable.
    a, gone, b = (comm.alloc_symmetric((size * NBYTES,), np.uint8, scope="world")
                  for _ in range(3))
    wins = [proxy.register(x) for x in (a, gone, b)]
    comm.free(gone)                                       # a hole in the middle of the table
    proxy.transport.check_command(1 - me, _one_command([wins[0], wins[2], wins[0]]))   # fine
    try:
        proxy.transport.check_command(1 - me, _one_command([wins[0], wins[1], wins[0]]))
    except MkValueError as e:
        refused = str(e)
    else:
        raise AssertionError("a command naming a freed window was accepted")
    comm.finalize()
    if me == 0:
        print(f"proxy_windows {spec}: {rounds} rounds, window ids {sorted(seen)} reused; "
              f"stale command refused ({refused[:60]}...)")


def _one_command(wins):
    from mknumba.proxy.ring import COMMAND_DTYPE
    c = np.zeros(1, COMMAND_DTYPE)
    c["src_win"], c["dst_win"], c["flag_win"], c["nbytes"] = wins[0], wins[1], wins[2], NBYTES
    return c


if __name__ == "__main__":
    main()
