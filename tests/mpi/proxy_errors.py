"""A failing proxy surfaces as exceptions, not a hang (simulator, 2 ranks).

1. Rank 0 enqueues a command naming an unregistered window: its proxy thread fails with
   MkValueError, and proxy.check() raises MkError chained to it.
2. A kernel then enqueues more commands than the ring holds: with no proxy to return credits its
   bounded credit wait expires and records the send role; comm.check() reports the dead proxy.
Run with MKNUMBA_GPUS_PER_NODE=1 MKNUMBA_PROXY_SLOTS=16 MKNUMBA_TIMEOUT_S=2.
"""
import time

import numpy as np

import mknumba
from mknumba.errors import MkError, MkTimeoutError, MkValueError, describe_error_record
from mknumba.primitives import globaltimer
from mknumba.proxy.ring import host_enqueue
from mknumba.roles.send import enqueue
from numba import cuda


@cuda.jit
def flood(ring, head, tail, n, peer, timeout_ns, err, rank):
    deadline = globaltimer() + timeout_ns
    for j in range(n):
        if not enqueue(ring, head, tail, peer, 0, 0, 0, 0, 8, j, 0, 0, 1, deadline, err, rank):
            return


def main():
    comm = mknumba.init(transport="sim")
    proxy = comm.proxy
    buf = comm.alloc_symmetric((64,), np.uint8, scope="world")
    proxy.register(buf)
    if comm.rank == 0:
        ring, head, tail = (np.asarray(a) for a in proxy.device_args())
        assert host_enqueue(ring, head, tail, peer=1, src_win=0, src_off=0, dst_win=7,
                            dst_off=0, nbytes=8, chunk=0, flag_win=0, flag_slot=0, epoch=1)
        deadline = time.monotonic() + 10
        while proxy.alive and time.monotonic() < deadline:
            time.sleep(1e-3)
        try:
            proxy.check()
            raise AssertionError("proxy.check() did not raise")
        except MkError as e:
            assert isinstance(e.__cause__, MkValueError), repr(e.__cause__)
            assert "window" in str(e.__cause__), e
            print("proxy error surfaced:", e)
        err = comm.new_error_record()
        r, h, t = proxy.device_args()
        flood[1, 1](r, h, t, 40, 1, comm.timeout_ns, err, comm.rank)
        timeout = describe_error_record(err, "flood")
        assert "inter-node send" in timeout, timeout
        print("credit wait timed out:", timeout)
        try:    # comm.check names the dead proxy first: the likelier cause of the timeout
            comm.check(err, "flood")
            raise AssertionError("comm.check did not raise")
        except MkError as e:
            assert "proxy" in str(e) and not isinstance(e, MkTimeoutError), e
    proxy_ref = comm.proxy
    try:
        comm.finalize()   # collective teardown completes on every rank despite the failure
    except MkError as e:  # finalize may re-raise the proxy's failure once teardown is done
        assert comm.rank == 0, e
    if comm.rank == 0:
        try:
            proxy_ref.check()
            raise AssertionError("the failure was lost at teardown")
        except MkError:
            print("proxy failure still reported after finalize")


if __name__ == "__main__":
    main()
