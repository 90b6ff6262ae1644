"""Work-arounds for numba's CUDA simulator (mknumba/_compat.py) hold."""
import textwrap

from mpi_util import run_python

# numba's simulator looks a block's static shared array up by the calling line and creates it
# when missing, without a lock: two simulated threads switched between the lookup and the store
# get two arrays. Here a lookup that waits (bounded) for the other thread to look up too forces
# exactly that interleaving every time: unlocked, both miss and make an array each; with the
# lock in _compat the second waits for the first, whose wait times out, and finds its array.
# The same run checks numba's own (unlocked) lookup fails it, so the check can fail.
RACE = textwrap.dedent("""
    import sys
    import threading
    import numpy as np
    import mknumba  # noqa: F401  (applies the work-arounds)
    from numba.cuda.simulator import kernelapi

    class Racing(dict):
        def __init__(self):
            self.barrier = threading.Barrier(2)

        def get(self, key, default=None):
            found = super().get(key, default)
            try:                  # return only once the other thread has looked up too
                self.barrier.wait(timeout=0.5)
            except threading.BrokenBarrierError:
                pass
            return found

    def arrays():
        shared = kernelapi.FakeCUDAShared(0)
        shared._allocations = Racing()
        got = []

        def thread():
            got.append(shared.array((4,), np.float32))    # one line: one static array
        ts = [threading.Thread(target=thread) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return len({id(a) for a in got})

    print("locked", arrays())

    def numba_array(self, shape, dtype, alignment=None):    # numba's lookup, unlocked
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    kernelapi.FakeCUDAShared.array = numba_array
    print("unlocked", arrays())
""")


def test_static_shared_array_is_one_per_block_under_thread_switches():
    out = run_python(RACE)
    assert "locked 1" in out and "unlocked 2" in out, out
